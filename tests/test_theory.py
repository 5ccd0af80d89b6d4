"""Section 3.2's formulas: Definition 3.3, Theorem 3.5's bound and Theorem 3.6's minimum delta."""

from __future__ import annotations

import math

import pytest
import torch

from proteus.signatures.theory import (
    bound_thm35,
    failed_assumptions,
    kappa,
    min_delta_thm36,
    separation_factor,
    theory_report,
    thm35_condition,
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
    # outside delta >= max(0, -2 kappa / d) the theorem says nothing: no bound, and the reason
    assert bound_thm35(100, 0.5, -30.0, 1.0, 5, 10) is None  # needs delta >= 0.6
    assert "0.5 < max(0, -2 kappa / d) = 0.6" in str(thm35_condition(100, 0.5, -30.0))
    assert bound_thm35(100, -0.1, 0.0, 1.0, 5, 10) is None
    assert bound_thm35(100, math.nan, 0.0, 1.0, 5, 10) is None
    assert "not finite" in str(thm35_condition(100, 1.0, 0.0, math.inf))
    b = bound_thm35(100, 0.61, -30.0, 1.0, 5, 10)
    assert b is not None and b <= 1.0 and thm35_condition(100, 0.61, -30.0) is None
    # a single task: only the chi-square tail remains
    assert bound_thm35(50, 1.0, 0.0, 1.0, 1, 10) == pytest.approx(math.exp(-50 / 20))
    for d, kap, s2 in [(768, 0.0, 1.0), (64, -5.0, 0.5), (256, 10.0, 2.0)]:
        deltas = [max(0.0, -2 * kap / d) + 0.05 * i for i in range(1, 200)]
        vals = [bound_thm35(d, x, kap, s2, 10, 20) for x in deltas]
        assert all(v is not None for v in vals)
        assert all(b2 <= b1 for b1, b2 in zip(vals, vals[1:]))  # type: ignore[operator]
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
    bound = bound_thm35(d, delta, kap, s2, n, tau)
    assert bound is not None and bound <= eps * (1 + 1e-9)
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
        # the headline sigma^2 is the proof's: the variance of Z over the pair's inputs, per other component
        others = torch.cat([maha[k][i][comp[k] == t] for i in range(n_tasks) if i != k], 1).double()
        assert r["sigma2"] == pytest.approx(float(others.var(0).max()) / d, rel=1e-9)
        assert 0.0 < r["sigma2_a23"] < 3.0  # A2-3's: trace Var[h] / d of unit-variance noise
        # a larger sigma^2 loosens the bound: A2-3's (about 1) gives a tight one, the proof's a looser one
        assert r["bound_a23"] < 1e-3 and r["bound_reason"] is None and r["bound_reason_a23"] is None
        assert r["bound_a23"] <= r["bound"] < 1.0
        # Theorem 3.6 with A2-3's sigma^2 is met; with the proof's (V[Z] / d ~ 30) the minimum exceeds delta
        assert math.isfinite(r["min_delta_a23"]) and r["delta_ok_a23"] is True
        assert math.isfinite(r["min_delta"]) and r["min_delta"] > r["min_delta_a23"]
        assert r["delta_ok"] is (r["delta"] >= r["min_delta"]) and r["delta_ok"] is False
        assert r["a21"] is True and r["a21_a23"] is True
        # the proof needs V[Z] <= d sigma^2; A2-3's sigma^2 (about 1) is far below V[Z] / d here
        assert r["a23"] is (r["sigma2"] <= r["sigma2_a23"]) and r["a23"] is False
        assert r["failed"] == ["A2-3"]
    # without embeddings: A2-3's fields are not measured (None), the headline stays the proof's
    rep2 = theory_report(maha, logdets, d)
    assert all(math.isnan(r["error"]) and r["sigma2"] > 0 for r in rep2.values())
    assert all(r["sigma2_a23"] is None and r["a23"] is None and r["bound_a23"] is None for r in rep2.values())
    rep3 = theory_report(maha, logdets, d, components=comp)
    assert all(
        r["sigma2"] == rep[key]["sigma2"] and r["bound"] == rep[key]["bound"] for key, r in rep3.items()
    )
    assert theory_report(maha[:1], logdets[:1], d) == {}


def test_theory_report_names_every_failed_assumption() -> None:
    """Overlapping tasks with unequal volumes: no silent bound of 1, and A2-1 reported per pair."""
    g = torch.Generator().manual_seed(1)
    d, N = 8, 60
    emb = [torch.randn(N, d, generator=g), torch.randn(N, d, generator=g) * 3.0]
    # task 2's component is far wider (log-det 8 log 9 ~ 17.6 above task 1's): kappa < 0 for task 1
    scales = [1.0, 9.0]
    maha = [[(emb[k] ** 2).sum(1, keepdim=True) / scales[i] for i in range(2)] for k in range(2)]
    logdets = [torch.tensor([d * math.log(s)]) for s in scales]
    retrieved = [torch.full((N,), 1), torch.full((N,), 1)]
    rep = theory_report(maha, logdets, d, retrieved=retrieved, embeddings=[[e, e] for e in emb])
    r = rep[(0, 0)]  # task 1's inputs sit inside task 2's wide component: delta < 0
    assert r["delta"] < 0 and r["bound"] is None and "condition fails" in r["bound_reason"]
    assert r["bound_a23"] is None and "Thm 3.5 condition" in r["failed"]
    # A2-1: log|Lambda_2| - log|Lambda_1| = 8 log 9 against d sigma^2
    spread = float(logdets[1] - logdets[0])
    assert r["a21"] is (spread <= d * r["sigma2"]) and r["a21_a23"] is (spread <= d * r["sigma2_a23"])
    assert ("A2-1" in r["failed"]) is (not r["a21"])
    # a bound below the measured error is named too
    row = {"bound": 0.01, "error": 0.5, "a21": True, "a21_a23": False, "a23": True, "bound_a23": 0.6}
    assert failed_assumptions(row) == ["A2-1 (A2-3's sigma^2)", "bound < error"]
    row.update(bound=1.0, bound_a23=0.0)  # the proof's sigma^2 gives a vacuous bound, A2-3's a violated one
    assert failed_assumptions(row) == ["A2-1 (A2-3's sigma^2)", "bound < error (A2-3's sigma^2)"]
    assert failed_assumptions({"bound": None, "error": 0.0}) == ["Thm 3.5 condition"]


def test_assumptions_statement_lists_the_pairs() -> None:
    from proteus.report.analysis import assumptions_statement

    comps = [
        {"task": 0, "component": 0, "failed": ["A2-1", "bound < error"]},
        {"task": 1, "component": 1, "failed": []},
        {"task": 1, "component": 0, "failed": ["A2-1"]},
    ]
    text = assumptions_statement(comps)
    assert (
        "A2-1 (|Lambda_i^s| <= e^(d sigma^2) |Lambda_k^t|, the proof's sigma^2) fails for 2 of 3 pairs"
        in text
    )
    assert "(task.component 1.1, 2.1)" in text and "lies below the measured retrieval error" in text
    assert assumptions_statement([{"task": 0, "component": 0, "failed": []}]).startswith("every assumption")


def test_premise_statement_names_the_tasks_far_from_d() -> None:
    from proteus.report.analysis import PREMISE_FACTOR, premise

    ok = premise([0.9, 1.3])
    assert ok["holds"] and ok["statement"].startswith("the premise holds")
    # the regime of few images per dimension: test inputs far beyond d from their own components
    bad = premise([1.1, 2.5e4, 0.9])
    assert not bad["holds"] and "does not hold" in bad["statement"]
    assert "task 2: 2.5e+04 d" in bad["statement"] and "task 1" not in bad["statement"]
    assert not premise([1 / (PREMISE_FACTOR * 1.01)])["holds"] and not premise([])["holds"]


def test_a_component_of_one_test_input_is_not_tested() -> None:
    """One test input gives no V[Z]: the pair is not tested (no sigma^2, bound or minimum delta, no pass),
    and the summary counts it apart instead of as a pass."""
    from proteus.report.analysis import _side, assumptions_statement

    g = torch.Generator().manual_seed(2)
    d, N = 8, 40
    means = [torch.zeros(2, d), torch.full((1, d), 6.0)]
    emb = [torch.randn(N, d, generator=g), means[1][0] + torch.randn(N, d, generator=g)]
    comp = [torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long)]
    comp[0][0] = 1  # task 1's component 2 has a single test input
    maha = [[torch.cdist(emb[k], means[i]) ** 2 for i in range(2)] for k in range(2)]
    logdets = [torch.zeros(2), torch.zeros(1)]
    retrieved = [torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.long)]
    rep = theory_report(
        maha, logdets, d, retrieved=retrieved, components=comp, embeddings=[[e, e] for e in emb]
    )
    one = rep[(0, 1)]
    assert one["n"] == 1 and one["tested"] is False and "not tested" in one["bound_reason"]
    assert one["sigma2"] is None and one["bound"] is None and one["delta_ok"] is None and one["failed"] == []
    assert one["delta"] is not None and one["error"] == 0.0  # delta and the error are still measured
    assert all(r["tested"] for key, r in rep.items() if key != (0, 1))
    rows = [{"task": k, "component": t, **r} for (k, t), r in rep.items()]
    side = _side(rows, [float(r["n"]) for r in rows], "")
    tested_ok = [r["delta_ok"] for r in rows if r["tested"]]
    assert side["frac_delta_ok"] == sum(tested_ok) / len(tested_ok)  # the untested pair is in neither count
    assert "1 pairs of fewer than two test inputs not tested, counted apart" in assumptions_statement(rows)
