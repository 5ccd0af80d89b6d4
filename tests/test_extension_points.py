"""Extension points as a user meets them: each thing is added from outside the package, the way a new file
would add it, and runs through the public command line. No module of the package changes:

* a baseline with its own options: one class with an ``Options`` dataclass, a registry line and a method
  declaration (its option is typed, range-checked and refused when unknown, like every config key); its
  knowledge base loads, predicts and serves like every learner's;
* a benchmark: one factory and a registry line (``--benchmark NAME``).

(A retrieval key in a new space is the same kind of test: ``test_learner_protocol.py``.)
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from proteus.baselines.learner import TrainingOptions
from proteus.baselines.ncm import NCM
from proteus.cli import main
from proteus.config import LEARNERS, METHODS, ConfigError, declare, resolve_config
from proteus.kb import KnowledgeBase
from proteus.learners import ContinualLearner, load_from_kb
from proteus.options import POSITIVE, option
from proteus.serve import KBServer
from proteus.streams import BENCHMARKS, build_benchmark
from proteus.streams.options import BenchmarkConfig
from tiny import sets

TINY = [*sets("report.figures=false", "report.latency=false"), "-q"]


@dataclasses.dataclass
class SharpOptions(TrainingOptions):
    sharpness: float = option(1.0, help="the class means' scale before the argmax", range=POSITIVE)


class SharpNCM(NCM):
    """NCM whose class means are scaled by ``baseline.sharpness`` (a test's own baseline)."""

    name = "sharp-ncm"
    Options = SharpOptions

    def learn_task(self, task, k):  # noqa: ANN001, ANN202
        stats = super().learn_task(task, k)
        with torch.no_grad():
            self.heads_[-1].weight.mul_(self.options_.sharpness)
        return {**stats, "sharpness": self.options_.sharpness}


@pytest.fixture
def sharp_ncm() -> Iterator[None]:
    LEARNERS.register("sharp-ncm", help="NCM with a sharpness")(SharpNCM)
    declare("sharp-ncm", "a test's baseline", base=None, learner="sharp-ncm")
    try:
        yield
    finally:
        METHODS.unregister("sharp-ncm")
        LEARNERS.unregister("sharp-ncm")


def test_a_baseline_with_options_is_one_class(
    sharp_ncm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = resolve_config("quickstart", method="sharp-ncm", sets=["baseline.sharpness=2"])
    assert cfg.baseline == {"sharpness": 2.0}  # typed by the baseline's own declaration
    with pytest.raises(ConfigError, match=r"baseline.sharpness must be a number in \(0, inf\)"):
        resolve_config("quickstart", method="sharp-ncm", sets=["baseline.sharpness=0"])
    with pytest.raises(ConfigError, match="unknown config key 'baseline.sharp'"):
        resolve_config("quickstart", method="sharp-ncm", sets=["baseline.sharp=2"])
    out = tmp_path / "run"
    argv = ["run", "--benchmark", "quickstart", "--method", "sharp-ncm", "--out", str(out), *TINY]
    assert main([*argv, "--set", "baseline.sharpness=3", "--set", "benchmark.num_tasks=2"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["method"] == "sharp-ncm" and [t["sharpness"] for t in res["tasks"]] == [3.0, 3.0]
    clf = predicts_and_serves(out / "kb", tmp_path, capsys)
    assert type(clf) is SharpNCM and clf.num_tasks == 2 and clf.options_.sharpness == 3.0


def predicts_and_serves(kb: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> ContinualLearner:
    """The knowledge base of a learner defined outside the package loads (through the one loader, typed to
    the protocol), answers ``proteus predict`` as the loaded learner does and, the same, ``proteus serve``;
    returns the loaded learner."""
    clf = load_from_kb(KnowledgeBase.open(kb), "test")
    images = []
    for i in range(3):
        images.append(tmp_path / f"{i}.png")
        pixels = np.random.default_rng(i).integers(0, 256, (28, 28, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images[-1])
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), *map(str, images), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["class"] for r in rows] == [
        clf.classes_[int(y)]
        for y in clf.predict(clf.transform_images([Image.open(f).convert("RGB") for f in images])).label
    ]
    srv = KBServer(("127.0.0.1", 0), kb, device="cpu")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        answer = httpx.post(url + "/predict", content=images[0].read_bytes(), timeout=60)
        assert answer.status_code == 200 and answer.json()["predictions"][0]["class"] == rows[0]["class"]
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=30)
    return clf


def _two_tasks(cfg: BenchmarkConfig):  # noqa: ANN202 - a benchmark factory: the quickstart cut to 2 tasks
    stream = build_benchmark(dataclasses.replace(cfg, name="quickstart", num_tasks=2))
    stream.name = "two-digit-tasks"
    return stream


def test_a_benchmark_is_one_factory(tmp_path: Path) -> None:
    BENCHMARKS.register("two-digit-tasks", help="the quickstart's first two tasks")(_two_tasks)
    try:
        out = tmp_path / "run"
        argv = ["run", "--benchmark", "two-digit-tasks", "--method", "ncm", "--out", str(out), *TINY]
        assert main(argv) == 0
        res = json.loads((out / "results.json").read_text())
        assert (res["benchmark"], res["num_tasks"]) == ("two-digit-tasks", 2)
    finally:
        BENCHMARKS.unregister("two-digit-tasks")
