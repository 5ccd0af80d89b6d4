"""Tensor rules with their owner (issue 36): each part declares what it stores next to its ``state()``
(:data:`proteus.tensor_rules.TENSOR_RULES`), the knowledge base gathers the rules of the learner a manifest
names and applies them. A key strategy that stores a new tensor is one file: here one class, its registry
line and its rule, added from outside the package, and ``proteus kb verify`` enforces the rule."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import proteus.kb as kbmod
from kbfiles import read_manifest, write_manifest
from proteus import Proteus
from proteus.cli import main
from proteus.config import resolve_config
from proteus.engine.keys import KEYS, KeyFit, KeyKind, LDAKeys
from proteus.engine.keys.space import FIRST_ADAPTER
from proteus.streams import build_benchmark
from proteus.tensor_rules import (
    TENSOR_RULES,
    Claim,
    F,
    Fields,
    Mount,
    Obj,
    Required,
    RuleBook,
    ShapeRule,
    Together,
    check_objects,
    record_problems,
)
from tiny import TINY_SETS

TINY = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}


# ------------------------------------------------------------------ the parts declare, kb gathers
def test_every_part_declares_its_own_tensors() -> None:
    """PROTEUS's knowledge base is what its parts declare (none of it in kb/), and kb/ names no part's
    tensor or field."""
    assert TENSOR_RULES.learners() == ["baseline", "proteus"]  # the learners' packages declare theirs
    owners = set(TENSOR_RULES.owners("proteus"))
    assert {"AdaptedBackbone", "TaskExperts", "ClassHeads", "LDAKeys", "GaussianKeys", "TaskRecord"} <= owners
    assert {"full", "ppca", "shared", "GaussianComponents", "Signature"} <= set(
        TENSOR_RULES.owners("signature")
    )
    assert TENSOR_RULES.owners("ranpac") == ["RanPACHead"]
    assert "ContinualClassifier" in TENSOR_RULES.owners("baseline")
    kb_dir = Path(kbmod.__file__).parent
    for name in ("tensors.py", "schema.py", "store.py", "inspect.py"):
        text = (kb_dir / name).read_text()
        for part in ("adapter/", "expert/", "forget/", "signature/", "W_rand", "prior_evecs", "task_classes"):
            assert part not in text, f"kb/{name} names {part!r}: declare it with its owner"


def test_a_mount_places_a_role_under_a_prefix_and_a_record() -> None:
    """A role mounted under a prefix and a record: names, symbols, record paths and messages follow it, a
    rule declared later is mounted too, and a mount's ``when`` gates it."""
    book = RuleBook()
    book.declare(
        "inner", "a", ShapeRule("v", ("meta:n", "kb.d"), "{prefix}v has one row per item of {record}")
    )
    book.declare(
        "outer", "b",
        Mount("inner", prefix="box/", record="box", when=lambda r: isinstance(r, dict)),
        Mount("inner", prefix="alt/", record="alt"),
    )  # fmt: skip
    book.declare(
        "inner", "c", Required(("w",), lambda r: isinstance(r, dict)), Fields({"n": F("count", True)})
    )
    record = {"box": {"n": 3}, "alt": None}
    shapes = {"box/v": ("F32", (2, 5)), "alt/v": ("F32", (4, 6))}
    problems = check_objects([record], [Obj("task index 0", "t", record, 0, shapes)], book.rules("outer"))
    assert any(
        "'box/v' has shape (2, 5): axis 0 should be 3 (the record's box.n); box/v has one row per item of box"
        in p
        for p in problems
    ), problems
    assert any("tensor 'box/w' missing, which its record's box needs" in p for p in problems), problems
    assert not any("alt/w" in p for p in problems), problems  # alt is no mapping: nothing is required
    fields = record_problems([{"box": {}}], None, book.rules("outer"), "outer", lambda i: f"tasks[{i}]")
    assert fields == ["tasks[0].box.n: missing"], fields
    record["box"] = "not a record"  # the gate: the mounted shape rules do not apply
    problems = check_objects([record], [Obj("task index 0", "t", record, 0, shapes)], book.rules("outer"))
    assert not any("box/v" in p for p in problems), problems


def test_a_role_is_found_by_its_claim_and_a_mount_loop_is_named() -> None:
    book = RuleBook()
    book.declare("mine", "learner", Claim(lambda meta: meta.get("kind") == "mine"))
    assert book.claimant({"kind": "mine"}) == "mine" and book.claimant({"kind": "other"}) is None
    assert book.learners() == ["mine"]
    with pytest.raises(KeyError, match="declared twice"):
        book.declare("mine", "learner")
    book.declare("a", "x", Mount("b"))
    book.declare("b", "y", Mount("a"))
    with pytest.raises(ValueError, match="a -> b -> a"):
        book.rules("a")


def test_together_and_required_take_alternatives() -> None:
    rules = [Together("(?:p|q)", ("p", "q|r"))]
    obj = Obj("task index 0", "t", {}, 0, {"p": ("F32", (1,))})
    assert check_objects([{}], [obj], rules) == [
        "t: tensor 'q' or 'r' missing, which 'p' comes with (task index 0)"
    ]
    obj.shapes["r"] = ("F32", (1,))
    assert check_objects([{}], [obj], rules) == []


# ------------------------------------------------------------------ a covariance kind's tensors: one file
def test_a_covariance_kind_that_stores_new_tensors_is_one_file() -> None:
    """A covariance kind registered from outside with its own stored tensor and rule: the keys that store
    signatures mount it under ``signature/`` (the knowledge base's check needs no change)."""
    from proteus.kb.tensors import check_objects as kb_check
    from proteus.signatures.components import COVARIANCES
    from proteus.signatures.dense import FullComponents

    class Diagonal(FullComponents):  # only its stored names matter here
        kind, factor_names, per_component = "diag-test", ("var",), ("var",)

    record = {"index": 0, "classes": [0, 1], "signature": {"n_active": 2, "d": 8}, "has_adapter": False}
    common = {"means": (2, 8), "weights": (2,), "center": (8,), "logdet": (2,), "var": (2, 7)}
    shapes = {f"signature/{n}": ("F32", shape) for n, shape in common.items()}
    obj = Obj("task index 0", "t", record, 0, shapes)
    assert any("'signature/prec_chol' or" in p for p in kb_check([record], [obj], "proteus"))  # no such kind
    COVARIANCES.register("diag-test", help="a test's kind")(Diagonal)
    TENSOR_RULES.declare(
        "signature", "diag-test", ShapeRule("var", ("meta:n_active", "meta:d"), "one variance per component")
    )
    try:
        assert kb_check([record], [obj], "proteus") == [
            "t: tensor 'signature/var' has shape (2, 7): axis 1 should be 8 (the record's signature.d); one "
            "variance per component (task index 0)"
        ]
    finally:
        COVARIANCES.unregister("diag-test")
        TENSOR_RULES.withdraw("signature", "diag-test")


# ------------------------------------------------------------------ a key that stores a new tensor: one file
class CountingKeys(LDAKeys):
    """LDA keys that also keep each task's number of training inputs per class (``counts/n``, one per
    class of the task): a key strategy that stores a tensor of its own."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.counts: dict[int, torch.Tensor] = {}

    def add_task(self, fit: KeyFit) -> None:
        super().add_task(fit)
        self.counts[fit.k] = torch.unique(fit.y, return_counts=True)[1].float()

    def truncate(self, m: int) -> None:
        super().truncate(m)
        self.counts = {k: v for k, v in self.counts.items() if k < m}

    def task_state(
        self, k: int, classes: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta, tensors = super().task_state(k, classes)
        return meta, {**tensors, "counts/n": self.counts[k]}

    def load_task(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.counts[self.n_tasks] = tensors["counts/n"]
        super().load_task(meta, tensors)


COUNTS_RULE = ShapeRule(r"counts/n", ("classes",), "one count per class of the task")


@pytest.fixture
def counting_keys() -> Iterator[None]:
    KEYS.register("counting-lda", help="LDA keys that count")(
        KeyKind(CountingKeys, True, {"space": FIRST_ADAPTER})
    )
    TENSOR_RULES.declare("proteus", "CountingKeys", COUNTS_RULE)
    try:
        yield
    finally:
        KEYS.unregister("counting-lda")
        if "CountingKeys" in TENSOR_RULES.owners("proteus"):
            TENSOR_RULES.withdraw("proteus", "CountingKeys")


def _halve_counts(kb: Path, index: int) -> Path:
    """Task ``index``'s ``counts/n`` cut to one entry, the object re-hashed and re-named as the store would
    (manifest checksum recomputed): only the rule can tell."""
    m = read_manifest(kb)
    t = m["tasks"][index]
    tensors = st_load((kb / t["object"]).read_bytes())
    tensors["counts/n"] = tensors["counts/n"][:1].clone()
    data = st_save(tensors)
    sha = hashlib.sha256(data).hexdigest()
    rel = re.sub(r"-[0-9a-f]{16}\.safetensors$", f"-{sha[:16]}.safetensors", t["object"])
    (kb / rel).write_bytes(data)
    t.update(object=rel, sha256=sha)
    m["object_bytes"][rel] = len(data)
    write_manifest(kb, m)
    return kb / rel


def test_a_key_that_stores_a_new_tensor_is_one_file(
    counting_keys: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = resolve_config(
        method="proteus",
        dotted={**TINY, "benchmark.max_train_per_class": 10, "signature.keys": "counting-lda"},
    )
    clf = Proteus(cfg, progress=False)
    for task in build_benchmark(cfg.benchmark).tasks[:2]:
        clf.fit_task(task)
    kb = tmp_path / "kb"
    clf.save(kb)
    assert main(["kb", "verify", str(kb)]) == 0
    assert Proteus.load(kb).keys_.counts[1].shape == (2,)
    path = _halve_counts(kb, 1)
    capsys.readouterr()
    assert main(["kb", "verify", str(kb)]) == 1
    out = capsys.readouterr().out
    assert (
        f"{path}: tensor 'counts/n' has shape (1,): axis 0 should be 2 (the classes of task index 1); one "
        "count per class of the task (task index 1)"
    ) in out, out
    with pytest.raises(kbmod.KBError, match="counts/n"):
        Proteus.load(kb)
    TENSOR_RULES.withdraw("proteus", "CountingKeys")  # the rule is what refused it: without it, it loads
    assert main(["kb", "verify", str(kb)]) == 0
    assert Proteus.load(kb).keys_.counts[1].shape == (1,)
