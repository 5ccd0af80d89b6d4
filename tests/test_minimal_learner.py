"""A learner written from scratch against the protocol (:class:`proteus.learners.ContinualLearner`), outside
the package and subclassing none of its classes: the table of docs/architecture.md ("What a new learner
implements") is all it implements. Registered with a method declaration and the rules of its knowledge
base, it learns through ``proteus run``, and its knowledge base loads (through the one loader), answers
``proteus predict`` and ``proteus serve``, and learns one more task in a new learner, task by task.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from proteus import learners
from proteus.cli import main
from proteus.config import LEARNERS, METHODS, RunConfig, declare
from proteus.engine.records import Prediction, TaskRecord, TaskRecords, TaskStats
from proteus.kb import KnowledgeBase
from proteus.learners import ContinualLearner, LearnerState, learner_header
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, Claim, Fields, ShapeRule
from test_extension_points import predicts_and_serves
from tiny import sets

#: the features: each image average-pooled to 4 x 4 pixels of 3 channels
SIDE, DIM = 4, 48


class PixelMeans:
    """Nearest class mean of pooled pixels: no backbone, no training, one mean per class."""

    name = "pixel-means"
    kb_layout = "pixel-means"
    supports = frozenset({"load"})

    def __init__(self, config: RunConfig, *, progress: bool = True) -> None:
        self.config, self.progress = config, progress
        self.records_ = TaskRecords()
        self.means_ = torch.zeros(0, DIM)
        self.names_: list[str] = []
        self.device_ = torch.device("cpu")
        self.train_log_: list[dict[str, Any]] = []

    @property
    def num_tasks(self) -> int:
        return len(self.records_)

    @property
    def classes_(self) -> list[str]:
        return list(self.names_)

    def set_params(self, **params: Any) -> PixelMeans:
        self.progress = params.pop("progress", self.progress)
        self.config = self.config.with_values(params) if params else self.config
        return self

    def transform_images(self, images: Sequence[Any]) -> torch.Tensor:
        side = self.config.backbone.img_size
        arrays = [np.asarray(im.convert("RGB").resize((side, side)), dtype=np.float32) / 255 for im in images]
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, SIDE).flatten(1)

    def prefix_dataset(self, ds: Any, desc: str = "prefix") -> tuple[torch.Tensor, torch.Tensor]:
        items = [ds[i] for i in range(len(ds))]
        x = self.transform_images([im for im, _ in items])
        return self._features(x), torch.as_tensor([int(y) for _, y in items])

    def fit_task(self, task: Task) -> TaskStats:
        k = self.num_tasks
        z, y = self.prefix_dataset(task.train)
        stats = TaskStats(k)
        record = TaskRecord(k, list(task.classes), list(task.class_names), len(task.train), False, stats)
        self._add(record, torch.stack([z[y == c].mean(0) for c in task.classes]))
        return stats

    def _add(self, record: TaskRecord, means: torch.Tensor) -> None:
        """A task's record and its classes' means (one row per class, in the record's order)."""
        n = max(max(record.classes) + 1, len(self.names_))
        grown = torch.zeros(n, DIM)
        grown[: len(self.means_)] = self.means_
        grown[record.classes] = means
        names = [*self.names_, *[""] * (n - len(self.names_))]
        for c, name in zip(record.classes, record.class_names, strict=True):
            names[c] = str(name)
        self.means_, self.names_ = grown, names
        self.records_.append(record)

    def _answer(self, z: torch.Tensor) -> Prediction:
        learned = torch.as_tensor([c for r in self.records_ for c in r.classes])
        logits = torch.full((len(z), len(self.means_)), float("-inf"))
        logits[:, learned] = -torch.cdist(z, self.means_[learned])
        return Prediction(logits.argmax(1), None, None, None, logits)

    def predict(self, x: torch.Tensor) -> Prediction:
        return self._answer(self._features(x))

    def predict_test(self, cache: learners.TestCache, tau: int, k: int) -> learners.TestOutcome:
        return learners.TestOutcome(self._answer(cache.prefix(tau)).label)

    def state(self) -> LearnerState:
        tasks = [(r.to_dict(), {"means": self.means_[r.classes].contiguous()}) for r in self.records_]
        head = (
            {"pixel_means": True, "num_classes": len(self.names_)},
            {"classes": torch.tensor([len(self.names_)])},
        )
        return LearnerState(tasks, head if tasks else None)

    def restore(self, state: LearnerState) -> PixelMeans:
        for meta, tensors in state.tasks:
            self._add(TaskRecord.from_dict(meta), tensors["means"].clone())
        return self

    def kb_header(self) -> dict[str, Any]:
        return learner_header(self.config, {"name": "pixel-means", "embed_dim": DIM})


#: what its knowledge base holds, declared as every learner's is: its head is recognised by its meta, each
#: task's means have one row per class of the task
RULES = (
    Claim(lambda meta: "pixel_means" in meta),
    Fields({}, required=("classes", "class_names", "n_train")),
    ShapeRule("means", ("classes", "kb.d"), "one mean of pooled pixels per class of the task"),
    ShapeRule("classes", ("*",), "the number of classes learned", "int", on="head"),
)


@pytest.fixture
def pixel_means() -> Iterator[None]:
    LEARNERS.register("pixel-means", help="nearest mean of pooled pixels")(PixelMeans)
    declare("pixel-means", "a learner written from the protocol alone", base=None, learner="pixel-means")
    TENSOR_RULES.declare("pixel-means", "PixelMeans", *RULES)
    try:
        yield
    finally:
        METHODS.unregister("pixel-means")
        LEARNERS.unregister("pixel-means")
        TENSOR_RULES.withdraw("pixel-means", "PixelMeans")


def test_a_learner_written_from_the_protocol_learns_loads_predicts_and_serves(
    pixel_means: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert isinstance(PixelMeans(RunConfig()), ContinualLearner)  # the protocol, checked at run time
    out = tmp_path / "run"
    argv = ["run", "--benchmark", "quickstart", "--method", "pixel-means", "--out", str(out), "-q"]
    tiny = sets("report.figures=false", "report.latency=false", "benchmark.num_tasks=2")
    assert main([*argv, *tiny]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == "pixel-means" and len(res["tasks"]) == 2 and res["final_avg_acc"] > 50
    kb = out / "kb"
    clf = predicts_and_serves(kb, tmp_path, capsys)
    assert type(clf) is PixelMeans and clf.num_tasks == 2
    assert len(clf.classes_) == sum(len(r.classes) for r in clf.records_)
    # task by task, each task a new learner read from the knowledge base: the same state as the run's
    tasks = tmp_path / "kb"
    for k in (1, 2):
        assert main(["learn", "--kb", str(tasks), "--task", str(k), *argv[1:5], "-q", *tiny]) == 0
    a, b = KnowledgeBase.open(kb).manifest, KnowledgeBase.open(tasks).manifest
    assert [t["sha256"] for t in a["tasks"]] == [t["sha256"] for t in b["tasks"]]
