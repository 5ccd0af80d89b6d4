"""The one learner protocol (issue 24): every method resolves to a registered learner, one loop and one
persistence layer serve PROTEUS and the baselines, commands refuse by name what a learner does not
support, and :class:`proteus.Proteus` is a scikit-learn estimator (parameters, clone, validation in
``fit_task``, fitted state created by fitting, the given config never modified)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from sklearn.base import clone

from proteus import Proteus
from proteus.baselines import BASELINES
from proteus.cli import main
from proteus.config import METHODS, ConfigError, RunConfig, resolve_config
from proteus.errors import NotFittedError
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from proteus.learners import LEARNERS, ContinualLearner, LearnerState
from proteus.streams import build_benchmark
from tiny import TINY_SETS, sets

TINY = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}


def _tiny_cfg(method: str = "proteus", **extra: object) -> RunConfig:
    return resolve_config(method=method, dotted={**TINY, "benchmark.max_train_per_class": 20, **extra})


def test_every_method_resolves_to_a_registered_learner() -> None:
    for name in METHODS.names():
        learner = LEARNERS.get(METHODS.get(name).learner)
        assert isinstance(learner, type), name
    assert LEARNERS.get("proteus") is Proteus
    assert set(BASELINES) <= set(LEARNERS.names())
    members = _protocol_members(ContinualLearner)
    assert {"predict", "records_", "classes_", "supports"} <= members
    for method in ("proteus", "ranpac", "inflora", "ncm"):
        clf = build_learner(_tiny_cfg(method), progress=False)
        # before fitting, all but the fitted attributes (scikit-learn's convention: ``records_`` and what
        # reads it exist once a task is learned)
        absent = sorted(m for m in members if not m.endswith("_") and not hasattr(clf, m))
        assert not absent, (method, absent)
        assert "load" in clf.supports or method in BASELINES
    for method in ("proteus", "ncm"):  # the whole protocol once a task is learned
        cfg = _tiny_cfg(method)
        clf = build_learner(cfg, progress=False)
        clf.fit_task(build_benchmark(cfg.benchmark).tasks[0])
        assert isinstance(clf, ContinualLearner), method


def _protocol_members(protocol: type) -> set[str]:
    """The names a runtime check of ``protocol`` asks an object for (its attributes, methods and
    annotations, those of the protocols it extends included)."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is object or base.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in (*vars(base), *getattr(base, "__annotations__", {})) if not n.startswith("_")}
    return names


# ------------------------------------------------------------------ the scikit-learn estimator
def test_clone_get_params_set_params() -> None:
    cfg = _tiny_cfg()
    before = copy.deepcopy(cfg.to_dict())
    clf = Proteus(cfg, progress=False)
    assert clf.get_params(deep=False) == {"config": cfg, "progress": False}
    assert clf.get_params()["train.epochs"] == 1
    twin = clone(clf)
    assert twin.config is not cfg and twin.config.to_dict() == cfg.to_dict() and twin.progress is False
    clf.set_params(**{"train.epochs": 3}, head__rp_dim=128)
    assert (clf.config.train.epochs, clf.config.head.rp_dim) == (3, 128)
    assert cfg.to_dict() == before  # the config given is never modified
    with pytest.raises(ConfigError, match="unknown config key 'train.epoch'"):
        clf.set_params(**{"train.epoch": 2})
    with pytest.raises(ConfigError, match="train.lr"):
        clf.set_params(**{"train.lr": -1.0})
    assert clf.config.train.lr == cfg.train.lr  # a refused value leaves the parameters as they were


def test_fitted_state_comes_from_fitting_and_config_is_validated_there() -> None:
    clf = Proteus(_tiny_cfg(), progress=False)
    assert not any(hasattr(clf, a) for a in ("records_", "head_", "model_", "keys_"))
    assert clf.num_tasks == 0
    with pytest.raises(NotFittedError, match="fit_task or Proteus.load"):
        clf.predict(torch.zeros(1, 3, 32, 32))
    bad = _tiny_cfg()
    bad.train.epochs = 0  # not through resolve_config: Proteus(cfg) must still refuse it before any work
    stream = build_benchmark(bad.benchmark)
    with pytest.raises(ConfigError, match="train.epochs"):
        Proteus(bad, progress=False).fit_task(stream.tasks[0])


def test_state_round_trip_and_config_untouched() -> None:
    cfg = _tiny_cfg()
    before = copy.deepcopy(cfg.to_dict())
    clf = Proteus(cfg, progress=False)
    stream = build_benchmark(cfg.benchmark)
    for task in stream.tasks[:2]:
        clf.fit_task(task)
    assert cfg.to_dict() == before
    state = clf.state()
    assert isinstance(state, LearnerState) and len(state.tasks) == 2 and state.head is not None
    back = Proteus.from_state(cfg, state)
    x = clf.transform_images([stream.tasks[1].test[i][0] for i in range(6)])
    a, b = clf.predict(x), back.predict(x)
    assert torch.equal(a.label, b.label) and torch.equal(a.task, b.task)


# ------------------------------------------------------------------ one loop, one persistence layer
def test_a_baseline_runs_through_the_shared_loop_into_a_kb(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ncm"
    extra = sets("benchmark.num_tasks=2", "benchmark.max_train_per_class=10", "report.figures=false")
    argv = ["run", "--benchmark", "quickstart", "--method", "ncm", "--out", str(out), "-q", *extra]
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["learner"] == "ncm" and len(res["acc_matrix"]) == 2 and res["retrieval_acc"] is None
    kb = out / "kb"
    assert main(["kb", "verify", str(kb)]) == 0
    assert main(["kb", "info", str(kb)]) == 0
    assert "ncm" in capsys.readouterr().out
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 2
    # what the learner does not support is refused by name (a baseline loads, but retrieves no task)
    assert main(["kb", "forget", str(kb), "--task", "1"]) == 2
    err = capsys.readouterr().err
    assert "ncm" in err and "'retrieval'" in err and "does not support" in err, err


def test_each_baseline_declares_its_own_options(caplog) -> None:
    """A baseline declares the ``baseline.*`` keys it reads (its ``Options`` dataclass, with defaults and
    ranges); a key of another baseline set on it is reported (it does nothing), a key of none is refused."""
    import dataclasses
    import logging

    from proteus.config import ConfigError, validate

    names = lambda clf: {f.name for f in dataclasses.fields(clf.options_)}  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="proteus"):
        inflora = build_learner(_tiny_cfg("inflora", **{"baseline.pool_size": 20}), progress=False)
        validate(inflora.config)
    assert "gpm_start" in names(inflora) and "pool_size" not in names(inflora)
    assert "baseline.pool_size set, not among its options" in caplog.text
    l2p = build_learner(_tiny_cfg("l2p", **{"baseline.pool_size": 20}), progress=False)
    assert l2p.options_.pool_size == 20 and "top_k" in names(l2p)
    assert names(build_learner(_tiny_cfg("ncm"), progress=False)) == set()
    with pytest.raises(ConfigError, match="unknown config key 'baseline.pool'"):
        _tiny_cfg("l2p", **{"baseline.pool": 20})
    with pytest.raises(ConfigError, match="baseline.pool_size must be a number in"):
        _tiny_cfg("l2p", **{"baseline.pool_size": 0})


# ------------------------------------------------------------------ extension points
@pytest.mark.slow  # about 20 s on 2 cores: it learns and predicts end to end with the new key
def test_a_key_in_a_new_space_is_a_space_and_a_registry_line() -> None:
    """A new key space (the frozen features beside the first adapter's) and LDA keys in it, registered
    from outside the package as a new file would: no other module changes, and the keys predict along
    their own one-space route what the m-forward path predicts."""
    from dataclasses import dataclass

    from proteus.engine.keys import KEYS, KeyKind, LDAKeys
    from proteus.engine.keys.space import FIRST_ADAPTER, FROZEN, SPACES, KeySpace

    @dataclass(frozen=True)
    class Both(KeySpace):
        def embed(self, embedder, z, shard=True):  # noqa: ANN001, ANN202
            return torch.cat([FROZEN.embed(embedder, z, shard), FIRST_ADAPTER.embed(embedder, z, shard)], 1)

        def select(self, H, F):  # noqa: ANN001, ANN202
            return torch.cat([FROZEN.select(H, F), FIRST_ADAPTER.select(H, F)], 1)

        def available(self, num_adapters: int) -> bool:
            return num_adapters > 0

    space = SPACES.register("both", help="frozen and first-adapter features")(Both("both", None))
    KEYS.register("both-lda", help="LDA keys on both")(KeyKind(LDAKeys, True, {"space": space}))
    try:
        clf = Proteus(_tiny_cfg(**{"signature.keys": "both-lda"}), progress=False)
        stream = build_benchmark(clf.config.benchmark)
        for task in stream.tasks[:2]:
            clf.fit_task(task)
        assert clf.parts_.route == "one-space" and clf.parts_.needs_frozen
        x = clf.transform_images([stream.tasks[k].test[i][0] for k in (0, 1) for i in range(4)])
        a, b = clf.predict(x), clf.predict_embedded(*clf.embed(x))
        assert torch.equal(a.task, b.task) and torch.equal(a.label, b.label)
    finally:
        KEYS.unregister("both-lda")
        SPACES.unregister("both")
    assert "both-lda" not in KEYS


def test_a_state_with_wrong_shapes_is_refused_naming_task_and_file() -> None:
    """Untrusted input: a stored adapter that does not fit the backbone's map is a TaskError naming the
    task and its object, not a RuntimeError inside torch."""
    from proteus.engine.errors import TaskError

    cfg = _tiny_cfg()
    clf = Proteus(cfg, progress=False)
    stream = build_benchmark(cfg.benchmark)
    for task in stream.tasks[:2]:
        clf.fit_task(task)
    state = clf.state()
    meta, tensors = state.tasks[1]
    name = next(n for n in tensors if n.startswith("adapter/") and n.endswith("/A"))
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2]
    meta["object"] = "objects/task001-0123456789abcdef.safetensors"
    where = r"task 2 \(objects/task001-0123456789abcdef.safetensors\)"
    with pytest.raises(TaskError, match=where + r": .*do not fit"):
        Proteus.from_state(cfg, state)
