"""The ``task-gaussian`` detector of inputs from no learned task (issue 39): each task's Gaussians (PPCA of
an OAS-shrunk covariance) on the frozen prefix's channel statistics at three depths and on the keys'
features, a combined score, one pooled threshold; a knowledge base without the Gaussians keeps the
class-Gaussian detector. Fast: synthetic statistics and a random MobileNetV2."""

from __future__ import annotations

import math

import pytest
import torch

from proteus.backbones.mobilenet import MobileNetV2Backbone
from proteus.engine.embedder import pooled_stats
from proteus.engine.novelty import (
    PPCA,
    ClassNovelty,
    TaskGaussians,
    shrunk_spectrum,
    shrunk_spectrum_gram,
)
from proteus.signatures.fitting import oas_rho


def _oas(X: torch.Tensor) -> torch.Tensor:
    X = X.double()
    R = X - X.mean(0)
    S = R.T @ R / len(X)
    rho, m = oas_rho(S, len(X)), float(S.diagonal().mean())
    return (1 - rho) * S + rho * m * torch.eye(S.shape[0], dtype=torch.float64)


@pytest.mark.parametrize("rank", [3, 8])
def test_ppca_scores_with_its_covariance(rank: int) -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 8, generator=g, dtype=torch.float64) @ torch.randn(
        8, 8, generator=g, dtype=torch.float64
    )
    p = PPCA.fit(X, rank)
    U, var = p.basis.double(), p.var.double()
    C = U @ torch.diag(var) @ U.T + p.noise * (torch.eye(8, dtype=torch.float64) - U @ U.T)
    if rank >= 8:
        assert torch.allclose(C, _oas(X), atol=1e-5)  # full rank: the OAS covariance itself
    Z = torch.randn(5, 8, generator=g, dtype=torch.float64)
    D = Z - p.mean.double()
    want = (D @ torch.linalg.inv(C) * D).sum(1) + torch.logdet(C)
    assert torch.allclose(p.nll(Z), want, rtol=1e-4, atol=1e-3)


def test_ppca_of_few_rows_keeps_only_their_directions_and_the_same_density() -> None:
    """n rows span n - 1 directions: a task of 20 rows keeps 19 (not RANK) and scores as the whole shrunk
    covariance does, to round-off."""
    g = torch.Generator().manual_seed(1)
    scales = torch.linspace(0.5, 3.0, 96, dtype=torch.float64)
    X = torch.randn(20, 96, generator=g, dtype=torch.float64) * scales
    p = PPCA.fit(X)
    assert p.basis.shape == (96, 19) and p.var.shape == (19,)
    C = _oas(X)
    Z = torch.randn(6, 96, generator=g, dtype=torch.float64) * 2
    D = Z - p.mean.double()
    want = (D @ torch.linalg.inv(C) * D).sum(1) + torch.logdet(C)
    torch.testing.assert_close(p.nll(Z), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("duplicated", [False, True])
def test_the_gram_spectrum_of_few_rows_is_the_covariance_spectrum(duplicated: bool) -> None:
    """n <= D rows: the Gram matrix's route (n x n) gives the (D, D) covariance's eigenvalues, directions
    and noise; rows repeated (fewer directions of variance than n - 1) keep only the directions with
    variance, and score the same."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(12, 40, generator=g, dtype=torch.float64) * torch.linspace(
        0.5, 3.0, 40, dtype=torch.float64
    )
    if duplicated:
        X = torch.cat([X[:6], X[:6]])
    R = X - X.mean(0)
    lam, U, noise = shrunk_spectrum(R, 11)
    lam_g, U_g, noise_g = shrunk_spectrum_gram(R, 11)
    r = 5 if duplicated else 11
    assert U_g.shape == (40, r)
    torch.testing.assert_close(lam_g, lam[:r], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((U[:, :r].T @ U_g).abs().diagonal(), torch.ones(r, dtype=torch.float64))
    Z = torch.randn(4, 40, generator=g)
    mu = X.mean(0).float()
    full = PPCA(mu, U.float(), lam.float(), noise).nll(Z)
    torch.testing.assert_close(
        PPCA(mu, U_g.float(), lam_g.float(), noise_g).nll(Z), full, rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(PPCA.fit(X, 11).nll(Z), full, rtol=1e-5, atol=1e-4)


def test_the_tasks_gaussians_scored_together_are_each_ppca_nll() -> None:
    """:class:`TaskGaussians` (every task's Gaussian of one component in one pass) gives each task's
    :meth:`PPCA.nll` to float64 round-off, for tasks of different ranks and inputs far from the origin."""
    g = torch.Generator().manual_seed(3)
    offset = 50.0 * torch.rand(48, generator=g, dtype=torch.float64)
    gaussians = [
        PPCA.fit(offset + torch.randn(n, 48, generator=g, dtype=torch.float64) * (1 + t), rank=8)
        for t, n in enumerate((5, 12, 30, 80))
    ]
    assert [q.basis.shape[1] for q in gaussians] == [4, 8, 8, 8]
    Z = (offset + 3 * torch.randn(7, 48, generator=g, dtype=torch.float64)).float()
    want = torch.stack([q.nll(Z) for q in gaussians], 1)
    torch.testing.assert_close(TaskGaussians(gaussians).scores(Z), want, rtol=1e-9, atol=1e-9)


def test_the_taps_are_the_last_block_of_each_third_of_the_prefix() -> None:
    b = MobileNetV2Backbone(pretrained=False)
    b.set_adapt_last(6)  # prefix: blocks 0..11
    assert [list(b.blocks).index(m) for m in b.tap_blocks()] == [3, 7, 11]
    b.set_adapt_last(None)
    assert b.tap_blocks() == []  # nothing frozen: no taps, the keys' features alone


def test_pooled_stats_of_maps_and_tokens() -> None:
    h = torch.randn(2, 3, 4, 5)
    s = pooled_stats(h)
    assert s.shape == (2, 6) and torch.allclose(s[:, :3], h.mean((2, 3)))
    assert torch.allclose(s[:, 3:], h.flatten(2).std(2, correction=0))
    tokens = torch.randn(2, 7, 3)
    assert torch.allclose(pooled_stats(tokens), pooled_stats(tokens.transpose(1, 2)[..., None]))


def _task(g: torch.Generator, shift: float, n: int = 400) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key features, taps, labels) of a synthetic task: its own mean and scale in every component."""
    X = shift + torch.randn(n, 6, generator=g) * (1 + shift / 4)
    taps = torch.cat([shift + torch.randn(n, 4, generator=g), -shift + torch.randn(n, 2, generator=g)], 1)
    return X, taps, torch.randint(0, 2, (n,), generator=g) + 2 * int(shift)


def test_task_gaussians_flag_another_source_and_accept_their_own() -> None:
    g = torch.Generator().manual_seed(1)
    det = ClassNovelty(holdout=0.25, tpr=0.95, tasks=True)
    tasks = [_task(g, s) for s in (0.0, 3.0)]
    for k, (X, taps, y) in enumerate(tasks):
        det.draw(k, X, y, seed=k, taps=taps, tap_sizes=[4, 2])
    assert det.uses_taps and [len(gs) for gs in det.gaussians.values()] == [3, 3]  # 2 taps + the features
    task_of = torch.tensor([0, 0, 1, 1])
    assert det.fit(torch.zeros(1), torch.zeros(1), torch.zeros(1), task_of, stamp=1)
    rows = [det.rows[k] for k in (0, 1)]
    cal = torch.cat([det.novelty(r.X, task_of, r.taps) for r in rows])
    assert abs(float((cal <= 0).double().mean()) - 0.95) < 0.02  # the pooled threshold at tpr 0.95
    fresh = [_task(g, s) for s in (0.0, 3.0)]
    known = torch.cat([det.novelty(X, task_of, t) for X, t, _ in fresh])
    other_X, other_taps, _ = _task(g, 7.0)
    unknown = det.novelty(other_X, task_of, other_taps)
    assert float((known > 0).double().mean()) < 0.1 and float((unknown > 0).double().mean()) > 0.99
    assert det.novelty(other_X, task_of) is None  # without the taps the task Gaussians cannot score
    # stored and read back: the same scores
    back = ClassNovelty(holdout=0.25, tpr=0.95, tasks=True)
    for k in (0, 1):
        meta, tensors = det.task_state(k)
        back.load_task(k, {**meta, "index": k}, tensors)
    back.fit(torch.zeros(1), torch.zeros(1), torch.zeros(1), task_of, stamp=2)
    assert torch.allclose(back.novelty(other_X, task_of, other_taps), unknown)
    assert math.isclose(back.thresholds()[0], det.thresholds()[0])


def test_without_task_gaussians_the_class_gaussians_score() -> None:
    g = torch.Generator().manual_seed(2)
    det = ClassNovelty(holdout=0.25, tpr=0.95, tasks=False)  # retrieval.novelty=class-gaussian
    X, taps, y = _task(g, 0.0)
    det.draw(0, X, y, seed=0, taps=taps, tap_sizes=[4, 2])
    assert not det.uses_taps and det.gaussians == {} and det.rows[0].taps is None
    meta, tensors = det.task_state(0)
    assert "tap_sizes" not in meta["novelty"] and "novelty/taps" not in tensors  # as before issue 39


def test_prefix_taps_give_the_prefix_and_each_taps_statistics() -> None:
    from proteus import Proteus

    clf = Proteus.from_method(
        "proteus", backbone="mobilenet_v2", progress=False,
        **{"backbone.pretrained": False, "backbone.img_size": 32, "backbone.adapt_last": 6},
    )  # fmt: skip
    clf.kb_header()  # builds the parts
    x = torch.randn(3, 3, 32, 32)
    z, taps = clf.embedder_.prefix_taps(x)
    assert torch.equal(z, clf.embedder_.prefix(x))
    assert clf.embedder_.tap_sizes() == [64, 128, 192] and taps.shape == (3, 384)  # 2 x 32, 64, 96 channels


def test_a_shortlist_scores_each_input_under_its_candidate_tasks_only() -> None:
    """``retrieval.shortlist``: with at least as many candidates as tasks the detector is the one over every
    task, bit for bit; with fewer, an input's score is its combined score minimised over its candidate
    tasks only (each pair scored as :meth:`PPCA.nll` scores it), and the calibration rows are scored under
    theirs, so the threshold still accepts the rate asked of them."""
    g = torch.Generator().manual_seed(3)
    shifts = (0.0, 3.0, 6.0, 9.0)
    tasks = [_task(g, s) for s in shifts]
    task_of = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    full, wide, short = (ClassNovelty(holdout=0.25, tpr=0.95, tasks=True, shortlist=k) for k in (None, 4, 2))
    for det in (full, wide, short):
        for k, (X, taps, y) in enumerate(tasks):
            det.draw(k, X, y, seed=k, taps=taps, tap_sizes=[4, 2])

    def nearest(X: torch.Tensor, k: int) -> torch.Tensor:  # the keys' stand-in: the closest task means
        means = torch.tensor([[s] for s in shifts])
        return (X.mean(1, keepdim=True) - means.T).abs().topk(k, dim=1, largest=False).indices

    assert full.fit(torch.zeros(1), torch.zeros(1), torch.zeros(1), task_of, stamp=1)
    assert wide.fit(torch.zeros(1), torch.zeros(1), torch.zeros(1), task_of, 1, lambda X: nearest(X, 4))
    assert short.fit(torch.zeros(1), torch.zeros(1), torch.zeros(1), task_of, 1, lambda X: nearest(X, 2))
    X, taps, _ = _task(g, 3.0, n=50)
    every = full.novelty(X, task_of, taps)
    assert torch.equal(wide.novelty(X, task_of, taps), every)  # 4 candidates of 4 tasks: the same detector
    cand = nearest(X, 2)
    got = short.novelty(X, task_of, taps, cand)
    _, fitted, _ = short._fitted
    loc, scale = fitted.loc, fitted.scale
    parts = short._components(X, taps)
    want = torch.stack([
        torch.stack([sum((short.gaussians[int(t)][c].nll(parts[c][i : i + 1]) - loc[c]) / scale[c]
                         for c in range(3))[0] for t in cand[i]]).min()
        for i in range(len(X))
    ]) - short.thresholds()[0]  # fmt: skip
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)
    cal = torch.cat([short.novelty(r.X, task_of, r.taps, nearest(r.X, 2)) for r in short.rows.values()])
    assert abs(float((cal <= 0).double().mean()) - 0.95) < 0.02
    with pytest.raises(ValueError, match="candidate tasks"):
        short.novelty(X, task_of, taps)


def test_a_long_streams_pool_is_a_seeded_sample_gathered_from_the_tasks_drawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond MAX_POOLED rows the detector pools a seeded uniform sample of every task's rows, in task
    order: the same rows as drawing from their concatenation, gathered from the tasks that hold them."""
    from proteus.engine import novelty

    g = torch.Generator().manual_seed(0)
    live = {
        k: novelty.CalibrationRows(torch.randn(n, 3, generator=g), torch.zeros(n), True, torch.randn(n, 2))
        for k, n in enumerate([5, 9, 1, 7, 4])
    }
    X_all, taps_all = novelty._pooled(live)
    assert torch.equal(X_all, torch.cat([r.X for r in live.values()]))  # under the cap: every row
    monkeypatch.setattr(novelty, "MAX_POOLED", 10)
    X, taps = novelty._pooled(live)
    keep = torch.randperm(26, generator=torch.Generator().manual_seed(26))[:10].sort().values
    assert torch.equal(X, X_all[keep]) and torch.equal(taps, taps_all[keep])


@pytest.mark.parametrize("block", [2**21, 200, 1])
def test_pair_scores_are_each_pairs_own_nll_in_blocks_of_tasks(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Candidates scored task block by task block (projections of lower rank padded) give each pair its
    Gaussian's :meth:`PPCA.nll`, for tasks of different ranks and row counts, however the tasks fall into
    blocks; a task without Gaussians scores +inf."""
    from proteus.engine import novelty

    monkeypatch.setattr(novelty, "PAIR_BLOCK", block)
    g = torch.Generator().manual_seed(5)
    gaussians = {
        t: [PPCA.fit(torch.randn(n, dim, generator=g, dtype=torch.float64) + t, rank=8) for dim in (6, 9)]
        for t, n in enumerate([4, 12, 7, 30, 3, 9])
        if t != 4
    }
    parts = [torch.randn(20, 6, generator=g) + 2, torch.randn(20, 9, generator=g) + 2]
    cand = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(20)])
    got = novelty.pair_scores(gaussians, parts, cand)
    for c in range(2):
        for i in range(20):
            for j, t in enumerate(cand[i].tolist()):
                want = gaussians[t][c].nll(parts[c][i : i + 1])[0] if t in gaussians else float("inf")
                assert float(got[c][i, j]) == pytest.approx(float(want), rel=1e-9, abs=1e-9)


def test_the_widest_variance_bounds_every_nll_from_below() -> None:
    """``||z - mean||^2 / widest + logdet`` never exceeds :meth:`PPCA.nll` (what the pruning relies on)."""
    from proteus.engine import novelty

    g = torch.Generator().manual_seed(8)
    gaussians = {t: [PPCA.fit(torch.randn(n, 9, generator=g, dtype=torch.float64) * (t + 1), rank=5)]
                 for t, n in enumerate([3, 8, 40])}  # fmt: skip
    Z = torch.randn(30, 9, generator=g) * 3
    cand = torch.arange(3).repeat(30, 1)
    (lb,) = novelty._lower_bounds(gaussians, [Z], cand)
    (nll,) = novelty.pair_scores(gaussians, [Z], cand)
    assert (lb <= nll + 1e-9).all() and (lb > -float("inf")).all()


@pytest.mark.parametrize("K", [1, 2, 5])
def test_the_pruned_search_finds_the_full_computations_best_candidate(K: int) -> None:
    """:func:`shortlist_novelty` (the best candidate's combined score, candidates whose lower bound cannot
    win never scored in full) is the full computation's minimum over the candidates, with candidates
    without Gaussians (+inf) among them; on well-separated tasks it scores far fewer pairs in full."""
    from proteus.engine import novelty

    g = torch.Generator().manual_seed(9)
    dims = (4, 6, 11)
    gaussians = {
        t: [PPCA.fit(torch.randn(n, d, generator=g, dtype=torch.float64) + 4 * t, rank=6) for d in dims]
        for t, n in enumerate([5, 12, 9, 30, 7, 9, 14, 6])
        if t != 4
    }
    truth = torch.randint(0, 8, (40,), generator=g)
    parts = [torch.randn(40, d, generator=g) + 4 * truth[:, None] for d in dims]
    # the keys' candidates: mostly the true task first, the rest random
    cand = torch.stack([torch.cat([t[None], torch.randperm(8, generator=g)]).unique_consecutive()[:K]
                        for t in truth])  # fmt: skip
    cand = torch.stack([torch.cat([r, torch.tensor([x for x in range(8) if x not in r])])[:K] for r in cand])
    loc, scale = [1.0, -2.0, 3.0], [2.0, 0.5, 4.0]
    full = novelty.TaskDetector.combined(novelty.pair_scores(gaussians, parts, cand), loc, scale)
    scored: list[int] = []
    real = novelty.pair_scores

    def counting(gs, ps, c, comps=None):  # type: ignore[no-untyped-def]
        scored.append(int((c >= 0).sum()) * len(ps))
        return real(gs, ps, c, comps)

    novelty.pair_scores = counting  # type: ignore[assignment]
    try:
        got = novelty.shortlist_novelty(gaussians, parts, cand, loc, scale)
    finally:
        novelty.pair_scores = real  # type: ignore[assignment]
    assert torch.allclose(got, full, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(got), torch.isinf(full))
    if K == 5:
        assert sum(scored) < 0.5 * cand.numel() * len(dims)


def test_a_stored_gaussian_keeps_its_float64_basis_once_a_shortlist_scores_under_it() -> None:
    """A Gaussian decoded from a knowledge base keeps the float64 copy of its basis that :func:`pair_scores`
    made (the same numbers, counted in the decoded Gaussians' budget); one held in memory, or a call that
    does not ask to keep it, converts anew; the scores are the same either way."""
    from proteus.engine import novelty

    g = torch.Generator().manual_seed(3)
    held = PPCA.fit(torch.randn(12, 7, generator=g, dtype=torch.float64), rank=4)
    stored = PPCA(held.mean, held.basis, held.var, held.noise, stored=True)
    assert held.basis_f64(keep=True) is not held.basis_f64(keep=True)  # held: never kept
    assert stored.basis_f64() is not stored.basis_f64()  # not asked to keep
    Z = torch.randn(5, 7, generator=g)
    first = novelty.pair_scores({0: [stored]}, [Z], torch.zeros(5, 1, dtype=torch.long))[0]
    kept = stored.basis_f64()
    assert (
        kept is stored.basis_f64() and kept.dtype == torch.float64 and torch.equal(kept, held.basis.double())
    )
    again = novelty.pair_scores({0: [stored]}, [Z], torch.zeros(5, 1, dtype=torch.long))[0]
    assert torch.equal(first, again)
    assert torch.equal(
        first[:, 0], novelty.pair_scores({0: [held]}, [Z], torch.zeros(5, 1, dtype=torch.long))[0][:, 0]
    )
    assert novelty._decoded_bytes([stored]) == 8 * (stored.basis.numel() + stored.var.numel())
    fresh = PPCA(held.mean, held.basis, held.var, held.noise, stored=True)
    assert novelty.held_bytes([fresh]) == 0  # decoded, bounded at most: no float64 copy yet
    assert novelty.held_bytes([stored]) == novelty._decoded_bytes([stored])  # scored: what it reserved
