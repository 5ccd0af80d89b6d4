"""HiDe-Prompt (proteus.baselines.hideprompt): stage 1's task-identity inference (TII) with its masked
training and its alignment, stage 2's momentum-initialised prompts, contrastive loss, head at a tenth of
the prompt's learning rate and its alignment on pseudo-features of every seen class, the prompt picked by
the TII's class at test time; and the method end to end through ``proteus run``.

Tiny settings: a random ViT-Ti at 32 px, two tasks of the quickstart stream, 8 images per class, 1 epoch
of stage 2, 2 of stage 1, 2 alignment epochs, 3 centroids per class.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from proteus.baselines.hideprompt import (
    HiDePrompt,
    align_on_pseudo_features,
    class_statistics,
    momentum_prompt,
    orth_loss,
    pseudo_features,
)
from proteus.baselines.learner import epoch_lr
from proteus.cli import main
from proteus.config import RunConfig, learner_of
from proteus.engine import task_identity
from proteus.experiment import resolve_config
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from tiny import TINY, baseline_cfg, baseline_stream, folder_args, make_tree, sets, write_spec

SMALL = {"tii_epochs": 2, "ca_epochs": 2, "n_centroids": 3}
SMALL_SETS = [f"baseline.{k}={v}" for k, v in SMALL.items()]


def _cfg(backbone: str = "vit_ti16") -> RunConfig:
    cfg = baseline_cfg("hide-prompt", backbone)
    for k, v in SMALL.items():
        cfg.baseline[k] = v
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


@pytest.fixture(scope="module")
def fitted(stream):
    """HiDe-Prompt after two tasks, with what task 1 did recorded on the way: its prompt when opened and
    before the momentum is kept, the TII before its alignment, the optimisers' groups, the classes of the
    pseudo-features drawn."""
    clf = build_learner(_cfg(), progress=False)
    assert isinstance(clf, HiDePrompt)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    rec: dict = {
        "after0": {k: v.clone() for k, v in clf.state_tensors().items()},
        "backbone0": {k: v.clone() for k, v in clf.backbone_.state_dict().items()},
        "groups": [],
        "drawn": [],
    }
    begin, end, align_tii = clf.begin_task, clf.end_task, clf.tii_.align

    def on_begin(k, z, loader):  # noqa: ANN001, ANN202
        begin(k, z, loader)
        rec["opened"] = clf.prompts_[k].detach().clone()
        rec["opened_effective"] = clf.prompt_of(k).detach().clone()

    def on_end(k, z, loader):  # noqa: ANN001, ANN202
        rec["trained_raw"] = clf.prompts_[k].detach().clone()
        end(k, z, loader)

    def on_align_tii(k, seen, steps):  # noqa: ANN001, ANN202
        rec["tii_before_align"] = clf.tii_.snapshot()
        return align_tii(k, seen, steps)

    adam_step = torch.optim.Adam.step

    def spy_step(opt, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        rec["groups"].append([(g["lr"], [id(p) for p in g["params"]]) for g in opt.param_groups])
        return adam_step(opt, *a, **kw)

    draw = task_identity.pseudo_features

    def spy_draw(stats, classes, n, generator, limit=None):  # noqa: ANN001, ANN202
        rec["drawn"].append((list(classes), n, limit))
        return draw(stats, classes, n, generator, limit)

    clf.begin_task, clf.end_task, clf.tii_.align = on_begin, on_end, on_align_tii  # type: ignore[method-assign]
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.optim.Adam, "step", spy_step)
    mp.setattr(task_identity, "pseudo_features", spy_draw)
    try:
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    finally:
        mp.undo()
        del clf.begin_task, clf.end_task, clf.tii_.align
    return clf, rec


def _z(clf: HiDePrompt, stream, k: int, n: int = 8) -> torch.Tensor:
    x = torch.stack([clf.eval_transform_(stream.tasks[k].test[i][0]) for i in range(n)])
    return clf.prefix(x)


# ------------------------------------------------------------------ stage 2: prompts
def test_prompt_momentum_initialisation(fitted) -> None:
    """Task 2's prompt opens as a copy of task 1's (the shared pool), trains as (1 - m) P + m mean(old)
    from the start, and that mix of its trained raw prompt is what it keeps."""
    clf, rec = fitted
    m = clf.options_.prompt_momentum
    assert m == 0.01
    p0 = clf.prompts_[0].detach()
    assert torch.equal(rec["opened"], rec["after0"]["prompt.0"])
    torch.testing.assert_close(rec["opened_effective"], (1 - m) * rec["opened"] + m * p0)
    torch.testing.assert_close(clf.prompts_[1].detach(), (1 - m) * rec["trained_raw"] + m * p0)
    assert not torch.equal(rec["trained_raw"], rec["opened"])  # it was trained
    # the rule itself: the mean of several old prompts, detached; nothing to mix on the first task
    raw = torch.randn(2, 3, requires_grad=True)
    old = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
    mixed = momentum_prompt(raw, old, 0.25)
    torch.testing.assert_close(mixed, 0.75 * raw + 0.25 * (old[0] + old[1] + old[2]) / 3)
    mixed.sum().backward()
    assert all(o.grad is None for o in old) and torch.allclose(raw.grad, torch.full((2, 3), 0.75))
    assert momentum_prompt(raw, [], 0.25) is raw


def test_earlier_prompts_and_the_backbone_never_move(fitted) -> None:
    clf, rec = fitted
    assert torch.equal(clf.prompts_[0].detach().cpu(), rec["after0"]["prompt.0"])
    assert all(torch.equal(v, rec["backbone0"][k]) for k, v in clf.backbone_.state_dict().items())
    assert not any(p.requires_grad for p in clf.prompts_)
    assert not any(p.requires_grad for p in clf.heads_.parameters())
    b = clf.options_
    assert tuple(clf.prompts_[0].shape) == (len(b.prompt_layers), 2, b.prompt_length, clf.embed_dim)
    assert b.prompt_layers == [0, 1, 2, 3, 4]


def test_head_learns_at_a_tenth_of_the_prompts_rate(fitted) -> None:
    clf, rec = fitted
    b = clf.options_
    stage2 = [g for g in rec["groups"] if len(g) == 2]
    assert stage2, "stage 2's optimiser has two parameter groups"
    prompt_id, head_ids = id(clf.prompts_[1]), {id(p) for p in clf.heads_[1].parameters()}
    for (lr_p, ps), (lr_h, hs) in stage2:
        assert ps == [prompt_id] and set(hs) == head_ids
        assert lr_p == pytest.approx(b.lr) and lr_h == pytest.approx(0.1 * b.lr)
    # stage 1's Adam: one group at tii_lr over the MLP and heads
    stage1 = [g for g in rec["groups"] if len(g) == 1]
    assert stage1 and all(g[0][0] == pytest.approx(b.tii_lr) for g in stage1)


def test_the_releases_timm_schedules() -> None:
    """timm's StepLR (x0.1 every 30 epochs) and CosineLR (to 1e-5) as the release's loop steps them,
    ``lr_scheduler.step(epoch)`` after each epoch: epoch e runs at the scheduler's value at e - 1."""
    from timm.scheduler import CosineLRScheduler, StepLRScheduler

    lr = 0.03 * 24 / 256
    for name, epochs, make in (
        ("hide-step", 50, lambda o: StepLRScheduler(o, decay_t=30, decay_rate=0.1)),
        ("hide-cosine", 150, lambda o: CosineLRScheduler(o, t_initial=150, lr_min=1e-5)),
    ):
        for base in (lr, 0.1 * lr):  # the prompt's group and the head's
            opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=base)
            sched = make(opt)
            for e in range(epochs):
                assert epoch_lr(base, name, e, epochs) == pytest.approx(opt.param_groups[0]["lr"]), (name, e)
                sched.step(e)
    assert epoch_lr(lr, "hide-step", 30, 50) == lr and epoch_lr(lr, "hide-step", 31, 50) == pytest.approx(
        lr / 10
    )


def test_orth_loss_by_hand() -> None:
    f = torch.tensor([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0]])
    means = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    M = [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 2.0], [0.5, -1.0, 0.0]]
    total = 0.0
    for i, a in enumerate(M):
        logits = [sum(x * y for x, y in zip(a, b)) / 0.8 for b in M]
        total += -(logits[i] - math.log(sum(math.exp(v) for v in logits)))
    assert float(orth_loss(f, means)) == pytest.approx(total / 4, rel=1e-12)
    # without stored centroids (the first task): the features alone
    alone = 0.0
    for i, a in enumerate(M[2:]):
        logits = [sum(x * y for x, y in zip(a, b)) / 0.8 for b in M[2:]]
        alone += -(logits[i] - math.log(sum(math.exp(v) for v in logits)))
    assert float(orth_loss(f, None)) == pytest.approx(alone / 2, rel=1e-12)


def test_training_loss_adds_reg_times_the_grouped_contrastive_loss(fitted, stream) -> None:
    clf, _ = fitted
    z = _z(clf, stream, 1, 6)
    clf.contrast_group = 4  # groups of 4 and 2, as two processes of those batches would
    clf.prompts_[1].requires_grad_(True)
    try:
        with torch.no_grad():
            h = clf.features(z, train=True)
        expect = 0.1 * (orth_loss(h[:4], clf._old_means) + orth_loss(h[4:], clf._old_means)) / 2
    finally:
        clf.prompts_[1].requires_grad_(False)
        del clf.contrast_group
    assert clf.options_.ortho_weight == 0.1
    torch.testing.assert_close(torch.as_tensor(clf.aux_loss).double(), expect.double())
    # the stored centroids are task 1's classes' (n_centroids each), of the instructed features
    assert clf._old_means.shape == (5 * 3, clf.embed_dim)


# ------------------------------------------------------------------ alignment on pseudo-features
def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_pseudo_features_draw_every_class_of_its_statistics() -> None:
    g = torch.Generator().manual_seed(0)
    stats = {
        3: (_t([[0.0, 0.0], [10.0, 10.0]]), _t([[1.0, 1.0], [0.0, 0.0]])),
        7: (_t([[-5.0, 5.0]]), _t([[0.04, 0.04]])),
        9: (_t([[1.0, 2.0]]), _t([[0.0, 0.0]])),
    }
    x, y = pseudo_features(stats, [3, 7, 9], 4000, g)
    # class 3's zero-variance centroid is skipped, as the release does; class 9 has no other
    assert (y == 3).sum() == (y == 7).sum() == (y == 9).sum() == 4000
    assert (x[y == 3].mean(0)).abs().max() < 0.1 and x[y == 3].std(0).sub(1.0).abs().max() < 0.05
    torch.testing.assert_close(x[y == 7].mean(0), torch.tensor([-5.0, 5.0]), atol=0.02, rtol=0)
    torch.testing.assert_close(x[y == 7].var(0), torch.tensor([0.0401, 0.0401]), atol=0.005, rtol=0)
    torch.testing.assert_close(x[y == 9].std(0), torch.tensor([0.01, 0.01]), atol=0.001, rtol=0)
    assert not torch.equal(y[:100], torch.sort(y[:100]).values)  # shuffled
    # only what an epoch's steps use is drawn: the first `limit` of the shuffled draws
    x, y = pseudo_features(stats, [3, 7, 9], 4000, g, limit=3000)
    assert x.shape == (3000, 2) and 800 < int((y == 7).sum()) < 1200
    torch.testing.assert_close(x[y == 7].mean(0), torch.tensor([-5.0, 5.0]), atol=0.03, rtol=0)


def test_alignment_moves_the_head_towards_the_statistics() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(2, 2)
    before = head.weight.detach().clone()
    stats = {0: (_t([[2.0, 0.0]]), _t([[0.1, 0.1]])), 1: (_t([[-2.0, 0.0]]), _t([[0.1, 0.1]]))}
    losses = align_on_pseudo_features(
        head, list(head.parameters()), stats, [0, 1], n=32, steps=2, epochs=20, lr=0.5,
        generator=torch.Generator().manual_seed(0), device=torch.device("cpu"),
    )  # fmt: skip
    assert len(losses) == 40 and losses[-1] < losses[0]
    assert not torch.equal(head.weight.detach(), before)
    x = torch.tensor([[2.0, 0.0], [-2.0, 0.0]])
    assert head(x).argmax(1).tolist() == [0, 1]


def test_alignment_after_task_2_covers_every_seen_class(fitted) -> None:
    """Both stages' alignments draw all seen classes; stage 2's moves task 1's head (not its prompt)."""
    clf, rec = fitted
    seen = sorted(clf.labels_)
    # 2 TII + 2 head alignment epochs, each one draw of every seen class; the release's batches (batch size
    # x 1, x 5) and steps (task 1's classes) of them
    assert len(rec["drawn"]) == 4 and all(sorted(d) == seen for d, _, _ in rec["drawn"])
    bs, n_old = clf.config.train.batch_size, len(clf.task_classes_[0])
    assert [(n, lim) for _, n, lim in rec["drawn"]] == [(bs, n_old * bs)] * 2 + [(5 * bs, n_old * 5 * bs)] * 2
    assert set(clf.stats_) == set(clf.tii_.stats) == set(seen)
    assert all(mu.shape == (3, clf.embed_dim) for mu, _ in clf.stats_.values())
    now = clf.state_tensors()
    assert not torch.equal(now["head.0.weight"], rec["after0"]["head.0.weight"])
    assert torch.equal(now["prompt.0"], rec["after0"]["prompt.0"])


def test_statistics_are_kmeans_centroids_of_the_features() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.cat([torch.randn(20, 4, generator=g) + 10, torch.randn(20, 4, generator=g) - 10])
    y = torch.tensor([5] * 30 + [6] * 10)
    st = class_statistics(h, y, n_centroids=2, seed=0)
    means, var = st[5]
    assert means.dtype == torch.float64 and means.shape == var.shape == (2, 4)
    # class 5 holds both blobs: its two centroids are theirs
    got = sorted(means[:, 0].tolist())
    assert got[0] == pytest.approx(float(h[20:30, 0].mean()), abs=1e-6)
    assert got[1] == pytest.approx(float(h[:20, 0].mean()), abs=1e-6)
    assert class_statistics(h[:1], y[:1], n_centroids=10, seed=0)[5][0].shape == (1, 4)


# ------------------------------------------------------------------ stage 1: task-identity inference
def test_tii_training_masks_the_other_tasks_classes(fitted) -> None:
    """Task 2's stage 1 trains the MLP and its own head only (task 1's columns get no gradient); the
    alignment then moves every head."""
    clf, rec = fitted
    before = rec["tii_before_align"]
    for n in ("heads.0.weight", "heads.0.bias"):
        assert torch.equal(before[n].cpu(), rec["after0"][f"tii.{n}"]), n
    assert not torch.equal(before["fc1.weight"].cpu(), rec["after0"]["tii.fc1.weight"])
    assert not torch.equal(clf.tii_.net.heads[0].weight.detach(), before["heads.0.weight"])
    assert [h.out_features for h in clf.tii_.net.heads] == [len(c) for c in clf.task_classes_]


def test_tii_head_is_the_releases_mlp_mapping() -> None:
    """hidden [2]: LN(q + W2 GELU(W1 q)), W1 d -> 2d; timm's init N(0, 0.02), bias 0; one head per task."""
    from proteus.baselines.hideprompt import TIIHead

    torch.manual_seed(0)
    m = TIIHead(64)
    assert (m.fc1.in_features, m.fc1.out_features, m.fc2.out_features) == (64, 128, 64)
    assert (
        abs(float(m.fc1.weight.detach().std()) - 0.02) < 0.002
        and not m.fc1.bias.any()
        and not m.fc2.bias.any()
    )
    m.add_head(3), m.add_head(2)
    q = torch.randn(5, 64)
    with torch.no_grad():
        e = F.layer_norm(q + F.linear(F.gelu(F.linear(q, m.fc1.weight)), m.fc2.weight), (64,))
        torch.testing.assert_close(m.embed(q), e)
        torch.testing.assert_close(m(q), torch.cat([m.heads[0](e), m.heads[1](e)], 1))
        torch.testing.assert_close(m(q, slice(1, 2)), m.heads[1](e))


def test_the_tii_starts_from_the_runs_seed() -> None:
    """Its MLP's initialisation depends on ``seed`` only, not on the global random stream's state (it is
    built before a task seeds that stream), nor does it move that stream."""
    from proteus.baselines.hideprompt import HiDeOptions, TaskIdentityInference

    cfg = _cfg()
    nets = []
    for state in (1, 2):
        torch.manual_seed(state)
        nets.append(TaskIdentityInference(cfg, HiDeOptions(), 16, torch.device("cpu")).net.state_dict())
    assert all(torch.equal(nets[0][n], nets[1][n]) for n in nets[0])
    torch.manual_seed(3)
    expect = torch.rand(3)
    torch.manual_seed(3)
    TaskIdentityInference(cfg, HiDeOptions(), 16, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expect)
    cfg.seed = 1
    other = TaskIdentityInference(cfg, HiDeOptions(), 16, torch.device("cpu")).net.state_dict()
    assert not torch.equal(other["fc1.weight"], nets[0]["fc1.weight"])


def test_the_tii_class_picks_the_prompt(fitted, stream) -> None:
    """Forced by its head's bias, the TII's class decides the task; that task's prompt runs, and the
    final heads score every seen class."""
    clf, _ = fitted
    z = torch.cat([_z(clf, stream, 0), _z(clf, stream, 1)])
    bias = [h.bias.detach().clone() for h in clf.tii_.net.heads]
    outs = {}
    try:
        for t in range(2):
            with torch.no_grad():
                clf.tii_.net.heads[t].bias[2] += 1e4
            logits, task = clf.infer(z)
            assert bool((task == t).all())
            with torch.no_grad():
                h = clf.prompted(z, torch.full((len(z),), t))
                own = torch.cat([head(h) for head in clf.heads_], 1)
            torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5)
            assert bool(torch.isfinite(logits).all()) and logits.shape[1] == len(clf.labels_)
            outs[t] = logits
            with torch.no_grad():
                clf.tii_.net.heads[t].bias.copy_(bias[t])
    finally:
        with torch.no_grad():
            for h, b0 in zip(clf.tii_.net.heads, bias):
                h.bias.copy_(b0)
    assert not torch.allclose(outs[0], outs[1])  # the prompt matters
    # unforced: the selected task is the one owning the TII's argmax class
    owner = torch.tensor([t for t, cs in enumerate(clf.task_classes_) for _ in cs])
    with torch.no_grad():
        expect = owner[clf.tii_.net(clf.query(z)).argmax(1)]
    assert torch.equal(clf.infer(z)[1], expect)


def test_per_sample_prefixes_are_each_inputs_own(fitted, stream) -> None:
    """Mixed tasks in one batch: each input runs under its own task's (key, value) prefixes, as it would
    alone (the release's reshape would mix the batch with the key/value halves)."""
    clf, _ = fitted
    z = _z(clf, stream, 0, 4)
    t = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        mixed = clf.prompted(z, t)
        alone = torch.cat([clf.prompted(z[i : i + 1], t[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(mixed, alone, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ failures and refusals
def test_refuses_a_backbone_without_tokens() -> None:
    with pytest.raises(ValueError, match="hide-prompt is a prompt method: it needs a backbone with tokens"):
        build_learner(_cfg("mobilenet_v2"), progress=False)._build()


def test_a_failed_task_leaves_the_learner_as_it_was(stream, monkeypatch) -> None:
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = _z(clf, stream, 0)
    before, state = clf.logits_prefix(z), {k: v.clone() for k, v in clf.state_tensors().items()}

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(HiDePrompt, "_align_heads", boom)  # the task's very last step
    with pytest.raises(KeyboardInterrupt):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and len(clf.prompts_) == len(clf.tii_.net.heads) == 1
    after = clf.state_tensors()
    assert set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
    torch.testing.assert_close(clf.logits_prefix(z), before)


def test_released_settings() -> None:
    cfg = resolve_config("cifar100", method="hide-prompt", config_files=["hide-prompt-cifar100"])
    b = learner_of(cfg)(cfg).options_
    assert (cfg.train.epochs, cfg.train.batch_size, b.optimizer, b.schedule) == (50, 192, "adam", "hide-step")
    assert (b.lr, b.tii_lr, b.tii_ca_lr, b.ca_lr) == pytest.approx(
        (0.03 * 24 / 256, 5e-4 * 24 / 256, 5e-3 * 24 / 256, 5e-3)
    )
    assert (b.prompt_length, b.ortho_weight, b.prompt_momentum, b.tii_epochs, b.ca_epochs, b.n_centroids) == (
        5,
        0.1,
        0.01,
        20,
        30,
        10,
    )
    assert (b.clip_grad, cfg.train.weight_decay) == (1.0, 0.0)
    cfg = resolve_config("imagenet-r", method="hide-prompt", config_files=["hide-prompt-imagenet-r"])
    b = learner_of(cfg)(cfg).options_
    assert (cfg.train.epochs, b.schedule, b.prompt_length, b.ortho_weight) == (150, "hide-cosine", 20, 0.5)


# ------------------------------------------------------------------ end to end
def test_run_through_the_cli(tmp_path: Path) -> None:
    """Three tasks of two classes (a folder benchmark of random images), through ``proteus run``."""
    tree = make_tree(tmp_path / "data", classes="abcdef", n_train=6, n_test=2)
    spec = write_spec(tmp_path / "tasks.yaml", [["a", "b"], ["c", "d"], ["e", "f"]])
    out = tmp_path / "run"
    argv = [
        "run",
        *folder_args(tree, spec),
        "--method",
        "hide-prompt",
        "--out",
        str(out),
        *TINY,
        *sets(*SMALL_SETS, base=[]),
    ]
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == "hide-prompt" and res["num_tasks"] == 3 and len(res["avg_acc"]) == 3
    assert res["retrieval_acc"][0] == 100.0 and all(0 <= a <= 100 for a in res["retrieval_acc"])
    assert res["forgetting"] is not None
    kb = KnowledgeBase.open(out / "kb")
    head = kb.manifest["head"]
    assert head["meta"]["method"] == "hide-prompt" and len(head["meta"]["task_classes"]) == 3
    tensors = kb.read(head["object"], head["sha256"])
    names = {"head.2.weight", "prompt.0", "prompt.2", "tii.fc1.weight", "tii.heads.2.weight"}
    assert names <= set(tensors)
    classes = [c for cs in head["meta"]["task_classes"] for c in cs]
    assert {f"stats.{c}.mean" for c in classes} | {f"tii_stats.{c}.var" for c in classes} <= set(tensors)
    assert tuple(tensors["prompt.2"].shape) == (5, 2, 5, 192)


def test_compare_runs_it_beside_another_baseline(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--benchmark", "quickstart", "--methods", "hide-prompt,ncm", "--seeds", "0",
            "--out", str(out), "--backbone", "vit_ti16", "-q", "--set", "backbone.pretrained=false",
            "--set", "backbone.img_size=32", "--set", "train.epochs=1", "--set", "benchmark.num_tasks=2",
            "--set", "benchmark.max_train_per_class=8", "--set", "report.figures=false",
            "--set", "report.latency=false", *sets(*SMALL_SETS, base=[])]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((out / "compare.json").read_text())
    assert rep["methods"] == ["hide-prompt", "ncm"]
    assert rep["summary"]["hide-prompt"]["retrieval_acc"]["mean"] is not None
