"""Within-task experts and the soft combination of task retrieval with the head (issue 23,
:mod:`proteus.engine.experts`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from proteus import Proteus
from proteus.config import ConfigError, RetrievalConfig, resolve_config
from proteus.engine.experts import TaskExperts, candidates, combine_soft, decide
from proteus.heads import RanPACHead
from proteus.signatures import RetrievalResult
from proteus.streams import build_benchmark
from tiny import TINY_SETS

SETS = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}


def _new_head(rp_dim: int | None = None) -> RanPACHead:
    return RanPACHead(8, rp_dim=0 if rp_dim is None else rp_dim, seed=0)


def _blobs(classes: list[int], n: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes).repeat_interleave(n)
    centres = torch.randn(max(classes) + 1, 8, generator=g) * 3
    return centres[y] + torch.randn(len(y), 8, generator=g), y


def test_an_expert_is_the_ridge_head_of_its_own_task_over_its_own_classes() -> None:
    ex = TaskExperts(_new_head)
    h, y = _blobs([3, 5, 4])
    e = ex.add_task(h, y, [3, 4, 5])
    ref = _new_head().update(h, torch.tensor([{3: 0, 4: 1, 5: 2}[int(c)] for c in y]), num_classes=3)
    assert torch.allclose(e.scores(h), ref.decision_function(h).float())
    h2, y2 = _blobs([0, 1], seed=1)
    ex.add_task(h2, y2, [0, 1])
    L = ex.logits(torch.cat([h[:4], h2[:4]]), torch.tensor([0] * 4 + [1] * 4), num_classes=6)
    assert torch.isinf(L[:4, [0, 1, 2]]).all() and torch.isfinite(L[:4, [3, 4, 5]]).all()
    assert torch.isinf(L[4:, 2:]).all() and torch.isfinite(L[4:, :2]).all()
    assert (L[:4].argmax(1) == y[:4]).all() and (L[4:].argmax(1) == y2[:4]).all()
    ex.truncate(1)
    assert len(ex) == 1


def test_a_batch_spread_over_tasks_is_each_rows_own_experts_scores() -> None:
    """Rows of many tasks, with different numbers of classes, scored in one batched product: each row gets
    exactly its own task's expert's scores (as scoring its rows task by task gives) in that task's columns,
    -inf elsewhere, whatever the order of the rows."""
    ex = TaskExperts(_new_head)
    tasks_classes = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9]]
    for i, cls in enumerate(tasks_classes):
        h, y = _blobs(cls if len(cls) > 1 else [*cls, *cls], seed=i)
        ex.add_task(h, torch.as_tensor(y), cls)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(23, 8, generator=g)
    tasks = torch.randint(0, len(tasks_classes), (23,), generator=g)
    L = ex.logits(h, tasks, num_classes=10)
    for i, t in enumerate(tasks.tolist()):
        cls = tasks_classes[t]
        assert torch.equal(L[i, cls], ex.experts[t].scores(h[i : i + 1])[0])
        assert torch.isinf(L[i, [c for c in range(10) if c not in cls]]).all()


def test_soft_combination_follows_a_sure_key_and_an_unsure_key_defers_to_the_heads() -> None:
    # two tasks: classes {0, 1} and {2, 3}; the input is under each candidate's adapter
    inf = float("-inf")
    scores = torch.tensor([[[2.0, 0.0, inf, inf], [inf, inf, 0.2, 0.1]]])  # task 0 sure of class 0
    cand = torch.tensor([[0, 1]])
    sure_of_1 = torch.tensor([[5.0, 0.0]])  # task scores, lower is better: task 1 far more likely
    out = combine_soft(sure_of_1, cand, scores, key_temperature=0.1, head_temperature=0.5)
    assert int(out.argmax(1)) == 2  # the key decides (the hard rule's answer)
    tied = torch.tensor([[0.0, 0.0]])
    out = combine_soft(tied, cand, scores, key_temperature=0.1, head_temperature=0.5)
    assert int(out.argmax(1)) == 0  # a tie: the surer head wins
    assert torch.isinf(out[0, [1, 3]]).logical_not().all()  # every candidate's classes are scored
    p = torch.softmax(out.double(), 1)
    assert torch.allclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))  # a joint posterior over classes


def test_decide_hard_is_alg2_and_soft_keeps_the_candidates_task() -> None:
    task_of = torch.tensor([0, 0, 1, 1])
    res = RetrievalResult(
        task=torch.tensor([1]), component=torch.tensor([0]), score=torch.tensor([0.5]),
        task_scores=torch.tensor([[0.51, 0.5]]),
    )  # fmt: skip
    H = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # (m, N, d): the input under each adapter

    def classify(h: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        out = torch.full((h.shape[0], 4), float("-inf"))
        for i, t in enumerate(tasks.tolist()):
            out[i, 2 * t : 2 * t + 2] = torch.tensor([3.0, 0.0]) if t == 0 else torch.tensor([0.1, 0.0])
        return out

    under = lambda cand: H[cand, torch.arange(1)[:, None]]  # noqa: E731
    hard = decide(res, under, classify, RetrievalConfig(combine="hard"), task_of)
    assert int(hard.task) == 1 and int(hard.task_scores.argmax(1)) == 2
    soft = decide(res, under, classify, RetrievalConfig(combine="soft", soft_top=2), task_of)
    assert int(soft.task) == 0 and int(soft.task_scores.argmax(1)) == 0
    assert float(soft.score) == pytest.approx(0.51)  # the score of the task that won
    assert candidates(torch.tensor([[0.3, 0.1, 0.2]]), 2).tolist() == [[1, 2]]


def _fit(tmp_path: Path | None = None, **extra: object) -> tuple[Proteus, torch.Tensor, object]:
    sets = {**SETS, "benchmark.max_train_per_class": 30, "signature.keys": "first-adapter-lda",
            "head.scope": "task", "retrieval.combine": "soft", **extra}  # fmt: skip
    clf = Proteus.from_method("proteus", progress=False, **sets)
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:3]:
        clf.fit_task(task)
    x = clf.transform_images([stream.tasks[t].test[i][0] for t in (0, 1, 2) for i in range(6)])
    return clf, x, stream


def test_task_heads_travel_with_their_tasks_in_the_knowledge_base(tmp_path: Path) -> None:
    clf, x, _ = _fit()
    clf.save(tmp_path / "kb")
    back = Proteus.load(tmp_path / "kb")
    assert len(back.heads_.experts) == 3
    a, b = clf.predict(x), back.predict(x)
    assert torch.equal(a.label, b.label) and torch.equal(a.task, b.task)
    assert torch.allclose(a.logits, b.logits)


def test_a_task_that_fails_leaves_no_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    clf, _, stream = _fit()

    def fail_after_the_head(name: str) -> None:
        if name == "learn:head":
            raise RuntimeError("fails after the head step")

    monkeypatch.setattr("proteus.core.parts.crash_point", fail_after_the_head)
    with pytest.raises(RuntimeError, match="after the head step"):
        clf.fit_task(stream.tasks[3])
    assert len(clf.heads_.experts) == clf.num_tasks == 3


def test_the_combination_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="head.scope=task .* need task retrieval, but retrieval.mode=first"):
        resolve_config(method="ranpac", dotted={"head.scope": "task"})
    with pytest.raises(ConfigError, match="retrieval.combine=soft needs task keys in one space"):
        resolve_config(method="proteus", dotted={"signature.keys": "adapter", "retrieval.combine": "soft"})
    with pytest.raises(ConfigError, match="retrieval.key_temperature must be a number in"):
        resolve_config(dotted={"retrieval.key_temperature": 0})
    with pytest.raises(ConfigError, match="head.scope must be one of global, task"):
        resolve_config(dotted={"head.scope": "class"})
