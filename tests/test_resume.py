"""``proteus run --resume DIR``: a run killed after its second task goes on from its knowledge base's last
committed task and ends with the results.json of an uninterrupted run (wall-clock times aside)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proteus.cli import main
from proteus.faults import ENV
from runresults import computed
from tiny import sets

SETS = sets("benchmark.max_train_per_class=20", "report.figures=false", "report.latency=false")
ARGS = ["--benchmark", "quickstart", "--method", "proteus", "-q", *SETS]
TIMING = ("seconds", "latency", "figures", "peak_gpu_mb")


def _plain(d: Any) -> Any:
    return computed(d, drop=lambda k: any(t in k for t in TIMING))


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_results(tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["run", *ARGS, "--out", str(whole)]) == 0
    env = {**os.environ, ENV: "learn:prefix@3", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "proteus", "run", *ARGS, "--out", str(cut)], env=env)
    assert p.returncode == -signal.SIGKILL and not (cut / "results.json").exists()
    assert main(["run", "--resume", str(cut), "-q"]) == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (whole, cut))
    assert _plain(a) == _plain(b)
    rows = (cut / "train_log.csv").read_text().splitlines()
    assert rows[0].startswith("task,") and {r.split(",")[0] for r in rows[1:]} == {"1", "2", "3", "4", "5"}


def test_resume_refuses_a_finished_run_and_other_options(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path), "--seed", "3"]) == 2
    assert "drop --seed" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("method: proteus\n")
    (tmp_path / "results.json").write_text("{}")
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "nothing to resume" in capsys.readouterr().err
