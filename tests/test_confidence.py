"""Calibrated confidence (issue 39): a temperature per task fitted on the task's calibration rows when it
is learned, stored in its record, applied to the confidence ``predict`` and ``serve`` show; labels never
change; a knowledge base without temperatures shows ``p_all`` as before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from proteus import Proteus
from proteus.cli import main
from proteus.engine.confidence import (
    MIN_ROWS,
    T_RANGE,
    Confidence,
    calibrated_probabilities,
    calibration_rows,
    fit_temperature,
    nll,
)
from proteus.engine.errors import TaskError
from proteus.engine.novelty import ClassNovelty
from proteus.experiment.predictions import format_row
from proteus.kb import KnowledgeBase, write_lock
from tiny import TINY, folder_args, make_tree, write_spec


def _sample(n: int, temperature: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (n, 5) and labels drawn from softmax(scores / temperature): calibrated at that temperature."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(logits / temperature, 1), 1, generator=g)[:, 0]
    return logits, y


@pytest.mark.parametrize("true_t", [0.1, 1.0, 4.0])
def test_fit_recovers_the_temperature_that_made_the_labels(true_t: float) -> None:
    logits, y = _sample(4000, true_t)
    t = fit_temperature(logits, y)
    assert t is not None and abs(math.log(t / true_t)) < 0.15  # label smoothing 1/4001 moves it a little
    eps = 1 / 4001
    assert nll(logits, y, t, eps) <= min(nll(logits, y, t * 1.05, eps), nll(logits, y, t / 1.05, eps))


def test_rows_all_answered_right_do_not_give_certainty() -> None:
    logits, _ = _sample(99, 1.0)
    y = logits.argmax(1)  # every calibration row right: plain NLL would drive T to 0 (p = 1)
    t = fit_temperature(logits, y)
    assert t is not None and t > 100 * T_RANGE[0]  # a finite temperature, not the search's edge
    mean_p = float(torch.softmax(logits / t, 1).max(1).values.mean())
    assert 0.85 < mean_p < 0.99  # confident, not certain (label smoothing 1 / (n + 1) = 0.01)


def test_rows_scored_minus_infinity_are_left_out_and_too_few_rows_fit_nothing() -> None:
    logits, y = _sample(500, 0.5)
    masked = logits.clone()
    masked[:100, y[:100]] = float("-inf")  # labels outside the classes the prediction weighed
    assert fit_temperature(masked, y) == pytest.approx(fit_temperature(logits[100:], y[100:]), rel=1e-6)
    assert fit_temperature(logits[: MIN_ROWS - 1], y[: MIN_ROWS - 1]) is None
    assert fit_temperature(torch.zeros(50, 3), torch.zeros(50, dtype=torch.long)) is None  # no information


def test_calibrated_probabilities_keep_the_argmax_and_use_the_class_task() -> None:
    logits, _ = _sample(200, 1.0)
    logits[:, 4] = float("-inf")  # a class the prediction did not weigh
    label = logits.argmax(1)
    task_of = torch.tensor([0, 0, 1, 1, 1])
    p, T = calibrated_probabilities(logits, label, [0.2, None], task_of)
    assert torch.equal(p.argmax(1), label)
    first = task_of[label] == 0
    assert torch.allclose(p[first], torch.softmax(logits[first] / 0.2, 1))
    assert torch.allclose(p[~first], torch.softmax(logits[~first], 1)) and bool(torch.isnan(T[~first]).all())
    assert bool((T[first] == 0.2).all()) and bool((p[:, 4] == 0).all())


def test_the_calibration_rows_are_the_detectors_rows() -> None:
    X, y = torch.randn(300, 4), torch.arange(300) % 3
    novelty = ClassNovelty(0.1, 0.95)
    novelty.draw(0, X, y, seed=11 + 3)  # LDAKeys.add_task draws with the task's seed + 3
    rows = calibration_rows(300, 0.1, seed=11)
    assert torch.equal(novelty.rows[0].X, X[rows]) and len(rows) == 30


@pytest.mark.parametrize("bad", [{"temperature": 0.0, "rows": 3}, {"temperature": "1", "rows": 3},
                                 {"temperature": float("nan"), "rows": 3}, {"temperature": 1.0, "rows": -1},
                                 [1.0]])  # fmt: skip
def test_a_stored_temperature_is_checked_and_named(bad: object) -> None:
    with pytest.raises(TaskError, match="task 3: confidence"):
        Confidence.from_dict(bad, 2)


ROW = {"file": "a.png", "class": "cat", "p_all": 0.2, "p_task": 0.3, "task": 2, "component": 1,
       "signature_score": -1.0, "known": True, "novelty": -0.5, "confidence": 0.93, "temperature": 0.12,
       "calibrated": True, "top_k": [{"class": "cat", "p_task": 0.3, "confidence": 0.93},
                                     {"class": "dog", "p_task": 0.25, "confidence": 0.05}]}  # fmt: skip


def test_the_line_says_what_the_number_is() -> None:
    line = format_row(ROW)
    assert line.startswith("a.png: cat  p = 0.93 (probability among learned classes)  task 2")
    assert line.endswith("top-k cat 0.93, dog 0.05")  # the same kind of number as the line's
    assert "p_all 0.20, temperature 0.12" in format_row(ROW, verbose=True)
    old = {**ROW, "confidence": 0.2, "temperature": None, "calibrated": False}
    assert format_row(old).startswith("a.png: cat  confidence 0.20  task 2")  # as before


@pytest.mark.slow
def test_learned_tasks_store_a_temperature_that_predict_applies(tmp_path: Path, capsys) -> None:
    tree = make_tree(tmp_path / "data", classes="abcd", n_train=60, n_test=5)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"], ["c", "d"]])
    kb = tmp_path / "kb"
    for t in (1, 2):
        args = ["learn", "--kb", str(kb), "--task", str(t), "--no-eval", *folder_args(tree, spec), *TINY]
        assert main(args) == 0
    clf = Proteus.load(kb)
    temps = clf.records_.temperatures()
    assert all(t is not None and t > 0 for t in temps)
    assert [r.confidence.rows for r in clf.records_] == [12, 12]  # 10% of 120 training images
    imgs = [str(p) for p in sorted((tree / "test").rglob("*.png"))]
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), *imgs, "--json", "--top-k", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        t = temps[clf.records_.task_of()[r["label"]]]
        assert r["calibrated"] is True and r["temperature"] == pytest.approx(t)
        assert 0 < r["confidence"] <= 1 and r["top_k"][0]["confidence"] == pytest.approx(r["confidence"])
        if t == pytest.approx(1.0):
            assert r["confidence"] == pytest.approx(r["p_all"])
    # a knowledge base of an earlier release: no temperature, the same labels, p_all shown as before
    with write_lock(kb):
        store = KnowledgeBase.open(kb)
        manifest = dict(store.manifest)
        manifest["tasks"] = [{k: v for k, v in t.items() if k != "confidence"} for t in manifest["tasks"]]
        store.commit(manifest)
    assert main(["predict", "--kb", str(kb), *imgs, "--json", "--top-k", "2"]) == 0
    old = json.loads(capsys.readouterr().out)
    for r, o in zip(rows, old, strict=True):
        assert o["label"] == r["label"] and o["p_all"] == r["p_all"]
        assert o["calibrated"] is False and o["temperature"] is None and o["confidence"] == o["p_all"]
    assert main(["predict", "--kb", str(kb), *imgs]) == 0
    out = capsys.readouterr()
    assert any(r["known"] for r in old)  # (some random test images are flagged unknown, not all)
    assert "  confidence " in out.out and " p = " not in out.out and "not a probability" in out.err
    # held-out images in class folders give it temperatures again (10 per task: enough)
    assert main(["kb", "calibrate", str(kb), "--images", str(tree / "test")]) == 0
    said = capsys.readouterr().out
    assert "confidence temperatures fitted on the images in class folders: task 1: " in said
    again = Proteus.load(kb).records_
    assert [r.confidence.rows for r in again] == [10, 10]
    assert main(["predict", "--kb", str(kb), *imgs, "--json"]) == 0
    assert all(r["calibrated"] for r in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("scope", ["task", "global"])
def test_the_heads_score_the_calibration_rows_without_them(scope: str) -> None:
    """Within ``ClassHeads.without`` the task's head is the one fitted without the rows (its γ kept), and
    the learner's own head is back afterwards."""
    from functools import partial

    from proteus.engine.class_heads import ClassHeads
    from proteus.heads import RanPACHead

    g = torch.Generator().manual_seed(3)
    h = torch.randn(120, 16, generator=g, dtype=torch.float64)
    y = torch.randint(4, 7, (120,), generator=g)  # global labels 4..6 (an earlier task held 0..3)
    width = 32 if scope == "global" else 0  # the global head's random projection; a task's head: none
    new_head = partial(RanPACHead, 16, seed=0)
    heads = ClassHeads(
        lambda rp_dim=None, dim=None: new_head(rp_dim=width if rp_dim is None else rp_dim),
        scope, False, torch.device("cpu"),
    )  # fmt: skip
    heads.update(0, h, y, [4, 5, 6], 7)
    rows = torch.arange(0, 120, 10)
    keep = torch.ones(120, dtype=torch.bool)
    keep[rows] = False
    before = heads.logits(h, torch.zeros(120, dtype=torch.long), 7, [])
    with heads.without(0, h, y, rows):
        inside = heads.logits(h, torch.zeros(120, dtype=torch.long), 7, [])
    assert torch.equal(heads.logits(h, torch.zeros(120, dtype=torch.long), 7, []), before)
    ref = new_head(rp_dim=width)
    gamma = heads.experts.experts[0].gamma if heads.experts is not None else heads.head.gamma_
    ref.gamma = gamma
    if scope == "task":
        ref.update(h[keep], y[keep] - 4, num_classes=3)
        want = ref.decision_function(h)
        torch.testing.assert_close(inside[:, 4:].double(), want, rtol=1e-4, atol=1e-5)
    else:
        ref.update(h[keep], y[keep], num_classes=7)
        torch.testing.assert_close(inside.double(), ref.decision_function(h).double(), rtol=1e-4, atol=1e-5)
