"""``make gpu-check`` (tools/gpu_check.py) without a GPU says so and exits 0; its CPU dry run of every
step is the way its plumbing is exercised here (``python tools/gpu_check.py --device cpu``, ~3 minutes,
not part of the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run `make gpu-check` itself")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and "no CUDA GPU" in p.stdout, p.stdout + p.stderr
    assert json.loads(out.read_text())["skipped"] == "no CUDA GPU"
