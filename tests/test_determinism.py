"""Determinism (issue 4): the same seed and configuration give the same results.json on the CPU.

Two runs of the tiny 5-task quickstart, one in this process and one in a fresh ``python -m proteus run``
process (so no import-time or cached state can hide a difference), both with one intra-op thread
(tests/conftest.py here, ``OMP_NUM_THREADS=1`` there: BLAS results are reproducible for a
fixed thread count, and one thread keeps MKL fast on a busy 2-core machine). Only wall-clock timings may
differ: every key containing ``seconds`` is dropped; everything else -- accuracy matrix, retrieval and
oracle accuracies, per-task statistics (losses, S sparsity, gamma, signature components) and
``kb_bytes`` -- must be equal, and so must every KB object hash and the KB manifest apart from its
time stamps (``created``, ``updated``, each task's ``learned``) and its random identity ``kb_id``; the
manifest checksum, which leaves those out, is equal too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbfiles import read_manifest
from proteus.cli import main
from runresults import computed
from tiny import sets

pytestmark = pytest.mark.slow

ARGS = [
    "run", "--benchmark", "quickstart", "--backbone", "vit_ti16", "--seed", "3", "--device", "cpu", "-q",
    *sets("benchmark.max_train_per_class=40"),
]  # fmt: skip


TIME_STAMPS = ("created", "updated", "learned", "kb_id")  # the checksum leaves them out: it must be equal


def _strip(d):
    return computed(d, drop=lambda k: k in TIME_STAMPS)


def test_same_seed_same_results(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # the two runs are independent (one thread each): the fresh process runs while this one does
    proc = subprocess.Popen(
        [sys.executable, "-m", "proteus", *ARGS, "--out", str(b)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert main([*ARGS, "--out", str(a)]) == 0
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    ra = json.loads((a / "results.json").read_text())
    rb = json.loads((b / "results.json").read_text())
    assert "kb_bytes" in ra and ra["tasks"][1]["train"]["loss_last"] is not None
    assert _strip(ra) == _strip(rb)
    ma, mb = read_manifest(a / "kb"), read_manifest(b / "kb")
    assert ma["checksum"] == mb["checksum"]  # the content, every object's sha256 included
    # what hashes time stamps (the record segments' names, hence the parent manifests') aside, the same
    content = ("segments", "parent")
    assert _strip({k: v for k, v in ma.items() if k not in content}) == _strip(
        {k: v for k, v in mb.items() if k not in content}
    )
    assert sorted(p.name for p in (a / "kb" / "objects").glob("*.safetensors")) == sorted(
        p.name for p in (b / "kb" / "objects").glob("*.safetensors")
    )
    assert (a / "split.json").read_text() == (b / "split.json").read_text()
