"""RanPAC's parameter-free ridge/LDA head: the statistics of Algorithm 1 (lines 8-12) and Eq. 23.

PROTEUS adopts the classification head of RanPAC (McDonnell et al., NeurIPS 2023). Every training
embedding ``h`` is mapped to ``phi(h) = relu(h @ W_rand)`` (a fixed Gaussian random projection to
``rp_dim`` dimensions, RanPAC's M = 10000; ``rp_dim = 0`` uses ``h`` itself) and two sufficient
statistics are accumulated over the whole stream (Algorithm 1, lines 10-11)::

    G  <- G + phi(h) phi(h)^T              (the Gram matrix G_S)
    Q  <- Q + phi(h) onehot(z)^T           (column c is the class-prototype sum e_S(c))

Prediction is Eq. 23, ``c* = argmax_c phi(h*)^T (G + gamma I)^{-1} e(c)``, i.e. the scores are
``phi(H) @ W_out`` with ``W_out = (G + gamma I)^{-1} Q``.

Notes on fidelity:

* The paper writes Eq. 23 (and Algorithm 1, and its complexity analysis) on ``h`` itself and never
  mentions a projection; the projection is RanPAC's, whose head the paper adopts ("gamma follows
  RanPAC"). ``rp_dim = 0`` is Eq. 23 as written; docs/experiments.md measures the difference.
* Algorithm 1 writes ``e_S(z) += m^{-1} |D_k|^{-1} h_S(x)``: ``head.prototypes = "task-mean"`` divides each
  task's sums by ``|D_k|`` (``proteus-paper``); ``"sum"`` keeps RanPAC's unscaled sums (the default).
  ``m^{-1}`` scales every score equally (no effect on the argmax) and ``|D_k|^{-1}`` only re-weights
  whole tasks, which is a no-op for equally sized tasks.
* The noise level ``gamma`` is chosen "with the same optimization strategy as in RanPAC" (App. C):
  after each update, on that update's data only, ridge-fit on a ``1 - holdout`` split over
  ``gamma in 10 ** arange(gamma_min_exp, gamma_max_exp)`` and keep the gamma with the smallest MSE
  against one-hot targets on the held-out split. RanPAC does one linear solve per gamma
  (``RanPACHead.select_gamma(reference=True)``, kept as the reference); :meth:`RanPACHead.select_gamma`
  does a single symmetric eigendecomposition and then only rescales eigenvalues per gamma
  (:mod:`proteus.heads.gamma`); ``selection`` names the rule (:data:`~proteus.heads.gamma.GAMMA_SELECTIONS`).
  The class prototypes ``e(c)`` are a strategy too (:mod:`proteus.heads.prototypes`). Input checks are in
  :mod:`proteus.heads.checks`, persistence in :mod:`proteus.heads.persist`.

Memory: ``G`` is ``rp_dim x rp_dim`` in ``dtype``: 800 MB at RanPAC's ``rp_dim = 10000`` in
float64 (200 MB at 5000), plus a Cholesky factor of the same size while ``W_out`` is computed and
the ``N x rp_dim`` projected features of the update being processed.

Long streams. ``W_out`` (m x C) is solved with the statistics while the classes are at most a quarter of
the features (``C <= m / 4``: the solve then costs a fraction of the gamma search's eigendecomposition, and
every packaged preset stays there); beyond, it is left unsolved, and
:meth:`RanPACHead.decision_function` scores through the Cholesky factor of ``G + gamma I`` instead,
``((G + gamma I)^{-1} phi(H)^T)^T Q`` -- O(N m^2 + N m C) per call rather than O(m^2 C) per update, so
that an update costs the same at 2,000 classes as at 20 (the same scores, to round-off). ``W_out_`` solves
it whenever it is asked for.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from proteus.devices import index_add
from proteus.heads.checks import allowed_mask, check_embeddings, check_labels
from proteus.heads.gamma import (
    GAMMA_SELECTIONS,
    GammaSelection,
    HeldOut,
    fallback_gamma,
    gamma_grid,
    holdout_split,
    log_selection,
    ridge_solve,
    select_fast,
    select_naive,
)
from proteus.heads.persist import (
    SUPPORTED_DTYPES,
    dtype_name,
    head_columns,
    head_meta,
    head_tensors,
    load_head_state,
    meta_dtype,
)
from proteus.heads.prototypes import PROTOTYPES

__all__ = ["GAMMA_SELECTIONS", "PROTOTYPES", "GammaSelection", "RanPACHead", "head_from_state"]


def _check_hyperparameters(
    embed_dim: int, rp_dim: int, gamma_min_exp: int, gamma_max_exp: int, holdout: float, dtype: torch.dtype,
    gamma: float | None,
) -> None:  # fmt: skip
    """The numeric hyper-parameters of a :class:`RanPACHead` (a ValueError names the one out of range)."""
    if int(embed_dim) <= 0:
        raise ValueError(f"embed_dim must be positive, got {embed_dim}")
    if int(rp_dim) < 0:
        raise ValueError(f"rp_dim must be >= 0 (0 disables the random projection), got {rp_dim}")
    if int(gamma_max_exp) <= int(gamma_min_exp):
        raise ValueError(f"empty gamma grid: gamma_min_exp={gamma_min_exp} >= gamma_max_exp={gamma_max_exp}")
    if not 0.0 < float(holdout) < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if gamma is not None and not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"a fixed gamma must be a finite positive number, got {gamma}")


class RanPACHead:
    """Ridge-regression / LDA head of RanPAC (Eq. 23) with incremental statistics ``G_`` and ``Q_``;
    hyper-parameters are set in ``__init__``, everything fitted ends with an underscore (``W_rand_``,
    ``G_``, ``Q_``, ``counts_``, ``gamma_``, ``W_out_``, ``gamma_selection_``).

    Args:
        embed_dim: dimension ``d`` of the backbone embeddings ``h``.
        rp_dim: random-projection dimension ``M`` (RanPAC's: 10000; the paper states none). ``0`` disables the
            projection and uses ``h`` directly. ``G_`` costs ``M^2`` numbers: 800 MB at 10000 in float64.
        gamma_min_exp, gamma_max_exp: the gamma grid is ``10 ** arange(gamma_min_exp, gamma_max_exp)``
            (end exclusive), i.e. ``1e-8 .. 1e13`` by default.
        holdout: fraction of each update's samples held out to score the gamma candidates.
        seed: seeds both the random projection and the train/held-out shuffle.
        dtype: float64 (default, recommended) or float32. device: where the statistics live (``None``:
            the device of the first update's inputs).
        gamma: a fixed noise level; ``None`` (default) searches the grid after every update as RanPAC.
        selection: a rule of :data:`~proteus.heads.gamma.GAMMA_SELECTIONS`: ``"task"`` (RanPAC's rule:
            this update's data alone) or ``"accumulated"``.
        prototypes: the class prototypes ``e(c)`` (:data:`~proteus.heads.prototypes.PROTOTYPES`): ``"sum"``
            (RanPAC's code: class sums ``Q_``) or ``"task-mean"`` (Algorithm 1 line 11: each update's sums
            divided by its size, in ``P_``).
    """

    def __init__(
        self,
        embed_dim: int,
        rp_dim: int = 10000,
        gamma_min_exp: int = -8,
        gamma_max_exp: int = 14,
        holdout: float = 0.2,
        selection: str = "accumulated",
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
        gamma: float | None = None,
        prototypes: str = "sum",
    ) -> None:
        _check_hyperparameters(embed_dim, rp_dim, gamma_min_exp, gamma_max_exp, holdout, dtype, gamma)
        if selection not in GAMMA_SELECTIONS:
            raise ValueError(f"selection must be one of {tuple(GAMMA_SELECTIONS)}, got {selection!r}")
        if prototypes not in PROTOTYPES:
            raise ValueError(f"prototypes must be one of {tuple(PROTOTYPES)}, got {prototypes!r}")
        self.embed_dim, self.rp_dim, self.seed = int(embed_dim), int(rp_dim), int(seed)
        self.gamma_min_exp, self.gamma_max_exp = int(gamma_min_exp), int(gamma_max_exp)
        self.holdout, self.selection, self.prototypes = float(holdout), selection, prototypes
        self.dtype, self.device = dtype, device
        self.gamma = None if gamma is None else float(gamma)

        self.W_rand_: Tensor | None = None
        self.P_: Tensor | None = None
        self.G_: Tensor | None = None
        self.Q_: Tensor | None = None
        self.counts_: Tensor | None = None
        self.gamma_: float | None = None
        self._W: Tensor | None = None  # W_out, solved (None: not yet; scores go through the factor)
        self._L: Tensor | None = None  # the Cholesky factor of G + gamma I, once computed for scoring
        self.gamma_selection_: GammaSelection | None = None
        self.n_samples_: int = 0
        self.n_updates_: int = 0

    # ------------------------------------------------------------------ properties
    @property
    def feature_dim(self) -> int:
        """Dimension of ``phi(h)``: ``rp_dim``, or ``embed_dim`` without projection."""
        return self.rp_dim if self.rp_dim > 0 else self.embed_dim

    @property
    def num_classes_(self) -> int:
        """Number of classes (columns of ``Q_``) seen so far; 0 before the first update."""
        return 0 if self.Q_ is None else int(self.Q_.shape[1])

    @property
    def is_fitted(self) -> bool:
        return self._W is not None or (self.G_ is not None and self.gamma_ is not None)

    @property
    def W_out_(self) -> Tensor | None:
        """Eq. 23's weights ``(G + gamma I)^{-1} Q`` (``P`` for prototypes that keep their own matrix): solved
        when first asked for if the update left them unsolved (many classes: module doc), then kept until
        the statistics change."""
        if self._W is None and self.G_ is not None and self.gamma_ is not None:
            self._W = self._ridge_solve(self.G_, self._prototypes(), self.gamma_)
        return self._W

    @W_out_.setter
    def W_out_(self, W: Tensor | None) -> None:
        self._W, self._L = W, None

    def _prototypes(self) -> Tensor:
        assert self.Q_ is not None
        return self.Q_ if self.P_ is None else self.P_

    def _solved(self, G: Tensor, prototypes: Tensor, gamma: float) -> Tensor | None:
        """``W_out`` for new statistics while the classes are at most a quarter of the features, else None
        (solved when asked for: module doc)."""
        return self._ridge_solve(G, prototypes, gamma) if 4 * prototypes.shape[1] <= G.shape[0] else None

    def gamma_grid(self) -> Tensor:
        """The candidate noise levels ``10 ** arange(gamma_min_exp, gamma_max_exp)`` (float64, CPU)."""
        return gamma_grid(self.gamma_min_exp, self.gamma_max_exp)

    # ------------------------------------------------------------------ helpers
    def _state_device(self, like: Tensor | None = None) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        for t in (self.G_, self._W, self.W_rand_):
            if t is not None:
                return t.device
        return like.device if like is not None else torch.device("cpu")

    def _ensure_projection(self, device: torch.device) -> None:
        if self.rp_dim == 0 or self.W_rand_ is not None:
            return
        # Drawn on the CPU with its own generator: the same seed gives the same W_rand on any device.
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        w = torch.randn(self.embed_dim, self.rp_dim, generator=gen, dtype=torch.float64)
        self.W_rand_ = w.to(device=device, dtype=self.dtype)

    def features(self, H: Tensor) -> Tensor:
        """``phi(H) = relu(H @ W_rand_)`` in the head's dtype and device (``H`` itself if ``rp_dim == 0``)."""
        H = check_embeddings(H, self.embed_dim)
        device = self._state_device(H)
        H = H.to(device=device, dtype=self.dtype)
        if self.rp_dim == 0:
            return H
        self._ensure_projection(device)
        assert self.W_rand_ is not None
        return torch.relu(H @ self.W_rand_)

    def _one_hot(self, y: Tensor, num_classes: int, device: torch.device) -> Tensor:
        Y = torch.zeros(y.shape[0], num_classes, dtype=self.dtype, device=device)
        Y[torch.arange(y.shape[0], device=device), y.to(device)] = 1.0
        return Y

    def _split(self, n: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        return holdout_split(n, self.holdout, self.seed, device)

    def _split_for_selection(self, phi: Tensor, Y: Tensor) -> HeldOut:
        split = self._split(phi.shape[0], phi.device)
        if split is None:
            raise ValueError(
                f"cannot split {phi.shape[0]} samples into a train part and a held-out part "
                f"(holdout={self.holdout}); need at least 2 samples"
            )
        tr, va = split
        return HeldOut(phi[tr], Y[tr], phi[va], Y[va])

    def _features_and_targets(self, H: Tensor, y: Tensor, num_classes: int | None) -> tuple[Tensor, Tensor]:
        H = check_embeddings(H, self.embed_dim)
        y, total = check_labels(y, H.shape[0], num_classes, self.num_classes_)
        phi = self.features(H)
        return phi, self._one_hot(y, total, phi.device)

    # ------------------------------------------------------------------ gamma search
    def select_gamma(
        self, H: Tensor, y: Tensor, num_classes: int | None = None, *, reference: bool = False
    ) -> GammaSelection:
        """RanPAC's gamma search on this update's data, with one eigendecomposition for all candidates
        (:func:`~proteus.heads.gamma.select_fast`); ``reference``: one solve per candidate, as RanPAC's
        ``optimise_ridge_parameter`` (:func:`~proteus.heads.gamma.select_naive`)."""
        phi, Y = self._features_and_targets(H, y, num_classes)
        search = select_naive if reference else select_fast
        return search(*self._split_for_selection(phi, Y), self.gamma_grid())

    def _choose_gamma(
        self, phi: Tensor, y: Tensor, total: int, device: torch.device, G_prev: Tensor, Q_prev: Tensor
    ) -> tuple[float, GammaSelection | None]:
        """The gamma an update uses, and the search that chose it: the fixed ``gamma``, else the
        ``selection`` rule on this update's features ``phi`` and labels ``y`` given the statistics before
        it (none at the first update); an update too small to split keeps the previous gamma (1 at first)."""
        if self.gamma is not None:
            return self.gamma, self.gamma_selection_
        split = self._split(phi.shape[0], device)
        if split is None:
            return fallback_gamma(self.gamma_, len(y)), self.gamma_selection_
        tr, va = split
        Y = self._one_hot(y, total, device)
        prev = (G_prev, Q_prev) if self.n_updates_ else (None, None)
        rule = GAMMA_SELECTIONS.get(self.selection)
        selection = rule.select(HeldOut(phi[tr], Y[tr], phi[va], Y[va]), self.gamma_grid(), *prev)
        log_selection(selection)
        return selection.gamma, selection

    # ------------------------------------------------------------------ fitting
    def update(self, H: Tensor, y: Tensor, num_classes: int | None = None) -> RanPACHead:
        """Accumulate ``G_``, ``Q_`` (and ``P_``), ``counts_`` with one task's data, re-select gamma, refit
        ``W_out_`` (Algorithm 1 lines 9-12).

        Args:
            H: ``(N, embed_dim)`` embeddings ``h_S(x)`` of the task's training data.
            y: ``(N,)`` integer *global* class labels.
            num_classes: total number of classes so far (optional); ``Q_`` grows columns as needed.
        """
        H = check_embeddings(H, self.embed_dim)
        y, total = check_labels(y, H.shape[0], num_classes, self.num_classes_)
        device = self._state_device(H)
        phi = self.features(H)
        m = phi.shape[1]

        # The new statistics are built aside and assigned at the end: an update that raises (a non-finite
        # gamma search or ridge solve) leaves the head exactly as it was, so a learner can roll back a task.
        if self.G_ is None:
            G_old = torch.zeros(m, m, dtype=self.dtype, device=device)
            Q_old = torch.zeros(m, 0, dtype=self.dtype, device=device)
            counts_old = torch.zeros(0, dtype=torch.long, device=device)
        else:
            assert self.Q_ is not None and self.counts_ is not None
            G_old, Q_old, counts_old = self.G_, self.Q_, self.counts_
        grow = max(0, total - Q_old.shape[1])
        Q_old = torch.cat([Q_old, Q_old.new_zeros(m, grow)], dim=1) if grow else Q_old
        counts_old = torch.cat([counts_old, counts_old.new_zeros(grow)]) if grow else counts_old

        y_dev = y.to(device)
        G_new = G_old + phi.T @ phi
        Q_new = Q_old.clone()
        index_add(Q_new, 1, y_dev, phi.T)  # column c += sum of phi over samples of class c: e_S(c)
        counts_new = counts_old + torch.bincount(y_dev, minlength=total)
        P_new = PROTOTYPES.get(self.prototypes).add(self.P_, phi, y_dev, total)

        gamma, selection = self._choose_gamma(phi, y, total, device, G_old, Q_old)
        W_out = self._solved(G_new, Q_new if P_new is None else P_new, gamma)

        self.G_, self.Q_, self.P_, self.counts_ = G_new, Q_new, P_new, counts_new
        self.gamma_, self.gamma_selection_, self.W_out_ = gamma, selection, W_out
        self.n_samples_ += int(H.shape[0])
        self.n_updates_ += 1
        return self

    def downdate(self, H: Tensor, y: Tensor, classes: list[int]) -> RanPACHead:
        """Subtract one earlier update exactly (``proteus kb forget``): ``H``, ``y`` the embeddings and
        labels that update accumulated, ``classes`` its classes (their prototype columns become exactly 0).
        ``G_``, ``Q_`` (``P_``), ``counts_`` then equal a head accumulated without that update, to float
        round-off; ``W_out_`` is re-solved with the current ``gamma_`` (the data that chose it is gone; with
        many classes, when it is next needed). Atomic like :meth:`update`."""
        if self.G_ is None or self.Q_ is None or self.counts_ is None:
            raise RuntimeError("RanPACHead has no statistics yet: nothing to subtract")
        H = check_embeddings(H, self.embed_dim)
        y, _ = check_labels(y, H.shape[0], self.num_classes_, self.num_classes_)
        phi = self.features(H)
        y_dev = y.to(phi.device)
        counts = self.counts_ - torch.bincount(y_dev, minlength=self.num_classes_)
        if bool((counts < 0).any()):
            raise ValueError("downdate: these labels were not all accumulated by this head")
        cls = torch.as_tensor(classes, dtype=torch.long, device=phi.device)
        G = self.G_ - phi.T @ phi
        Q = self.Q_.clone()
        index_add(Q, 1, y_dev, -phi.T)
        Q[:, cls] = 0.0
        counts[cls] = 0
        P = PROTOTYPES.get(self.prototypes).subtract(self.P_, phi, y_dev, cls)
        assert self.gamma_ is not None
        W_out = self._solved(G, Q if P is None else P, self.gamma_)
        self.G_, self.Q_, self.P_, self.counts_, self.W_out_ = G, Q, P, counts, W_out
        self.n_samples_ -= int(H.shape[0])
        self.n_updates_ -= 1
        return self

    def refit(self, gamma: float | None = None) -> RanPACHead:
        """Recompute ``W_out_ = (G_ + gamma I)^{-1} Q_`` (Cholesky), optionally with a new ``gamma``."""
        if self.G_ is None or self.Q_ is None:
            raise RuntimeError("RanPACHead has no statistics yet: call update() first")
        if gamma is not None:
            if not (math.isfinite(gamma) and gamma > 0):
                raise ValueError(f"gamma must be a finite positive number, got {gamma}")
            self.gamma_ = float(gamma)
        if self.gamma_ is None:
            raise RuntimeError("no gamma selected yet")
        self.W_out_ = self._ridge_solve(self.G_, self.Q_ if self.P_ is None else self.P_, self.gamma_)
        return self

    #: ``(G + gamma I)^{-1} Q`` (:func:`~proteus.heads.gamma.ridge_solve`)
    _ridge_solve = staticmethod(ridge_solve)

    # ------------------------------------------------------------------ persistence
    def meta(self, columns: bool = True) -> dict[str, Any]:
        """JSON-serialisable description of the head (:func:`~proteus.heads.persist.head_meta`; without
        ``columns``: its class columns are stored by task)."""
        return head_meta(self, columns)

    def state_tensors(self, columns: bool = True) -> dict[str, Tensor]:
        """Fitted tensors for safetensors storage, ``W_rand`` included (contiguous CPU copies); without
        ``columns``, only those of a fixed size (:func:`~proteus.heads.persist.head_tensors`)."""
        return head_tensors(self, columns)

    def columns(self, classes: list[int]) -> dict[str, Tensor]:
        """The class statistics' columns of ``classes`` (:func:`~proteus.heads.persist.head_columns`)."""
        return head_columns(self, classes)

    def load_state_tensors(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> RanPACHead:
        """Restore a head saved with :meth:`state_tensors` and :meth:`meta` (bit-exact; no dtype casts)."""
        load_head_state(self, tensors, meta)
        return self

    # ------------------------------------------------------------------ prediction
    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError("RanPACHead is not fitted: call update() (or load_state_tensors()) first")

    def decision_function(self, H: Tensor) -> Tensor:
        """Eq. 23 scores ``phi(H)^T (G + gamma I)^{-1} e(c)`` for every class: shape ``(N, num_classes_)``;
        through the Cholesky factor of ``G + gamma I`` while ``W_out`` is unsolved (module doc)."""
        self._check_fitted()
        phi = self.features(H)
        if self._W is not None:
            return phi @ self._W
        assert self.G_ is not None
        if self._L is None:
            assert self.gamma_ is not None
            A = self.G_.clone()
            A.diagonal().add_(self.gamma_)
            L, info = torch.linalg.cholesky_ex(A)
            if int(info) != 0:  # not numerically positive definite: the solve's LU path
                W = self.W_out_
                assert W is not None
                return phi @ W
            self._L = L
        return torch.cholesky_solve(phi.T, self._L).T @ self._prototypes()

    def predict(self, H: Tensor, classes: Tensor | None = None) -> Tensor:
        """Predicted global labels ``(N,)``; ``classes`` restricts the argmax.

        ``classes`` is a 1-D integer tensor of allowed labels (same for every row), a ``(C,)`` boolean
        mask, or a per-row ``(N, C)`` boolean mask of allowed labels.
        """
        scores = self.decision_function(H)
        if classes is not None:
            mask = allowed_mask(classes, scores.shape[0], scores.shape[1], scores.device)
            scores = scores.masked_fill(~mask, -math.inf)
        return scores.argmax(dim=1)

    def __repr__(self) -> str:
        return (
            f"RanPACHead(embed_dim={self.embed_dim}, rp_dim={self.rp_dim}, gamma={self.gamma_}, "
            f"num_classes={self.num_classes_}, n_samples={self.n_samples_}, dtype={dtype_name(self.dtype)})"
        )


def head_from_state(
    tensors: dict[str, Tensor], meta: dict[str, Any], device: torch.device | str | None = None
) -> RanPACHead:
    """A head built from :meth:`RanPACHead.state_tensors` and :meth:`RanPACHead.meta` (bit-exact)."""
    head = RanPACHead(
        embed_dim=int(meta["embed_dim"]),
        rp_dim=int(meta["rp_dim"]),
        seed=int(meta["seed"]),
        dtype=meta_dtype(meta) or torch.float64,
        device=device,
    )
    return head.load_state_tensors(tensors, meta)
