"""RanPAC's parameter-free ridge/LDA head: the statistics of Algorithm 1 (lines 8-12) and Eq. 23.

PROTEUS adopts the classification head of RanPAC (McDonnell et al., NeurIPS 2023). Every training
embedding ``h`` is mapped to ``phi(h) = relu(h @ W_rand)`` (a fixed Gaussian random projection to
``rp_dim`` dimensions; ``rp_dim = 0`` uses ``h`` itself) and two sufficient statistics are
accumulated over the whole stream (Algorithm 1, lines 10-11)::

    G  <- G + phi(h) phi(h)^T              (the Gram matrix G_S)
    Q  <- Q + phi(h) onehot(z)^T           (column c is the class-prototype sum e_S(c))

Prediction is Eq. 23, ``c* = argmax_c phi(h*)^T (G + gamma I)^{-1} e(c)``, i.e. the scores are
``phi(H) @ W_out`` with ``W_out = (G + gamma I)^{-1} Q``.

Two notes on fidelity:

* Algorithm 1 writes ``e_S(z) += m^{-1} |D_k|^{-1} h_S(x)``; like RanPAC we keep the unscaled sums.
  ``m^{-1}`` scales every score equally (no effect on the argmax) and ``|D_k|^{-1}`` only re-weights
  whole tasks, which is a no-op for equally sized tasks; the unscaled ``Q`` is what RanPAC's code and
  its ridge-parameter search use.
* The noise level ``gamma`` is chosen "with the same optimization strategy as in RanPAC" (App. C):
  after each update, on that update's data only, ridge-fit on a ``1 - holdout`` split over
  ``gamma in 10 ** arange(gamma_min_exp, gamma_max_exp)`` and keep the gamma with the smallest MSE
  against one-hot targets on the held-out split. RanPAC does one linear solve per gamma
  (:meth:`RanPACHead.select_gamma_naive`, kept as the reference); :meth:`RanPACHead.select_gamma`
  does a single symmetric eigendecomposition and then only rescales eigenvalues per gamma. It
  decomposes whichever of the two train-part Gram matrices is smaller: the primal
  ``Phi^T Phi`` (``rp_dim x rp_dim``) or the dual ``Phi Phi^T`` (``n_train x n_train``), using
  ``(Phi^T Phi + g I)^{-1} Phi^T = Phi^T (Phi Phi^T + g I)^{-1}``.

Memory: ``G`` is ``rp_dim x rp_dim`` in ``dtype``: 800 MB at the paper's ``rp_dim = 10000`` in
float64 (200 MB at 5000), plus a Cholesky factor of the same size while ``W_out`` is computed and
the ``N x rp_dim`` projected features of the update being processed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["GammaSelection", "RanPACHead"]

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
_FORMAT = "proteus.heads.ranpac"
_FORMAT_VERSION = 1


#: how gamma is chosen after an update: on all statistics so far, or RanPAC's rule (this task alone)
GAMMA_SELECTIONS = ("accumulated", "task")


@dataclass(frozen=True)
class GammaSelection:
    """Result of a ridge-parameter search: the chosen ``gamma`` and the held-out loss of every candidate."""

    gamma: float
    gammas: Tensor  # (n_gammas,) float64, CPU
    losses: Tensor  # (n_gammas,) float64, CPU: MSE against one-hot targets on the held-out split
    method: str  # "primal-eigh", "dual-eigh" or "naive-solve"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RanPACHead:
    """Ridge-regression / LDA head of RanPAC (Eq. 23) with incremental statistics ``G_`` and ``Q_``.

    Hyper-parameters are set in ``__init__``; everything fitted ends with an underscore
    (``W_rand_``, ``G_``, ``Q_``, ``counts_``, ``gamma_``, ``W_out_``, ``gamma_selection_``).

    Args:
        embed_dim: dimension ``d`` of the backbone embeddings ``h``.
        rp_dim: random-projection dimension ``M`` (RanPAC and the paper: 10000). ``0`` disables the
            projection and uses ``h`` directly. ``G_`` costs ``M^2`` numbers: 800 MB at 10000 in float64.
        gamma_min_exp, gamma_max_exp: the gamma grid is ``10 ** arange(gamma_min_exp, gamma_max_exp)``
            (end exclusive), i.e. ``1e-8 .. 1e13`` by default.
        holdout: fraction of each update's samples held out to score the gamma candidates.
        seed: seeds both the random projection and the train/held-out shuffle.
        dtype: float64 (default, recommended) or float32.
        device: where the statistics live; ``None`` uses the device of the first update's inputs.
        gamma: a fixed noise level; ``None`` (default) searches the grid after every update as RanPAC.
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
    ) -> None:
        if int(embed_dim) <= 0:
            raise ValueError(f"embed_dim must be positive, got {embed_dim}")
        if int(rp_dim) < 0:
            raise ValueError(f"rp_dim must be >= 0 (0 disables the random projection), got {rp_dim}")
        if int(gamma_max_exp) <= int(gamma_min_exp):
            raise ValueError(
                f"empty gamma grid: gamma_min_exp={gamma_min_exp} >= gamma_max_exp={gamma_max_exp}"
            )
        if not 0.0 < float(holdout) < 1.0:
            raise ValueError(f"holdout must be in (0, 1), got {holdout}")
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if gamma is not None and not (math.isfinite(gamma) and gamma > 0):
            raise ValueError(f"a fixed gamma must be a finite positive number, got {gamma}")
        self.embed_dim = int(embed_dim)
        self.rp_dim = int(rp_dim)
        self.gamma_min_exp = int(gamma_min_exp)
        self.gamma_max_exp = int(gamma_max_exp)
        self.holdout = float(holdout)
        if selection not in GAMMA_SELECTIONS:
            raise ValueError(f"selection must be one of {GAMMA_SELECTIONS}, got {selection!r}")
        self.selection = selection
        self.seed = int(seed)
        self.dtype = dtype
        self.device = device
        self.gamma = None if gamma is None else float(gamma)

        self.W_rand_: Tensor | None = None
        self.G_: Tensor | None = None
        self.Q_: Tensor | None = None
        self.counts_: Tensor | None = None
        self.gamma_: float | None = None
        self.W_out_: Tensor | None = None
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
        return self.W_out_ is not None

    def gamma_grid(self) -> Tensor:
        """The candidate noise levels ``10 ** arange(gamma_min_exp, gamma_max_exp)`` (float64, CPU)."""
        exps = torch.arange(self.gamma_min_exp, self.gamma_max_exp, dtype=torch.float64)
        return torch.pow(torch.tensor(10.0, dtype=torch.float64), exps)

    # ------------------------------------------------------------------ helpers
    def _state_device(self, like: Tensor | None = None) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        for t in (self.G_, self.W_out_, self.W_rand_):
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

    def _check_embeddings(self, H: Tensor, what: str = "H") -> Tensor:
        if not isinstance(H, Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(H).__name__}")
        if H.ndim != 2 or H.shape[1] != self.embed_dim:
            raise ValueError(f"{what} must have shape (N, {self.embed_dim}), got {tuple(H.shape)}")
        if H.shape[0] == 0:
            raise ValueError(f"{what} is empty (0 samples)")
        if not H.is_floating_point():
            raise ValueError(f"{what} must be a real floating-point tensor, got {H.dtype}")
        if not bool(torch.isfinite(H).all()):
            n_bad = int((~torch.isfinite(H)).any(dim=1).sum())
            raise ValueError(f"{what} contains NaN or inf values in {n_bad} of {H.shape[0]} rows")
        return H

    def features(self, H: Tensor) -> Tensor:
        """``phi(H) = relu(H @ W_rand_)`` in the head's dtype and device (``H`` itself if ``rp_dim == 0``)."""
        H = self._check_embeddings(H)
        device = self._state_device(H)
        H = H.to(device=device, dtype=self.dtype)
        if self.rp_dim == 0:
            return H
        self._ensure_projection(device)
        assert self.W_rand_ is not None
        return torch.relu(H @ self.W_rand_)

    def _check_labels(self, y: Tensor, n: int, num_classes: int | None) -> tuple[Tensor, int]:
        if not isinstance(y, Tensor):
            raise TypeError(f"y must be a torch.Tensor of integer labels, got {type(y).__name__}")
        if y.ndim != 1 or y.shape[0] != n:
            raise ValueError(f"y must have shape ({n},) to match H, got {tuple(y.shape)}")
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
        y_min, y_max = int(y.min()), int(y.max())
        if y_min < 0:
            raise ValueError(f"label {y_min} out of range: labels must be >= 0")
        if num_classes is not None:
            if int(num_classes) < self.num_classes_:
                raise ValueError(
                    f"num_classes={num_classes} is smaller than the {self.num_classes_} classes already seen"
                )
            if y_max >= int(num_classes):
                raise ValueError(f"label {y_max} out of range for num_classes={num_classes}")
            total = int(num_classes)
        else:
            total = max(self.num_classes_, y_max + 1)
        return y.long(), total

    def _one_hot(self, y: Tensor, num_classes: int, device: torch.device) -> Tensor:
        Y = torch.zeros(y.shape[0], num_classes, dtype=self.dtype, device=device)
        Y[torch.arange(y.shape[0], device=device), y.to(device)] = 1.0
        return Y

    def _split(self, n: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        n_train = int(math.floor(n * (1.0 - self.holdout) + 1e-9))
        if n_train < 1 or n - n_train < 1:
            return None
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        perm = torch.randperm(n, generator=gen).to(device)
        return perm[:n_train], perm[n_train:]

    def _split_for_selection(self, phi: Tensor, Y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        split = self._split(phi.shape[0], phi.device)
        if split is None:
            raise ValueError(
                f"cannot split {phi.shape[0]} samples into a train part and a held-out part "
                f"(holdout={self.holdout}); need at least 2 samples"
            )
        tr, va = split
        return phi[tr], Y[tr], phi[va], Y[va]

    def _features_and_targets(self, H: Tensor, y: Tensor, num_classes: int | None) -> tuple[Tensor, Tensor]:
        H = self._check_embeddings(H)
        y, total = self._check_labels(y, H.shape[0], num_classes)
        phi = self.features(H)
        return phi, self._one_hot(y, total, phi.device)

    # ------------------------------------------------------------------ gamma search
    def select_gamma(self, H: Tensor, y: Tensor, num_classes: int | None = None) -> GammaSelection:
        """RanPAC's gamma search with one eigendecomposition (``torch.linalg.eigh``) for all candidates.

        With ``Phi`` the train-part features and ``Y`` its one-hot targets, the ridge weights are
        ``W(g) = U diag(1 / (lam + g)) U^T Phi^T Y`` (primal, ``G_tr = U diag(lam) U^T``) or, when
        ``n_train < feature_dim``, ``W(g) = Phi^T V diag(1 / (mu + g)) V^T Y`` (dual,
        ``Phi Phi^T = V diag(mu) V^T``). The held-out predictions are formed without materialising
        ``W``; each candidate costs ``O(n_val * r * C)``.
        """
        return self._select_gamma_fast(*self._features_and_targets(H, y, num_classes))

    def _select_gamma_fast(self, phi: Tensor, Y: Tensor) -> GammaSelection:
        phi_tr, Y_tr, phi_va, Y_va = self._split_for_selection(phi, Y)
        gammas = self.gamma_grid()
        n_tr, m = phi_tr.shape
        if n_tr < m:
            method = "dual-eigh"
            lam, U = torch.linalg.eigh(phi_tr @ phi_tr.T)
            A = (phi_va @ phi_tr.T) @ U  # (n_val, n_tr)
            B = U.T @ Y_tr  # (n_tr, C)
        else:
            method = "primal-eigh"
            lam, U = torch.linalg.eigh(phi_tr.T @ phi_tr)
            A = phi_va @ U  # (n_val, m)
            B = U.T @ (phi_tr.T @ Y_tr)  # (m, C)
        lam = lam.clamp_min(0.0)  # a PSD matrix: negative eigenvalues are round-off
        per_gamma = []
        for g in gammas.tolist():
            pred = A @ (B / (lam + g).unsqueeze(1))
            per_gamma.append(torch.mean((pred - Y_va) ** 2))
        losses = torch.stack(per_gamma).to(device="cpu", dtype=torch.float64)  # one device sync
        return self._finish_selection(gammas, losses, method)

    def _select_gamma_accumulated(
        self, phi: Tensor, Y: Tensor, G_prev: Tensor, Q_prev: Tensor
    ) -> GammaSelection:
        """Select gamma for the head that will actually be used: ridge on everything learned so far
        (``G_prev``, ``Q_prev``) plus the train part of this update, scored on this update's held-out
        part with targets over all classes. One ``eigh`` of the accumulated Gram matrix serves every
        candidate. RanPAC's rule (this update alone) picks gamma ~1e-8 for small tasks whose Gram
        matrix has low rank, which then ruins the accumulated head; this rule does not."""
        phi_tr, Y_tr, phi_va, Y_va = self._split_for_selection(phi, Y)
        gammas = self.gamma_grid()
        G = G_prev + phi_tr.T @ phi_tr
        Q = phi_tr.T @ Y_tr
        Q[:, : Q_prev.shape[1]] += Q_prev
        lam, U = torch.linalg.eigh(G)
        lam = lam.clamp_min(0.0)
        A = phi_va @ U
        B = U.T @ Q
        per_gamma = []
        for g in gammas.tolist():
            pred = A @ (B / (lam + g).unsqueeze(1))
            per_gamma.append(torch.mean((pred - Y_va) ** 2))
        losses = torch.stack(per_gamma).to(device="cpu", dtype=torch.float64)
        return self._finish_selection(gammas, losses, "accumulated-eigh")

    def select_gamma_naive(self, H: Tensor, y: Tensor, num_classes: int | None = None) -> GammaSelection:
        """Reference gamma search as RanPAC's ``optimise_ridge_parameter``: one solve per candidate."""
        phi, Y = self._features_and_targets(H, y, num_classes)
        phi_tr, Y_tr, phi_va, Y_va = self._split_for_selection(phi, Y)
        gammas = self.gamma_grid()
        G_tr = phi_tr.T @ phi_tr
        Q_tr = phi_tr.T @ Y_tr
        eye = torch.eye(G_tr.shape[0], dtype=G_tr.dtype, device=G_tr.device)
        per_gamma = []
        for g in gammas.tolist():
            W = torch.linalg.solve(G_tr + g * eye, Q_tr)
            per_gamma.append(torch.mean((phi_va @ W - Y_va) ** 2))
        losses = torch.stack(per_gamma).to(device="cpu", dtype=torch.float64)
        return self._finish_selection(gammas, losses, "naive-solve")

    @staticmethod
    def _finish_selection(gammas: Tensor, losses: Tensor, method: str) -> GammaSelection:
        finite = torch.isfinite(losses)
        if not bool(finite.any()):
            raise FloatingPointError("every gamma candidate gave a non-finite held-out loss")
        masked = torch.where(finite, losses, torch.full_like(losses, math.inf))
        best = int(torch.argmin(masked))
        return GammaSelection(gamma=float(gammas[best]), gammas=gammas, losses=losses, method=method)

    # ------------------------------------------------------------------ fitting
    def update(self, H: Tensor, y: Tensor, num_classes: int | None = None) -> RanPACHead:
        """Accumulate ``G_``, ``Q_`` and ``counts_`` with one task's data, re-select gamma, refit ``W_out_``.

        Args:
            H: ``(N, embed_dim)`` embeddings ``h_S(x)`` of the task's training data.
            y: ``(N,)`` integer *global* class labels.
            num_classes: total number of classes so far (optional); ``Q_`` grows columns as needed.
        """
        H = self._check_embeddings(H)
        y, total = self._check_labels(y, H.shape[0], num_classes)
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
        if total > Q_old.shape[1]:
            grow = total - Q_old.shape[1]
            Q_old = torch.cat([Q_old, Q_old.new_zeros(m, grow)], dim=1)
            counts_old = torch.cat([counts_old, counts_old.new_zeros(grow)])

        y_dev = y.to(device)
        G_new = G_old + phi.T @ phi
        Q_new = Q_old.clone()
        Q_new.index_add_(1, y_dev, phi.T)  # column c += sum of phi over samples of class c: e_S(c)
        counts_new = counts_old + torch.bincount(y_dev, minlength=total)

        gamma, selection = self.gamma_, self.gamma_selection_
        if self.gamma is not None:
            gamma = self.gamma
        elif self._split(H.shape[0], device) is not None:
            Y = self._one_hot(y, total, device)
            if self.selection == "accumulated" and self.n_updates_:
                selection = self._select_gamma_accumulated(phi, Y, G_old, Q_old)
            else:
                selection = self._select_gamma_fast(phi, Y)
            gamma = selection.gamma
            log.info(
                "RanPAC head: gamma=%.0e selected (%s, %d candidates, held-out MSE %.4g)",
                gamma,
                selection.method,
                len(selection.losses),
                float(selection.losses.min()),
            )
        elif gamma is None:
            gamma = 1.0
            log.warning(
                "RanPAC head: %d sample(s) cannot be split for the gamma search; using gamma=1", len(y)
            )
        else:
            log.warning("RanPAC head: update too small for the gamma search; keeping gamma=%g", gamma)
        W_out = self._ridge_solve(G_new, Q_new, gamma)

        self.G_, self.Q_, self.counts_ = G_new, Q_new, counts_new
        self.gamma_, self.gamma_selection_, self.W_out_ = gamma, selection, W_out
        self.n_samples_ += int(H.shape[0])
        self.n_updates_ += 1
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
        self.W_out_ = self._ridge_solve(self.G_, self.Q_, self.gamma_)
        return self

    @staticmethod
    def _ridge_solve(G: Tensor, Q: Tensor, gamma: float) -> Tensor:
        A = G.clone()
        A.diagonal().add_(gamma)
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) == 0:
            W = torch.cholesky_solve(Q, L)
        else:
            log.warning(
                "RanPAC head: G + %g I is not numerically positive definite; using an LU solve", gamma
            )
            W = torch.linalg.solve(A, Q)
        if not bool(torch.isfinite(W).all()):
            raise FloatingPointError(f"ridge solve with gamma={gamma:g} produced non-finite weights")
        return W.contiguous()  # LAPACK returns column-major; keep one layout so matmuls are reproducible

    # ------------------------------------------------------------------ prediction
    def _check_fitted(self) -> Tensor:
        if self.W_out_ is None:
            raise RuntimeError("RanPACHead is not fitted: call update() (or load_state_tensors()) first")
        return self.W_out_

    def decision_function(self, H: Tensor) -> Tensor:
        """Eq. 23 scores ``phi(H)^T (G + gamma I)^{-1} e(c)`` for every class: shape ``(N, num_classes_)``."""
        W = self._check_fitted()
        return self.features(H) @ W

    def _allowed_mask(self, classes: Tensor, n: int, c: int, device: torch.device) -> Tensor:
        if not isinstance(classes, Tensor):
            classes = torch.as_tensor(classes)
        classes = classes.to(device)
        if classes.dtype == torch.bool:
            if classes.shape == (c,):
                mask = classes.unsqueeze(0).expand(n, c)
            elif classes.shape == (n, c):
                mask = classes
            else:
                raise ValueError(
                    f"a boolean class mask must have shape ({c},) or ({n}, {c}), got {tuple(classes.shape)}"
                )
        else:
            if classes.is_floating_point() or classes.ndim != 1:
                raise ValueError("classes must be a 1-D tensor of integer labels or a boolean mask")
            if classes.numel() == 0:
                raise ValueError("classes is empty: no class to predict")
            lo, hi = int(classes.min()), int(classes.max())
            if lo < 0 or hi >= c:
                bad = lo if lo < 0 else hi
                raise ValueError(f"label {bad} in classes out of range for num_classes={c}")
            row = torch.zeros(c, dtype=torch.bool, device=device)
            row[classes.long()] = True
            mask = row.unsqueeze(0).expand(n, c)
        if not bool(mask.any(dim=1).all()):
            raise ValueError("the class mask allows no class for some rows")
        return mask

    def predict(self, H: Tensor, classes: Tensor | None = None) -> Tensor:
        """Predicted global labels ``(N,)``; ``classes`` restricts the argmax.

        ``classes`` is a 1-D integer tensor of allowed labels (same for every row), a ``(C,)`` boolean
        mask, or a per-row ``(N, C)`` boolean mask of allowed labels.
        """
        scores = self.decision_function(H)
        if classes is not None:
            mask = self._allowed_mask(classes, scores.shape[0], scores.shape[1], scores.device)
            scores = scores.masked_fill(~mask, -math.inf)
        return scores.argmax(dim=1)

    # ------------------------------------------------------------------ persistence
    def meta(self) -> dict[str, Any]:
        """JSON-serialisable description of the head (hyper-parameters and scalar fitted state)."""
        return {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "embed_dim": self.embed_dim,
            "rp_dim": self.rp_dim,
            "gamma_min_exp": self.gamma_min_exp,
            "gamma_max_exp": self.gamma_max_exp,
            "holdout": self.holdout,
            "selection": self.selection,
            "seed": self.seed,
            "dtype": _dtype_name(self.dtype),
            "fixed_gamma": self.gamma,
            "gamma": self.gamma_,
            "num_classes": self.num_classes_,
            "n_samples": self.n_samples_,
            "n_updates": self.n_updates_,
        }

    def state_tensors(self) -> dict[str, Tensor]:
        """Fitted tensors for safetensors storage (contiguous CPU copies). ``W_rand`` is stored too."""
        out: dict[str, Tensor] = {}
        for key, t in (
            ("W_rand", self.W_rand_),
            ("G", self.G_),
            ("Q", self.Q_),
            ("counts", self.counts_),
            ("W_out", self.W_out_),
        ):
            if t is not None:
                out[key] = t.detach().to("cpu", copy=True).contiguous()
        return out

    def load_state_tensors(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> RanPACHead:
        """Restore a head saved with :meth:`state_tensors` and :meth:`meta` (bit-exact; no dtype casts)."""
        if meta.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"not a RanPAC head state: format={meta.get('format')!r}")
        dtype_name = meta["dtype"]
        dtype = {v: k for k, v in _SUPPORTED_DTYPES.items()}.get(dtype_name)
        if dtype is None:
            raise ValueError(f"unsupported dtype {dtype_name!r} in head meta")
        self.embed_dim = int(meta["embed_dim"])
        self.rp_dim = int(meta["rp_dim"])
        self.gamma_min_exp = int(meta.get("gamma_min_exp", self.gamma_min_exp))
        self.gamma_max_exp = int(meta.get("gamma_max_exp", self.gamma_max_exp))
        self.holdout = float(meta.get("holdout", self.holdout))
        self.selection = str(meta.get("selection", self.selection))
        self.seed = int(meta["seed"])
        self.dtype = dtype
        self.gamma = None if meta.get("fixed_gamma") is None else float(meta["fixed_gamma"])
        m, c = self.feature_dim, int(meta["num_classes"])
        device = torch.device(self.device) if self.device is not None else None
        if "G" not in tensors and int(meta.get("n_samples", 0)) == 0:  # saved before the first update
            w = tensors.get("W_rand")
            self.W_rand_ = None if w is None or self.rp_dim == 0 else w.to(device or w.device)
            self.G_ = self.Q_ = self.counts_ = self.W_out_ = None
            self.gamma_, self.gamma_selection_, self.n_samples_, self.n_updates_ = None, None, 0, 0
            return self
        expected = {
            "G": ((m, m), dtype),
            "Q": ((m, c), dtype),
            "counts": ((c,), torch.long),
            "W_out": ((m, c), dtype),
        }
        if self.rp_dim > 0:
            expected["W_rand"] = ((self.embed_dim, self.rp_dim), dtype)
        for key, (shape, dt) in expected.items():
            if key not in tensors:
                raise ValueError(f"head state is missing tensor {key!r}")
            t = tensors[key]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(
                    f"head tensor {key!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                    f"expected {shape}, {dt}"
                )
        device = device or tensors["G"].device
        self.W_rand_ = tensors["W_rand"].to(device) if self.rp_dim > 0 else None
        self.G_ = tensors["G"].to(device)
        self.Q_ = tensors["Q"].to(device)
        self.counts_ = tensors["counts"].to(device)
        self.W_out_ = tensors["W_out"].to(device)
        self.gamma_ = None if meta.get("gamma") is None else float(meta["gamma"])
        self.n_samples_ = int(meta.get("n_samples", int(self.counts_.sum())))
        self.n_updates_ = int(meta.get("n_updates", 0))
        self.gamma_selection_ = None
        return self

    @classmethod
    def from_state_tensors(
        cls, tensors: dict[str, Tensor], meta: dict[str, Any], device: torch.device | str | None = None
    ) -> RanPACHead:
        """Build a head from :meth:`state_tensors` and :meth:`meta`."""
        dtype = {v: k for k, v in _SUPPORTED_DTYPES.items()}.get(meta.get("dtype", ""), torch.float64)
        head = cls(
            embed_dim=int(meta["embed_dim"]),
            rp_dim=int(meta["rp_dim"]),
            seed=int(meta["seed"]),
            dtype=dtype,
            device=device,
        )
        return head.load_state_tensors(tensors, meta)

    def __repr__(self) -> str:
        return (
            f"RanPACHead(embed_dim={self.embed_dim}, rp_dim={self.rp_dim}, gamma={self.gamma_}, "
            f"num_classes={self.num_classes_}, n_samples={self.n_samples_}, dtype={_dtype_name(self.dtype)})"
        )
