"""Section 3.2's formulas: Definition 3.3, Theorem 3.5's bound and Theorem 3.6's minimum delta."""

from __future__ import annotations

import math

import pytest
import torch

from proteus.signatures.theory import (
    bound_thm35,
    kappa,
    min_delta_thm36,
    separation_factor,
    theory_report,
)


def test_separation_factor_and_kappa() -> None:
    assert separation_factor(2 * 768.0, 768) == pytest.approx(1.0)
    assert separation_factor(768.0, 768) == pytest.approx(0.0)
    assert separation_factor(384.0, 768) == pytest.approx(-0.5)
    k = kappa(torch.tensor(-10.0), torch.tensor([[-8.0, -12.5], [-9.0, -3.0]]))
    assert k.item() == pytest.approx(-2.5)
    ks = kappa(torch.tensor([-10.0, -20.0]), torch.tensor([-8.0, -12.5]))
    assert ks.tolist() == pytest.approx([-2.5, 7.5])


def test_bound_thm35_by_hand() -> None:
    d, delta, kap, s2, n, tau = 768, 1.0, 0.0, 1.0, 10, 20
    first = math.exp(-d * delta**2 / (4 * delta + 16))  # exp(-768 / 20)
    z = d * delta / 2 + kap  # 384
    second = (n - 1) * tau * math.exp(-(z**2) / (2 * s2 * d + (2 / 3) * z))  # 180 exp(-147456 / 1792)
    assert first == pytest.approx(math.exp(-38.4))
    assert second == pytest.approx(180 * math.exp(-147456 / 1792))
    assert bound_thm35(d, delta, kap, s2, n, tau) == pytest.approx(first + second, rel=1e-12)
    # a case where both terms matter
    d, delta, kap, s2, n, tau = 10, 2.0, 1.5, 2.0, 3, 2
    first = math.exp(-10 * 4 / (8 + 16))
    z = 10 + 1.5
    second = 2 * 2 * math.exp(-(z**2) / (2 * 2 * 10 + (2 / 3) * z))
    expect = min(1.0, first + second)
    assert bound_thm35(d, delta, kap, s2, n, tau) == pytest.approx(expect, rel=1e-12)
    d, delta, kap, s2, n, tau = 100, 2.0, 1.5, 0.5, 3, 2
    first = math.exp(-100 * 4 / 24)
    z = 100 + 1.5
    second = 4 * math.exp(-(z**2) / (100 + (2 / 3) * z))
    assert bound_thm35(d, delta, kap, s2, n, tau) == pytest.approx(first + second, rel=1e-12)


def test_bound_thm35_validity_and_monotonicity() -> None:
    # outside delta >= max(0, -2 kappa / d): the trivial bound
    assert bound_thm35(100, 0.5, -30.0, 1.0, 5, 10) == 1.0  # needs delta >= 0.6
    assert bound_thm35(100, -0.1, 0.0, 1.0, 5, 10) == 1.0
    assert bound_thm35(100, 0.61, -30.0, 1.0, 5, 10) <= 1.0
    # a single task: only the chi-square tail remains
    assert bound_thm35(50, 1.0, 0.0, 1.0, 1, 10) == pytest.approx(math.exp(-50 / 20))
    for d, kap, s2 in [(768, 0.0, 1.0), (64, -5.0, 0.5), (256, 10.0, 2.0)]:
        deltas = [max(0.0, -2 * kap / d) + 0.05 * i for i in range(1, 200)]
        vals = [bound_thm35(d, x, kap, s2, 10, 20) for x in deltas]
        assert all(b2 <= b1 for b1, b2 in zip(vals, vals[1:]))
        assert vals[-1] < vals[0] or vals[0] == 1.0
        assert all(0.0 <= v <= 1.0 for v in vals)


def test_min_delta_thm36_by_hand() -> None:
    d, eps, kap, s2, n, tau = 768, 0.04, 0.0, 1.0, 10, 20
    N = (n - 1) * tau + 1  # 181
    L = math.log(N / eps)
    M = 3 * d * s2 - kap
    first = (M + math.sqrt(M * M - 24 * d * s2 * kap)) / 4 - kap  # = 3 d / 2 for kappa = 0
    second = L * (1 + math.sqrt(1 + 4 * d / L))
    expect = 2 / d * max(first, second)
    assert first == pytest.approx(1.5 * d)
    assert min_delta_thm36(d, eps, kap, s2, n, tau) == pytest.approx(expect, rel=1e-12)
    assert expect == pytest.approx(3.0)  # the first term dominates here: delta >= 3 sigma^2


def test_min_delta_thm36_conventions() -> None:
    # negative discriminant (kappa > 0, small M): the first constraint vanishes
    d, s2, kap = 100, 0.01, 2.0
    M = 3 * d * s2 - kap
    assert M * M - 24 * d * s2 * kap < 0
    L = math.log(21 / 0.1)
    assert min_delta_thm36(d, 0.1, kap, s2, 3, 10) == pytest.approx(
        2 / d * L * (1 + math.sqrt(1 + 4 * d / L))
    )
    # eps >= N: only the validity condition remains
    assert min_delta_thm36(100, 50.0, -10.0, 1.0, 3, 10) == pytest.approx(
        max(0.2, 2 / 100 * ((3 * 100 + 10 + math.sqrt((310) ** 2 + 24 * 100 * 10)) / 4 + 10))
    )
    assert min_delta_thm36(100, 0.0, 0.0, 1.0, 3, 10) == math.inf


@pytest.mark.parametrize(
    ("d", "kap", "s2", "n", "tau", "eps"),
    [
        (768, 0.0, 1.0, 10, 20, 0.04),
        (64, -3.0, 0.2, 5, 10, 0.01),
        (256, 20.0, 0.5, 20, 5, 0.1),
        (32, 1.0, 0.05, 2, 3, 0.2),
        (768, -50.0, 2.0, 50, 20, 0.001),
    ],
)
def test_theorem_36_delta_makes_theorem_35_bound_at_most_eps(
    d: int, kap: float, s2: float, n: int, tau: int, eps: float
) -> None:
    delta = min_delta_thm36(d, eps, kap, s2, n, tau)
    assert delta >= max(0.0, -2 * kap / d)
    assert bound_thm35(d, delta, kap, s2, n, tau) <= eps * (1 + 1e-9)
    # and it decreases when more error is tolerated
    assert min_delta_thm36(d, eps * 2, kap, s2, n, tau) <= delta


def test_theory_report_on_separated_tasks() -> None:
    g = torch.Generator().manual_seed(0)
    d, n_tasks, T, N = 16, 3, 2, 120
    means = [torch.randn(T, d, generator=g) * 0.5 + 8.0 * torch.eye(n_tasks, d)[k] for k in range(n_tasks)]
    # identity covariances: Mahalanobis = squared Euclidean distance; log-dets 0 (kappa = 0)
    emb, comp = [], []
    for k in range(n_tasks):
        c = torch.randint(0, T, (N,), generator=g)
        emb.append(means[k][c] + torch.randn(N, d, generator=g))
        comp.append(c)
    maha = [[torch.cdist(emb[k], means[i]) ** 2 for i in range(n_tasks)] for k in range(n_tasks)]
    logdets = [torch.zeros(T) for _ in range(n_tasks)]
    retrieved = [torch.stack([m.min(1).values for m in maha[k]], 1).argmin(1) for k in range(n_tasks)]
    rep = theory_report(
        maha,
        logdets,
        d,
        retrieved=retrieved,
        components=comp,
        embeddings=[[emb[k]] * n_tasks for k in range(n_tasks)],
    )
    assert set(rep) == {(k, t) for k in range(n_tasks) for t in range(T)}
    for (k, t), r in rep.items():
        assert r["n"] == int((comp[k] == t).sum())
        assert r["kappa"] == pytest.approx(0.0)
        assert r["tau"] == pytest.approx(T)
        assert r["delta"] > 3.0  # ||mu_k - mu_i||^2 ~ 128 >> d
        assert r["error"] == 0.0
        assert 0.0 < r["sigma2"] < 3.0
        assert r["bound"] < 1e-3
        assert math.isfinite(r["min_delta"]) and r["delta_ok"] is True
        assert r["a21"] is True
    # the Mahalanobis-variance fallback for sigma^2 and the default component assignment
    rep2 = theory_report(maha, logdets, d)
    assert all(math.isnan(r["error"]) and r["sigma2"] > 0 for r in rep2.values())
    assert theory_report(maha[:1], logdets[:1], d) == {}


def test_premise_statement_names_the_tasks_far_from_d() -> None:
    from proteus.report.analysis import PREMISE_FACTOR, premise

    ok = premise([0.9, 1.3])
    assert ok["holds"] and ok["statement"].startswith("the premise holds")
    # the regime of few images per dimension: test inputs far beyond d from their own components
    bad = premise([1.1, 2.5e4, 0.9])
    assert not bad["holds"] and "does not hold" in bad["statement"]
    assert "task 2: 2.5e+04 d" in bad["statement"] and "task 1" not in bad["statement"]
    assert not premise([1 / (PREMISE_FACTOR * 1.01)])["holds"] and not premise([])["holds"]
