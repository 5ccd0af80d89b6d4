"""TOSCA (proteus.baselines.tosca): what the method states, checked without the authors' code (the
side-by-side check against it is tools/baseline_checks/check_tosca.py): the flows compose as declared, a
task's rows are its class prototypes under its own module, the earlier modules stay frozen while the
earlier rows move (as released), each input takes the task of least entropy, and a restored learner
predicts and learns on as the writer."""

from __future__ import annotations

import pytest
import torch

from proteus.baselines.learner import entropy
from proteus.baselines.tosca import EPS, FLOWS, ToscaModule, cosine_logits
from proteus.engine.errors import TaskError
from proteus.experiment.store import build_learner
from tiny import baseline_cfg, baseline_stream


def _cfg(**baseline: object) -> object:
    cfg = baseline_cfg("tosca", "mobilenet_v2")
    cfg.backbone.adapt_last = 2
    cfg.train.epochs = 2
    cfg.baseline.update(baseline)
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


@pytest.fixture(scope="module")
def learned(stream):
    """A learner after task 1 (its rows, sigma and module copied) and after task 2."""
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    after1 = {
        "rows": clf._rows().clone(),
        "sigma": clf.sigma_.clone(),
        "module": {n: t.clone() for n, t in clf.modules_[0].state_dict().items()},
    }
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    return clf, after1


def test_the_flows_compose_as_declared() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 32)
    for flow in FLOWS.names():
        mod = ToscaModule(32, 4, 8, flow).xavier_()
        mlp, se, norm = mod.mlp, mod.se, mod.norm
        want = {
            "tosca": norm(x + mlp(x)) * se(norm(x + mlp(x))),
            "tosca_r": x * se(x) + norm(mlp(x)),
            "adapter": norm(mlp(x)),
            "calibrator": x * se(x),
        }[flow]
        torch.testing.assert_close(mod(x), want, rtol=0, atol=0)
    mod = ToscaModule(32, 4, 8, "tosca")
    assert mod.mlp[0].out_features == 8 and mod.se[0].out_features == 4 and mod.se[0].bias is None
    assert all(
        float(m.bias.detach().abs().max()) == 0
        for m in mod.xavier_().modules()
        if getattr(m, "bias", None) is not None
    )


def test_a_task_s_rows_are_its_prototypes_and_the_earlier_rows_move(stream, learned) -> None:
    clf, after1 = learned
    z, y = clf.prefix_dataset(stream.tasks[1].train)
    out = clf.modules_[1](z)
    protos = torch.stack([out[y == c].mean(0) for c in stream.tasks[1].classes])
    torch.testing.assert_close(clf.heads_[1].weight, protos, rtol=0, atol=1e-6)
    z0, y0 = clf.prefix_dataset(stream.tasks[0].train)
    out0 = clf.modules_[0](z0)
    torch.testing.assert_close(
        after1["rows"],
        torch.stack([out0[y0 == c].mean(0) for c in stream.tasks[0].classes]),
        rtol=0,
        atol=1e-6,
    )
    for n, t in clf.modules_[0].state_dict().items():  # task 1's module is frozen
        assert torch.equal(t, after1["module"][n]), n
    assert not torch.equal(clf.heads_[0].weight, after1["rows"])  # its rows trained on with task 2 (released)
    assert float(after1["sigma"]) != 1.0 and not torch.equal(clf.sigma_, after1["sigma"])  # sigma learns
    assert clf.labels_ == [*stream.tasks[0].classes, *stream.tasks[1].classes]


def test_each_input_takes_the_task_of_least_entropy(stream, learned) -> None:
    clf, _ = learned
    z = torch.cat([clf.prefix_dataset(t.test)[0] for t in stream.tasks])
    logits, task = clf.infer(z)
    every = torch.stack([cosine_logits(m(z), clf._rows(), clf.sigma_) for m in clf.modules_])
    assert torch.equal(task, entropy(every, EPS).argmin(0))
    torch.testing.assert_close(logits, every[task, torch.arange(len(z))], rtol=0, atol=0)
    part_logits, part_task = clf.infer(z[:3])  # an input's answer does not depend on the others
    assert torch.equal(part_task, task[:3])
    torch.testing.assert_close(part_logits, logits[:3], rtol=0, atol=1e-6)  # (another batch shape: round-off)
    pred = clf.predict(
        torch.cat([torch.stack([clf.eval_transform_(im) for im, _ in t.test]) for t in stream.tasks])
    )
    assert torch.equal(pred.task, task)


def test_batch_selection_gives_one_task_per_batch(stream, learned) -> None:
    clf, _ = learned
    z = torch.cat([clf.prefix_dataset(t.test)[0] for t in stream.tasks])
    every = torch.stack([cosine_logits(m(z[:4]), clf._rows(), clf.sigma_) for m in clf.modules_])
    clf.config.baseline["selection"], batch = "batch", clf.config.eval.batch_size
    clf.__dict__.pop("options_", None)
    clf.config.eval.batch_size = 4
    try:
        _, task = clf.infer(z)
    finally:
        clf.config.baseline["selection"], clf.config.eval.batch_size = "input", batch
        clf.__dict__.pop("options_", None)
    chunks = task.split(4)
    assert all(len(set(c.tolist())) == 1 for c in chunks)
    assert int(chunks[0][0]) == int(entropy(every, EPS).mean(1).argmin())


def test_a_restored_learner_predicts_and_learns_on_as_the_writer(stream) -> None:
    first = build_learner(_cfg(), progress=False)
    first.fit_task(stream.tasks[0], stream_tasks=2)
    back = build_learner(_cfg(), progress=False).restore(first.state())
    z = back.prefix_dataset(stream.tasks[0].test)[0]
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))
    for clf in (first, back):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))
    state = first.state()
    meta, tensors = state.head
    tensors = {**tensors, "tosca.1.mlp.0.weight": tensors["tosca.1.mlp.0.weight"][:, :-1]}
    with pytest.raises(TaskError, match=r"task 2's module \(tosca\.1\.\*\)"):
        build_learner(_cfg(), progress=False).restore(type(state)(state.tasks, (meta, tensors)))


def test_a_failed_task_leaves_the_learner_as_before(stream, monkeypatch: pytest.MonkeyPatch) -> None:
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = clf.prefix_dataset(stream.tasks[0].test)[0]
    before, rows = clf.logits_prefix(z), clf._rows().clone()

    def fail(*args: object) -> None:
        raise RuntimeError("the step failed")

    monkeypatch.setattr("proteus.baselines.tosca.task_stats", fail)  # after training, before the commit
    with pytest.raises(RuntimeError, match="the step failed"):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and len(clf.modules_) == 1 and torch.equal(clf._rows(), rows)
    assert torch.equal(clf.logits_prefix(z), before)
