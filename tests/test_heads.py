"""Tests for RanPAC's ridge/LDA head (Eq. 23; Algorithm 1 lines 8-12)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from proteus.heads import GammaSelection, RanPACHead
from proteus.heads.ranpac import head_from_state


def gaussian_classes(
    n: int, d: int, num_classes: int, *, seed: int = 0, sep: float = 4.0, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Isotropic Gaussian classes with well-separated means (labels offset..offset+num_classes-1)."""
    g = torch.Generator().manual_seed(1234)  # same means for every call
    means = torch.randn(offset + num_classes, d, generator=g) * sep / d**0.5 * 2
    gs = torch.Generator().manual_seed(seed)
    y = torch.randint(offset, offset + num_classes, (n,), generator=gs)
    H = means[y] + torch.randn(n, d, generator=gs)
    return H.float(), y


def svd_reference_losses(head: RanPACHead, H: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Held-out losses from the SVD form of ridge regression, the numerically safest reference."""
    phi, Y = head._features_and_targets(H, y, None)
    phi_tr, Y_tr, phi_va, Y_va = head._split_for_selection(phi, Y)
    U, S, Vh = torch.linalg.svd(phi_tr, full_matrices=False)
    out = []
    for g in head.gamma_grid().tolist():
        W = Vh.T @ ((S / (S**2 + g)).unsqueeze(1) * (U.T @ Y_tr))
        out.append(float(((phi_va @ W - Y_va) ** 2).mean()))
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("rp_dim", [0, 256])
def test_separates_gaussian_classes(rp_dim: int) -> None:
    H, y = gaussian_classes(1000, 32, 6, seed=0)
    Ht, yt = gaussian_classes(500, 32, 6, seed=1)
    head = RanPACHead(32, rp_dim=rp_dim).update(H, y)
    acc = (head.predict(Ht) == yt).float().mean().item()
    assert acc > 0.95, acc
    assert head.gamma_ is not None and head.gamma_ > 0
    assert head.decision_function(Ht).shape == (500, 6)
    assert head.decision_function(Ht).dtype == torch.float64


def test_incremental_tasks_grow_classes_and_stay_accurate() -> None:
    head = RanPACHead(32, rp_dim=256)
    tests = []
    for task in range(3):
        H, y = gaussian_classes(600, 32, 3, seed=10 + task, offset=3 * task)
        # keep only this task's classes (offset..offset+2): global labels, classes grow per task
        head.update(H, y)
        assert head.Q_ is not None and head.Q_.shape[1] == 3 * (task + 1)
        tests.append(gaussian_classes(300, 32, 3, seed=100 + task, offset=3 * task))
    Ht = torch.cat([t[0] for t in tests])
    yt = torch.cat([t[1] for t in tests])
    acc = (head.predict(Ht) == yt).float().mean().item()
    assert acc > 0.95, acc
    assert head.counts_ is not None and int(head.counts_.sum()) == 1800
    assert head.n_updates_ == 3


def test_num_classes_argument_reserves_columns() -> None:
    H, y = gaussian_classes(200, 8, 3)
    head = RanPACHead(8, rp_dim=0).update(H, y, num_classes=10)
    assert head.num_classes_ == 10
    assert head.counts_ is not None and head.counts_[3:].sum() == 0


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("rp_dim", [0, 64])
def test_two_updates_equal_one_update_on_concatenation(rp_dim: int) -> None:
    H1, y1 = gaussian_classes(300, 16, 3, seed=1)
    H2, y2 = gaussian_classes(200, 16, 5, seed=2)
    a = RanPACHead(16, rp_dim=rp_dim, seed=7).update(H1, y1).update(H2, y2)
    b = RanPACHead(16, rp_dim=rp_dim, seed=7).update(torch.cat([H1, H2]), torch.cat([y1, y2]))
    assert a.G_ is not None and b.G_ is not None and a.Q_ is not None and b.Q_ is not None
    torch.testing.assert_close(a.G_, b.G_, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(a.Q_, b.Q_, rtol=1e-12, atol=1e-9)
    assert torch.equal(a.counts_, b.counts_)
    # Q's column c is the class-prototype sum e(c) of Algorithm 1
    phi = b.features(torch.cat([H1, H2]))
    yy = torch.cat([y1, y2])
    torch.testing.assert_close(b.Q_[:, 4], phi[yy == 4].sum(0), rtol=1e-12, atol=1e-9)


def test_w_out_solves_eq23_system() -> None:
    H, y = gaussian_classes(400, 16, 4)
    head = RanPACHead(16, rp_dim=48).update(H, y)
    assert head.G_ is not None and head.Q_ is not None and head.W_out_ is not None and head.gamma_ is not None
    eye = torch.eye(48, dtype=torch.float64)
    ref = torch.linalg.solve(head.G_ + head.gamma_ * eye, head.Q_)
    torch.testing.assert_close(head.W_out_, ref, rtol=1e-7, atol=1e-10)
    head.refit(gamma=3.0)
    assert head.gamma_ == 3.0
    torch.testing.assert_close(head.W_out_, torch.linalg.solve(head.G_ + 3.0 * eye, head.Q_))


def test_projection_is_seeded_and_device_independent() -> None:
    a = RanPACHead(16, rp_dim=32, seed=3)
    b = RanPACHead(16, rp_dim=32, seed=3)
    c = RanPACHead(16, rp_dim=32, seed=4)
    H = torch.randn(5, 16)
    assert torch.equal(a.features(H), b.features(H))
    assert not torch.equal(a.features(H), c.features(H))
    assert a.W_rand_ is not None and a.W_rand_.shape == (16, 32)
    assert (a.features(H) >= 0).all()


def test_fixed_gamma_skips_search() -> None:
    H, y = gaussian_classes(100, 8, 2)
    head = RanPACHead(8, rp_dim=0, gamma=0.5).update(H, y)
    assert head.gamma_ == 0.5 and head.gamma_selection_ is None


def test_float32_head() -> None:
    H, y = gaussian_classes(500, 16, 4)
    Ht, yt = gaussian_classes(200, 16, 4, seed=5)
    head = RanPACHead(16, rp_dim=64, dtype=torch.float32).update(H, y)
    assert head.W_out_ is not None and head.W_out_.dtype == torch.float32
    assert (head.predict(Ht) == yt).float().mean() > 0.95


# ---------------------------------------------------------------- gamma selection


def test_fast_gamma_selection_equals_naive_full_rank() -> None:
    """Primal regime (n_train >= feature_dim): same gamma and same losses on the whole default grid."""
    H, y = gaussian_classes(800, 24, 5, seed=3, sep=2.0)
    head = RanPACHead(24, rp_dim=96)
    fast = head.select_gamma(H, y)
    naive = head.select_gamma(H, y, reference=True)
    assert isinstance(fast, GammaSelection)
    assert fast.method == "primal-eigh" and naive.method == "naive-solve"
    assert fast.gamma == naive.gamma
    assert torch.equal(fast.gammas, naive.gammas)
    assert len(fast.losses) == 22  # 1e-8 .. 1e13
    torch.testing.assert_close(fast.losses, naive.losses, rtol=1e-6, atol=0.0)


def test_fast_gamma_selection_dual_regime() -> None:
    """n_train < rp_dim: the dual eigendecomposition. G_tr is singular there, so RanPAC's solve loses
    accuracy at tiny gamma; the fast path matches an SVD reference everywhere and the naive solve
    wherever G_tr + gamma I is reasonably conditioned, and both pick the same gamma."""
    H, y = gaussian_classes(250, 16, 4, seed=4, sep=2.0)
    head = RanPACHead(16, rp_dim=400)
    fast = head.select_gamma(H, y)
    naive = head.select_gamma(H, y, reference=True)
    assert fast.method == "dual-eigh"
    assert fast.gamma == naive.gamma
    torch.testing.assert_close(fast.losses, svd_reference_losses(head, H, y), rtol=1e-9, atol=0.0)
    ok = fast.gammas >= 1e-2
    torch.testing.assert_close(fast.losses[ok], naive.losses[ok], rtol=1e-6, atol=0.0)


def test_update_uses_fast_selection_result() -> None:
    H, y = gaussian_classes(500, 16, 4, seed=6, sep=1.5)
    head = RanPACHead(16, rp_dim=32)
    expected = head.select_gamma(H, y)
    head.update(H, y)
    assert head.gamma_selection_ is not None
    assert head.gamma_ == expected.gamma
    torch.testing.assert_close(head.gamma_selection_.losses, expected.losses)


def test_gamma_grid() -> None:
    grid = RanPACHead(4, rp_dim=0, gamma_min_exp=-2, gamma_max_exp=3).gamma_grid()
    torch.testing.assert_close(grid, torch.tensor([1e-2, 1e-1, 1.0, 10.0, 100.0], dtype=torch.float64))


# ---------------------------------------------------------------- persistence


@pytest.mark.parametrize("rp_dim", [0, 40])
def test_save_load_bit_exact(tmp_path, rp_dim: int) -> None:
    H, y = gaussian_classes(300, 12, 4)
    head = RanPACHead(12, rp_dim=rp_dim, seed=5).update(H, y)
    save_file(head.state_tensors(), str(tmp_path / "head.safetensors"))
    (tmp_path / "head.json").write_text(json.dumps(head.meta()))

    meta = json.loads((tmp_path / "head.json").read_text())
    tensors = load_file(str(tmp_path / "head.safetensors"))
    loaded = head_from_state(tensors, meta)
    for key, t in head.state_tensors().items():
        assert torch.equal(t, loaded.state_tensors()[key]), key
        assert t.dtype == loaded.state_tensors()[key].dtype
    assert ("W_rand" in tensors) == (rp_dim > 0)
    assert loaded.meta() == head.meta()
    assert loaded.gamma_ == head.gamma_
    Ht, _ = gaussian_classes(50, 12, 4, seed=9)
    assert torch.equal(loaded.decision_function(Ht), head.decision_function(Ht))

    # a loaded head keeps learning exactly like the original
    H2, y2 = gaussian_classes(100, 12, 5, seed=11)
    head.update(H2, y2)
    loaded.update(H2, y2)
    assert torch.equal(loaded.W_out_, head.W_out_)


def test_save_load_unfitted_head() -> None:
    head = RanPACHead(8, rp_dim=16, seed=2)
    head.features(torch.randn(2, 8))  # creates W_rand only
    loaded = head_from_state(head.state_tensors(), json.loads(json.dumps(head.meta())))
    assert not loaded.is_fitted and loaded.W_rand_ is not None
    assert torch.equal(loaded.W_rand_, head.W_rand_)


def test_load_rejects_mismatched_tensors() -> None:
    H, y = gaussian_classes(100, 8, 2)
    head = RanPACHead(8, rp_dim=16).update(H, y)
    tensors = head.state_tensors()
    bad = dict(tensors, G=tensors["G"].float())
    with pytest.raises(ValueError, match="'G'"):
        head_from_state(bad, head.meta())
    missing = {k: v for k, v in tensors.items() if k != "W_rand"}
    with pytest.raises(ValueError, match="W_rand"):
        head_from_state(missing, head.meta())


# ---------------------------------------------------------------- restricted argmax


def test_restricted_argmax() -> None:
    H, y = gaussian_classes(600, 16, 6)
    head = RanPACHead(16, rp_dim=0).update(H, y)
    Ht, yt = gaussian_classes(300, 16, 6, seed=2)
    allowed = torch.tensor([1, 4])
    pred = head.predict(Ht, classes=allowed)
    assert set(pred.unique().tolist()) <= {1, 4}
    scores = head.decision_function(Ht)
    ref = torch.where(scores[:, 1] >= scores[:, 4], 1, 4)
    assert torch.equal(pred, ref)

    # (C,) bool mask == label list
    mask_c = torch.zeros(6, dtype=torch.bool)
    mask_c[allowed] = True
    assert torch.equal(head.predict(Ht, classes=mask_c), pred)

    # per-row mask: the true class plus one other -> always correct on separable data
    mask = torch.zeros(300, 6, dtype=torch.bool)
    mask[torch.arange(300), yt] = True
    mask[torch.arange(300), (yt + 1) % 6] = True
    assert (head.predict(Ht, classes=mask) == yt).float().mean() > 0.97
    # single allowed class per row -> exactly that class
    only = torch.zeros(300, 6, dtype=torch.bool)
    only[torch.arange(300), yt] = True
    assert torch.equal(head.predict(Ht, classes=only), yt)


def test_restricted_argmax_errors() -> None:
    H, y = gaussian_classes(100, 8, 3)
    head = RanPACHead(8, rp_dim=0).update(H, y)
    with pytest.raises(ValueError, match="out of range"):
        head.predict(H, classes=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="no class"):
        head.predict(H, classes=torch.zeros(100, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        head.predict(H, classes=torch.ones(7, 3, dtype=torch.bool))


# ---------------------------------------------------------------- errors


def test_errors() -> None:
    head = RanPACHead(8, rp_dim=16)
    H, y = gaussian_classes(50, 8, 3)
    with pytest.raises(RuntimeError, match="not fitted"):
        head.predict(H)
    bad = H.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        head.update(bad, y)
    bad[3, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        head.update(bad, y)
    with pytest.raises(ValueError, match="empty"):
        head.update(H[:0], y[:0])
    with pytest.raises(ValueError, match="out of range"):
        head.update(H, y, num_classes=2)
    with pytest.raises(ValueError, match="out of range"):
        head.update(H, y - 1)
    with pytest.raises(ValueError, match="shape"):
        head.update(H[:, :4], y)
    with pytest.raises(ValueError, match="shape"):
        head.update(H, y[:-1])
    with pytest.raises(ValueError, match="integer"):
        head.update(H, y.float())
    assert head.G_ is None  # nothing was accumulated by the failed calls
    head.update(H, y)
    with pytest.raises(ValueError, match="smaller"):
        head.update(H, y, num_classes=2)
    with pytest.raises(ValueError, match="NaN or inf"):
        head.predict(bad)
    with pytest.raises(ValueError):
        RanPACHead(8, holdout=1.0)
    with pytest.raises(ValueError):
        RanPACHead(8, dtype=torch.float16)
    with pytest.raises(ValueError):
        RanPACHead(8, rp_dim=-1)


def test_tiny_update_keeps_working() -> None:
    H, y = gaussian_classes(1, 8, 1)
    head = RanPACHead(8, rp_dim=0).update(H, y)
    assert head.gamma_ == 1.0
    assert head.predict(H).shape == (1,)


@pytest.mark.parametrize("classes", [12, 400])
def test_the_accumulated_gamma_search_scores_every_candidate_alike_with_many_classes(classes: int) -> None:
    """The accumulated rule's held-out losses, with ``U^T Q`` formed (few classes) or the candidates' rows
    stacked instead (many classes: :func:`proteus.heads.gamma._losses_by_rows`), are each candidate's ridge
    on everything so far, solved directly, to round-off."""
    from proteus.heads.gamma import gamma_grid, select_accumulated

    g = torch.Generator().manual_seed(0)
    d = 24
    G_prev = torch.randn(60, d, generator=g, dtype=torch.float64)
    Q_prev = G_prev.T @ torch.randn(60, classes - 2, generator=g, dtype=torch.float64)
    G_prev = G_prev.T @ G_prev
    phi_tr, phi_va = (torch.randn(n, d, generator=g, dtype=torch.float64) for n in (10, 4))
    Y_tr = torch.nn.functional.one_hot(torch.tensor([classes - 2, classes - 1] * 5), classes).double()
    Y_va = torch.nn.functional.one_hot(torch.tensor([classes - 2, classes - 1] * 2), classes).double()
    gammas = gamma_grid(-4, 4)
    got = select_accumulated(phi_tr, Y_tr, phi_va, Y_va, gammas, G_prev, Q_prev)
    Q = phi_tr.T @ Y_tr
    Q[:, : classes - 2] += Q_prev
    G = G_prev + phi_tr.T @ phi_tr
    want = torch.stack(
        [
            ((phi_va @ torch.linalg.solve(G + c * torch.eye(d, dtype=G.dtype), Q) - Y_va) ** 2).mean()
            for c in gammas
        ]
    )
    torch.testing.assert_close(got.losses, want, rtol=1e-9, atol=1e-12)
    assert got.gamma == float(gammas[int(want.argmin())])


def test_many_classes_score_through_the_factor_without_solving_w_out() -> None:
    """With more classes than a quarter of the features, an update (and a downdate) leaves ``W_out``
    unsolved: the scores go through the Cholesky factor of ``G + gamma I`` and equal those of the solved
    weights to round-off; ``W_out_`` solves them when asked for. With fewer classes nothing changes."""
    g = torch.Generator().manual_seed(0)
    d, n_classes = 16, 6  # 6 > 16 / 4
    head = RanPACHead(d, rp_dim=0, seed=0)
    for t in range(3):
        X = torch.randn(40, d, generator=g, dtype=torch.float64)
        head.update(X, torch.arange(2 * t, 2 * t + 2).repeat(20), num_classes=2 * t + 2)
    assert 4 * head.num_classes_ > d and head._W is None  # the update did not solve it
    H = torch.randn(7, d, generator=g, dtype=torch.float64)
    factored = head.decision_function(H)
    assert head._W is None and head._L is not None  # scored through the factor, still unsolved
    W = head.W_out_  # solved when asked for, then used
    assert W is not None and head._W is W and W.shape == (d, n_classes)
    assert torch.allclose(factored, H @ W, rtol=1e-9, atol=1e-12)
    A = head.G_ + head.gamma_ * torch.eye(d, dtype=torch.float64)
    assert torch.allclose(W, torch.linalg.solve(A, head.Q_), rtol=1e-8, atol=1e-12)
    X = torch.randn(4, d, generator=g, dtype=torch.float64)  # a downdate leaves it unsolved again
    head.downdate(X[:2], torch.tensor([0, 1]), [])
    assert head._W is None
    A = head.G_ + head.gamma_ * torch.eye(d, dtype=torch.float64)
    assert torch.allclose(
        head.decision_function(H), H @ torch.linalg.solve(A, head.Q_), rtol=1e-7, atol=1e-12
    )
    few = RanPACHead(64, rp_dim=0, seed=0)  # 2 classes <= 64 / 4: solved by the update, as always
    few.update(torch.randn(20, 64, generator=g, dtype=torch.float64), torch.arange(2).repeat(10))
    assert few._W is not None


def test_a_head_assembled_from_its_tasks_columns_is_the_head_whatever_their_classes() -> None:
    """A head whose class columns its tasks hold (``columns=False`` in the head's object) is assembled
    bit for bit from them, whether a task's classes are consecutive (a block copy) or scattered."""
    from proteus.heads.persist import assemble_columns

    torch.manual_seed(0)
    head = RanPACHead(embed_dim=6, rp_dim=0, gamma=1.0)
    order = [[0, 1, 2], [7, 3], [4, 5, 6], [9, 8]]  # consecutive, scattered, consecutive, descending
    for classes in order:
        y = torch.tensor(classes * 4)
        head.update(torch.randn(len(y), 6, dtype=torch.float64), y, num_classes=10)
    got = assemble_columns(head.meta(columns=False), [(c, head.columns(c)) for c in order])
    assert torch.equal(got["Q"], head.Q_) and torch.equal(got["counts"], head.counts_)
    tiled = [[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]]  # every class in order: the pieces joined side by side
    joined = assemble_columns(head.meta(columns=False), [(c, head.columns(c)) for c in tiled])
    assert torch.equal(joined["Q"], head.Q_) and torch.equal(joined["counts"], head.counts_)
    assert joined["Q"].is_contiguous() and joined["Q"].untyped_storage().data_ptr() != head.Q_.data_ptr()
    gap = assemble_columns(head.meta(columns=False), [(c, head.columns(c)) for c in tiled[:-1]])
    assert torch.equal(gap["Q"][:, :8], head.Q_[:, :8]) and not gap["Q"][:, 8:].any()  # (a class left out)
