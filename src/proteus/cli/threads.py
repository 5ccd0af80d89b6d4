"""CPU threads chosen for the machine as it is: a command's torch uses as many intra-op threads as this
process may use cores (:func:`usable_cores`: its CPU affinity, within a cgroup's CPU quota), and OpenMP's
threads wait passively (``OMP_WAIT_POLICY=PASSIVE``): a thread that waits for work sleeps instead of
spinning, so that on a machine busy with other work the command costs wall time, not CPU burnt while its
threads wait for cores that others hold (``tools/perf/busy_demo.py`` measures it).

OpenMP reads its environment once, when torch's library loads, so :func:`prepare` runs first in
:func:`proteus.cli.main`, before any command imports torch. What the user set wins: ``OMP_WAIT_POLICY`` and
``OMP_NUM_THREADS`` in the environment are left as they are, and ``--threads N`` (or the config's
``threads`` key) sets the count.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

__all__ = ["apply", "prepare", "usable_cores"]

#: cgroup v2's CPU quota of this process's group: "<quota> <period>" or "max <period>"
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores() -> int:
    """The cores this process may use: those of its CPU affinity (``taskset``, a batch scheduler's
    binding), at most its cgroup's CPU quota rounded up (``docker --cpus``); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    try:
        quota, period = CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return max(1, cores)


def prepare(threads: int | None) -> None:
    """Before torch loads: OpenMP's passive wait policy unless ``OMP_WAIT_POLICY`` is set, and the thread
    count: ``threads`` when given, else ``OMP_NUM_THREADS`` as the user set it, else :func:`usable_cores`
    (through the environment, read by OpenMP when torch loads; torch's own setter where torch was imported
    already, as by a program that calls :func:`proteus.cli.main`)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return
    apply(threads or usable_cores())


def apply(threads: int) -> None:
    """Use ``threads`` intra-op threads from now on (the config's ``threads``, once a command resolved it)."""
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)
