"""Inputs from no learned task (issue 15): thresholds calibrated on held-out training inputs, stored in
the KB, ``known`` / ``novelty`` in predictions, recalibration without data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from proteus import Proteus
from proteus.cli import main
from proteus.engine.novelty import Calibration, ClassGaussians, holdout_split
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
    thr = clf.records_.thresholds()
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
    assert clf.records_.thresholds().tolist() == [max(r.calibration["scores"]) for r in clf.records_]
    assert main(["kb", "calibrate", str(kb), "--tpr", "1.5"]) == 2
    assert "true-positive rate" in capsys.readouterr().err


def test_uncalibrated_kbs_say_so(tmp_path: Path, capsys) -> None:
    tree = make_tree(tmp_path / "data", classes="ab", n_train=6, n_test=2)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"]])
    kb = tmp_path / "kb"
    off = ["--set", "retrieval.novelty=none"]  # as a KB learned before the detector existed
    assert main(["learn", "--kb", str(kb), "--task", "1", *folder_args(tree, spec), *TINY, *off]) == 0
    assert main(["kb", "calibrate", str(kb), "--tpr", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "--images DIR" in err and "retrieval.reject=true" in err
    assert Proteus.load(kb).records_.thresholds() is None
    assert main(["kb", "calibrate", str(kb)]) == 2
    assert "--images DIR" in capsys.readouterr().err


def test_class_gaussians_subtract_rows_exactly() -> None:
    """The Gaussians built from accumulated statistics less some rows equal those built without them."""
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(300, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (300,), generator=g)
    X[y == 1] += 3.0

    def stats(X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        Q = torch.zeros(6, 3, dtype=torch.float64).index_add_(1, y, X.T)
        return X.T @ X, Q, torch.bincount(y, minlength=3)

    full = ClassGaussians.from_statistics(*stats(X, y), minus=[(X[:40], y[:40])])
    kept = ClassGaussians.from_statistics(*stats(X[40:], y[40:]))
    assert torch.allclose(full.means, kept.means) and torch.allclose(full.precision, kept.precision)
    d2, cls = kept.distances(X[:40])
    # by hand: the squared Mahalanobis distance to the nearest class under the shrunk shared covariance
    diff = X[:40, None, :] - kept.means[None]
    ref = torch.einsum("ncd,de,nce->nc", diff, kept.precision, diff)
    assert torch.allclose(d2, ref.min(1).values) and torch.equal(cls, ref.argmin(1))


def _learn(kb: Path, tree: Path, spec: Path, *extra: str) -> None:
    for t in (1, 2):
        args = ["learn", "--kb", str(kb), "--task", str(t), *folder_args(tree, spec), *TINY, *extra]
        assert main(args) == 0


def test_default_method_flags_inputs_without_changing_accuracy(tmp_path: Path, capsys) -> None:
    """proteus's default detector (task Gaussians on the prefix's channel statistics and the LDA keys'
    features) answers known / unknown for every input, holds nothing out of the keys (every prediction
    equals the detector-free one's) and accepts every calibration row at a true-positive rate of 1."""
    tree = make_tree(tmp_path / "data", classes="abcd", n_train=12, n_test=3)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"], ["c", "d"]])
    imgs = [str(p) for p in sorted((tree / "test").rglob("*.png"))]
    rows = {}
    for name, extra in (("on", ()), ("off", ("--set", "retrieval.novelty=none"))):
        _learn(tmp_path / name, tree, spec, *extra)
        capsys.readouterr()
        assert main(["predict", "--kb", str(tmp_path / name), *imgs, "--json"]) == 0
        rows[name] = json.loads(capsys.readouterr().out)
    for on, off in zip(rows["on"], rows["off"], strict=True):
        assert isinstance(on["known"], bool) and (on["novelty"] <= 0) == on["known"] and off["known"] is None
        assert on["class"] == (on["nearest_class"] if on["known"] else None)  # no class for a rejected input
        assert {k: v for k, v in on.items() if k not in ("known", "novelty", "class")} == {
            k: v for k, v in off.items() if k not in ("known", "novelty", "class")
        }
    clf = Proteus.load(tmp_path / "on")
    rows_x = {k: r.X for k, r in clf.keys_.novelty.rows.items()}
    assert sorted(rows_x) == [0, 1] and all(len(x) == 2 for x in rows_x.values())  # 10% of 24, seeded
    assert all(r.in_stats for r in clf.keys_.novelty.rows.values())
    assert clf.keys_.uses_taps and sorted(clf.keys_.novelty.gaussians) == [0, 1]  # the task Gaussians
    assert main(["kb", "calibrate", str(tmp_path / "on"), "--tpr", "1.0"]) == 0
    clf = Proteus.load(tmp_path / "on")
    classes = [t.classes for t in clf.records_]
    thr = clf.keys_.novelty_thresholds(classes)
    assert len(thr) == 2 and clf.keys_.novelty.tpr == 1.0
    # every calibration row is accepted at rate 1: its novelty is <= 0
    for r in clf.keys_.novelty.rows.values():
        assert (clf.keys_.novelty_of(r.X, classes, r.taps) <= 1e-9).all()


def test_calibrate_images_gives_an_old_kb_rejection(tmp_path: Path, capsys) -> None:
    tree = make_tree(tmp_path / "data", classes="abcd", n_train=8, n_test=3)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"], ["c", "d"]])
    kb = tmp_path / "kb"
    _learn(kb, tree, spec, "--set", "retrieval.novelty=none")
    imgs = [str(p) for p in sorted((tree / "test").rglob("*.png"))]
    capsys.readouterr()
    assert main(["kb", "calibrate", str(kb), "--images", str(tree / "test"), "--tpr", "1.0"]) == 2
    assert "retrieval.novelty" in capsys.readouterr().err  # learned without the detector: said by name
    kb2 = tmp_path / "kb2"
    _learn(kb2, tree, spec)
    capsys.readouterr()
    assert main(["kb", "calibrate", str(kb2), "--images", str(tree / "test"), "--tpr", "1.0"]) == 0
    assert "thresholds fitted" in capsys.readouterr().out
    clf = Proteus.load(kb2)
    rows = clf.keys_.novelty.rows
    assert sorted(rows) == [0, 1] and not any(r.in_stats for r in rows.values())
    assert [len(r.y) for r in rows.values()] == [6, 6]  # the folders' classes decide each image's task
    assert main(["predict", "--kb", str(kb2), *imgs, "--json"]) == 0
    assert all(r["known"] for r in json.loads(capsys.readouterr().out))  # rate 1 on these very images
    bad = tmp_path / "bad" / "zebra"
    bad.mkdir(parents=True)
    shutil.copy(imgs[0], bad / "x.png")
    assert main(["kb", "calibrate", str(kb2), "--images", str(tmp_path / "bad")]) == 2
    assert "zebra: names no learned class" in capsys.readouterr().err


def test_class_gaussian_needs_lda_keys(tmp_path: Path) -> None:
    from proteus.config import ConfigError
    from tiny import folder_cfg

    tree = make_tree(tmp_path / "data", classes="ab", n_train=4, n_test=1)
    spec = write_spec(tmp_path / "spec.yaml", [["a", "b"]])
    cfg = folder_cfg(tree, spec, "retrieval.novelty=class-gaussian", method="proteus-dpgmm")
    with pytest.raises(ConfigError, match="needs LDA keys"):
        Proteus(cfg)._build()


def test_a_reader_pools_a_pack_s_calibration_scores_in_one_run_per_pack() -> None:
    """A reader's first fit after opening a knowledge base pools every task's calibration scores: the
    tasks of one pack come as one view of it (a run), held tasks and tasks outside a pack one by one, and
    the pooled rows are those of the tasks in order, whichever way they were read."""
    from proteus.engine.novelty import ShortlistScores
    from proteus.kb.packs import Pack, pack_tasks

    gen = torch.Generator().manual_seed(0)
    stored = [
        {"novelty/cal_tasks": torch.randint(-1, 9, (n, 4), generator=gen),
         "novelty/cal_nll": torch.rand(n, 4, 3, generator=gen)}
        for n in (3, 1, 5, 2)
    ]  # fmt: skip
    pack = Pack(pack_tasks(1, stored[:3]))
    scores = ShortlistScores()
    for k in range(3):  # tasks 0..2 read from the pack, task 3 from a loose object, task 4 held
        scores.load(k, pack.task(k), len(stored[k]["novelty/cal_tasks"]))
    scores.load(3, stored[3], 2)
    scores.score(4, torch.tensor([[0, 2], [1, 3]]), lambda c: [torch.rand(2, 4) for _ in range(3)], 4)
    tasks = [0, 1, 2, 3, 4]
    parts = scores._parts(tasks)
    assert len(parts) == 3  # the pack's three tasks in one run, then the other two
    cand, nll = scores._concat(tasks)
    want = [scores._of(k) for k in tasks]
    assert torch.equal(cand, torch.cat([c for c, _ in want]))
    assert torch.equal(nll, torch.cat([x for _, x in want]).float())


def test_the_pooled_rows_alive_candidates_are_isins_and_every_task_is_asked_for_at_once() -> None:
    """The refit's test of which candidates are alive (a lookup table) answers as ``torch.isin``, padding and
    a negative index stored by someone else included; the Gaussians' presence is asked of a
    :class:`TaskShares` for every task at once, with the answer of one test per task."""
    from proteus.engine.novelty import _all_with_taps, _member
    from proteus.engine.stored import TaskShares

    g = torch.Generator().manual_seed(0)
    for n, alive in ((1, []), (5, [0, 3]), (40, list(range(0, 40, 3))), (7, [6, 9])):
        cand = torch.randint(-3, n + 2, (50, 4), generator=g)
        tasks = torch.as_tensor(alive, dtype=torch.long)
        assert torch.equal(_member(cand, tasks), torch.isin(cand, tasks))
    shares: TaskShares[int] = TaskShares(lambda k, t: k)
    shares[0], shares[2] = 0, 2
    shares.bind(3, {})
    counts = {0: (4, True), 1: (0, False), 2: (3, True), 3: (2, True)}
    assert _all_with_taps(counts, shares) and _all_with_taps(counts, {0, 2, 3})
    for changed in ({**counts, 4: (1, True)}, {**counts, 2: (3, False)}, {1: (0, True)}):
        assert not _all_with_taps(changed, shares) and not _all_with_taps(changed, set(shares))


def test_a_pack_s_tap_split_is_checked_for_every_task_and_names_the_one_that_does_not_fit() -> None:
    """The record's split of the tap statistics (``tap_sizes``) against a task's stored widths: for a task
    of a pack the same answer as for the task's own object: only the task whose tensors do not fit is
    refused, by what does not fit."""
    from proteus.engine.novelty import _misfit
    from proteus.kb.packs import Pack, StoredTensors, pack_tasks

    def task(width: int) -> dict[str, torch.Tensor]:
        return {"novelty/taps": torch.zeros(3, 6), "novelty/g0/mean": torch.zeros(4),
                "novelty/g1/mean": torch.zeros(width), "novelty/y": torch.zeros(3)}  # fmt: skip

    tasks = [task(2), task(3), task(2)]  # the second task's last tap block is one feature too wide
    pack = Pack(pack_tasks(0, tasks))
    got = [_misfit(pack.task(slot), [4, 2]) for slot in range(3)]
    assert got == [None, ("novelty/g1/mean", 2, 3), None]
    assert [_misfit(t, [4, 2]) for t in tasks] == got  # each task's own object: the same answers
    assert _misfit(pack.task(0), [3, 3]) == ("novelty/g0/mean", 3, 4)  # another split
    assert _misfit(StoredTensors(pack, 2), [5, 1]) == ("novelty/g0/mean", 5, 4)
