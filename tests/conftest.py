"""Test-suite settings.

One intra-op thread: the suite is made of many small linear-algebra calls (eigh, Cholesky on a few
hundred dimensions), which run ~100x slower when two threads contend on a 2-core machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
