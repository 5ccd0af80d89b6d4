"""The command line's CPU threads (:mod:`proteus.cli.threads`): torch's thread count follows the cores the
process may use (its affinity, within a cgroup quota), OpenMP waits passively, both set before torch loads
and only where the user has not set them; ``--threads`` and the config's ``threads`` override the count.
Each check runs in a fresh interpreter: OpenMP reads its environment once, when torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, sys
from proteus.cli import threads
threads.prepare({threads})
import torch
print(torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
"""


def _probe(threads: int | None = None, cores: set[int] | None = None, **env: str) -> list[str]:
    """(torch's thread count, OMP_WAIT_POLICY) in a fresh interpreter pinned to ``cores``, with ``env``
    added to an environment where neither OMP variable is set."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
    }
    p = subprocess.run(
        [sys.executable, "-c", PROBE.format(threads=threads)],
        capture_output=True, text=True, env={**base, **env}, check=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )  # fmt: skip
    return p.stdout.split()


def test_the_thread_count_follows_the_cores_the_process_may_use() -> None:
    assert _probe(cores={0}) == ["1", "PASSIVE"]


def test_what_the_user_set_wins() -> None:
    """The environment's wait policy and count stay (not the one core pinned); --threads wins over both."""
    assert _probe(cores={0}, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="ACTIVE") == ["2", "ACTIVE"]
    assert _probe(threads=2, cores={0}, OMP_NUM_THREADS="1") == ["2", "PASSIVE"]


def test_a_cgroup_quota_bounds_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proteus.cli import threads

    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "CPU_MAX", cpu_max)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.usable_cores() == 4  # no quota file
    cpu_max.write_text("max 100000\n")
    assert threads.usable_cores() == 4
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: 2 threads
    assert threads.usable_cores() == 2


def test_threads_on_the_command_line_and_in_the_config() -> None:
    from proteus.cli import build_parser
    from proteus.config import resolve_config

    args = build_parser().parse_args(["run", "--benchmark", "quickstart", "--threads", "2"])
    assert args.threads == 2 and args.set == ["threads=2"]  # recorded in the run's config
    assert resolve_config("quickstart", "proteus", sets=args.set).threads == 2
    assert resolve_config("quickstart", "proteus").threads is None  # default: the cores
    assert build_parser().parse_args(["predict", "--kb", "kb", "x.jpg", "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["predict", "--kb", "kb", "x.jpg", "--threads", "0"])
