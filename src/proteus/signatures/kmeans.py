"""k-means with k-means++ seeding in torch, following scikit-learn's ``KMeans(n_init=1)``.

It initialises the DP-GMM of Eq. 18 (:class:`~proteus.signatures.dpgmm.DPGMM`) and is the clustering of
the K-means signature ablation. The k-means++ seeds are drawn from ``numpy.random.RandomState
(random_state)`` exactly as scikit-learn draws them, so the same ``random_state`` gives the same initial
partition as scikit-learn (and hence the same DP-GMM fit).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["Draws", "RandomSource", "kmeans", "kmeans_plusplus", "mm_nt", "sq_dist"]


def mm_nt(A: Tensor, B: Tensor) -> Tensor:
    """``A @ B.T`` for a tall A (N, d) and a short B (K, d), computed as ``(B @ A.T).T``: some CPU BLAS
    builds are several times slower on the (N x d) @ (d x small K) shape."""
    return (B @ A.T).T


def sq_dist(X: Tensor, C: Tensor, x2: Tensor | None = None, c2: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances (N, K) via ||x||^2 - 2 x.c + ||c||^2, clamped at 0."""
    if x2 is None:
        x2 = (X * X).sum(1)
    if c2 is None:
        c2 = (C * C).sum(1)
    return (x2[:, None] - 2.0 * mm_nt(X, C) + c2[None, :]).clamp_min_(0.0)


def _dist_to_all(P: Tensor, X: Tensor, x2: Tensor) -> Tensor:
    """Squared distances (K, N) of a few points ``P`` to every row of ``X``: ``sq_dist(P, X)`` with the
    product as ``P @ X.T`` (small times big: the fast orientation for CPU BLAS)."""
    p2 = (P * P).sum(1)
    return torch.addmm(x2[None, :] + p2[:, None], P, X.T, alpha=-2.0).clamp_min_(0.0)


RandomSource = int | np.random.RandomState | torch.Generator | None


class Draws:
    """The few random numbers k-means++ needs, from a numpy ``RandomState`` (scikit-learn's stream: an
    integer seed gives the draws ``KMeans(random_state=seed)`` makes) or from a ``torch.Generator``."""

    def __init__(self, source: RandomSource) -> None:
        if isinstance(source, torch.Generator):
            self.gen: torch.Generator | None = source
            self.rs: np.random.RandomState | None = None
        else:
            self.gen = None
            self.rs = source if isinstance(source, np.random.RandomState) else np.random.RandomState(source)

    def first(self, n: int) -> int:
        if self.rs is not None:
            return int(self.rs.choice(n, p=np.full(n, 1.0 / n)))
        assert self.gen is not None
        return int(torch.randint(n, (1,), generator=self.gen, device=self.gen.device).item())

    def uniform(self, size: int) -> np.ndarray:
        if self.rs is not None:
            return self.rs.uniform(size=size)
        assert self.gen is not None
        return torch.rand(size, generator=self.gen, device=self.gen.device, dtype=torch.float64).cpu().numpy()


def kmeans_plusplus(X: Tensor, k: int, draws: Draws, x2: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy k-means++ seeding exactly as scikit-learn's ``_kmeans_plusplus`` (2 + log k local trials,
    candidates drawn by inverse-CDF of the squared distances); returns ``(centres (k, d), indices (k,))``."""
    N = X.shape[0]
    n_trials = 2 + int(np.log(k))
    idx = [draws.first(N)]
    closest = _dist_to_all(X[idx[0] : idx[0] + 1], X, x2)[0]
    pot = closest.sum()
    for _ in range(1, k):
        r = torch.from_numpy(draws.uniform(n_trials)).to(device=X.device, dtype=X.dtype) * pot
        cand = torch.searchsorted(torch.cumsum(closest, 0), r).clamp_(max=N - 1)
        d_cand = torch.minimum(_dist_to_all(X.index_select(0, cand), X, x2), closest[None, :])
        pots = d_cand.sum(1)
        j = int(torch.argmin(pots))
        pot, closest = pots[j], d_cand[j]
        idx.append(int(cand[j]))
    index = torch.tensor(idx, device=X.device)
    return X.index_select(0, index).clone(), index


def kmeans(
    X: Tensor,
    n_clusters: int,
    random_state: RandomSource = 0,
    max_iter: int = 300,
    tol: float = 1e-4,
) -> tuple[Tensor, Tensor, int]:
    """Lloyd's k-means with k-means++ seeding in torch, following scikit-learn's ``KMeans(n_init=1)``.

    Same seeding draws as scikit-learn for an integer ``random_state`` (a ``torch.Generator`` is also
    accepted), same stopping rule (labels unchanged, or total squared centre shift below ``tol`` times
    the mean feature variance), empty clusters re-seeded with the points farthest from their centres.
    ``X`` should be centred (scikit-learn centres it). Returns ``(labels (N,), centres (K, d), n_iter)``.
    """
    N = X.shape[0]
    k = max(1, min(int(n_clusters), N))
    draws = Draws(random_state)
    x2 = (X * X).sum(1)
    C, _ = kmeans_plusplus(X, k, draws, x2)
    abs_tol = float(X.var(dim=0, unbiased=False).mean()) * tol
    dist = _Assign(X, x2)
    dist.update(C, None)
    labels = dist.labels()
    counts = torch.bincount(labels, minlength=k).to(X.dtype)
    sums = torch.zeros((k, X.shape[1]), dtype=X.dtype, device=X.device).index_add_(0, labels, X)
    labels_old = torch.full((N,), -1, dtype=torch.long, device=X.device)
    strict = False
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported
        if n_iter > 1:
            labels = dist.labels()
            sums, counts = _update_sums(X, labels, labels_old, sums, counts)
        sums_it, counts_it = sums, counts
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:  # re-seed with the points farthest from their centres (scikit-learn's rule)
            sums_it, counts_it = sums.clone(), counts.clone()
            far = dist.own(labels).argsort(descending=True)[: len(empty)].tolist()
            for j, p in zip(empty, far):
                old = int(labels[p])
                sums_it[old] -= X[p]
                counts_it[old] -= 1.0
                sums_it[j] = X[p]
                counts_it[j] = 1.0
        C_new = sums_it / counts_it.clamp_min(1.0)[:, None]
        moved = ((C_new - C) ** 2).sum(1)
        shift = float(moved.sum())
        C = C_new
        if bool((labels == labels_old).all()):
            strict = True
            break
        if shift <= abs_tol:
            break
        labels_old = labels
        if empty:  # the sums follow the labels; a re-seeded point is counted where it is assigned
            sums = torch.zeros_like(sums).index_add_(0, labels, X)
            counts = torch.bincount(labels, minlength=k).to(X.dtype)
        dist.update(C, (moved > 0).nonzero().flatten())
    if not strict:
        dist.update(C, None)
        labels = dist.labels()
    return labels, C, n_iter


def _update_sums(
    X: Tensor, labels: Tensor, old: Tensor, sums: Tensor, counts: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-cluster sums and counts for ``labels`` from those of ``old``: only the points that changed
    cluster are moved (a full recount when many did)."""
    k = sums.shape[0]
    moved = (labels != old).nonzero().flatten()
    if moved.numel() * 4 > X.shape[0]:
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        return torch.zeros_like(sums).index_add_(0, labels, X), counts
    xm = X.index_select(0, moved)
    new_l, old_l = labels.index_select(0, moved), old.index_select(0, moved)
    sums = sums.index_add(0, new_l, xm).index_add_(0, old_l, xm, alpha=-1.0)
    ones = torch.ones(moved.numel(), dtype=X.dtype, device=X.device)
    counts = counts.index_add(0, new_l, ones).index_add_(0, old_l, ones, alpha=-1.0)
    return sums, counts


class _Assign:
    """Nearest centres of the rows of ``X``, exactly as float64 distances choose them, at float32 cost.

    ``h[j, n] = ||c_j||^2 - 2 x_n . c_j`` (the squared distance less ``||x_n||^2``, which does not change
    the argmin) is computed in float32 for the centres that moved; a float32 value is within ``err =
    (d + 8) eps32 (||x_n||^2 + 2 ||c_j||^2)`` of the exact one (the worst-case rounding bound of a
    length-d dot product). Rows whose best centre is not ahead of every other by more than the errors
    are recomputed in the input's dtype. For float32 (or lower) input, everything is in that dtype."""

    def __init__(self, X: Tensor, x2: Tensor) -> None:
        self.X, self.x2 = X, x2
        self.low = X.dtype == torch.float64
        self.Xl = X.float() if self.low else X
        self.h = self.err = self.C = torch.empty(0)

    def update(self, C: Tensor, idx: Tensor | None) -> None:
        """New centres ``C``; only rows ``idx`` of ``h`` changed (``None``: all)."""
        self.C = C
        if idx is not None and idx.numel() == 0:
            return
        Cs = C if idx is None else C.index_select(0, idx)
        c2 = (Cs * Cs).sum(1)
        h = torch.addmm(c2[:, None].to(self.Xl.dtype), Cs.to(self.Xl.dtype), self.Xl.T, alpha=-2.0)
        if idx is None:
            self.h = h
        else:
            self.h[idx] = h
        if self.low:
            eps = (self.X.shape[1] + 8) * float(torch.finfo(torch.float32).eps)
            err = (2.0 * eps) * c2
            if idx is None:
                self.err = err
            else:
                self.err[idx] = err

    def labels(self) -> Tensor:
        best = self.h.argmin(0)
        if not self.low:
            return best
        eps = (self.X.shape[1] + 8) * float(torch.finfo(torch.float32).eps)
        ex = (eps * self.x2).to(self.h.dtype)  # the ||x_n||^2 part of the error bound
        n = torch.arange(self.h.shape[1], device=self.h.device)
        hi = self.h[best, n] + self.err.to(self.h.dtype)[best] + ex
        lo = self.h - self.err.to(self.h.dtype)[:, None] - ex[None, :]
        lo[best, n] = float("inf")
        unsure = (lo.min(0).values <= hi).nonzero().flatten()
        if unsure.numel():
            C = self.C
            h64 = torch.addmm((C * C).sum(1)[:, None], C, self.X.index_select(0, unsure).T, alpha=-2.0)
            best[unsure] = h64.argmin(0)
        return best

    def own(self, labels: Tensor) -> Tensor:
        """Squared distance of each row to its centre (in the input's dtype)."""
        diff = self.X - self.C.index_select(0, labels)
        return (diff * diff).sum(1)
