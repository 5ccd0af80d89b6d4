"""The ridge parameter ``gamma`` of Eq. 23, chosen "with the same optimization strategy as in RanPAC"
(App. C).

After an update, on that update's data, the head is ridge-fitted on a ``1 - holdout`` split for every
``gamma in 10 ** arange(gamma_min_exp, gamma_max_exp)`` and the gamma with the smallest MSE against
one-hot targets on the held-out split is kept. With ``Phi`` the train-part features and ``Y`` its
targets:

* :func:`select_fast`: RanPAC's rule (this update's data alone) with one symmetric eigendecomposition
  for all candidates, of whichever train-part Gram matrix is smaller: the primal ``Phi^T Phi`` or the
  dual ``Phi Phi^T`` (``(Phi^T Phi + g I)^{-1} Phi^T = Phi^T (Phi Phi^T + g I)^{-1}``);
* :func:`select_naive`: RanPAC's ``optimise_ridge_parameter`` as written, one solve per candidate (the
  reference);
* :func:`select_accumulated`: beyond RanPAC, the ridge on everything learned so far plus this update's
  train part, scored on this update's held-out part with targets over all classes.

``head.gamma_selection`` names a rule in :data:`GAMMA_SELECTIONS`: an object whose ``select(data,
gammas, G_prev, Q_prev)`` picks gamma on an update's :class:`HeldOut` split (``G_prev``, ``Q_prev``: the
statistics before the update, None at the first one). ``"task"`` is RanPAC's rule (:func:`select_fast`),
``"accumulated"`` is :func:`select_accumulated` (RanPAC's rule at the first update).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from proteus.registry import Registry

__all__ = [
    "GAMMA_SELECTIONS",
    "AccumulatedRule",
    "GammaRule",
    "GammaSelection",
    "HeldOut",
    "TaskRule",
    "fallback_gamma",
    "finish_selection",
    "gamma_grid",
    "holdout_split",
    "log_selection",
    "ridge_solve",
    "select_accumulated",
    "select_fast",
    "select_naive",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GammaSelection:
    """Result of a ridge-parameter search: the chosen ``gamma`` and the held-out loss of every candidate."""

    gamma: float
    gammas: Tensor  # (n_gammas,) float64, CPU
    losses: Tensor  # (n_gammas,) float64, CPU: MSE against one-hot targets on the held-out split
    method: str  # "primal-eigh", "dual-eigh", "accumulated-eigh" or "naive-solve"


def gamma_grid(min_exp: int, max_exp: int) -> Tensor:
    """The candidate noise levels ``10 ** arange(min_exp, max_exp)`` (float64, CPU)."""
    exps = torch.arange(min_exp, max_exp, dtype=torch.float64)
    return torch.pow(torch.tensor(10.0, dtype=torch.float64), exps)


def finish_selection(gammas: Tensor, losses: Tensor, method: str) -> GammaSelection:
    """The candidate with the smallest finite held-out loss."""
    finite = torch.isfinite(losses)
    if not bool(finite.any()):
        raise FloatingPointError("every gamma candidate gave a non-finite held-out loss")
    masked = torch.where(finite, losses, torch.full_like(losses, math.inf))
    best = int(torch.argmin(masked))
    return GammaSelection(gamma=float(gammas[best]), gammas=gammas, losses=losses, method=method)


def _losses(A: Tensor, B: Tensor, lam: Tensor, Y_va: Tensor, gammas: Tensor) -> Tensor:
    """Held-out MSE per candidate of the predictions ``A diag(1 / (lam + g)) B``."""
    per_gamma = []
    for g in gammas.tolist():
        pred = A @ (B / (lam + g).unsqueeze(1))
        per_gamma.append(torch.mean((pred - Y_va) ** 2))
    return torch.stack(per_gamma).to(device="cpu", dtype=torch.float64)  # one device sync


def _losses_by_rows(A: Tensor, U: Tensor, Q: Tensor, lam: Tensor, Y_va: Tensor, gammas: Tensor) -> Tensor:
    """:func:`_losses` with ``B = U^T Q`` not formed: every candidate's held-out rows ``A diag(1 / (lam +
    g)) U^T`` stacked, then one product with Q. Costs ``n_gammas * n_val * d * (d + C)`` instead of
    ``d^2 C``: less once the classes outnumber the stacked rows (a long stream's accumulated head)."""
    rows = torch.cat([A / (lam + g) for g in gammas.tolist()]) @ U.T
    pred = (rows @ Q).view(len(gammas), *Y_va.shape)
    return ((pred - Y_va) ** 2).mean((1, 2)).to(device="cpu", dtype=torch.float64)


def select_fast(phi_tr: Tensor, Y_tr: Tensor, phi_va: Tensor, Y_va: Tensor, gammas: Tensor) -> GammaSelection:
    """RanPAC's search with one eigendecomposition: ``W(g) = U diag(1 / (lam + g)) U^T Phi^T Y`` (primal,
    ``G_tr = U diag(lam) U^T``) or, when ``n_train < feature_dim``, ``W(g) = Phi^T V diag(1 / (mu + g))
    V^T Y`` (dual, ``Phi Phi^T = V diag(mu) V^T``). The held-out predictions are formed without
    materialising ``W``; each candidate costs ``O(n_val * r * C)``."""
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
    return finish_selection(gammas, _losses(A, B, lam, Y_va, gammas), method)


def select_accumulated(
    phi_tr: Tensor,
    Y_tr: Tensor,
    phi_va: Tensor,
    Y_va: Tensor,
    gammas: Tensor,
    G_prev: Tensor,
    Q_prev: Tensor,
) -> GammaSelection:
    """Select gamma for the head that will actually be used: ridge on everything learned so far
    (``G_prev``, ``Q_prev``) plus the train part of this update, scored on this update's held-out
    part with targets over all classes. One ``eigh`` of the accumulated Gram matrix serves every
    candidate. RanPAC's rule (this update alone) picks gamma ~1e-8 for small tasks whose Gram
    matrix has low rank, which then ruins the accumulated head; this rule does not."""
    G = G_prev + phi_tr.T @ phi_tr
    Q = phi_tr.T @ Y_tr
    Q[:, : Q_prev.shape[1]] += Q_prev
    lam, U = torch.linalg.eigh(G)
    lam = lam.clamp_min(0.0)
    A = phi_va @ U
    if len(gammas) * A.shape[0] < Q.shape[1]:  # many classes: (A diag U^T) Q costs less than U^T Q
        return finish_selection(gammas, _losses_by_rows(A, U, Q, lam, Y_va, gammas), "accumulated-eigh")
    return finish_selection(gammas, _losses(A, U.T @ Q, lam, Y_va, gammas), "accumulated-eigh")


def select_naive(
    phi_tr: Tensor, Y_tr: Tensor, phi_va: Tensor, Y_va: Tensor, gammas: Tensor
) -> GammaSelection:
    """Reference search as RanPAC's ``optimise_ridge_parameter``: one solve per candidate."""
    G_tr = phi_tr.T @ phi_tr
    Q_tr = phi_tr.T @ Y_tr
    eye = torch.eye(G_tr.shape[0], dtype=G_tr.dtype, device=G_tr.device)
    per_gamma = []
    for g in gammas.tolist():
        W = torch.linalg.solve(G_tr + g * eye, Q_tr)
        per_gamma.append(torch.mean((phi_va @ W - Y_va) ** 2))
    losses = torch.stack(per_gamma).to(device="cpu", dtype=torch.float64)
    return finish_selection(gammas, losses, "naive-solve")


class HeldOut(NamedTuple):
    """An update's features ``phi`` and one-hot targets ``Y``, split into a train and a held-out part."""

    phi_tr: Tensor
    Y_tr: Tensor
    phi_va: Tensor
    Y_va: Tensor


class GammaRule(Protocol):
    """A ``head.gamma_selection`` rule: gamma for an update from its split ``data`` and the candidates
    ``gammas``; ``G_prev``, ``Q_prev`` are the head's statistics before the update (None at the first)."""

    def select(
        self, data: HeldOut, gammas: Tensor, G_prev: Tensor | None, Q_prev: Tensor | None
    ) -> GammaSelection: ...


class TaskRule:
    """RanPAC's rule: this update's data alone (:func:`select_fast`)."""

    def select(
        self, data: HeldOut, gammas: Tensor, G_prev: Tensor | None, Q_prev: Tensor | None
    ) -> GammaSelection:
        return select_fast(*data, gammas)


class AccumulatedRule:
    """The ridge on all statistics so far (:func:`select_accumulated`); RanPAC's rule at the first update."""

    def select(
        self, data: HeldOut, gammas: Tensor, G_prev: Tensor | None, Q_prev: Tensor | None
    ) -> GammaSelection:
        if G_prev is None or Q_prev is None:
            return select_fast(*data, gammas)
        return select_accumulated(*data, gammas, G_prev, Q_prev)


#: ``head.gamma_selection``: how gamma is chosen after an update
GAMMA_SELECTIONS: Registry[GammaRule] = Registry("head.gamma_selection")
GAMMA_SELECTIONS.register("accumulated")(AccumulatedRule())
GAMMA_SELECTIONS.register("task")(TaskRule())


def holdout_split(n: int, holdout: float, seed: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """``(train, held-out)`` indices of a seeded permutation of ``n`` samples (None if either is empty)."""
    n_train = int(math.floor(n * (1.0 - holdout) + 1e-9))
    if n_train < 1 or n - n_train < 1:
        return None
    gen = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(n, generator=gen).to(device)
    return perm[:n_train], perm[n_train:]


def ridge_solve(G: Tensor, Q: Tensor, gamma: float) -> Tensor:
    """``W = (G + gamma I)^{-1} Q`` (Eq. 23's weights): Cholesky, or LU when G + gamma I is not
    numerically positive definite; raises FloatingPointError for non-finite weights."""
    A = G.clone()
    A.diagonal().add_(gamma)
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        W = torch.cholesky_solve(Q, L)
    else:
        log.warning("RanPAC head: G + %g I is not numerically positive definite; using an LU solve", gamma)
        W = torch.linalg.solve(A, Q)
    if not bool(torch.isfinite(W).all()):
        raise FloatingPointError(f"ridge solve with gamma={gamma:g} produced non-finite weights")
    return W.contiguous()  # LAPACK returns column-major; keep one layout so matmuls are reproducible


def log_selection(selection: GammaSelection) -> None:
    log.info(
        "RanPAC head: gamma=%.0e selected (%s, %d candidates, held-out MSE %.4g)",
        selection.gamma,
        selection.method,
        len(selection.losses),
        float(selection.losses.min()),
    )


def fallback_gamma(previous: float | None, n: int) -> float:
    """The gamma of an update too small to split: the previous one, or 1 at first."""
    if previous is None:
        log.warning("RanPAC head: %d sample(s) cannot be split for the gamma search; using gamma=1", n)
        return 1.0
    log.warning("RanPAC head: update too small for the gamma search; keeping gamma=%g", previous)
    return previous
