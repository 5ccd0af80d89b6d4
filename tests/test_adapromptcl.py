"""AdaPromptCL (proteus.baselines.adapromptcl): the semantic grouping of warm-up prompts (BIRCH assign, the
post-merge BIRCH and K-Means refinement) on constructed vectors; the learner around it -- the head restored
after the warm-up, the group's prompt trained when a task joins a group, merged prompts copied from their
base, test-time selection by the keys' cosine, a failed task rolled back; the grouping persisted in the
knowledge base; and the method end to end through ``proteus run`` on a three-task stream.

Tiny settings: a random ViT-Ti at 32 px, a six-class folder stream of three tasks (6 images per class),
one epoch after each warm-up. Where the learner's decisions are tested, the warm-up vectors are replaced
by constructed ones (the warm-up itself still runs), so each test decides what it checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import proteus.baselines.adapromptcl as ada
from proteus.baselines.adapromptcl import (
    AdaPromptCL,
    SemanticGroups,
    distinct_partitions,
    kmeans_counts,
    warmup_vector,
)
from proteus.cli import main
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from tiny import folder_args, folder_cfg, folder_stream, make_tree, write_spec

TASKS = [["a", "b"], ["c", "d"], ["e", "f"]]


def ang(deg: float, d: int = 8) -> np.ndarray:
    """A unit vector at ``deg`` degrees in the plane of the first two axes."""
    v = np.zeros(d)
    v[0], v[1] = np.cos(np.deg2rad(deg)), np.sin(np.deg2rad(deg))
    return v


def groups(**kw) -> SemanticGroups:
    return SemanticGroups(**{"remerge_samples": 100, "kmeans_run": 10, **kw})


# ------------------------------------------------------------------ the grouping on constructed vectors
@pytest.mark.parametrize("dist,kind", [(0.78, "shared"), (0.82, "specific")])
def test_birch_threshold_decides_join_or_open(dist: float, kind: str) -> None:
    """Two unit vectors ``dist`` apart form a subcluster of radius dist / 2: under converge_thrh 0.4 they
    join (the second task trains the first one's prompt); over it the second opens its own group."""
    g = groups(mergable=False)
    theta = np.rad2deg(2 * np.arcsin(dist / 2))
    assert g.assign(0, ang(0), cand_pid=0, n_prompts=1).kind == "first"
    d = g.assign(1, ang(theta), cand_pid=1, n_prompts=2)
    assert d.kind == kind and d.new_prompts == []
    assert d.train_pids == ([0] if kind == "shared" else [1])
    assert g.inference_pids == ([0] if kind == "shared" else [0, 1])


def test_close_vectors_share_a_group_a_far_one_opens_a_new_one() -> None:
    g = groups()
    ds = [g.assign(t, ang(a), cand_pid=10 + t, n_prompts=10 + t) for t, a in enumerate([0, 20, 90])]
    assert [d.kind for d in ds] == ["first", "shared", "specific"]
    assert [d.train_pids for d in ds] == [[10], [10], [12]]  # task 1: task 0's candidate, the group's
    assert g.converged == [10, 10, 12] and g.inference_pids == [10, 12]
    assert g.fine_labels()[0] == g.fine_labels()[1] != g.fine_labels()[2]


def test_postmerge_birch_and_kmeans_refine_the_groups() -> None:
    """0, 60 and 30 degrees: 60 is too far for the fine tree (radius 0.5 > 0.4) but within the post-merge
    tree (0.5 < 0.6), so task 1 is a merge candidate; 30 joins 0's fine cluster and re-clustering the
    three finds the two-cluster partitions {0, 2}{1} and {0}{1, 2} (BIRCH orderings; the best silhouette
    is at 2 clusters) and the singletons (K-Means with 3 clusters). Each keeps the earlier blocks {0} and
    {1}, so task 2 adds the blocks {0, 2} and {1, 2} (new prompts copied from 0's and 1's) and {2} (its own
    candidate), and trains all three."""
    g = groups()
    d0 = g.assign(0, ang(0), 0, 1)
    d1 = g.assign(1, ang(60), 1, 2)
    assert (d0.kind, d1.kind, d1.train_pids) == ("first", "merge", [1])
    d2 = g.assign(2, ang(30), 2, 3)
    assert d2.kind == "merge" and d2.group_task == 0  # the fine tree alone would have shared task 0's
    assert d2.new_prompts == [(3, 0), (4, 1)] and d2.train_pids == [3, 4, 2]
    assert [sorted(b) for b in g.blocks] == [[0], [1], [0, 2], [1, 2], [2]]
    assert g.block_pid[frozenset({0, 2})] == 3 and g.block_pid[frozenset({1, 2})] == 4
    assert g.reduce_hist[2] == (2, [frozenset({0, 2}), frozenset({1})])  # the fewest-cluster partition
    assert g.converged == [0, -1, -1] and g.reclustered == [3, 1]
    assert 3 in g.inference_pids and 4 not in g.inference_pids

    # without K-Means' extra counts only the BIRCH partitions add blocks
    g = groups(kmeans_top_n=0)
    for t, a in enumerate([0, 60, 30]):
        d = g.assign(t, ang(a), t, 3)
    assert d.train_pids == [3, 4] and frozenset({2}) not in g.blocks

    # a tighter post-merge threshold (0.45 < 0.5): no merge candidates, the fine tree decides
    g = groups(postmerge_thrh=0.45)
    kinds = [g.assign(t, ang(a), t, 3).kind for t, a in enumerate([0, 60, 30])]
    assert kinds == ["first", "specific", "shared"] and g.blocks == [frozenset({0})]


def test_kmeans_counts_follow_the_best_silhouette() -> None:
    """K-Means runs with the kmeans_top_n counts above the best mean silhouette's (first on ties), else
    above the fewest BIRCH clusters; never more clusters than candidates."""
    sil = {2: [0.1, 0.3], 3: [0.5], 4: [0.2]}
    assert kmeans_counts(sil, fewest=2, n=6, top_n=2) == [4, 5]
    assert kmeans_counts({2: [0.4], 3: [0.4]}, fewest=2, n=6, top_n=2) == [3, 4]
    assert kmeans_counts({}, fewest=2, n=6, top_n=2) == [3, 4]
    assert kmeans_counts(sil, fewest=2, n=4, top_n=2) == [4] and kmeans_counts({}, 1, 2, 2) == [2]


def test_distinct_partitions_ignore_label_names() -> None:
    labs = [np.array([1, 1, 0]), np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([2, 2, 2])]
    out = distinct_partitions(labs)
    assert [o.tolist() for o in out] == [[0, 0, 1], [0, 1, 1], [2, 2, 2]]


def test_warmup_vector_is_the_normalised_mean() -> None:
    p = torch.randn(5, 2, 8, 12)
    v = warmup_vector(p)
    assert v.dtype == np.float64 and v.shape == (12,)
    np.testing.assert_allclose(v, F.normalize(p.mean((0, 1, 2)), dim=0).numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the learner
@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("ada")
    return make_tree(root / "data"), write_spec(root / "tasks.yaml", TASKS)


def _cfg(tree, *extra: str):
    cfg = folder_cfg(*tree, "train.batch_size=8", "backbone.adapt_last=null", *extra, method="adapromptcl")
    return cfg


class Recorder:
    """Fits a learner with constructed warm-up vectors and records, per task, the head at creation and
    after each ``load_state_dict``, and the pool (prompts, keys) and head at the grouping."""

    def __init__(self, clf: AdaPromptCL, angles: list[float], monkeypatch) -> None:
        self.clf, self.heads, self.loads, self.at_assign = clf, [], [], []
        d = clf.embed_dim if hasattr(clf, "backbone_") else 192
        vectors = iter([ang(a, d) for a in angles])
        monkeypatch.setattr(ada, "warmup_vector", lambda prompt: next(vectors))
        make_head = clf.new_head

        def new_head(n):  # noqa: ANN001, ANN202
            h = make_head(n)
            self.heads.append(self._copy(h))
            self.loads.append([])
            load = h.load_state_dict

            def spy(sd, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                out = load(sd, *a, **k)
                self.loads[-1].append(self._copy(h))
                return out

            h.load_state_dict = spy  # type: ignore[method-assign]
            self.head = h
            return h

        clf.new_head = new_head  # type: ignore[method-assign]
        self.record_assign(monkeypatch)

    @staticmethod
    def _copy(h) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {k: v.detach().clone() for k, v in h.state_dict().items()}

    def fit(self, stream, k: int) -> dict:
        return self.clf.fit_task(stream.tasks[k], stream_tasks=len(stream.tasks)).extra

    def record_assign(self, monkeypatch) -> None:
        assign = SemanticGroups.assign

        def spy(groups, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            pool = [p.detach().clone() for p in self.clf.pool_]
            keys = [q.detach().clone() for q in self.clf.keys_]
            self.at_assign.append((pool, keys, self._copy(self.head)))
            return assign(groups, *a, **kw)

        monkeypatch.setattr(SemanticGroups, "assign", spy)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def fitted(tree):
    """Three tasks whose warm-up vectors are 0, 20 and 90 degrees apart: first, shared, specific."""
    mp = pytest.MonkeyPatch()
    cfg = _cfg(tree)
    clf = build_learner(cfg, progress=False)
    assert isinstance(clf, AdaPromptCL)
    rec = Recorder(clf, [0, 20, 90], mp)
    stream = folder_stream(cfg)
    stats = [rec.fit(stream, k) for k in range(3)]
    mp.undo()
    return clf, rec, stats, stream


def test_head_restored_after_the_warm_up(fitted) -> None:
    clf, rec, stats, _ = fitted
    for k in (1, 2):
        init, (at_assign_head) = rec.heads[k], rec.at_assign[k][2]
        assert not _same(at_assign_head, init)  # the warm-up trained the head ...
        assert len(rec.loads[k]) == 1 and _same(rec.loads[k][0], init)  # ... then it is restored, bit-equal
    # task 0: no restore (the release's ``task_id > 0``) and no epoch after its warm-up (left_1Tepochs 0)
    assert rec.loads[0] == [] and _same(clf.heads_[0].state_dict(), rec.at_assign[0][2])
    assert [s["epochs_after_warmup"] for s in stats] == [0, 1, 1]
    assert [s["group"] for s in stats] == ["first", "shared", "specific"]
    W = clf.evolve_epoch + 1
    assert W == 3 and stats[0]["steps"] == W * 2 and stats[1]["steps"] == (W + 1) * 2  # 12 images, batch 8


def test_a_joining_task_trains_the_groups_prompt_not_a_new_one(fitted) -> None:
    clf, rec, stats, _ = fitted
    pool1, keys1, _ = rec.at_assign[1]
    assert len(clf.pool_) == 3 and stats[1]["prompts"] == [0]
    assert not torch.equal(clf.pool_[0].detach(), pool1[0])  # the group's prompt moved in task 1
    assert not torch.equal(clf.keys_[0].detach(), keys1[0])  # and its key was pulled
    pool2, keys2, _ = rec.at_assign[2]
    assert torch.equal(pool2[1], pool1[1]) and torch.equal(
        keys2[1], keys1[1]
    )  # candidate 1 left as warmed up
    # every candidate starts from the same draw (prompt_same_init), and a specific task trains its own
    assert not torch.equal(pool1[1], clf.init_prompt_) and stats[2]["prompts"] == [2]
    assert torch.equal(clf.pool_[0].detach(), pool2[0]) and not torch.equal(clf.pool_[2].detach(), pool2[2])
    assert clf.groups_.inference_pids == [0, 2]
    assert not any(p.requires_grad for p in [*clf.pool_, *clf.keys_, *clf.heads_.parameters()])


def test_selection_by_cosine_to_the_keys_of_the_prompts_in_use(fitted) -> None:
    clf, _, _, stream = fitted
    z, _ = clf.prefix_dataset(stream.tasks[2].test)
    q = clf.query(z)
    keys = [k.detach().clone() for k in clf.keys_]
    try:
        with torch.no_grad():
            clf.keys_[1].copy_(q[0])  # candidate 1 is not in use: never chosen, however close
            clf.keys_[2].copy_(q[0] * 3)  # the direction counts, not the norm
            clf.keys_[0].copy_(-q[0])
        sel = clf.select(q)
        assert sel[0] == 2 and set(sel.tolist()) <= {0, 2}
        sim = F.normalize(q, dim=-1) @ F.normalize(torch.stack([clf.keys_[0], clf.keys_[2]]), dim=-1).T
        assert torch.equal(sel, torch.tensor([0, 2])[sim.argmax(1)])
        logits = clf.logits_prefix(z)  # one head over every seen class, under the selected prompt
        with torch.no_grad():
            h = clf.prompted(z, sel)
            own = torch.cat([head(h) for head in clf.heads_], 1)
        torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5)
        assert logits.shape == (len(z), 6)
    finally:
        with torch.no_grad():
            for k, old in zip(clf.keys_, keys):
                k.copy_(old)


def test_state_carries_the_groups(fitted) -> None:
    clf = fitted[0]
    st = clf.state()
    meta, tensors = st.head
    assert meta["method"] == "adapromptcl" and meta["groups"] == clf.groups_.to_meta()
    assert [r["prompt_group"]["kind"] for r, _ in st.tasks] == ["first", "shared", "specific"]
    assert {"e.0", "e.2", "key.2"} <= {k.removeprefix("prompt.") for k in tensors}
    assert tuple(tensors["prompt.e.0"].shape) == (5, 2, 8, 192)  # blocks 0-4, key/value, length 8
    back = SemanticGroups.from_meta(
        json.loads(json.dumps(meta["groups"])), [tensors[f"warmup.{t}"].numpy() for t in range(3)]
    )
    assert back.to_meta() == clf.groups_.to_meta()
    np.testing.assert_array_equal(back.fine_labels(), clf.groups_.fine_labels())


def test_merged_prompts_are_copied_from_their_base_and_trained(tree, monkeypatch) -> None:
    cfg = _cfg(tree, "baseline.remerge_samples=100", "baseline.kmeans_run=10")
    clf = build_learner(cfg, progress=False)
    rec = Recorder(clf, [0, 60, 30], monkeypatch)
    stream = folder_stream(cfg)
    stats = [rec.fit(stream, k) for k in range(3)]
    assert [s["group"] for s in stats] == ["first", "merge", "merge"]
    assert stats[2]["prompts"] == [3, 4, 2] and len(clf.pool_) == 5
    pool2, keys2, _ = rec.at_assign[2]
    for new, base in ((3, 0), (4, 1)):
        assert torch.equal(clf.pool_[base].detach(), pool2[base])  # the bases stay as they were
        assert not torch.equal(clf.pool_[new].detach(), pool2[base])  # the copies were trained on
        assert (clf.pool_[new].detach() - pool2[base]).abs().max() < 0.2  # ... starting from their base
    assert clf.groups_.inference_pids == [0, 1, 3]


def test_reinit_clf_trains_the_head_in_the_last_epochs_only(tree, monkeypatch) -> None:
    cfg = _cfg(tree, "train.epochs=2", "baseline.head_last_epochs=1")
    clf = build_learner(cfg, progress=False)
    rec = Recorder(clf, [0, 90], monkeypatch)
    stream = folder_stream(cfg)
    stats = [rec.fit(stream, k) for k in range(2)]
    assert stats[1]["group"] == "specific" and stats[1]["epochs_after_warmup"] == 2
    # restored after the warm-up, reset again one epoch before the end
    assert len(rec.loads[1]) == 2 and all(_same(s, rec.heads[1]) for s in rec.loads[1])
    assert not _same(clf.heads_[1].state_dict(), rec.heads[1])


def test_a_failed_task_gives_back_the_shared_prompt(tree, monkeypatch) -> None:
    cfg = _cfg(tree)
    clf = build_learner(cfg, progress=False)
    rec = Recorder(clf, [0, 20, 20], monkeypatch)
    stream = folder_stream(cfg)
    rec.fit(stream, 0)
    before = [p.detach().clone() for p in clf.pool_], clf.groups_.to_meta()
    z, _ = clf.prefix_dataset(stream.tasks[0].test)
    logits = clf.logits_prefix(z)
    step, calls = torch.optim.Adam.step, []

    def boom(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) > 7:  # after the warm-up's six steps and one of the shared prompt's
            raise KeyboardInterrupt
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", boom)
    with pytest.raises(KeyboardInterrupt):
        rec.fit(stream, 1)
    monkeypatch.setattr(torch.optim.Adam, "step", step)
    assert clf.num_tasks == 1 and len(clf.pool_) == 1 and clf.groups_.to_meta() == before[1]
    assert torch.equal(clf.pool_[0].detach(), before[0][0]) and not clf.pool_[0].requires_grad
    torch.testing.assert_close(clf.logits_prefix(z), logits)
    assert rec.fit(stream, 1)["group"] == "shared"  # and the task can be learned again


def test_refuses_a_backbone_without_tokens(tree) -> None:
    cfg = _cfg(tree)
    cfg.backbone.name = "mobilenet_v2"
    with pytest.raises(ValueError, match="adapromptcl is a prompt method: it needs a backbone with tokens"):
        build_learner(cfg, progress=False)._build()


def test_released_settings() -> None:
    from proteus.experiment import resolve_config

    cfg = resolve_config("quickstart", method="adapromptcl")
    b = AdaPromptCL(cfg, progress=False).options_
    assert (b.optimizer, b.lr, b.schedule, b.clip_grad, b.match_weight) == (
        "adam",
        0.0125,
        "constant",
        1.0,
        1.0,
    )
    assert (b.pool_size, b.prompt_length, b.prompt_layers) == (300, 8, [0, 1, 2, 3, 4])
    cfg = resolve_config("imagenet-r", method="adapromptcl", config_files=["adapromptcl-imagenet-r"])
    assert AdaPromptCL(cfg, progress=False).evolve_epoch == 7
    cfg = resolve_config("cifar100", method="adapromptcl", config_files=["adapromptcl-cifar100"])
    assert AdaPromptCL(cfg, progress=False).evolve_epoch == 2 and cfg.train.epochs == 50


# ------------------------------------------------------------------ end to end
def test_run_through_the_cli_writes_results_and_the_groups(tree, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["run", *folder_args(*tree), "--method", "adapromptcl", "--out", str(out), "-q",
            "--backbone", "vit_ti16", "--device", "cpu", "--set", "backbone.pretrained=false",
            "--set", "backbone.img_size=32", "--set", "train.epochs=1", "--set", "train.batch_size=8",
            "--set", "baseline.pool_size=20", "--set", "baseline.remerge_samples=100",
            "--set", "baseline.kmeans_run=10"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == "adapromptcl" and res["num_tasks"] == 3 and len(res["avg_acc"]) == 3
    assert res["retrieval_acc"] is None and res["forgetting"] is not None
    kb = KnowledgeBase.open(out / "kb")
    head = kb.manifest["head"]
    meta = head["meta"]
    assert meta["method"] == "adapromptcl" and len(meta["task_classes"]) == 3
    g = meta["groups"]
    assert len(g["cand_pid"]) == len(g["converged"]) == len(g["kinds"]) == 3 and g["inference_pids"]
    assert [t["prompt_group"]["kind"] for t in kb.manifest["tasks"]] == g["kinds"]
    tensors = kb.read(head["object"], head["sha256"])
    assert {"head.0.weight", "head.2.weight", "warmup.0", "warmup.2", "prompt.e.0", "prompt.key.0"} <= set(
        tensors
    )
    back = SemanticGroups.from_meta(g, [tensors[f"warmup.{t}"].numpy() for t in range(3)])
    assert back.to_meta() == g


def test_compare_runs_it_beside_another_baseline(tree, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", *folder_args(*tree), "--methods", "adapromptcl,ncm", "--seeds", "0", "--out", str(out),
            "-q", "--backbone", "vit_ti16", "--device", "cpu", "--set", "backbone.pretrained=false",
            "--set", "backbone.img_size=32", "--set", "train.epochs=1", "--set", "train.batch_size=8",
            "--set", "baseline.pool_size=20", "--set", "report.figures=false",
            "--set", "baseline.remerge_samples=100", "--set", "baseline.kmeans_run=10",
            "--set", "report.latency=false"]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((out / "compare.json").read_text())
    assert (
        rep["methods"] == ["adapromptcl", "ncm"]
        and rep["summary"]["adapromptcl"]["retrieval_acc"]["mean"] is None
    )
