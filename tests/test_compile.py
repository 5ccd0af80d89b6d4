"""``compile`` (the issue's "``torch.compile`` as an option measured in the bench"): the backbone's inference
forwards through ``torch.compile`` predict what the eager ones predict (to float round-off), batches of
varying size do not compile a graph each, and a compiler that fails leaves one warning and eager forwards.

Most tests run on dynamo's ``eager`` backend: the graph capture, its guards and dynamic shapes, without
AOT autograd and inductor's C++ build (minutes per graph of the full ViT-Ti on two CPU cores: the learner
here is a ViT-Ti of five blocks); the numbers of inductor's kernels are compared in the test marked slow.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import yaml

from proteus import Proteus, devices
from proteus.config import ConfigError, validate
from proteus.streams import build_benchmark
from tiny import TINY_SETS

#: blocks of the ViT-Ti built here (12 in timm's): the graphs traced and compiled are what the tests cost
DEPTH = 5


@pytest.fixture(scope="module")
def learned() -> tuple[Proteus, torch.Tensor]:
    """A ViT-Ti of :data:`DEPTH` blocks with random weights after two tasks (eager), and 8 test images of
    both tasks: the prefix (three blocks, each a tap of the detector) and the adapted suffix (two) are the
    same modules as in the full model, in a third of the graph."""
    import timm

    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}
    create = timm.create_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timm, "create_model", lambda tag, **kw: create(tag, **kw, depth=DEPTH))
        clf = Proteus.from_method(
            "proteus", progress=False, **sets,
            **{"backbone.name": "vit_ti16", "benchmark.max_train_per_class": 10, "device": "cpu"},
        )  # fmt: skip
        clf._build()
    assert len(clf.model_.backbone.vit.blocks) == DEPTH
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:2]:
        clf.fit_task(task)
    x = clf.transform_images([t.test[i][0] for t in stream.tasks[:2] for i in range(4)])
    return clf, x


@pytest.fixture(autouse=True)
def fresh(learned: tuple[Proteus, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts eager with no compiled graph and no recorded failure, on the eager backend."""
    monkeypatch.setattr(devices, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(devices, "_compile_failure", None)
    torch._dynamo.reset()
    yield
    learned[0].model_.compile_mode = "none"
    learned[0].model_._compiled.clear()
    torch._dynamo.reset()


def _predict(clf: Proteus, x: torch.Tensor, sizes: tuple[int, ...]) -> list:
    """Predictions of the first n images for each n of ``sizes`` (batches of varying size)."""
    return [clf.predict(x[:n]) for n in sizes]


def _assert_close(compiled: list, eager: list) -> None:
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c.logits, e.logits, rtol=1e-4, atol=1e-5)
        assert torch.equal(c.label, e.label) and torch.equal(c.task, e.task)
        if e.novelty is not None:
            torch.testing.assert_close(c.novelty, e.novelty, rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # dynamo traces the learner's forwards at seven batch sizes
def test_compiled_predicts_as_eager_without_a_graph_per_batch_size(learned) -> None:
    clf, x = learned
    sizes = (8, 5, 3, 2, 7, 6, 4)
    eager = _predict(clf, x, sizes)
    clf.model_.compile_mode = "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager would fail here
        compiled = _predict(clf, x, sizes)
    _assert_close(compiled, eager)
    assert clf.keys_.uses_taps  # the detector reads the prefix's taps: the prefix is compiled with them
    assert devices._compile_failure is None and set(clf.model_._compiled) == {"prefix_taps", "suffix"}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 10, f"{graphs} graphs compiled for {len(sizes)} batch sizes"
    again = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _predict(clf, x, (1, 3, 4))  # other sizes again: at most the size-1 specialisation is new
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - again <= 3


def test_a_compiler_failure_warns_once_and_predicts_eagerly(learned, monkeypatch) -> None:
    clf, x = learned
    eager = _predict(clf, x, (8, 5))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    clf.model_.compile_mode = "max-autotune"
    with pytest.warns(RuntimeWarning) as caught:
        compiled = _predict(clf, x, (8, 5))
    msgs = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "compile='max-autotune'" in msgs[0] and "no C++ compiler found" in msgs[0]
    for c, e in zip(compiled, eager):
        assert torch.equal(c.logits, e.logits)  # the eager forwards themselves


def test_an_error_of_the_forward_itself_is_raised(learned) -> None:
    clf, _ = learned
    clf.model_.compile_mode = "default"
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        clf.model_.prefix(torch.zeros(2, 5, 32, 32))  # 5 channels: the patch embedding refuses them


def test_the_key_is_validated_and_reaches_the_model() -> None:
    clf = Proteus.from_method("proteus", progress=False, compile="reduce-overhead", **{"device": "cpu"})
    assert clf.config.compile == "reduce-overhead"
    clf._build()
    assert clf.model_.compile_mode == "reduce-overhead"
    assert "compile" not in clf.config.task_settings()  # how fast, not what: records stay as they were
    with pytest.raises(ConfigError, match="compile"):
        validate(clf.config.with_values({"compile": "fast"}))
    with pytest.raises(ValueError, match="compile must be one of none, default"):
        devices.CompiledForward(lambda t: t, "fast")


@pytest.mark.slow
def test_inductor_predicts_as_eager(learned, monkeypatch) -> None:
    clf, x = learned
    monkeypatch.setattr(devices, "COMPILE_BACKEND", "inductor")
    eager = _predict(clf, x, (8,))  # one size: the batch dimension's graphs are the eager backend's tests
    clf.model_.compile_mode = "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _assert_close(_predict(clf, x, (8,)), eager)
