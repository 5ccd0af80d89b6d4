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
    closest = sq_dist(X[idx[0] : idx[0] + 1], X, None, x2)[0]
    pot = closest.sum()
    for _ in range(1, k):
        r = torch.from_numpy(draws.uniform(n_trials)).to(device=X.device, dtype=X.dtype) * pot
        cand = torch.searchsorted(torch.cumsum(closest, 0), r).clamp_(max=N - 1)
        d_cand = torch.minimum(sq_dist(X.index_select(0, cand), X, None, x2), closest[None, :])
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
    labels_old = torch.full((N,), -1, dtype=torch.long, device=X.device)
    strict = False
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported
        dist = sq_dist(X, C, x2)
        labels = dist.argmin(1)
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        onehot = torch.zeros((N, k), dtype=X.dtype, device=X.device)
        onehot[torch.arange(N, device=X.device), labels] = 1.0
        sums = onehot.T @ X
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            far = dist.gather(1, labels[:, None])[:, 0].argsort(descending=True)[: len(empty)].tolist()
            for j, p in zip(empty, far):
                old = int(labels[p])
                sums[old] -= X[p]
                counts[old] -= 1.0
                sums[j] = X[p]
                counts[j] = 1.0
        C_new = sums / counts.clamp_min(1.0)[:, None]
        shift = float(((C_new - C) ** 2).sum())
        C = C_new
        if bool((labels == labels_old).all()):
            strict = True
            break
        if shift <= abs_tol:
            break
        labels_old = labels
    if not strict:
        labels = sq_dist(X, C, x2).argmin(1)
    return labels, C, n_iter
