"""The public estimator: its docstring example runs and its steps compose to ``predict``."""

from __future__ import annotations

import doctest

import torch
import yaml

import proteus.core.estimator
from proteus import Proteus
from proteus.streams import build_benchmark
from tiny import TINY_SETS


def test_docstring_example_runs() -> None:
    res = doctest.testmod(proteus.core.estimator, optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.attempted >= 4 and res.failed == 0


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
