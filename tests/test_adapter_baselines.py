"""TUNA and MOS (proteus.baselines.tuna, .mos, on the parallel adapters of .adaptformer): the rules each
states, on constructed inputs, and a failed task leaving the learner as it was (the side-by-side check of TUNA
against its released code is tools/baseline_checks/check_tuna.py).

Tiny settings: a random MobileNetV2 at 32 px, two adapted blocks, the quickstart's tasks of 8 training images
per class, one epoch, two alignment epochs.
"""

from __future__ import annotations

import pytest
import torch

from proteus.baselines.adaptformer import KEYS, emr_merge
from proteus.baselines.mos import pull, self_refine
from proteus.baselines.tuna import entropy_selection
from proteus.experiment.store import build_learner
from tiny import baseline_cfg, baseline_stream


def _cfg(method: str, epochs: int = 1):
    cfg = baseline_cfg(method, "mobilenet_v2")
    cfg.backbone.adapt_last = 2
    cfg.baseline["ca_epochs"] = 2
    cfg.train.epochs = epochs
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


def _block(v: float) -> dict[str, torch.Tensor]:
    return {k: torch.full((2,), v) for k in KEYS}


def test_emr_merge_elects_the_sign_of_the_mean_and_keeps_the_largest_agreeing_magnitude() -> None:
    a = [{"down_w": torch.tensor([0.5, -0.2, 0.1]), **{k: torch.zeros(3) for k in KEYS[1:]}}]
    b = [{"down_w": torch.tensor([-0.1, -0.4, -0.3]), **{k: torch.zeros(3) for k in KEYS[1:]}}]
    merged = emr_merge([a, b])[0]["down_w"]
    # means 0.2 (+), -0.3 (-), -0.1 (-): the largest entry of that sign
    torch.testing.assert_close(merged, torch.tensor([0.5, -0.4, -0.3]))


def test_entropy_selection_picks_the_most_confident_adapter() -> None:
    flat = torch.zeros(1, 2, 3)
    sharp = torch.tensor([[[9.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    logits = torch.cat([flat, sharp])  # adapter 1 is sure of input 0; input 1 is a tie (first wins)
    assert entropy_selection(logits).tolist() == [1, 0]


def test_self_refinement_follows_the_argmax_until_the_task_repeats() -> None:
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    logits = torch.zeros(3, 2, 6)
    logits[0, 0, 2] = 1  # input 0: task 0's adapter points to task 1,
    logits[1, 0, 3] = 1  # task 1's to itself: stop at task 1
    for t in range(3):  # input 1 cycles 0 -> 1 -> 2 -> 0 -> ...: stopped after the looks allowed
        logits[t, 1, 2 * ((t + 1) % 3)] = 1
    final, task = self_refine(logits, owner, torch.tensor([0, 0]), steps=4)
    assert task.tolist() == [1, 0]  # input 1's fourth look is at task 0 again
    assert torch.equal(final[0], logits[1, 0]) and torch.equal(final[1], logits[0, 1])


def test_a_pull_moves_towards_the_mean_of_the_earlier_adapters() -> None:
    w, total = torch.tensor([1.0]), torch.tensor([4.0])  # two earlier adapters summing to 4: mean 2
    torch.testing.assert_close(pull(w, total, 2, 0.1), torch.tensor([0.9 * 1 + 0.1 * 2]))
    torch.testing.assert_close(pull(w, total, 2, 0.0), w)


@pytest.mark.parametrize("method", ["tuna", "mos"])
@pytest.mark.parametrize("epochs", [2, 1], ids=["in-training", "in-alignment"])
def test_a_failed_task_leaves_the_learner_as_it_was(method: str, epochs: int, stream, monkeypatch) -> None:
    """A task of one batch: with two epochs its second SGD step fails in training; with one, the second SGD
    step is the alignment's, after the task's head and adapter have joined the learner."""
    clf = build_learner(_cfg(method, epochs), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    x = clf.transform_images([stream.tasks[0].test[i][0] for i in range(6)])
    before = clf.predict(x).logits
    state = {n: t.clone() for n, t in clf.state_tensors().items()}
    calls = {"n": 0}
    step = torch.optim.SGD.step

    def boom(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 1:  # one step taken: the open adapter and the heads have moved
            raise KeyboardInterrupt
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", boom)
    with pytest.raises(KeyboardInterrupt):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and clf.labels_ == list(stream.tasks[0].classes)
    after = clf.state_tensors()
    assert after.keys() == state.keys() and all(torch.equal(after[n], state[n]) for n in state)
    torch.testing.assert_close(clf.predict(x).logits, before)
    clf.fit_task(stream.tasks[1], stream_tasks=2)  # and the task can be learned again, as the first try
    fresh = build_learner(_cfg(method, epochs), progress=False)
    for t in stream.tasks[:2]:
        fresh.fit_task(t, stream_tasks=2)
    a, b = clf.state_tensors(), fresh.state_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_mos_predictions_do_not_change_the_learner(stream) -> None:
    clf = build_learner(_cfg("mos"), progress=False)
    for t in stream.tasks[:2]:
        clf.fit_task(t, stream_tasks=2)
    x = clf.transform_images([stream.tasks[1].test[i][0] for i in range(6)])
    state = {n: t.clone() for n, t in clf.state_tensors().items()}
    first = clf.predict(x)
    second = clf.predict(x)
    assert torch.equal(first.logits, second.logits) and torch.equal(first.task, second.task)
    assert all(torch.equal(clf.state_tensors()[n], t) for n, t in state.items())
