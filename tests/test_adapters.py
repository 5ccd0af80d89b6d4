"""Adapters (Eq. 9, Eq. 15): orthogonality, S gradient and sparsity, batched multi-adapter forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from proteus.adapters import AdaptedBackbone, LoRAUnit, LoRAWrapper
from proteus.adapters.lora import Composed
from proteus.backbones import build_backbone


def _train_units(model: AdaptedBackbone, x: torch.Tensor, steps: int = 20, lr: float = 0.05) -> None:
    opt = torch.optim.Adam(model.lora_parameters() + model.transfer_parameters(), lr=lr)
    target = torch.randn(x.shape[0], model.embed_dim)
    for _ in range(steps):
        loss = ((model.embed(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _stored_tasks(unit: LoRAUnit, n: int, g: torch.Generator, rank: int = 2) -> None:
    """Learn ``n`` tasks into ``unit`` without training: random B and S (non-zero directions and transfer)."""
    for _ in range(n):
        unit.begin_task(rank, "learned", True, g)
        with torch.no_grad():
            unit.B_new.normal_()
            if unit.s is not None:
                unit.s.normal_()
        unit.end_task()


@pytest.fixture(scope="module")
def vit() -> AdaptedBackbone:
    torch.manual_seed(0)
    return AdaptedBackbone(build_backbone("vit_ti16", pretrained=False, img_size=32, adapt_last=2))


def test_orthogonality_holds_after_training(vit: AdaptedBackbone) -> None:
    x = torch.randn(4, 3, 32, 32)
    for k in range(3):
        vit.begin_task(4, "learned", True, seed=k)
        _train_units(vit, x)
        vit.end_task()
    worst = 0.0
    for name, cos in vit.unit_cosines().items():
        assert cos.shape == (3, 3), name
        off = cos - torch.diag(torch.diag(cos))
        worst = max(worst, off.abs().max().item())
        # the A columns of different tasks are exactly orthogonal
        u = vit.units[name]
        for i in range(3):
            for j in range(i):
                cross = u.A[:, u.columns(i)].double().T @ u.A[:, u.columns(j)].double()
                assert cross.abs().max() < 1e-5
    assert worst < 1e-5, f"<dW_new, dW_old> cosine {worst} is not ~0"


def test_without_orthogonality_directions_overlap() -> None:
    torch.manual_seed(0)
    u = LoRAUnit(8, 6)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        u.begin_task(4, "zero", False, g)
        with torch.no_grad():
            u.B_new.normal_()
        u.end_task()
    assert (u.A[:, :4].T @ u.A[:, 4:]).abs().max() > 1e-3


def test_S_receives_gradient_and_prox_makes_it_sparse() -> None:
    from proteus.config import RunConfig
    from proteus.engine.trainer import S_UPDATES

    torch.manual_seed(0)
    unit = LoRAUnit(16, 16)
    lin = nn.Linear(16, 16)
    w = LoRAWrapper(lin, {}, 1.0)
    g = torch.Generator().manual_seed(0)
    w.units["w"].begin_task(4, "learned", True, g)
    with torch.no_grad():
        w.units["w"].B_new.normal_()
    w.units["w"].end_task()
    w.units["w"].begin_task(4, "learned", True, g)
    x = torch.randn(32, 16)
    loss = w(x).pow(2).sum()
    loss.backward()
    s = w.units["w"].s
    assert s is not None and s.grad is not None and s.grad.abs().sum() > 0, "S must receive gradient"
    del unit

    # the learner's proximal step: a strong penalty zeroes most coefficients, none keeps them dense
    cfg = RunConfig()
    with torch.no_grad():
        s.copy_(torch.tensor([0.5, -0.002, 0.001, -0.8]))
    s.grad = torch.zeros_like(s)
    cfg.adapter.s_lr = 1.0
    S_UPDATES.get("prox")(cfg.adapter).after_step([s], lam=0.01)
    assert (s == 0).sum() == 2, f"small coefficients must be exactly zero after the prox step: {s}"
    assert s[0] > 0 and s[3] < 0


def test_lambda_decays_twenty_percent_per_task() -> None:
    from proteus.config import RunConfig
    from proteus.engine.trainer import AdapterTrainer

    cfg = RunConfig()
    trainer = AdapterTrainer(None, cfg.adapter, cfg.train, None)  # type: ignore[arg-type]
    lams = [trainer.lam_for(k) for k in range(4)]
    assert lams[0] == pytest.approx(0.006)
    for a, b in zip(lams, lams[1:]):
        assert b == pytest.approx(0.8 * a)


def test_budget_schedule() -> None:
    from proteus.config import RunConfig
    from proteus.engine.trainer import AdapterTrainer

    cfg = RunConfig()
    cfg.adapter.rank = 10
    cfg.adapter.budget_decay = 0.1
    trainer = AdapterTrainer(None, cfg.adapter, cfg.train, None)  # type: ignore[arg-type]
    ranks = [trainer.rank_for(k) for k in range(30)]
    assert ranks[0] == 10 and ranks == sorted(ranks, reverse=True) and ranks[-1] >= 1
    assert ranks[10] == round(10 * torch.exp(torch.tensor(-1.0)).item())


def test_grouped_forward_equals_per_task_forward(vit: AdaptedBackbone) -> None:
    x = torch.randn(3, 3, 32, 32)
    m = vit.num_tasks
    with torch.no_grad():
        grouped = vit.embed(x, list(range(m)))
        single = torch.stack([vit.embed(x, [k])[0] for k in range(m)])
    assert torch.allclose(grouped, single, atol=1e-5)
    assert not torch.allclose(grouped[0], grouped[-1])


def test_identity_transfer_and_all_units_compositions() -> None:
    u = LoRAUnit(8, 4)
    g = torch.Generator().manual_seed(1)
    u.begin_task(2, "learned", True, g)
    u.end_task()
    u.begin_task(2, "identity", True, g)
    u.end_task()
    assert torch.equal(u.C[1], torch.ones(4))
    assert torch.equal(u.coefficients([0], "all-units"), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(u.coefficients([1], "all-units"), torch.ones(1, 4))


def test_rank_is_capped_when_no_orthogonal_room() -> None:
    u = LoRAUnit(6, 4)
    g = torch.Generator().manual_seed(0)
    assert u.begin_task(4, "zero", True, g) == 4
    u.end_task()
    assert u.begin_task(4, "zero", True, g) == 2
    u.end_task()
    assert u.total_rank == 6


def test_conv1x1_wrapper_matches_linear_math() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 7, 1)
    w = LoRAWrapper(conv, {}, 1.0)
    unit = w.units["w"]
    unit.begin_task(3, "learned", True, torch.Generator().manual_seed(0))
    with torch.no_grad():
        unit.B_new.normal_()
    x = torch.randn(2, 5, 4, 4)
    dW = unit.B_new @ unit.projected_A_new().T
    expected = conv(x) + torch.einsum("oi,nihw->nohw", dW, x)
    assert torch.allclose(w(x), expected, atol=1e-5)


def test_base_layer_untouched(vit: AdaptedBackbone) -> None:
    for wr in vit.wrappers.values():
        assert not any(p.requires_grad for p in wr.base.parameters())


def test_grouped_conv_forward_equals_per_task_forward() -> None:
    torch.manual_seed(0)
    w = LoRAWrapper(nn.Conv2d(6, 5, 1), {}, 0.5)
    unit = w.units["w"]
    _stored_tasks(unit, 3, torch.Generator().manual_seed(0))
    x = torch.randn(4, 6, 3, 3)
    unit.composed, w.groups = Composed(unit.coefficients([0, 1, 2])), 3
    grouped = w(x.repeat(3, 1, 1, 1)).unflatten(0, (3, 4))
    for k in range(3):
        dW = unit.B @ torch.diag(unit.C[k]) @ unit.A.T
        expected = w.base(x) + 0.5 * torch.einsum("oi,nihw->nohw", dW, x)
        assert torch.allclose(grouped[k], expected, atol=1e-5)
    unit.composed, w.groups = None, 1


@pytest.mark.parametrize("transfer", ["learned", "zero"])
def test_learned_tasks_embed_the_same_forever(transfer: str) -> None:
    """A finished task's adapter never changes: later tasks (their new directions, S rows and training)
    leave every earlier task's embedding as it was, to float32 rounding (the product now runs over more,
    zero-weighted columns; measured 1e-6 on embeddings of size ~3, which training moved by ~5).
    Signatures and LDA keys rely on it (the keys of `proteus-lda` live in the first adapter's space)."""
    torch.manual_seed(0)
    model = AdaptedBackbone(build_backbone("vit_ti16", pretrained=False, img_size=32, adapt_last=2))
    x = torch.randn(4, 3, 32, 32)
    before: list[torch.Tensor] = []
    with torch.no_grad():
        for k in range(3):
            with torch.enable_grad():
                model.begin_task(4, transfer, True, seed=k)
                _train_units(model, x)
            model.end_task()
            before.append(model.suffix(model.prefix(x), [k])[0].clone())
        later = model.suffix(model.prefix(x), [0, 1, 2])
    for k in range(3):
        diff = (later[k] - before[k]).abs().max().item()
        assert diff < 1e-5, f"task {k + 1}'s embedding changed by {diff:g} after later tasks"


@pytest.mark.parametrize("kind", ["linear-fused", "conv"])
def test_training_forward_and_gradients_equal_dense_eq9(kind: str) -> None:
    """The training forward (old frozen directions through S apart from the new ones, each unit's update
    added in place to its slice of the base output) equals Eq. 9 written as dense matrices: outputs and the
    gradients of S, A_new, B_new and the input."""
    torch.manual_seed(0)
    base = nn.Linear(6, 9) if kind == "linear-fused" else nn.Conv2d(6, 5, 1)
    slices = {"q": (0, 3), "v": (6, 9)} if kind == "linear-fused" else {}
    w = LoRAWrapper(base, slices, 0.5)
    g = torch.Generator().manual_seed(0)
    for u in w.units.values():  # two frozen tasks with non-zero directions and S
        _stored_tasks(u, 2, g)
    for u in w.units.values():
        u.begin_task(2, "learned", True, g)
        with torch.no_grad():
            u.B_new.normal_()
            u.s.normal_()
    x = torch.randn(3, 6) if kind == "linear-fused" else torch.randn(3, 6, 2, 2)
    x.requires_grad_()
    out = w(x)
    W = base.weight.detach().reshape(base.weight.shape[0], 6).clone()
    dense = []
    for u, (s, e) in zip(w.units.values(), w.slices.values()):
        dW = u.scaling * ((u.B * u.s) @ u.A.T + u.B_new @ u.projected_A_new().T)  # Eq. 9
        dense.append((s, e, dW))
    rows = [W[i] for i in range(W.shape[0])]
    for s, e, dW in dense:
        for i in range(s, e):
            rows[i] = rows[i] + dW[i - s]
    Wfull = torch.stack(rows)
    if kind == "conv":
        expected = torch.nn.functional.conv2d(x, Wfull[:, :, None, None], base.bias)
    else:
        expected = torch.nn.functional.linear(x, Wfull, base.bias)
    params = [p for u in w.units.values() for p in (u.s, u.A_new, u.B_new)] + [x]
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), params)
    want = torch.autograd.grad((expected * probe).sum(), params)
    assert torch.allclose(out, expected, atol=1e-5)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_basis_extended_per_task_spans_the_old_directions() -> None:
    """The orthonormal basis of the old directions is extended task by task (not a QR of all of A at every
    task): its projector equals the one onto span(A), after a truncation too, and a column of A already in
    the span (without orthogonal new directions) adds nothing."""
    torch.manual_seed(0)
    u = LoRAUnit(12, 5)
    g = torch.Generator().manual_seed(0)

    def step(orthogonal: bool = True) -> None:
        u.begin_task(2, "learned", orthogonal, g)
        if orthogonal and u.total_rank:
            U, sv, _ = torch.linalg.svd(u.A.double(), full_matrices=False)
            q = U[:, sv > 1e-5 * sv.max()]  # span(A), whatever its rank (float32 A)
            assert torch.allclose(u.basis.double() @ u.basis.double().T, q @ q.T, atol=1e-6)
            assert (u.A.double().T @ u.projected_A_new().double()).abs().max() < 1e-5
        with torch.no_grad():
            u.B_new.normal_()
        u.end_task()

    for _ in range(3):
        step()
    u.truncate(1)
    for _ in range(2):
        step()
    u.begin_task(2, "learned", False, g)
    with torch.no_grad():
        u.A_new.copy_(u.A[:, :2] + u.A[:, 2:4])  # inside the span of the old directions
    u.end_task()
    step()
    # the in-span pair added nothing (and the last task's pair is not covered before the next task)
    assert u.basis.shape[1] == u.total_rank - 2 - 2


def test_basis_of_a_restored_unit_is_bit_identical() -> None:
    """A unit rebuilt from stored tasks (a knowledge base loaded in another process) builds the same basis,
    bit for bit, as the unit that extended it task by task: ``proteus learn`` task by task equals a run."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(10, 4)
    _stored_tasks(u, 4, g)
    u.begin_task(2, "learned", True, g)
    v = LoRAUnit(10, 4)
    for t in range(u.num_tasks):
        x = u.task_tensors(t)
        v.append_task(x["A"], x["B"], x["s"])
    v.begin_task(2, "learned", True, torch.Generator().manual_seed(1))
    assert torch.equal(u.basis, v.basis)


def test_a_unit_whose_room_is_full_keeps_no_basis_and_rebuilds_it_when_room_is_freed() -> None:
    """Once the old directions fill the input space, every later task opens with rank 0 and the unit keeps no
    basis (a q x q matrix nobody reads); a truncation that frees room builds it again, bit for bit the basis
    of a unit that never filled its room."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(6, 4)
    _stored_tasks(u, 4, g)  # 4 tasks of rank 2 on 6 input features: the third fills the room
    assert u.total_rank == 6 and u.ranks[-1] == 0
    assert u.begin_task(2, "learned", True, g) == 0
    assert u.basis.shape == (6, 0)
    u.abort_task()
    u.truncate(2)  # 4 of 6 columns: room for one more task of rank 2
    assert u.begin_task(2, "learned", True, g) == 2
    v = LoRAUnit(6, 4)
    for t in range(2):
        x = u.task_tensors(t)
        v.append_task(x["A"], x["B"], x["s"])
    v.begin_task(2, "learned", True, torch.Generator().manual_seed(1))
    assert torch.equal(u.basis, v.basis) and u.basis.shape == (6, 4)


def test_a_stored_task_holds_its_own_tensors_not_views_of_the_unit() -> None:
    """A stored task's A, B and row of S are copies: a view would keep the whole matrix of its time alive,
    one per stored task (O(m^3) numbers over m tasks on a long stream)."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(10, 4)
    _stored_tasks(u, 4, g)
    held = {t.untyped_storage().data_ptr() for t in (u.A, u.B, *u.rows.blocks) if t.numel()}
    for t in range(u.num_tasks):
        for name, x in u.task_tensors(t).items():
            assert x.untyped_storage().data_ptr() not in held, (t, name)
            assert x.untyped_storage().nbytes() == x.numel() * x.element_size(), (t, name)


def test_an_appended_task_is_written_into_room_kept_for_it() -> None:
    """A and B grow by half at a time: appending a task copies its own numbers, not every older task's
    (else learning task k, and loading k tasks, costs O(k) per task), and what a truncation left behind in
    the room is never read back as a later task's coefficients."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(64, 8)
    storages = set()
    for _ in range(30):
        _stored_tasks(u, 1, g, rank=1)
        storages.add(u.A.untyped_storage().data_ptr())
    assert len(storages) <= 8  # about log_1.5(30) reallocations, not 30
    rows = [u.C[k].clone() for k in range(u.num_tasks)]
    u.truncate(20)
    _stored_tasks(u, 3, g, rank=2)
    assert u.total_rank == 20 + 6 and u.C.shape == (23, 26)
    assert all(torch.equal(u.C[k, : k + 1], rows[k][: k + 1]) for k in range(20))
    assert not u.C[:20, 20:].any()  # the old rows stop at their own columns: zeros after, not stale numbers
    assert torch.equal(u.C[22, 24:], torch.ones(2))
    v = LoRAUnit(64, 8)  # the same numbers appended into a fresh unit
    for k in range(u.num_tasks):
        t = u.task_tensors(k)
        v.append_task(t["A"], t["B"], t["s"])
    assert torch.equal(v.A, u.A) and torch.equal(v.B, u.B) and torch.equal(v.C, u.C)


def test_stored_tasks_whose_rows_of_s_do_not_fit_are_refused_by_name() -> None:
    """A stored task whose row of S has another length than the columns before it is refused, the error
    naming that task (the first that does not fit, inside a piece of several tasks too)."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(10, 4)
    _stored_tasks(u, 3, g)
    x = [u.task_tensors(t) for t in range(3)]
    v = LoRAUnit(10, 4)
    A, B = torch.cat([t["A"] for t in x], 1), torch.cat([t["B"] for t in x], 1)
    s = torch.cat([x[0]["s"], x[1]["s"], torch.zeros(3)])  # task 3's row: 3 entries for 4 older columns
    with pytest.raises(ValueError, match=r"^third: transfer coefficients have 3 entries, expected 4$"):
        v.append_stored([(A, B, s, [2, 2, 2], [0, 2, 3])], ["first", "second", "third"])
    with pytest.raises(ValueError, match="2 rows of transfer coefficients for 3 tasks"):
        v.append_stored([(A, B, s, [2, 2, 2], [0, 5])], ["first", "second", "third"])
    v.append_stored([(A, B, torch.cat([t["s"] for t in x]), [2, 2, 2], [0, 2, 4])])
    assert torch.equal(v.C, u.C) and v.ranks == u.ranks


def test_the_rows_of_s_are_read_where_they_live_and_compose_as_the_dense_matrix() -> None:
    """Each task's row of S lives in its own tensor (or a stored one, after :meth:`LoRAUnit.adopt`: the old
    tensor is let go), and the rows a composition builds for any tasks are those of C, the dense matrix
    (row k: s^(k), then 1 on its own columns, then zeros), which a baseline may also set whole; a task's
    own columns may enter with another coefficient (SD-LoRA's magnitude)."""
    import weakref

    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(12, 4)
    _stored_tasks(u, 4, g)
    C = u.C
    assert C.shape == (4, 8) and torch.equal(C[2, 4:6], torch.ones(2)) and not C[2, 6:].any()
    assert torch.equal(u.coefficient_rows([3, 0, 2]), C[[3, 0, 2]])
    old = weakref.ref(u.rows.blocks[2])
    stored = u.row(2).clone()  # what a knowledge base's object holds
    u.adopt(2, stored)
    assert old() is None and u.row(2).data_ptr() == stored.data_ptr() and torch.equal(u.C, C)
    u.adopt(1, torch.zeros(3))  # not the row's shape: kept as it was
    assert torch.equal(u.C, C)
    v = LoRAUnit(12, 4)
    x = [u.task_tensors(t) for t in range(4)]
    v.append_stored([(torch.cat([t["A"] for t in x], 1), torch.cat([t["B"] for t in x], 1),
                      torch.cat([t["s"] for t in x]), [2] * 4, [0, 2, 4, 6])])  # fmt: skip
    assert len(v.rows.blocks) == 1 and torch.equal(v.C, C)  # a pack's rows: one block
    v.scale_own(3, torch.tensor(0.5))
    assert torch.equal(v.coefficient_rows([3])[0, 6:], torch.full((2,), 0.5))
    w = LoRAUnit(12, 4)
    w.A, w.B, w.ranks = v.A.clone(), v.B.clone(), list(v.ranks)
    w.C = v.C  # a baseline's dense matrix: the same rows and own coefficients
    assert torch.equal(w.C, v.C) and 3 in w.rows.own and 2 not in w.rows.own
    w.truncate(2)
    assert w.C.shape == (2, 4) and torch.equal(w.C, C[:2, :4]) and not w.rows.own
    bad = v.C.clone()
    bad[0, 5] = 1.0  # task 1's row on task 3's columns
    with pytest.raises(ValueError, match="columns of later tasks"):
        w.A, w.B, w.ranks = v.A.clone(), v.B.clone(), list(v.ranks)
        w.C = bad
    assert v.double().rows.blocks[0].dtype == torch.float64  # a move moves the rows with the directions


def test_the_room_kept_for_directions_stops_at_the_map_s_width() -> None:
    """Growing by half, the buffers of A and B keep no more columns than the map can ever hold orthogonal
    directions (its input width): a full map holds no spare room."""
    g = torch.Generator().manual_seed(0)
    u = LoRAUnit(10, 3)
    _stored_tasks(u, 7, g, rank=2)  # 2, 4, ... columns, then 10: the room is full (the last task rank 0)
    assert u.total_rank == 10 and u._bufs["A"].shape == (10, 10) and u._bufs["B"].shape == (3, 10)
