"""Data-parallel runs (issue 4): ``torchrun --nproc_per_node=2 -m proteus run`` with gloo on the CPU.

The 2-process run must equal the single-process run:

* exactly (results.json minus wall-clock timings and the logged losses, and every KB object hash) when
  the gradient steps cannot move the adapters (``adapter.scaling=0``: the LoRA update is zero, so its
  gradients are zero and Adam leaves it as initialised; adapters are still created, the steps taken and
  their gradients all-reduced, signatures fitted, the head accumulated and every embedding and
  evaluation pass sharded across the ranks and gathered back), because each rank runs whole batches that
  a single process would run, in the same order; the logged cross-entropy of the throw-away classifier
  differs by the summation order only (and so may the manifest's size, which records it);
* within a tolerance when the adapters are trained: each rank's forward and backward covers its half of
  every batch and the gradients are summed, so the gradient equals the single-process one up to the
  summation order (float32 round-off, ~1e-7 relative). We allow |accuracy difference| <= 2 points per
  entry of the accuracy matrix and of the retrieval accuracies, and 1e-3 on the logged losses.

The settings make the sharding non-trivial: an eval batch of 8 gives 25 prefix batches of task data and
two embedding chunks (one per rank), and a training batch of 25 splits 12/13 between the ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proteus.cli import main
from proteus.kb import KnowledgeBase
from runresults import computed
from tiny import TINY_SETS, sets

pytestmark = pytest.mark.slow

ARGS = [
    "--benchmark", "quickstart", "--num-tasks", "2", "--backbone", "vit_ti16", "-q",
    *sets("benchmark.max_train_per_class=40", "eval.batch_size=8", "train.batch_size=25",
           base=[s for s in TINY_SETS if not s.startswith("train.epochs")]),
]  # fmt: skip

ACC_TOL = 2.0  # percentage points
LOSS_TOL = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_torchrun(out: Path, extra: list[str], nproc: int = 2) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        "-m", "proteus", "run", "--out", str(out), "--device", "cpu", *ARGS, *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_torchrun(proc: subprocess.Popen[str]) -> None:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    # one table: ranks other than 0 print nothing
    assert stdout.count("final average accuracy") == 1, stdout


def _torchrun(out: Path, extra: list[str], nproc: int = 2) -> None:
    _finish_torchrun(_start_torchrun(out, extra, nproc))


def _single(out: Path, extra: list[str]) -> None:
    assert main(["run", "--out", str(out), "--device", "cpu", *ARGS, *extra]) == 0


def _strip(d):
    return computed(d, drop=lambda k: k.startswith("loss_") or k == "manifest")


def _hashes(out: Path) -> tuple[list[str], str]:
    m = KnowledgeBase.open(out / "kb").manifest
    return [t["sha256"] for t in m["tasks"]], m["head"]["sha256"]


def _files(out: Path) -> set[str]:
    # objects are named by their content; history/ names each manifest by its bytes' hash (time stamps)
    named = ("objects", "history")
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.parent.name not in named}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain run with one epoch of training, once for the tests that compare a torchrun with it (they
    only read it)."""
    out = tmp_path_factory.mktemp("plain") / "one"
    _single(out, ["--set", "train.epochs=1"])
    return out


def _one_and_two_ranks(tmp_path: Path, *sets: str, one: Path | None = None) -> tuple[dict, dict]:
    """results.json of the same run in one process (``one``: made already) and under torchrun with two
    ranks."""
    extra = [a for s in sets for a in ("--set", s)]
    two = _start_torchrun(tmp_path / "two", extra)  # (independent of the single run: both run at once)
    try:
        if one is None:
            _single(one := tmp_path / "one", extra)
    finally:
        _finish_torchrun(two)
    return json.loads((one / "results.json").read_text()), json.loads(
        (tmp_path / "two" / "results.json").read_text()
    )


def test_two_ranks_equal_one_without_training(tmp_path: Path) -> None:
    one, two = _one_and_two_ranks(tmp_path, "train.epochs=1", "adapter.scaling=0")
    assert all(t["train"]["steps"] > 0 for t in one["tasks"])
    assert _strip(one) == _strip(two)
    assert _hashes(tmp_path / "one") == _hashes(tmp_path / "two")
    assert _files(tmp_path / "one") == _files(tmp_path / "two")  # rank 1 wrote nothing extra


def test_two_ranks_match_one_when_training(tmp_path: Path, trained: Path) -> None:
    one, two = _one_and_two_ranks(tmp_path, "train.epochs=1", one=trained)
    for k, (r1, r2) in enumerate(zip(one["acc_matrix"], two["acc_matrix"])):
        for a, b in zip(r1, r2):
            assert (a is None) == (b is None)
            assert a is None or abs(a - b) <= ACC_TOL, (k, r1, r2)
    for a, b in zip(one["retrieval_acc"], two["retrieval_acc"]):
        assert abs(a - b) <= ACC_TOL
    for t1, t2 in zip(one["tasks"], two["tasks"]):
        assert t1["train"]["steps"] == t2["train"]["steps"] > 0
        for key in ("loss_first", "loss_last"):
            assert abs(t1["train"][key] - t2["train"][key]) <= LOSS_TOL, (key, t1["train"], t2["train"])
    assert _strip(one["kb_bytes"]) == _strip(two["kb_bytes"])  # the manifest records the logged losses


def test_one_rank_under_torchrun_joins_the_group_and_equals_a_plain_run(
    tmp_path: Path, trained: Path
) -> None:
    """``torchrun --nproc_per_node=1`` joins a process group (gloo here, NCCL on a GPU: how `make gpu-check`
    runs NCCL on a machine with one GPU) and runs every collective through it; the results and the
    knowledge base are those of a plain run, bit for bit (trained adapters included)."""
    _torchrun(tmp_path / "rank", ["--set", "train.epochs=1"], nproc=1)
    assert "torch.distributed: gloo, 1 process" in (tmp_path / "rank" / "log.txt").read_text()
    assert "one process" in (trained / "log.txt").read_text()
    one, rank = (json.loads((d / "results.json").read_text()) for d in (trained, tmp_path / "rank"))
    assert all(t["train"]["steps"] > 0 for t in one["tasks"])
    strip = lambda d: {k: v for k, v in _strip(d).items() if k != "kb_bytes"}  # noqa: E731
    assert strip(one) == strip(rank)
    assert [t["train"]["loss_last"] for t in one["tasks"]] == [t["train"]["loss_last"] for t in rank["tasks"]]
    assert _hashes(trained) == _hashes(tmp_path / "rank")


def test_helpers_in_a_single_process() -> None:
    from proteus import distributed as dist

    assert not dist.is_distributed() and dist.rank() == 0 and dist.world_size() == 1 and dist.is_main()
    assert dist.init_from_env() is False  # no torchrun variables here
    dist.barrier()
    t = torch.arange(6.0).reshape(3, 2)
    assert dist.all_gather_rows(t) is t and dist.all_reduce_sum_(t) is t
    blocks = [dist.shard_range(10, r, 3) for r in range(3)]
    assert [list(b) for b in blocks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert [len(dist.shard_range(1, r, 2)) for r in range(2)] == [0, 1]
    assert dist.device_for_rank("cpu") == torch.device("cpu")
