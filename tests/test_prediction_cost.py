"""Prediction whose cost does not grow with m (issue 14): merged and factored adapter forwards agree, the
staged routes (keys in one space; a candidate shortlist) predict what the m-forward path predicts, and
images stream through ``proteus.experiment.batches.predict_images``. No timing is asserted (tools/perf
measures it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from proteus import Proteus
from proteus.adapters import AdaptedBackbone, LoRAWrapper
from proteus.adapters.lora import Composed, LoRAUnit, MergedCache, set_composition, sparse_columns
from proteus.backbones import build_backbone
from proteus.config import ConfigError, resolve_config
from proteus.engine.embedder import suffix_peak_bytes
from proteus.experiment.predictions import predict_images
from proteus.streams import build_benchmark
from tiny import TINY_SETS

SETS = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}


def _add_tasks(model: AdaptedBackbone, m: int, seed: int = 0) -> None:
    """m tasks with non-zero B and S (the state training leaves, without training)."""
    g = torch.Generator().manual_seed(seed)
    while model.num_tasks < m:
        model.begin_task(4, "learned", True, seed=seed + model.num_tasks)
        with torch.no_grad():
            for u in model.units.values():
                assert u.B_new is not None
                u.B_new.normal_(0, 0.05, generator=g)
                if u.s is not None:
                    u.s.normal_(0, 0.5, generator=g)
        model.end_task()


def _add_unit_tasks(w: LoRAWrapper, m: int) -> None:
    """m tasks of rank 2 on every unit of ``w``, with non-zero B and S (seed 0)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(m):
        for u in w.units.values():
            u.begin_task(2, "learned", True, g)
            with torch.no_grad():
                u.B_new.normal_(generator=g)
                if u.s is not None:
                    u.s.normal_(generator=g)
            u.end_task()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------------------------- merged weights
# a linear map, and 1x1 maps over fewer and over at least 16 positions
@pytest.mark.parametrize(("conv", "side"), [(False, 0), (True, 3), (True, 5)])
def test_merged_map_is_w0_plus_eq9_update(conv: bool, side: int) -> None:
    torch.manual_seed(0)
    base = nn.Conv2d(6, 10, 1) if conv else nn.Linear(6, 10)
    w = LoRAWrapper(base, {"q": (0, 4), "v": (6, 10)} if not conv else {}, 1.5)
    _add_unit_tasks(w, 3)
    W = w.merged_weights([2, 0])
    for W_k, k in zip(W, (2, 0)):
        ref = base.weight.detach().reshape(10, 6).clone()
        for u, (s, e) in zip(w.units.values(), w.slices.values()):
            ref[s:e] += 1.5 * u.B @ torch.diag(u.C[k]) @ u.A.T  # Eq. 9
        assert torch.allclose(W_k, ref, atol=1e-6)
    x = torch.randn(6, 6, side, side) if conv else torch.randn(6, 5, 6)
    outs = {}
    for merged in (False, True):
        for u in w.units.values():
            u.composed = None if merged else Composed(u.coefficients([2, 0, 1]))
        w.groups, w.merged = 3, ([2, 0, 1], "task") if merged else None
        outs[merged] = w(x)
    assert _rel(outs[True], outs[False]) < 1e-5


@pytest.mark.parametrize("side", [3, 5])
def test_the_factored_1x1_update_runs_no_convolution(side: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1x1 map's factored update is two matrix products, equal to the two 1x1 convolutions it replaces:
    oneDNN compiles and caches kernels per convolution shape, and the composed columns grow with every task
    (docs/performance.md, "`long-300`")."""
    torch.manual_seed(0)
    w = LoRAWrapper(nn.Conv2d(6, 10, 1), {}, 1.0)
    _add_unit_tasks(w, 3)
    u = next(iter(w.units.values()))
    coef = u.coefficients([2, 0, 1])
    u.composed = Composed(coef)
    x = torch.randn(6, 6, side, side)
    cols = coef.shape[1]
    conv = torch.nn.functional.conv2d(x, u.A[:, :cols].T[:, :, None, None]).unflatten(0, (3, -1))
    conv = torch.nn.functional.conv2d((conv * coef[:, None, :, None, None]).flatten(0, 1),
                                      u.B[:, :cols, None, None])  # fmt: skip

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a convolution in the factored update")

    monkeypatch.setattr(torch.nn.functional, "conv2d", refused)
    monkeypatch.setattr(torch, "conv2d", refused)
    d = u.delta_conv(x, 3)
    assert d is not None and _rel(d, conv) < 1e-5


@pytest.mark.parametrize("name", ["mobilenet_v2", "vit_ti16"])
def test_merged_and_factored_backbones_agree(name: str) -> None:
    torch.manual_seed(0)
    model = AdaptedBackbone(build_backbone(name, pretrained=False, img_size=32)).eval()  # every block adapted
    _add_tasks(model, 10)  # m x r = 40: wider than MobileNetV2's early 1x1 convs
    z = model.prefix(torch.randn(3, 3, 32, 32))
    out = {}
    with torch.no_grad():
        for mode in ("never", "always", "auto"):
            model.merge = mode
            out[mode] = model.suffix(z, list(range(10)))
    assert _rel(out["always"], out["never"]) < 1e-4 and _rel(out["auto"], out["never"]) < 1e-4
    if name == "mobilenet_v2":  # the narrow early maps run merged, and their weights are cached
        assert "blocks.0.conv.1" in model.merge_plan() and model.merged_nbytes() > 0
    # each input under its own task in one forward: the same as its row of the m-group forward
    t = torch.tensor([7, 0, 7])
    with torch.no_grad():
        each = model.suffix_each(z, t)
    assert _rel(each, out["never"][t, torch.arange(3)]) < 1e-4
    # a rolled-back task's merged weights are dropped: a new task 10 is merged afresh
    model.truncate(9)
    assert model.merged_nbytes() == 0
    _add_tasks(model, 10, seed=99)
    with torch.no_grad():
        model.merge = "always"
        merged = model.suffix(z, [9])
        model.merge = "never"
        factored = model.suffix(z, [9])
    assert _rel(merged, factored) < 1e-4


def test_merge_budget_limits_the_cache() -> None:
    model = AdaptedBackbone(build_backbone("mobilenet_v2", pretrained=False, img_size=32))
    _add_tasks(model, 10)
    model.merge_budget_bytes = 0
    assert model.merge_plan() == []
    model.merge_budget_bytes = None
    assert len(model.merge_plan()) > 0


def test_an_evicted_merged_weight_frees_its_memory() -> None:
    """Weights merged together in one batched product are cached each in its own storage: evicting one
    frees it, so the memory the cache keeps alive is what it counts against its budget."""
    torch.manual_seed(0)
    w = LoRAWrapper(nn.Linear(16, 24), {}, 1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        for u in w.units.values():
            u.begin_task(2, "learned", True, g)
            u.end_task()
    w.cache = MergedCache(budget=3 * w.merged_bytes_per_task())
    w.merged_weights([0, 1, 2])  # one batched product
    w.merged_weights([3])  # task 0 evicted (least recently used)
    held = {e.untyped_storage().data_ptr(): e.untyped_storage().nbytes() for e in w.cache.entries.values()}
    assert sorted(k[2] for k in w.cache.entries) == [1, 2, 3]
    assert sum(held.values()) == w.cache.nbytes == 3 * w.merged_bytes_per_task()


def test_merged_cache_stays_within_its_budget_at_m_100() -> None:
    """100 tasks (rank 1 each): whatever a forward asks for, the cache holds at most the budget between
    forwards (least recently used out first), the maps beyond it run factored, and the result is the
    factored one's to round-off."""
    torch.manual_seed(0)
    model = AdaptedBackbone(build_backbone("mobilenet_v2", pretrained=False, img_size=32)).eval()
    g = torch.Generator().manual_seed(1)
    while model.num_tasks < 100:
        model.begin_task(1, "learned", True, seed=model.num_tasks)
        with torch.no_grad():
            for u in model.units.values():
                u.B_new.normal_(0, 0.05, generator=g)  # type: ignore[union-attr]
        model.end_task()
    per_task = sum(model.wrappers[n].merged_bytes_per_task() for n in model.merge_plan())
    model.merge_budget_bytes = budget = 5 * per_task  # room for 5 tasks' merged weights of every map
    z = model.prefix(torch.randn(8, 3, 32, 32))
    t = torch.tensor([3, 97, 3, 50, 12, 97, 64, 0])
    with torch.no_grad():
        each = model.suffix_each(z, t)  # 6 distinct tasks: the costliest maps merged, the rest factored
        assert 0 < model.merged_nbytes() <= budget
        all_m = model.suffix(z[:2], list(range(100)))  # every task at once: beyond the budget, factored
        assert model.merged_nbytes() <= budget
        few = model.suffix(z[:2], [5, 6])  # two tasks fit: merged, the older entries evicted
        assert model.merged_nbytes() <= budget and {k[2] for k in model.merged_cache.entries} >= {5, 6}
        model.merge = "never"
        ref_each, ref_all, ref_few = (
            model.suffix_each(z, t),
            model.suffix(z[:2], list(range(100))),
            model.suffix(z[:2], [5, 6]),
        )
    assert _rel(each, ref_each) < 1e-4 and _rel(all_m, ref_all) < 1e-4 and _rel(few, ref_few) < 1e-4


# ---------------------------------------------------------------------------------- staged prediction
def _fit(method: str, **extra: object) -> tuple[Proteus, torch.Tensor]:
    sets = {**SETS, "benchmark.max_train_per_class": 30, **extra}
    clf = Proteus.from_method(method, progress=False, **sets)
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:3]:
        clf.fit_task(task)
    x = clf.transform_images([stream.tasks[t].test[i][0] for t in (0, 1, 2) for i in range(6)])
    return clf, x


def _same(pred, ref) -> None:  # noqa: ANN001
    assert torch.equal(pred.task, ref.task) and torch.equal(pred.label, ref.label)
    assert torch.allclose(pred.score.double(), ref.score.double(), rtol=1e-4, atol=1e-4)
    assert torch.allclose(pred.logits, ref.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("proteus", {}),
        ("proteus-lda", {}),
        ("proteus-flda", {}),
        ("proteus", {"signature.keys": "frozen"}),
        ("proteus-lda", {"head.scope": "task"}),
        ("proteus-lda", {"head.scope": "task", "retrieval.combine": "soft"}),
        ("proteus-flda", {"retrieval.combine": "soft", "retrieval.soft_top": 3}),
    ],
)
def test_keys_in_one_space_predict_as_the_m_forward_path(method: str, extra: dict) -> None:
    clf, x = _fit(method, **extra)
    assert clf.parts_.route == "one-space"
    _same(clf.predict(x), clf.predict_embedded(*clf.embed(x)))
    _same(clf.predict(x, num_tasks=2), clf.predict_embedded(*clf.embed(x, 2)))


@pytest.fixture(scope="module")
def shortlisted() -> tuple[Proteus, torch.Tensor]:
    return _fit("proteus-dpgmm", **{"retrieval.candidates": 2})


def test_candidates_predict_as_the_shortlist_rule_and_all_candidates_as_the_paper(
    shortlisted: tuple[Proteus, torch.Tensor],
) -> None:
    clf, x = shortlisted
    assert clf.parts_.route == "candidates"
    pred = clf.predict(x)
    _same(pred, clf.predict_embedded(*clf.embed(x)))  # the rule is the same on the cached H
    assert (pred.score.isfinite()).all()
    keys = clf.keys_
    keys.candidates = 3  # every task a candidate: exactly the paper's retrieval
    with_all = clf.predict(x)
    keys.candidates = None
    assert clf.parts_.route == "all-adapters"
    _same(with_all, clf.predict(x))
    keys.candidates = 2


def test_cheap_keys_are_stored_in_the_knowledge_base(
    shortlisted: tuple[Proteus, torch.Tensor], tmp_path: Path
) -> None:
    clf, x = shortlisted
    clf.save(tmp_path / "kb")
    back = Proteus.load(tmp_path / "kb")
    assert back.parts_.route == "candidates"
    _same(back.predict(x), clf.predict(x))


def test_embedding_chunks_over_tasks_and_images(shortlisted: tuple[Proteus, torch.Tensor]) -> None:
    clf, x = shortlisted
    z = clf.embedder_.prefix(x)
    H = clf.embedder_.embed_prefix(z, [0, 1, 2], batch_size=8, shard=False)  # 8 images x 1 task a forward
    for t in range(3):
        assert torch.allclose(H[t], clf.embed_prefix(z, [t], shard=False)[0], rtol=1e-4, atol=1e-5)
    t = torch.tensor([2, 0, 1, 1] * (len(x) // 4) + [0] * (len(x) % 4))
    each = clf.embedder_.embed_each(z, t, batch_size=5)
    assert torch.allclose(each, H[t, torch.arange(len(x))], rtol=1e-4, atol=1e-5)


def test_cpu_chunks_follow_the_suffixs_largest_activation(shortlisted: tuple[Proteus, torch.Tensor]) -> None:
    """On a CPU the images per adapted forward are capped by ``cpu_chunk_bytes`` over the suffix's largest
    activation per image (measured once, in evaluation mode, every module's mode restored after); the
    embeddings do not depend on the cap beyond round-off."""
    clf, x = shortlisted
    E = clf.embedder_
    z = E.prefix(x)
    model = clf.model_
    model.backbone.train()
    modes = [m.training for m in model.backbone.modules()]
    E._peak_bytes.clear()
    peak = suffix_peak_bytes(model.backbone, z[:1])
    assert (
        peak >= z[:1].numel() * z.element_size() and [m.training for m in model.backbone.modules()] == modes
    )
    model.backbone.eval()
    saved = E.cpu_chunk_bytes
    try:
        E.cpu_chunk_bytes = 3 * peak
        assert E.images_per_forward(z) == min(3, E.batch_size)
        assert E.images_per_forward(z, batch_size=2) == 2
        calls: list[int] = []
        suffix = model.backbone.forward_suffix
        model.backbone.forward_suffix = lambda zz: (calls.append(zz.shape[0]), suffix(zz))[1]
        try:
            H3 = E.embed_prefix(z, [0, 1], shard=False)
        finally:
            del model.backbone.forward_suffix
        assert max(calls) <= 3 and sum(calls) == 2 * len(x)
        E.cpu_chunk_bytes = 2**62
        assert E.images_per_forward(z) == E.batch_size
        assert torch.allclose(H3, E.embed_prefix(z, [0, 1], shard=False), rtol=1e-4, atol=1e-5)
    finally:
        E.cpu_chunk_bytes = saved


def test_candidates_are_validated() -> None:
    with pytest.raises(ConfigError, match="retrieval.candidates"):
        resolve_config(sets=["retrieval.candidates=0"])
    with pytest.raises(ConfigError, match="retrieval.candidate_space"):
        resolve_config(sets=["retrieval.candidate_space=everywhere"])


# ---------------------------------------------------------------------------------- images
def test_predict_images_streams_batches(shortlisted: tuple[Proteus, torch.Tensor], tmp_path: Path) -> None:
    clf, _ = shortlisted
    stream = build_benchmark(clf.config.benchmark)
    files = []
    for i in range(5):
        path = tmp_path / f"{i}.png"
        stream.tasks[i % 3].test[i][0].save(path)
        files.append(str(path))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    items = files[:3] + [str(tmp_path / "bad.png")] + files[3:] + [Image.open(files[0]).convert("RGB")]
    batches = list(predict_images(clf, items, batch_size=2, progress=False, skip_unreadable=True))
    assert [len(b.files) + len(b.skipped) for b in batches] == [2, 2, 2, 1]
    assert batches[1].skipped[0][0].endswith("bad.png") and batches[-1].files == ["image 6"]
    assert batches[-1].done == 7 and batches[-1].predicted == 6 and batches[-1].images_per_second > 0
    labels = torch.cat([b.prediction.label for b in batches if b.prediction is not None])
    ims = [Image.open(f).convert("RGB") for f in files] + [Image.open(files[0]).convert("RGB")]
    assert torch.equal(labels, clf.predict(clf.transform_images(ims)).label)
    with pytest.raises(ValueError, match="bad.png"):
        list(predict_images(clf, items, batch_size=2, progress=False))


def _sparse_unit(conv: bool) -> tuple[LoRAWrapper, LoRAUnit]:
    """A wrapped map of 200 inputs whose 40 tasks (80 columns) each keep 2 old columns in S."""
    torch.manual_seed(0)
    base = nn.Conv2d(200, 12, 1) if conv else nn.Linear(200, 12)
    w = LoRAWrapper(base, {}, 1.0)
    g = torch.Generator().manual_seed(1)
    u = w.unit_list()[0]
    for _t in range(40):
        u.begin_task(2, "learned", True, g)
        with torch.no_grad():
            u.B_new.normal_(generator=g)
            if u.s is not None:
                u.s[torch.randperm(u.s.numel(), generator=g)[:2]] = torch.randn(2, generator=g)
        u.end_task()
    return w, u


@pytest.mark.parametrize("conv", [False, True])
def test_a_composition_runs_only_the_columns_its_s_keeps(conv: bool) -> None:
    """The elastic net of Eq. 15 zeroes most of S: a task's composition then runs its own directions and the
    few old ones its S keeps (at most half of 64 or more columns), not every older direction -- each group
    its own columns when the groups' union is over twice what any one keeps, else the union; factored and
    merged, the same update as over every column (the columns left out add exact zeros)."""
    w, u = _sparse_unit(conv)
    for tasks, per_group in (([39, 12, 39, 0], True), ([39, 39], False)):
        coef = u.coefficients(tasks)[:, : u.used_columns(tasks)]
        kept, cols = sparse_columns(coef)
        assert cols is not None and cols.ndim == (2 if per_group else 1)
        if per_group:  # each group: its own 2 + 2 columns at most, their coefficients, zeros after
            assert cols.shape == (len(tasks), 4) and torch.equal(kept, coef.gather(1, cols))
            assert torch.equal(kept.ne(0).sum(1), coef.ne(0).sum(1))
        else:
            assert len(cols) <= 2 * 4 and torch.equal(kept, coef[:, cols])
        full = (u.B[None, :, :80] * coef[:, None, :]) @ u.A[:, :80].T
        assert torch.allclose(u.merged_updates(tasks), full, rtol=1e-5, atol=1e-6)
        x = torch.randn(len(tasks) * 3, 200, *((5, 5) if conv else ()))
        w.groups = len(tasks)
        u.composed = Composed(kept, cols)
        sparse_out = w(x)
        u.composed = Composed(coef)
        assert torch.allclose(sparse_out, w(x), rtol=1e-5, atol=1e-5)
    dense = torch.ones(2, 80)  # every column used: nothing to leave out
    assert sparse_columns(dense)[1] is None  # every column kept
    assert sparse_columns(torch.ones(2, 30))[1] is None  # under 64 columns


@pytest.mark.parametrize("conv", [False, True])
def test_groups_of_few_positions_run_the_union_of_their_columns(conv: bool) -> None:
    """Where each group keeps its own columns, a forward over groups of few positions (one small image per
    task) runs the union of the groups' columns instead (gathering each group's columns would copy more than
    it saves: ``OWN_COLUMNS_MIN_WORK``), and groups of many positions their own; both the update over every
    column."""
    w, u = _sparse_unit(conv)
    tasks, sizes = [39, 12, 0, 25], [1, 2, 1, 1]
    coef = u.coefficients(tasks)[:, : u.used_columns(tasks)]
    set_composition(u, coef, sizes)
    composed = u.composed
    assert composed is not None and composed.cols is not None and composed.cols.ndim == 2
    assert composed.union is not None
    union = composed.union[0].shape[1]
    assert composed.form(1) is composed.union  # one position per group: the union
    assert composed.form(10_000)[1] is composed.cols  # many: each group its own
    rows = coef.repeat_interleave(torch.as_tensor(sizes), 0)
    w.groups, w.sizes = sum(sizes), sizes
    for positions in (1, 1600):  # per group: 1 (the union) and 1,600 (their own)
        side = math.isqrt(positions)
        x = torch.randn(sum(sizes), *((200, side, side) if conv else (positions, 200)))
        run = composed.form(positions)
        assert (run is composed.union) == (positions == 1)
        assert run[0].shape[1] == (union if positions == 1 else 4)
        u.composed = composed
        out = w(x)
        u.composed = Composed(rows)  # every column, no selection
        assert torch.allclose(out, w(x), rtol=1e-5, atol=1e-5)
