"""The provable retrieval error rate of Section 3.2: Definition 3.3, Theorems 3.5 and 3.6 (Appendix A).

* Separation factor (Definition 3.3, Eq. delta / A2-2): ``E_{x ~ D_k^t}[Z_i^s(x)] = (1 + delta) d`` with
  ``Z_i^s(x) = (h_i(x) - m_i^s)^T (Lambda_i^s)^{-1} (h_i(x) - m_i^s)``, so ``delta = E[Z] / d - 1``.
* ``kappa = min_{(i, s): i != k} log(|Lambda_i^s| / |Lambda_k^t|)`` (Eq. bound).
* Theorem 3.5 ("Bounding Retrieval Error Rate"): for ``delta >= max(0, -2 kappa / d)``,
  ``Pr(E_k^t) <= exp(-d delta^2 / (4 delta + 16))
  + (n - 1) tau exp(-(d delta / 2 + kappa)^2 / (2 sigma^2 d + (2/3)(d delta / 2 + kappa)))``.
* Theorem 3.6 ("Keeping Error Rate Arbitrarily Low", Eq. epsrate, proof Eq. a10-a16): ``Pr(E_k^t) <= eps``
  when
  ``delta >= (2 / d) max{ (M + (M^2 - 24 d sigma^2 kappa)^(1/2)) / 4 - kappa,
  log(N / eps) (1 + (1 + 4 d / log(N / eps))^(1/2)) }`` with ``M = 3 d sigma^2 - kappa`` and
  ``N = (n - 1) tau + 1``.
* ``sigma^2`` (A2-3): ``V_{x ~ D_k^t}[h_i(x)] <= d sigma^2``, measured as ``trace(Var[h_i(x)]) / d``
  maximised over the other tasks i. A2-1 (``max |Lambda_i^s| <= e^{d sigma^2} |Lambda_k^t|``) is reported
  as a boolean.

All functions are pure functions of numbers and tensors, so the learner can call them on cached
evaluation embeddings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "separation_factor",
    "kappa",
    "bound_thm35",
    "min_delta_thm36",
    "theory_report",
]


def separation_factor(maha_mean: float, d: int) -> float:
    """Definition 3.3: ``delta`` such that ``E[Z] = (1 + delta) d``, i.e. ``maha_mean / d - 1``."""
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    return float(maha_mean) / d - 1.0


def kappa(logdets_true: Tensor | float, logdets_other: Tensor) -> Tensor:
    """``min_{(i,s)} log|Lambda_i^s| - log|Lambda_k^t|`` (the minimum log-volume difference, Eq. bound).

    ``logdets_true``: ``log|Lambda_k^t|`` (scalar or (m,) for several true components); ``logdets_other``:
    the log-determinants of every component of every other task (any shape, flattened). Returns a tensor
    of the shape of ``logdets_true``.
    """
    other = torch.as_tensor(logdets_other).reshape(-1)
    if other.numel() == 0:
        raise ValueError("kappa needs at least one other-task component")
    true = torch.as_tensor(logdets_true, dtype=other.dtype, device=other.device)
    return other.min() - true


def bound_thm35(d: int, delta: float, kappa: float, sigma2: float, n: int, tau: float) -> float:
    """Right-hand side of Theorem 3.5, clipped to 1.

    Returns ``1.0`` (the trivial bound) outside the theorem's validity range
    ``delta >= max(0, -2 kappa / d)``, and ``min(1, RHS)`` inside it. ``tau`` may be fractional: with
    different numbers of components per task use ``tau = (number of other-task components) / (n - 1)``
    so that ``(n - 1) tau`` counts the union-bound terms exactly.
    """
    d = int(d)
    delta, kap, s2 = float(delta), float(kappa), float(sigma2)
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    if not (math.isfinite(delta) and math.isfinite(kap) and math.isfinite(s2)):
        return 1.0
    if delta < max(0.0, -2.0 * kap / d):
        return 1.0
    first = math.exp(-d * delta * delta / (4.0 * delta + 16.0))
    z = d * delta / 2.0 + kap  # >= 0 inside the validity range
    denom = 2.0 * s2 * d + (2.0 / 3.0) * z
    if n <= 1 or tau <= 0:
        second = 0.0
    elif z <= 0.0:
        second = (n - 1) * tau  # exponent 0 (also the 0/0 case sigma2 = 0, z = 0)
    else:
        second = (n - 1) * tau * math.exp(-(z * z) / denom)
    return min(1.0, first + second)


def min_delta_thm36(d: int, eps: float, kappa: float, sigma2: float, n: int, tau: float) -> float:
    """Smallest ``delta`` of Theorem 3.6 (Eq. epsrate) guaranteeing ``Pr(E_k^t) <= eps``.

    ``N = (n - 1) tau + 1``, ``M = 3 d sigma^2 - kappa``. Conventions:

    * negative discriminant ``M^2 - 24 d sigma^2 kappa < 0`` (possible only for ``kappa > 0``): the
      quadratic ``2 z^2 - M z + 3 kappa d sigma^2`` of Eq. a12 has no real root and is positive for every
      z, so Eq. a10 holds for any delta and the first term imposes no constraint (it is dropped);
    * ``eps >= N`` (``log(N / eps) <= 0``): Eq. a14 holds for every ``delta >= 0`` and the second term is 0;
    * ``eps <= 0``: no finite delta suffices; returns ``inf``.

    The result is also at least Theorem 3.5's validity condition ``max(0, -2 kappa / d)`` (which the
    proof assumes; with the formula's terms it is implied whenever the first term is present).
    """
    d = int(d)
    kap, s2, eps = float(kappa), float(sigma2), float(eps)
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    if eps <= 0.0:
        return math.inf
    N = (max(int(n), 1) - 1) * float(tau) + 1.0
    M = 3.0 * d * s2 - kap
    disc = M * M - 24.0 * d * s2 * kap
    first = (M + math.sqrt(disc)) / 4.0 - kap if disc >= 0.0 else -math.inf
    L = math.log(N / eps)
    second = L * (1.0 + math.sqrt(1.0 + 4.0 * d / L)) if L > 0.0 else 0.0
    return max((2.0 / d) * max(first, second), max(0.0, -2.0 * kap / d))


def _var_trace(H: Tensor) -> float:
    """``trace(Var[h])`` of the rows of H (unbiased; 0 for a single row)."""
    if H.shape[0] < 2:
        return 0.0
    Hd = H.to(torch.float64)
    return float(Hd.var(dim=0, unbiased=True).sum())


def theory_report(
    maha: list[list[Tensor]],
    logdets: list[Tensor],
    d: int,
    retrieved: list[Tensor] | None = None,
    components: list[Tensor] | None = None,
    embeddings: list[list[Tensor]] | None = None,
    eps_floor: float | None = None,
) -> dict[tuple[int, int], dict[str, Any]]:
    """Section 3.2's quantities per (task k, component t), from cached evaluation tensors.

    Arguments (n tasks, task i with T_i signature components, N_k test inputs of task k):

    * ``maha[k][i]``: (N_k, T_i) Mahalanobis distances ``Z_i^s(x)`` of task k's test inputs embedded by
      task i's adapter, under task i's components (``i == k`` included: it defines the sub-distributions);
    * ``logdets[i]``: (T_i,) ``log|Lambda_i^s|``;
    * ``d``: the embedding dimension;
    * ``retrieved[k]``: (N_k,) retrieved task per input of task k (for the measured error); optional;
    * ``components[k]``: (N_k,) the sub-distribution ``D_k^t`` of each input; default: the nearest own
      component, ``argmin_t maha[k][k]``;
    * ``embeddings[k][i]``: (N_k, d) ``h_i(x)`` for task k's inputs; gives ``sigma^2 = max_{i != k}
      trace(Var[h_i(x)]) / d`` (A2-3). Without it, ``sigma^2 = max_{(i,s)} Var[Z_i^s] / d`` (the variance
      bound ``V[Z] <= sigma^2 d`` that the proof of Theorem 3.5 actually uses);
    * ``eps_floor``: the measured error used by Theorem 3.6 is ``max(error, eps_floor)``; default
      ``0.5 / n_kt`` (half an error), so that an error-free component gives a finite delta.

    ``delta`` is the smallest separation over the other tasks' components, ``min_{(i,s)} E[Z_i^s] / d - 1``
    (A2-2 assumes one delta for all of them; the smallest is the conservative choice), ``tau`` is
    ``(number of other-task components) / (n - 1)``. Returns ``{(k, t): {"n", "delta", "kappa", "sigma2",
    "tau", "bound", "error", "min_delta", "delta_ok", "a21"}}`` (``delta_ok``: measured delta >=
    min_delta; ``a21``: A2-1 holds). Pairs with no input are omitted; with a single task, delta, kappa and
    the bounds are undefined and the dict is empty.
    """
    n = len(maha)
    if len(logdets) != n:
        raise ValueError(f"maha has {n} tasks, logdets {len(logdets)}")
    out: dict[tuple[int, int], dict[str, Any]] = {}
    if n < 2:
        return out
    for k in range(n):
        if len(maha[k]) != n:
            raise ValueError(f"maha[{k}] must list all {n} tasks, got {len(maha[k])}")
        own = maha[k][k]
        comp = components[k].to(own.device) if components is not None else own.argmin(dim=1)
        others = [i for i in range(n) if i != k]
        ld_other = torch.cat([logdets[i].reshape(-1).to(torch.float64).cpu() for i in others])
        n_other_comp = int(ld_other.numel())
        tau = n_other_comp / (n - 1)
        for t in range(int(logdets[k].numel())):
            sel = (comp == t).nonzero().flatten()
            n_kt = int(sel.numel())
            if n_kt == 0:
                continue
            Z = torch.cat(
                [
                    maha[k][i].index_select(0, sel.to(maha[k][i].device)).to(torch.float64).cpu()
                    for i in others
                ],
                dim=1,
            )  # (n_kt, other comps)
            delta = separation_factor(float(Z.mean(0).min()), d)
            ld_true = float(logdets[k].reshape(-1)[t])
            kap = float(kappa(ld_true, ld_other))
            if embeddings is not None:
                sigma2 = (
                    max(
                        _var_trace(embeddings[k][i].index_select(0, sel.to(embeddings[k][i].device)))
                        for i in others
                    )
                    / d
                )
            else:
                sigma2 = float(Z.var(dim=0, unbiased=True).max()) / d if n_kt > 1 else 0.0
            if retrieved is not None:
                err = float((retrieved[k].to(sel.device).index_select(0, sel) != k).double().mean())
            else:
                err = math.nan
            floor = eps_floor if eps_floor is not None else 0.5 / n_kt
            eps_used = max(err, floor) if math.isfinite(err) else math.nan
            min_delta = (
                min_delta_thm36(d, eps_used, kap, sigma2, n, tau) if math.isfinite(eps_used) else math.nan
            )
            a21 = float(ld_other.max()) - ld_true <= d * sigma2
            out[(k, t)] = {
                "n": n_kt,
                "delta": delta,
                "kappa": kap,
                "sigma2": sigma2,
                "tau": tau,
                "bound": bound_thm35(d, delta, kap, sigma2, n, tau),
                "error": err,
                "min_delta": min_delta,
                "delta_ok": bool(delta >= min_delta) if math.isfinite(min_delta) else None,
                "a21": bool(a21),
            }
    return out
