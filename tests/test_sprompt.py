"""S-Prompt (proteus.baselines.sprompt): the task of an input by its nearest K-Means key under the L1
distance, one prompt and one head trained per task, prediction by the retrieved task's head only; and the
method end to end through ``proteus run`` / ``proteus compare``.

Tiny settings: a random ViT-Ti at 32 px, two tasks of the quickstart stream, 8 images per class, 1 epoch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from proteus.baselines.learner import epoch_lr
from proteus.baselines.sprompt import SPrompt, nearest_key_task, task_keys
from proteus.cli import main
from proteus.config import RunConfig
from proteus.experiment import resolve_config
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from tiny import baseline_cfg, baseline_stream

TINY_RUN = ["--backbone", "vit_ti16", "-q", "--set", "backbone.pretrained=false",
            "--set", "backbone.img_size=32", "--set", "train.epochs=1", "--set", "benchmark.num_tasks=2",
            "--set", "benchmark.max_train_per_class=8"]  # fmt: skip


def _cfg(backbone: str = "vit_ti16") -> RunConfig:
    return baseline_cfg("s-prompt", backbone)


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


@pytest.fixture(scope="module")
def fitted(stream):
    """S-Prompt after two tasks, with task 1's prompt as initialised and task 0's state after task 0."""
    clf = build_learner(_cfg(), progress=False)
    assert isinstance(clf, SPrompt)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    after0 = {k: v.clone() for k, v in clf.state_tensors().items()}
    backbone0 = {k: v.clone() for k, v in clf.backbone_.state_dict().items()}
    inits = {}
    begin = clf.begin_task

    def recording_begin(k, z, loader):  # noqa: ANN001, ANN202
        begin(k, z, loader)
        inits[k] = clf.prompts_[k].detach().clone()

    clf.begin_task = recording_begin  # type: ignore[method-assign]
    stats1 = clf.fit_task(stream.tasks[1], stream_tasks=2)
    del clf.begin_task
    return clf, after0, backbone0, inits, stats1


def _z(clf: SPrompt, stream, k: int, n: int = 8) -> torch.Tensor:
    x = torch.stack([clf.eval_transform_(stream.tasks[k].test[i][0]) for i in range(n)])
    return clf.prefix(x)


# ------------------------------------------------------------------ retrieval by the K-Means keys
def test_l1_nearest_centroid_picks_the_task_and_differs_from_l2() -> None:
    """Hand-made keys: the task of the nearest of its centroids; L1 (the release's distance) and L2 disagree
    on a constructed point."""
    keys = [torch.tensor([[1.0, 1.0], [10.0, 10.0]]), torch.tensor([[1.6, 0.0]])]
    q = torch.tensor([[0.0, 0.0], [9.0, 9.5], [1.7, 0.1]])
    # q0: task 0's [1, 1] is L1 2.0 / L2 1.41 away, task 1's [1.6, 0] is L1 1.6 / L2 1.6 away
    assert nearest_key_task(q, keys).tolist() == [1, 0, 1]
    assert nearest_key_task(q, keys, p=2.0).tolist() == [0, 0, 1]
    # the released code's expression, literally, gives the same choice
    rel = torch.stack([torch.stack([(((q - c) ** 2) ** 0.5).sum(1) for c in cs]).min(0)[0] for cs in keys])
    assert torch.equal(rel.min(0)[1], nearest_key_task(q, keys))


def test_select_normalises_the_query_and_uses_l1() -> None:
    clf = SPrompt(_cfg(), progress=False)
    # normalisation decides: [3, 0] is nearer task 1's key, its direction [1, 0] task 0's
    clf.keys_ = [torch.tensor([[1.0, 0.3]]), torch.tensor([[2.5, 0.0]])]
    q = torch.tensor([[3.0, 0.0]])
    assert clf.select(q).tolist() == [0] and nearest_key_task(q, clf.keys_).tolist() == [1]
    # L1 decides: [0, 1] is L1 1.0 / L2 0.71 from [0.5, 0.5], L1 0.8 / L2 0.8 from [0, 0.2]
    clf.keys_ = [torch.tensor([[0.5, 0.5]]), torch.tensor([[0.0, 0.2]])]
    q = torch.tensor([[0.0, 1.0]])
    assert clf.select(q).tolist() == [1] and nearest_key_task(q, clf.keys_, p=2.0).tolist() == [0]
    with pytest.raises(Exception, match="no task keys"):
        SPrompt(_cfg(), progress=False).select(q)


def test_keys_are_the_kmeans_centroids_of_normalised_prompt_free_features(fitted, stream) -> None:
    clf = fitted[0]
    assert [tuple(k.shape) for k in clf.keys_] == [(5, clf.embed_dim)] * 2
    for t in range(2):
        z, _ = clf.prefix_dataset(stream.tasks[t].train)
        q = F.normalize(clf.query(z), dim=-1)
        torch.testing.assert_close(clf.keys_[t].cpu(), task_keys(q))
        torch.testing.assert_close(
            clf.keys_[t].norm(dim=1), torch.ones(5), atol=0.2, rtol=0
        )  # near the sphere
    # the evaluation's retrieved task is the nearest key's
    z = torch.cat([_z(clf, stream, 0), _z(clf, stream, 1)])
    _, task = clf.infer(z)
    assert torch.equal(task, nearest_key_task(F.normalize(clf.query(z), dim=-1), list(clf.keys_)).cpu())
    # fewer images than keys: one key per image
    assert task_keys(F.normalize(torch.randn(3, 4), dim=-1)).shape == (3, 4)


# ------------------------------------------------------------------ training: the task's own prompt and head
def test_only_the_tasks_own_prompt_and_head_are_trained(fitted) -> None:
    clf, after0, backbone0, inits, stats1 = fitted
    now = clf.state_tensors()
    for name in ("prompt.0", "key.0", "head.0.weight", "head.0.bias"):
        assert torch.equal(now[name], after0[name]), name  # task 0's state never moves again
    assert all(torch.equal(v, backbone0[k]) for k, v in clf.backbone_.state_dict().items())
    assert not torch.equal(clf.prompts_[1].detach(), inits[1])  # task 1's prompt was trained
    assert not any(p.requires_grad for p in clf.prompts_) and not any(
        p.requires_grad for p in clf.heads_.parameters()
    )
    L, d = clf.options_.prompt_length, clf.embed_dim
    n1 = len(clf.task_classes_[1])
    assert L == 10 and stats1.extra["trainable_params"] == L * d + (d + 1) * n1  # one prompt, one head
    assert [tuple(p.shape) for p in clf.prompts_] == [(L, d)] * 2
    assert inits[1].abs().max() <= 1 / math.sqrt(d)  # the release's nn.Linear(d, L) weight init


def test_prompt_after_the_class_token_without_position_embedding(fitted, stream) -> None:
    clf = fitted[0]
    z = _z(clf, stream, 0, 4)
    seen = {}
    run_blocks = clf.run_blocks

    def spy(x, prefixes):  # noqa: ANN001, ANN202
        seen["x"] = x
        return run_blocks(x, prefixes)

    clf.run_blocks = spy  # type: ignore[method-assign]
    try:
        clf.prompted(z, torch.ones(4, dtype=torch.long))
    finally:
        del clf.run_blocks
    x, plain = seen["x"], clf.tokens(z)
    L = clf.options_.prompt_length
    assert x.shape[1] == plain.shape[1] + L
    assert torch.equal(x[:, :1], plain[:, :1]) and torch.equal(x[:, 1 + L :], plain[:, 1:])
    assert torch.equal(x[:, 1 : 1 + L], clf.prompts_[1].detach()[None].expand(4, -1, -1))


def test_released_optimiser_settings() -> None:
    clf = SPrompt(resolve_config("quickstart", method="s-prompt"), progress=False)
    b = clf.options_
    assert (b.optimizer, b.lr, b.momentum, b.schedule, b.prompt_length) == (
        "sgd",
        0.01,
        0.9,
        "cosine-annealing",
        10,
    )
    assert clf.weight_decay(0) == pytest.approx(5e-4) and clf.weight_decay(3) == pytest.approx(2e-4)
    # CosineAnnealingLR(T_max=E) stepped once per epoch
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    for e in range(5):
        assert epoch_lr(0.01, "cosine-annealing", e, 5) == pytest.approx(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()


# ------------------------------------------------------------------ prediction: the retrieved task's head
def test_prediction_uses_only_the_retrieved_tasks_head(fitted, stream) -> None:
    clf = fitted[0]
    z = torch.cat([_z(clf, stream, 0), _z(clf, stream, 1)])
    logits, task = clf.infer(z)
    cols = torch.as_tensor([t for t, cs in enumerate(clf.task_classes_) for _ in cs])
    assert torch.equal(torch.isfinite(logits), cols[None] == task[:, None])
    pred = torch.as_tensor(clf.labels_)[logits.argmax(1)]
    assert all(int(p) in clf.task_classes_[int(t)] for p, t in zip(pred, task))
    # forced to one task by its keys: that task's prompt and head decide, whatever the other head says
    keys = list(clf.keys_)
    try:
        for t in range(2):
            clf.keys_ = [k if i == t else k + 100.0 for i, k in enumerate(keys)]
            logits, task = clf.infer(z)
            assert bool((task == t).all())
            with torch.no_grad():
                own = clf.heads_[t](clf.prompted(z, torch.full((len(z),), t)))
            torch.testing.assert_close(logits[:, cols == t], own, rtol=1e-5, atol=1e-5)
            assert set(torch.as_tensor(clf.labels_)[logits.argmax(1)].tolist()) <= set(clf.task_classes_[t])
    finally:
        clf.keys_ = keys


def test_refuses_a_backbone_without_tokens() -> None:
    with pytest.raises(ValueError, match="s-prompt is a prompt method: it needs a backbone with tokens"):
        build_learner(_cfg("mobilenet_v2"), progress=False)._build()


def test_a_failed_task_leaves_the_learner_as_it_was(stream, monkeypatch) -> None:
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = _z(clf, stream, 0)
    before = clf.logits_prefix(z)

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.SGD, "step", boom)
    with pytest.raises(KeyboardInterrupt):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and len(clf.prompts_) == len(clf.keys_) == 1
    torch.testing.assert_close(clf.logits_prefix(z), before)


# ------------------------------------------------------------------ end to end
def test_run_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert (
        main(["run", "--benchmark", "quickstart", "--method", "s-prompt", "--out", str(out), *TINY_RUN]) == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == "s-prompt" and res["num_tasks"] == 2 and len(res["avg_acc"]) == 2
    assert res["retrieval_acc"][0] == 100.0 and 0 <= res["retrieval_acc"][1] <= 100  # K-Means task retrieval
    assert res["forgetting"] is not None
    kb = KnowledgeBase.open(out / "kb")
    head = kb.manifest["head"]
    assert head["meta"]["method"] == "s-prompt" and len(head["meta"]["task_classes"]) == 2
    tensors = kb.read(head["object"], head["sha256"])
    assert {"head.0.weight", "head.1.weight", "prompt.0", "prompt.1", "key.0", "key.1"} <= set(tensors)
    assert tuple(tensors["prompt.1"].shape) == (10, 192) and tuple(tensors["key.1"].shape) == (5, 192)


def test_compare_runs_it_beside_another_baseline(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--benchmark", "quickstart", "--methods", "s-prompt,ncm", "--seeds", "0",
            "--out", str(out), *TINY_RUN,
            "--set", "report.figures=false", "--set", "report.latency=false"]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((out / "compare.json").read_text())
    assert rep["methods"] == ["s-prompt", "ncm"]
    assert rep["summary"]["s-prompt"]["retrieval_acc"]["mean"] is not None
    assert rep["summary"]["ncm"]["retrieval_acc"]["mean"] is None
