"""The public estimator (issue 11): its docstring example runs, its steps compose to ``predict``, and the
package keeps its layering (no import cycles, no module importing one above it)."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import torch
import yaml

import proteus.estimator
from proteus import Proteus
from proteus.streams import build_benchmark
from tiny import TINY_SETS

SRC = Path(proteus.estimator.__file__).resolve().parent

#: rank of each top-level module or package: a module may import only ranks below its own (or its own
#: package). cli -> experiment -> report -> estimator -> engine -> presets -> the parts
LAYERS = {
    "cli": 7, "__main__": 8, "serve": 7,
    "experiment": 6,
    "report": 5,
    "estimator": 4, "baselines": 4,
    "presets": 3,
    "engine": 2, "methods": 1,
    "adapters": 0, "signatures": 0, "heads": 0, "kb": 0, "backbones": 0, "streams": 0, "config": 0,
    "registry": 0, "metrics": 0, "distributed": 0, "devices": 0, "faults": 0, "images": 0, "__init__": 0,
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    """Top-level proteus modules imported anywhere in a file (including inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("proteus"):
            parts = node.module.split(".")
            if len(parts) > 1:
                out.add(parts[1])
            else:  # from proteus import X
                out.update(a.name for a in node.names if a.name in LAYERS)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("proteus."))
    return out


def test_docstring_example_runs() -> None:
    res = doctest.testmod(proteus.estimator, optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.attempted >= 4 and res.failed == 0


def test_no_module_imports_a_layer_above_it() -> None:
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel == Path("__init__.py"):
            continue  # the package's front door re-exports the estimator (lazily)
        top = rel.parts[0].removesuffix(".py")
        assert top in LAYERS, f"{rel}: add its layer to LAYERS"
        for imp in _imports(path):
            if imp != top and imp in LAYERS and LAYERS[imp] > LAYERS[top]:
                bad.append(f"{rel} imports proteus.{imp}")
    assert not bad, bad


def test_no_source_file_over_about_400_lines() -> None:
    long = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if len(p.read_text().splitlines()) > 440]
    assert sorted(long) == []


def test_predict_is_embed_retrieve_classify() -> None:
    """One retrieval path: predict equals the public steps composed by hand (Alg. 2: the best task, then
    the head; the soft combination of ``proteus`` is checked in test_experts.py)."""
    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}
    clf = Proteus.from_method(
        "proteus-dpgmm", progress=False, **sets, **{"benchmark.max_train_per_class": 30}
    )
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:2]:
        clf.fit_task(task)
    x = clf.transform_images([stream.tasks[t].test[i][0] for t in (0, 1) for i in range(4)])
    pred = clf.predict(x)
    H, F = clf.embed(x)
    res = clf.retrieve(H, F)
    logits = clf.classify(H[res.task, torch.arange(len(x))])
    assert torch.equal(pred.task, res.task) and torch.equal(pred.logits, logits)
    assert torch.equal(pred.label, logits.argmax(1))
    assert len(clf.records_) == 2 and clf.records_[1].settings["train.epochs"] == 1
