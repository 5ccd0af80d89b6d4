"""Test-suite settings and shared fixtures (helpers to import live in :mod:`tiny`).

The knowledge bases' record of what was verified (:mod:`proteus.kb.verified`) goes to a temporary folder.
One intra-op thread: the suite is made of many small linear-algebra calls (eigh, Cholesky on a few
hundred dimensions), which run ~100x slower when two threads contend on a 2-core machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# what the stores verified (proteus.kb.verified) goes to a folder of this run, not the user's cache
if "PROTEUS_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PROTEUS_CACHE_DIR"] = tempfile.mkdtemp(prefix="proteus-test-cache-")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import TINY, folder_args, make_tree, write_spec  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder benchmark of 2 tasks (classes a, b | c, d; 5 training and 2 test images per class) and a
    KB with task 1 learned through the real CLI, built once per test module: ``tree``, ``spec``, ``kb1``
    (copy it before writing to it) and ``root``. (test_crash_safety.py has a ``world`` of its own.)"""
    from proteus.cli import main

    root = tmp_path_factory.mktemp("world")
    tree = make_tree(root / "data", classes="abcd", n_train=5, n_test=2)
    spec = write_spec(root / "spec.yaml", [["a", "b"], ["c", "d"]])
    kb = root / "kb1"
    assert main(["learn", "--kb", str(kb), "--task", "1", *folder_args(tree, spec), *TINY]) == 0
    return {"tree": tree, "spec": spec, "kb1": kb, "root": root}


#: the longest files, longest first (seconds each alone on 2 cores, measured: compile ~60-200 with a cold
#: inductor cache, distributed ~105, executors ~95, crash_safety ~55, wheel ~40): handed out before the
#: other files, so that no worker starts one of them while the other is near its end
LONGEST = (
    "test_compile.py",
    "test_distributed.py",
    "test_executors.py",
    "test_crash_safety.py",
    "test_wheel.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files (:data:`LONGEST`) first, then the other files holding end-to-end tests (marked
    ``slow``), in their collected order, the others after: pytest-xdist hands out whole files in this
    order (``make test`` passes ``--no-loadscope-reorder``), so the long files start early and the short
    ones fill in at the end, instead of one worker running the last long file while the other waits."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[int, int]:
        if item.path.name in LONGEST:
            return 0, LONGEST.index(item.path.name)
        return (1 if item.path in slow else 2), 0

    items.sort(key=rank)  # (a stable sort: the order within stays)
