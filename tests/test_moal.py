"""MoAL (proteus.baselines.moal): what the method states, checked without the authors' code (the
side-by-side check against it is tools/baseline_checks/check_moal.py): the first task's head is the
regularised least-squares solution scaled by 0.9, the recursive update equals least squares over all the
rows, the moving average keeps the adapter at alpha 1, the rumination pairs each earlier class with its
closest new class, and a restored learner predicts and learns on as the writer; a failed task leaves the
learner as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from proteus.baselines.moal import FIRST_SCALE, RIDGES, relations, rls_update, select_ridge
from proteus.engine.errors import TaskError
from proteus.experiment.store import build_learner
from tiny import baseline_cfg, baseline_stream


def _cfg(**baseline: object) -> object:
    cfg = baseline_cfg("moal", "mobilenet_v2")
    cfg.backbone.adapt_last = 2
    cfg.train.epochs = 2
    cfg.baseline.update({"hidden": 64, "drift_epochs": 3, **baseline})
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


@pytest.fixture(scope="module")
def learned(stream):
    """A learner after task 1 (its adapter, R and W copied) and after task 2."""
    clf = build_learner(_cfg(), progress=False)
    stats = clf.fit_task(stream.tasks[0], stream_tasks=2)
    after1 = {
        "adapter": [{k: t.clone() for k, t in a.items()} for a in clf.adapter_],
        "R": clf.R_.clone(),
        "W": clf.W_.clone(),
        "ridge": stats.extra["ridge"],
    }
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    return clf, after1


def test_the_recursive_update_is_least_squares_over_every_row() -> None:
    g = torch.Generator().manual_seed(0)
    A0, A1 = torch.randn(30, 8, generator=g, dtype=torch.float64), torch.randn(7, 8, generator=g).double()
    Y0, Y1 = torch.randn(30, 3, generator=g).double(), torch.randn(7, 3, generator=g).double()
    gamma = 0.5
    R = torch.linalg.inv(A0.T @ A0 + gamma * torch.eye(8, dtype=torch.float64))
    R, W = rls_update(R, R @ A0.T @ Y0, A1[:4], Y1[:4])
    R, W = rls_update(R, W, A1[4:], Y1[4:])
    A, Y = torch.cat([A0, A1]), torch.cat([Y0, Y1])
    want = torch.linalg.inv(A.T @ A + gamma * torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(R, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(W, want @ A.T @ Y, rtol=0, atol=1e-12)
    same = rls_update(R, W, A1[:0], Y1[:0])  # no rows: nothing changes
    assert same[0] is R and same[1] is W


def test_the_ridge_is_the_one_that_predicts_the_held_out_rows_best() -> None:
    g = torch.Generator().manual_seed(1)
    A = torch.randn(50, 6, generator=g)
    Y = F.one_hot((A[:, 0] > 0).long(), 2).float() + 0.3 * torch.randn(50, 2, generator=g)
    losses = []
    for r in RIDGES:
        Wr = torch.linalg.solve(A[:40].T @ A[:40] + r * torch.eye(6), A[:40].T @ Y[:40])
        losses.append(float(F.mse_loss(A[40:] @ Wr, Y[40:])))
    assert select_ridge(A.double(), Y.double()) == RIDGES[min(range(len(RIDGES)), key=losses.__getitem__)]


def test_the_first_head_is_the_scaled_ridge_solution(stream, learned) -> None:
    clf, after1 = learned
    z, y = clf.prefix_dataset(stream.tasks[0].train)
    with torch.no_grad():
        A = clf.expand(clf.embed(z, after1["adapter"])).double()
    Y = F.one_hot(torch.as_tensor([list(stream.tasks[0].classes).index(int(c)) for c in y])).double()
    G = A.T @ A + after1["ridge"] * torch.eye(A.shape[1], dtype=torch.float64)
    torch.testing.assert_close(after1["R"] @ G, torch.eye(len(G), dtype=torch.float64), rtol=0, atol=1e-6)
    want = FIRST_SCALE * torch.linalg.solve(G, A.T @ Y)
    torch.testing.assert_close(after1["W"], want, rtol=0, atol=1e-6 * float(want.abs().max()))


def test_the_head_predicts_from_its_columns_and_the_adapter_moves_little(stream, learned) -> None:
    clf, after1 = learned
    z = torch.cat([clf.prefix_dataset(t.test)[0] for t in stream.tasks])
    with torch.no_grad():
        want = clf.expand(clf.embed(z, clf.adapter_)) @ clf.W_.float()
    torch.testing.assert_close(clf.logits_prefix(z), want, rtol=0, atol=1e-4)
    assert clf.labels_ == [*stream.tasks[0].classes, *stream.tasks[1].classes]
    # alpha 0.999 over 2 epochs: the adapter of task 2 is task 1's up to a small step
    a = torch.cat([t.ravel() for blk in after1["adapter"] for t in blk.values()])
    b = torch.cat([t.ravel() for blk in clf.adapter_ for t in blk.values()])
    assert 0 < float((a - b).norm()) < 0.01 * float(a.norm())
    assert clf.means_.shape == (len(clf.labels_), clf.embed_dim)


def test_alpha_one_keeps_the_adapter_and_rumination_pairs_the_closest_class(stream) -> None:
    clf = build_learner(_cfg(adapter_ema=1.0, drift_epochs=0), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    before = [{k: t.clone() for k, t in a.items()} for a in clf.adapter_]
    means = clf.means_.clone()
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    for a, b in zip(before, clf.adapter_):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    torch.testing.assert_close(clf.means_[: len(means)], means, rtol=0, atol=0)  # no drift map: carried as is
    old = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.1]])
    new = torch.tensor([[0.0, 5.0], [3.0, 0.2]])
    assert relations(old, new).tolist() == [1, 0, 0]


def test_a_restored_learner_predicts_and_learns_on_as_the_writer(stream) -> None:
    first = build_learner(_cfg(), progress=False)
    first.fit_task(stream.tasks[0], stream_tasks=2)
    back = build_learner(_cfg(), progress=False).restore(first.state())
    z = back.prefix_dataset(stream.tasks[0].test)[0]
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))
    for clf in (first, back):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))
    assert torch.equal(back.R_, first.R_) and torch.equal(back.means_, first.means_)
    state = first.state()
    meta, tensors = state.head
    tensors = {**tensors, "moal.R": tensors["moal.R"][:, :-1]}
    with pytest.raises(TaskError, match=r"moal\.R"):
        build_learner(_cfg(), progress=False).restore(type(state)(state.tasks, (meta, tensors)))


def test_a_failed_task_leaves_the_learner_as_before(stream, monkeypatch: pytest.MonkeyPatch) -> None:
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = clf.prefix_dataset(stream.tasks[0].test)[0]
    before, R, adapter = clf.logits_prefix(z), clf.R_.clone(), clf.adapter_

    def fail(*args: object) -> None:
        raise RuntimeError("the step failed")

    monkeypatch.setattr("proteus.baselines.moal.MoAL._ruminate", fail)  # after training and the update
    with pytest.raises(RuntimeError, match="the step failed"):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and clf.adapter_ is adapter and torch.equal(clf.R_, R)
    assert torch.equal(clf.logits_prefix(z), before)
