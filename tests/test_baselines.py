"""The Table 1 baselines (proteus.baselines): the invariants each method states, checked without the
authors' code (the side-by-side checks against their code are in docs/experiments.md), and each method
end to end through ``proteus run`` / ``proteus compare``.

Tiny settings: random MobileNetV2 / ViT-Ti weights at 32 px, a few digits per task, one epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from proteus.baselines import BASELINES
from proteus.baselines.lora_methods import DualGPM
from proteus.baselines.prompts import block_with_prefix, gram_schmidt
from proteus.cli import main
from proteus.config import METHODS, RunConfig
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from tiny import baseline_cfg, baseline_stream

BASELINE_METHODS = sorted(n for n in METHODS.names() if METHODS.get(n).learner != "proteus")
#: the baselines that retrieve a task per input (results.json's retrieval_acc)
RETRIEVING = ("s-prompt", "hide-prompt", "tuna", "mos", "tosca")
PROMPT_METHODS = {"l2p", "dualprompt", "coda-prompt", "s-prompt", "adapromptcl", "hide-prompt"}


def _cfg(method: str, backbone: str = "vit_ti16", **sets) -> RunConfig:
    cfg = baseline_cfg(method, backbone)
    cfg.backbone.adapt_last = None if method in PROMPT_METHODS else 2
    cfg.baseline["rank"] = 4
    if method == "coda-prompt":
        cfg.baseline.update(pool_size=4, max_tasks=2)
    for k, v in sets.items():
        section, _, name = k.partition("__")
        if section == "baseline":
            cfg.baseline[name] = v
        else:
            setattr(getattr(cfg, section), name, v)
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


def _frozen_state(clf) -> dict[str, torch.Tensor]:
    """Every backbone parameter and buffer (BatchNorm statistics included), without the LoRA units."""
    sd = clf.backbone_.state_dict()
    return {k: v.clone() for k, v in sd.items() if ".units." not in k}


def _batch(clf, stream, k: int = 0, n: int = 6) -> torch.Tensor:
    x = torch.stack([clf.eval_transform_(stream.tasks[k].train[i][0]) for i in range(n)])
    return clf.prefix(x)


def test_every_declared_baseline_has_a_learner() -> None:
    expected = {
        "inflora",
        "sd-lora",
        "l2p",
        "dualprompt",
        "coda-prompt",
        "ncm",
        "klda",
        "s-prompt",
        "adapromptcl",
        "hide-prompt",
        "tuna",
        "mos",
        "tosca",
        "moal",
    }
    assert set(BASELINE_METHODS) == expected
    for m in BASELINE_METHODS:
        assert METHODS.get(m).learner in BASELINES


@pytest.mark.parametrize(
    "method,backbone",
    [("inflora", "mobilenet_v2"), ("sd-lora", "mobilenet_v2"), ("inflora", "vit_ti16"), ("l2p", "vit_ti16"),
     ("dualprompt", "vit_ti16"), ("coda-prompt", "vit_ti16")],
)  # fmt: skip
def test_backbone_frozen_and_old_tasks_unchanged(method: str, backbone: str, stream) -> None:
    """The backbone (parameters and buffers) is bit-identical after training; task 0's head and its
    predictions on task 0's inputs survive task 1 where the method promises it (old state frozen)."""
    clf = build_learner(_cfg(method, backbone), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    before = _frozen_state(clf)
    head0 = {k: v.clone() for k, v in clf.heads_[0].state_dict().items()}
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    after = _frozen_state(clf)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(head0[k], v) for k, v in clf.heads_[0].state_dict().items())
    assert clf.labels_ == list(stream.tasks[0].classes) + list(stream.tasks[1].classes)
    z = _batch(clf, stream)
    assert clf.logits_prefix(z).shape == (6, len(clf.labels_))


def test_masked_cross_entropy_touches_only_the_current_head(stream) -> None:
    """Training task 1 is the CE over task 1's classes: task 0's head gets no update at all."""
    clf = build_learner(_cfg("sd-lora"), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    assert not any(p.requires_grad for p in clf.heads_[0].parameters())
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    assert len(clf.heads_) == 2 and clf.heads_[1].out_features == len(stream.tasks[1].classes)


# ------------------------------------------------------------------ InfLoRA
def test_inflora_design_and_interference(stream) -> None:
    clf = build_learner(_cfg("inflora"), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    units = clf.model_.units
    assert units and all(n.endswith((":k", ":v")) for n in units)  # k and v rows only: q untouched
    A0 = {n: u.A.clone() for n, u in units.items()}
    B0 = {n: u.B.clone() for n, u in units.items()}
    z = _batch(clf, stream)
    out_end_0 = clf.model_.suffix(z, [0])[0]
    # open task 1 by hand: B = 0 keeps the model of task 0 exactly; A is designed off the DualGPM space
    clf.begin_task(1, z, None)
    torch.testing.assert_close(clf.model_.suffix(z), out_end_0, rtol=0, atol=1e-5)
    for name, w in clf.model_.wrappers.items():
        gpm = clf.gpm_[name]
        for u in w.units.values():
            A = u.A_new.detach().double()
            assert not u.A_new.requires_grad and torch.count_nonzero(u.B_new) == 0
            torch.testing.assert_close(A.T @ A, torch.eye(A.shape[1], dtype=A.dtype) / 3, atol=1e-5, rtol=0)
            M = gpm.basis
            assert torch.allclose(M.T @ M, torch.eye(M.shape[1], dtype=M.dtype), atol=1e-6)
            if gpm.mode == "remove" and M.shape[1]:
                assert float((M.T @ A).abs().max()) < 1e-5  # rows of A_t orthogonal to the old inputs
            else:
                assert float((A - M @ (M.T @ A)).abs().max()) < 1e-5  # inside the retained complement
    clf.model_.truncate(1)
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    for n, u in units.items():  # old branches bit-identical; k's and v's A are one shared matrix
        c = u.columns(0)
        assert torch.equal(u.A[:, c], A0[n]) and torch.equal(u.B[:, c], B0[n])
        assert bool((u.C[1] == 1).all())  # every branch summed with weight 1
    k_unit, v_unit = units["vit.blocks.10.attn.qkv:k"], units["vit.blocks.10.attn.qkv:v"]
    assert torch.equal(k_unit.A, v_unit.A)


def test_dualgpm_threshold_and_mode_switch() -> None:
    g = torch.Generator().manual_seed(0)
    gpm = DualGPM(8)
    sizes = []
    for t in range(4):
        H = torch.randn(8, 3 + 2 * t, generator=g, dtype=torch.float64)
        C = H @ H.T / H.shape[1]
        gpm.update(C, 0.95)
        M = gpm.basis
        assert torch.allclose(M.T @ M, torch.eye(M.shape[1], dtype=M.dtype), atol=1e-8)
        sizes.append((gpm.mode, M.shape[1]))
        if gpm.mode == "remove":
            assert M.shape[1] <= 4
    assert sizes[0][0] == "remove" and any(m == "retain" for m, _ in sizes)  # switched past d / 2
    clf_thr = build_learner(_cfg("inflora", baseline__gpm_start=0.98), progress=False)
    clf_thr._stream_tasks = 10
    assert [round(clf_thr.threshold(t), 4) for t in (0, 5)] == [0.98, 0.99]


# ------------------------------------------------------------------ SD-LoRA
def test_sdlora_old_directions_fixed_magnitudes_learned(stream) -> None:
    clf = build_learner(_cfg("sd-lora"), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    units = clf.model_.units
    assert all(n.endswith((":q", ":v")) for n in units)
    saved = {n: (u.A.clone(), u.B.clone()) for n, u in units.items()}
    z = _batch(clf, stream)
    clf.begin_task(1, None, None)
    assert float(clf.alpha_.detach()[0]) == pytest.approx(0.8)  # re-initialised as the released code does
    h = clf.features(z, train=True)
    h.sum().backward()
    assert clf.alpha_.grad is not None and float(clf.alpha_.grad[0].abs()) > 0  # old magnitude trained
    for u in units.values():
        assert u.A.grad is None and u.B.grad is None  # the old directions are buffers: never trained
        c = u.columns(0)
        dW = (u.B[:, c] * u.s_fixed[c]) @ u.A[:, c].T
        # the old term is alpha_0 * B A / (||B|| ||A||)
        expect = 0.8 * (u.B[:, c] @ u.A[:, c].T) / (u.B[:, c].norm() * u.A[:, c].norm())
        torch.testing.assert_close(dW.detach(), expect, rtol=1e-5, atol=1e-7)
    clf.model_.truncate(1)
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    for n, u in units.items():
        c = u.columns(0)
        assert torch.equal(u.A[:, c], saved[n][0]) and torch.equal(u.B[:, c], saved[n][1])
        a1 = clf.magnitudes_[-1]
        assert float(u.C[1, u.columns(1)][0]) == pytest.approx(a1[-1])  # own branch: alpha_1, unnormalised


# ------------------------------------------------------------------ prompts
def test_prompt_methods_refuse_a_backbone_without_tokens() -> None:
    clf = build_learner(_cfg("l2p", "mobilenet_v2"), progress=False)
    with pytest.raises(ValueError, match="needs a backbone with tokens"):
        clf._build()


def test_prefix_keeps_the_sequence_and_matches_plain_attention_when_empty() -> None:
    clf = build_learner(_cfg("dualprompt"), progress=False)
    clf._build()
    blk = clf.vit.blocks[0]
    x = torch.randn(2, 5, clf.embed_dim)
    empty = torch.zeros(2, 0, clf.embed_dim)
    torch.testing.assert_close(block_with_prefix(blk, x, (empty, empty)), blk(x), rtol=1e-5, atol=1e-5)
    p = torch.randn(2, 3, clf.embed_dim)
    assert block_with_prefix(blk, x, (p, p)).shape == x.shape


def test_l2p_selection(stream) -> None:
    clf = build_learner(_cfg("l2p", baseline__top_k=3, baseline__pool_size=6), progress=False)
    clf._build()
    z = _batch(clf, stream)
    q = clf.query(z)
    assert not q.requires_grad  # the query never depends on the prompts
    x = torch.stack([clf.eval_transform_(stream.tasks[0].train[i][0]) for i in range(6)])
    torch.testing.assert_close(q, clf.backbone_(x))  # the frozen ViT's pre-logits class token
    clf.prompt_.data.add_(1.0)
    torch.testing.assert_close(clf.query(_batch(clf, stream)), q)
    idx, cos = clf.select(q)
    assert idx.shape == (6, 3) and bool((cos.abs() <= 1 + 1e-6).all())
    sim = F.normalize(q, dim=-1) @ F.normalize(clf.key_, dim=-1).T
    assert torch.equal(idx, sim.topk(3, dim=1).indices)
    clf._stream_tasks = 2
    h = clf.features(z, train=True)
    assert h.shape == (6, clf.embed_dim)
    assert float(clf.aux_loss.detach()) == pytest.approx(-0.1 * float(cos.detach().sum()) / 6, rel=1e-5)


def test_dualprompt_train_uses_the_task_prompt_and_copies_it(stream) -> None:
    clf = build_learner(_cfg("dualprompt"), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = _batch(clf, stream)
    clf.begin_task(1, None, None)
    assert torch.equal(clf.e_prompts_[1].detach(), clf.e_prompts_[0].detach())  # the port's shared pool
    clf.features(z, train=True)
    clf.aux_loss.backward()
    assert clf.e_keys_[1].grad is not None and clf.e_keys_[0].grad is None  # only key t is pulled
    assert clf.select(clf.query(z)).shape == (6,)


def test_coda_components_gram_schmidt_and_frozen_past(stream) -> None:
    g = torch.Generator().manual_seed(0)
    old = gram_schmidt(torch.zeros(0, 12), 3, g)
    new = gram_schmidt(old, 3, g)
    allrows = torch.cat([old, new]).double()
    torch.testing.assert_close(allrows @ allrows.T, torch.eye(6, dtype=torch.float64), atol=1e-6, rtol=0)
    clf = build_learner(_cfg("coda-prompt"), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    s0, f0 = clf.span(0)
    past = {k: v[s0:f0].clone() for k, v in clf._params().items()}
    clf.fit_task(stream.tasks[1], stream_tasks=2)
    for k, v in clf._params().items():
        assert torch.equal(v[s0:f0], past[k])  # task 0's components never move again
    assert clf.span(1) == (f0, 2 * f0)


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("method", BASELINE_METHODS)
def test_every_baseline_runs(method: str, tmp_path: Path) -> None:
    out = tmp_path / method
    backbone = "vit_ti16" if method in PROMPT_METHODS else "mobilenet_v2"
    argv = ["run", "--benchmark", "quickstart", "--method", method, "--out", str(out), "-q",
            "--backbone", backbone, "--set", "backbone.pretrained=false", "--set", "backbone.img_size=32",
            "--set", "train.epochs=1", "--set", "benchmark.num_tasks=2",
            "--set", "benchmark.max_train_per_class=8", "--set", "baseline.pool_size=20",
            *(["--set", "baseline.ca_epochs=2"] if method in ("tuna", "mos") else []),
            *(["--set", "baseline.hidden=64", "--set", "baseline.drift_epochs=2"] if method == "moal"
              else [])]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == method and res["num_tasks"] == 2 and len(res["avg_acc"]) == 2
    # S-Prompt (its K-Means keys), HiDe-Prompt (its TII), TUNA and TOSCA (entropy) and MOS (self-refinement)
    # retrieve a task per input; the others none
    assert (res["retrieval_acc"] is None) == (method not in RETRIEVING)
    assert res["forgetting"] is not None
    assert (out / "split.json").is_file()
    # one persistence layer: the baseline's learned tensors are its knowledge base's head object
    kb = KnowledgeBase.open(out / "kb")
    head = kb.manifest["head"]
    assert head["meta"]["method"] == method and len(head["meta"]["task_classes"]) == 2
    tensors = kb.read(head["object"], head["sha256"])
    assert {"head.0.weight", "head.1.weight"} <= set(tensors)
    assert [t["classes"] for t in kb.manifest["tasks"]] == head["meta"]["task_classes"]
    assert res["kb_bytes"]["head"] == res["model_bytes"] > 0


def test_cosine_schedule_as_the_released_loops_step_it() -> None:
    """CODA-Prompt's / InfLoRA's CosineSchedule resets its step count after construction: lr, lr, then
    cos(99 pi (e - 1) / (200 (E - 1))); the last of 20 epochs runs at 9.7 % of lr."""
    from proteus.baselines.learner import epoch_lr

    lrs = [epoch_lr(1.0, "cosine", e, 20) for e in range(20)]
    assert lrs[0] == lrs[1] == 1.0 and lrs[2] == pytest.approx(0.9967, abs=1e-4)
    assert lrs[-1] == pytest.approx(0.0974, abs=1e-3)
    assert epoch_lr(1.0, "constant", 7, 20) == 1.0


@pytest.mark.parametrize("method", ["inflora", "dualprompt"])
def test_a_failed_task_leaves_the_learner_as_it_was(method: str, stream, monkeypatch) -> None:
    clf = build_learner(_cfg(method), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = _batch(clf, stream)
    before = clf.logits_prefix(z)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.Adam, "step", boom)
    with pytest.raises(KeyboardInterrupt):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and clf.labels_ == list(stream.tasks[0].classes)
    torch.testing.assert_close(clf.logits_prefix(z), before)
    clf.fit_task(stream.tasks[1], stream_tasks=2)  # and the task can be learned again
    assert clf.num_tasks == 2


def test_every_perturbation_of_the_side_by_side_checks_finds_its_code() -> None:
    """tools/baseline_checks/perturb.py edits our baselines' code by text: each text is still there once
    (a refactor that moves it would leave a perturbation that can no longer be applied)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "tools" / "baseline_checks" / "perturb.py"
    p = subprocess.run([sys.executable, str(script), "--texts"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
