"""Inputs from no learned task (issue 15): thresholds calibrated on held-out training inputs, stored in
the KB, ``known`` / ``novelty`` in predictions, recalibration without data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proteus import Proteus
from proteus.cli import main
from proteus.engine.novelty import Calibration, holdout_split
from tiny import TINY, folder_args, make_tree, write_spec

pytestmark = pytest.mark.slow


def test_calibration_threshold_and_split() -> None:
    c = Calibration.from_scores(torch.arange(100.0), tpr=0.9)
    assert c.threshold == 89.0 and len(c.scores) == 100
    assert c.at(0.5).threshold == 49.0 and c.at(1.0).threshold == 99.0
    big = Calibration.from_scores(torch.randn(5000), tpr=0.95)
    assert len(big.scores) == 256 and big.scores == sorted(big.scores)
    keep, held = holdout_split(50, 0.1, seed=3)
    assert len(held) == 5 and sorted(keep.tolist() + held.tolist()) == list(range(50))
    with pytest.raises(ValueError, match="true-positive rate"):
        c.at(0.0)


@pytest.mark.parametrize("method", ["proteus-dpgmm", "proteus"])
def test_known_flags_and_recalibration(tmp_path: Path, capsys, method: str) -> None:
    tree = make_tree(tmp_path / "data", classes="abcd", n_train=12, n_test=3)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"], ["c", "d"]])
    kb = tmp_path / "kb"
    extra = ["--set", "retrieval.reject=true", "--set", "retrieval.calibration_holdout=0.25",
             "--method", method]  # fmt: skip
    for t in (1, 2):
        assert (
            main(["learn", "--kb", str(kb), "--task", str(t), *folder_args(tree, spec), *TINY, *extra]) == 0
        )
    capsys.readouterr()
    clf = Proteus.load(kb)
    thr = clf.thresholds()
    assert thr is not None and thr.shape == (2,)
    for rec in clf.records_:
        cal = rec.calibration
        assert cal is not None and cal["tpr"] == 0.95 and len(cal["scores"]) == 6  # 25% of 24 held out
    imgs = [str(p) for p in sorted((tree / "test").rglob("*.png"))]
    assert main(["predict", "--kb", str(kb), *imgs, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        assert isinstance(r["known"], bool) and (r["novelty"] <= 0) == r["known"]
        thr_t = float(thr[r["task"] - 1])
        assert r["novelty"] == pytest.approx(r["signature_score"] - thr_t, abs=1e-6)
    # recalibrating at tpr 1.0 accepts every held-out input: thresholds are the largest held-out scores
    assert main(["kb", "calibrate", str(kb), "--tpr", "1.0"]) == 0
    capsys.readouterr()
    clf = Proteus.load(kb)
    assert clf.thresholds().tolist() == [max(r.calibration["scores"]) for r in clf.records_]
    assert main(["kb", "calibrate", str(kb), "--tpr", "1.5"]) == 2
    assert "true-positive rate" in capsys.readouterr().err


def test_uncalibrated_kbs_say_so(tmp_path: Path, capsys) -> None:
    tree = make_tree(tmp_path / "data", classes="ab", n_train=6, n_test=2)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"]])
    kb = tmp_path / "kb"
    assert main(["learn", "--kb", str(kb), "--task", "1", *folder_args(tree, spec), *TINY]) == 0
    assert main(["kb", "calibrate", str(kb), "--tpr", "0.9"]) == 2
    assert "retrieval.reject=true" in capsys.readouterr().err
    assert Proteus.load(kb).thresholds() is None
