"""A result's provenance (``proteus.experiment.provenance``): the checkout's commit, package versions,
device and threads, and how several runs' provenances merge."""

from __future__ import annotations

import subprocess
from pathlib import Path

from proteus.experiment.provenance import UNKNOWN, git_state, merged, provenance

ROOT = Path(__file__).resolve().parents[1]


def test_provenance_of_this_process() -> None:
    p = provenance("cpu")
    assert p["device"] == "cpu" and p["threads"] >= 1
    assert {"proteus", "torch", "numpy", "scikit-learn", "python"} <= set(p["versions"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit is HEAD's
        assert p["commit"] == head.stdout.strip() and p["dirty"] in (True, False)
    else:
        assert p["commit"] == UNKNOWN


def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    assert git_state(tmp_path) == (UNKNOWN, None)


def test_merged() -> None:
    a = {"commit": "a" * 40, "dirty": False, "device": "cpu", "threads": 2, "versions": {"torch": "2.1"},
         "time": "2026-01-02T00:00:00Z"}  # fmt: skip
    b = {**a, "threads": 1, "time": "2026-01-01T00:00:00Z"}
    m = merged([a, b])
    assert m["commit"] == "a" * 40 and m["threads"] == [1, 2] and m["versions"]["torch"] == "2.1"
    assert m["time"] == ["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"] and m["runs"] == 2
    old = merged([a, None])  # a run of an earlier release: no provenance
    assert old["commit"] == ["a" * 40, UNKNOWN] and old["versions"]["torch"] == ["2.1", UNKNOWN]
    assert merged([]) == {}
    record = merged([a, {"commit": UNKNOWN, "versions": UNKNOWN}])  # a record made before provenance
    assert record["versions"]["torch"] == ["2.1", UNKNOWN] and record["commit"] == ["a" * 40, UNKNOWN]
    twice = merged([m, {**a, "time": "2026-01-03T00:00:00Z"}])  # a merged provenance's span, and one more run
    assert twice["time"] == ["2026-01-01T00:00:00Z", "2026-01-03T00:00:00Z"]
    again = merged([old, {**a, "commit": "b" * 40, "threads": [1, 2]}])  # merged ones: their values, flat
    assert again["commit"] == ["a" * 40, "b" * 40, UNKNOWN] and again["threads"] == [UNKNOWN, 1, 2]
    assert again["versions"]["torch"] == ["2.1", UNKNOWN]


def test_two_runs_agree_on_what_they_computed_whatever_their_provenance_and_times() -> None:
    """``computed`` keeps what two runs of the same settings must agree on: a plain run and one under
    ``torchrun`` differ in their provenance (its time) and their seconds, not in their results
    (``tools/gpu_check.py`` and ``tools/parity`` compare runs through it)."""
    from proteus.experiment.results import computed

    def run(acc: float) -> dict:
        return {"final_avg_acc": acc, "seconds": 3.2, "tasks": [{"avg_acc": acc, "train_seconds": 1.0}],
                "provenance": provenance(), "latency": {"p50": 0.1}, "peak_gpu_mb": 10.0}  # fmt: skip

    a, b = run(0.5), run(0.5)
    b["provenance"]["time"], b["seconds"], b["tasks"][0]["train_seconds"] = "another time", 9.9, 2.0
    assert computed(a) == computed(b) == {"final_avg_acc": 0.5, "tasks": [{"avg_acc": 0.5}]}
    assert computed(run(0.5)) != computed(run(0.25))
