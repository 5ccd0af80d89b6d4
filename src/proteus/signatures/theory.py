"""The provable retrieval error rate of Section 3.2: Definition 3.3, Theorems 3.5 and 3.6 (Appendix A).

* Separation factor (Definition 3.3, Eq. delta / A2-2): ``E_{x ~ D_k^t}[Z_i^s(x)] = (1 + delta) d`` with
  ``Z_i^s(x) = (h_i(x) - m_i^s)^T (Lambda_i^s)^{-1} (h_i(x) - m_i^s)``, so ``delta = E[Z] / d - 1``.
* ``kappa = min_{(i, s): i != k} log(|Lambda_i^s| / |Lambda_k^t|)`` (Eq. bound).
* Theorem 3.5 ("Bounding Retrieval Error Rate"): for ``delta >= max(0, -2 kappa / d)``,
  ``Pr(E_k^t) <= exp(-d delta^2 / (4 delta + 16))
  + (n - 1) tau exp(-(d delta / 2 + kappa)^2 / (2 sigma^2 d + (2/3)(d delta / 2 + kappa)))``.
  Outside that condition the theorem says nothing: :func:`bound_thm35` returns None and
  :func:`thm35_condition` says why (never a silent 1).
* Theorem 3.6 ("Keeping Error Rate Arbitrarily Low", Eq. epsrate, proof Eq. a10-a16): ``Pr(E_k^t) <= eps``
  when
  ``delta >= (2 / d) max{ (M + (M^2 - 24 d sigma^2 kappa)^(1/2)) / 4 - kappa,
  log(N / eps) (1 + (1 + 4 d / log(N / eps))^(1/2)) }`` with ``M = 3 d sigma^2 - kappa`` and
  ``N = (n - 1) tau + 1``.
* ``sigma^2``. The proof's Bernstein step (Eq. a6-a8, l. 516 of the paper's source) needs
  ``V[Z_i^s] <= sigma^2 d``; that is the headline ``sigma^2 = max_{(i,s)} V[Z_i^s] / d`` here, the only one
  that makes Theorem 3.5 a proven bound. Assumption A2-3 as the paper states it bounds the variance of
  the embedding instead, ``V[h_i(x)] <= d sigma^2``; measured as ``max_i trace(Var[h_i(x)]) / d`` it is
  reported beside (the ``*_a23`` fields). The two differ by orders of magnitude on real runs.
* Assumptions checked per (task k, component t): A2-1 (``max |Lambda_i^s| <= e^{d sigma^2} |Lambda_k^t|``,
  with either sigma^2) and whether A2-3's sigma^2 licenses the proof's step (``V[Z] <= d sigma^2_A2-3``).
  :func:`failed_assumptions` names the ones that fail.

All functions are pure functions of numbers and tensors, so the learner can call them on cached
evaluation embeddings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "bound_thm35",
    "failed_assumptions",
    "kappa",
    "min_delta_thm36",
    "separation_factor",
    "theory_report",
    "thm35_condition",
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


def thm35_condition(d: int, delta: float, kappa: float, sigma2: float = 0.0) -> str | None:
    """Why Theorem 3.5 gives no bound for these numbers (None: its condition holds). The condition is
    ``delta >= max(0, -2 kappa / d)`` (Eq. bound), with finite delta, kappa and sigma^2."""
    d = int(d)
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    delta, kap, s2 = float(delta), float(kappa), float(sigma2)
    if not (math.isfinite(delta) and math.isfinite(kap) and math.isfinite(s2)):
        return f"delta, kappa or sigma^2 is not finite (delta={delta:.4g}, kappa={kap:.4g}, sigma^2={s2:.4g})"
    need = max(0.0, -2.0 * kap / d)
    if delta < need:
        return f"delta = {delta:.4g} < max(0, -2 kappa / d) = {need:.4g}: Theorem 3.5's condition fails"
    return None


def bound_thm35(d: int, delta: float, kappa: float, sigma2: float, n: int, tau: float) -> float | None:
    """Right-hand side of Theorem 3.5, clipped to 1; None where the theorem does not apply
    (:func:`thm35_condition` says why), so that "no bound" never reads as a bound of 1.

    ``tau`` may be fractional: with different numbers of components per task use
    ``tau = (number of other-task components) / (n - 1)`` so that ``(n - 1) tau`` counts the union-bound
    terms exactly.
    """
    if thm35_condition(d, delta, kappa, sigma2) is not None:
        return None
    d = int(d)
    delta, kap, s2 = float(delta), float(kappa), float(sigma2)
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


def _with_sigma2(
    d: int, delta: float, kap: float, s2: float, n: int, tau: float, eps: float, spread: float
) -> dict[str, Any]:
    """Theorem 3.5's bound (or None and why), Theorem 3.6's minimum delta for error ``eps`` and A2-1
    (``spread = max log|Lambda_i^s| - log|Lambda_k^t| <= d sigma^2``) with one sigma^2."""
    md = min_delta_thm36(d, eps, kap, s2, n, tau) if math.isfinite(eps) else math.nan
    return {
        "bound": bound_thm35(d, delta, kap, s2, n, tau),
        "bound_reason": thm35_condition(d, delta, kap, s2),
        "min_delta": md,
        "delta_ok": bool(delta >= md) if math.isfinite(md) else None,
        "a21": bool(spread <= d * s2),
    }


#: a (task, component) pair with fewer test inputs is *not tested*: V[Z] (the proof's sigma^2) needs two
MIN_TEST_INPUTS = 2

#: the fields of a row that need a variance (None in a row that is not tested)
_NEEDS_VARIANCE = (
    "sigma2", "bound", "min_delta", "delta_ok", "a21", "sigma2_a23", "bound_a23", "bound_reason_a23",
    "min_delta_a23", "delta_ok_a23", "a21_a23", "a23",
)  # fmt: skip


def failed_assumptions(row: dict[str, Any]) -> list[str]:
    """The names of what fails for one (task, component) row of :func:`theory_report`: ``"A2-1"`` (with
    the headline sigma^2), ``"A2-1 (A2-3's sigma^2)"``, ``"A2-3"`` (A2-3's sigma^2 does not bound
    V[Z] / d, the variance the proof uses), ``"Thm 3.5 condition"`` (no bound), ``"bound < error"``
    (the measured error exceeds the bound: the premise of the theorems fails for this run) and
    ``"bound < error (A2-3's sigma^2)"`` (the same for the bound with A2-3's sigma^2)."""
    out = []
    if row.get("a21") is False:
        out.append("A2-1")
    if row.get("a21_a23") is False:
        out.append("A2-1 (A2-3's sigma^2)")
    if row.get("a23") is False:
        out.append("A2-3")
    if row.get("bound") is None:
        out.append("Thm 3.5 condition")
    err = row.get("error")
    measured = isinstance(err, float) and math.isfinite(err)
    if measured and row.get("bound") is not None and err > row["bound"]:
        out.append("bound < error")
    if measured and row.get("bound_a23") is not None and err > row["bound_a23"]:
        out.append("bound < error (A2-3's sigma^2)")
    return out


def _error(retrieved: list[Tensor] | None, k: int, sel: Tensor) -> float:
    """The measured retrieval error of task k's inputs ``sel`` (nan without ``retrieved``)."""
    if retrieved is None:
        return math.nan
    return float((retrieved[k].to(sel.device).index_select(0, sel) != k).double().mean())


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
    * ``embeddings[k][i]``: (N_k, d) ``h_i(x)`` for task k's inputs; gives A2-3's ``sigma^2 = max_{i != k}
      trace(Var[h_i(x)]) / d`` and the ``*_a23`` fields (None without it);
    * ``eps_floor``: the measured error used by Theorem 3.6 is ``max(error, eps_floor)``; default
      ``0.5 / n_kt`` (half an error), so that an error-free component gives a finite delta.

    ``delta`` is the smallest separation over the other tasks' components, ``min_{(i,s)} E[Z_i^s] / d - 1``
    (A2-2 assumes one delta for all of them; the smallest is the conservative choice), ``tau`` is
    ``(number of other-task components) / (n - 1)``, ``sigma2`` the proof's ``max_{(i,s)} V[Z_i^s] / d``.

    Returns ``{(k, t): row}`` with ``n``, ``delta``, ``kappa``, ``sigma2``, ``tau``, ``error``; ``bound``
    (None where Theorem 3.5's condition fails, ``bound_reason`` saying why), ``min_delta``, ``delta_ok``
    (measured delta >= min_delta; None where min_delta is not finite); the same with A2-3's sigma^2
    (``sigma2_a23``, ``bound_a23``, ``bound_reason_a23``, ``min_delta_a23``, ``delta_ok_a23``); the
    assumptions ``a21`` (A2-1 with sigma2), ``a21_a23`` (with sigma2_a23) and ``a23`` (sigma2_a23 >=
    sigma2, i.e. A2-3's variance bound gives the proof's ``V[Z] <= d sigma^2``), None where not measured;
    and ``failed`` (:func:`failed_assumptions`); ``tested``: False for a pair of fewer than
    :data:`MIN_TEST_INPUTS` test inputs, whose variance, bounds, minimum delta and assumptions are None
    (``bound_reason`` says so): one input gives no V[Z], and a sigma^2 of 0 would make it a pass. Pairs
    with no input are omitted; with a single task, delta, kappa and the bounds are undefined and the dict
    is empty.
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
            if n_kt < MIN_TEST_INPUTS:  # no variance from one input: the pair is not tested (not a pass)
                out[(k, t)] = {
                    "n": n_kt, "delta": delta, "kappa": kap, "tau": tau, "tested": False,
                    "error": _error(retrieved, k, sel), **dict.fromkeys(_NEEDS_VARIANCE),
                    "bound_reason": f"not tested: {n_kt} test input (V[Z] needs {MIN_TEST_INPUTS})",
                    "failed": [],
                }  # fmt: skip
                continue
            sigma2 = float(Z.var(dim=0, unbiased=True).max()) / d
            sigma2_a23: float | None = None
            if embeddings is not None:
                sigma2_a23 = (
                    max(
                        _var_trace(embeddings[k][i].index_select(0, sel.to(embeddings[k][i].device)))
                        for i in others
                    )
                    / d
                )
            err = _error(retrieved, k, sel)
            floor = eps_floor if eps_floor is not None else 0.5 / n_kt
            eps_used = max(err, floor) if math.isfinite(err) else math.nan
            spread = (
                float(ld_other.max()) - ld_true
            )  # A2-1: max log|Lambda_i^s| - log|Lambda_k^t| <= d sigma^2

            row: dict[str, Any] = {
                "n": n_kt, "delta": delta, "kappa": kap, "sigma2": sigma2, "tau": tau, "error": err,
                "tested": True,
                **_with_sigma2(d, delta, kap, sigma2, n, tau, eps_used, spread),
            }  # fmt: skip
            if sigma2_a23 is not None:
                a23 = _with_sigma2(d, delta, kap, sigma2_a23, n, tau, eps_used, spread)
                row.update({f"{key}_a23": v for key, v in a23.items()})
                row["sigma2_a23"] = sigma2_a23
                row["a23"] = bool(sigma2 <= sigma2_a23)
            else:
                row.update(dict.fromkeys(("sigma2_a23", "bound_a23", "bound_reason_a23", "min_delta_a23",
                                          "delta_ok_a23", "a21_a23", "a23")))  # fmt: skip
            row["failed"] = failed_assumptions(row)
            out[(k, t)] = row
    return out
