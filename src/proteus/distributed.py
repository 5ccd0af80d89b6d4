"""Data-parallel runs on PyTorch's own engine (``torch.distributed``, launched by ``torchrun``).

The paper trains on 2 GPUs (App. "Datasets, Hyperparameters"). ``torchrun --nproc_per_node=N -m proteus run
...`` starts N processes; :func:`init_from_env` reads torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins the default process group: NCCL with
``cuda:LOCAL_RANK`` when CUDA is available, gloo on the CPU. Under torchrun the group is joined whatever the
number of processes, so ``torchrun --nproc_per_node=1`` runs every collective through the backend (how NCCL
is checked on a machine with one GPU; the results equal a plain run's). Without those variables (a plain
``proteus`` process) every helper here is a no-op, so single-process code pays nothing.

How the learner uses it (:mod:`proteus.learner`, :mod:`proteus.runner`):

* **Embedding passes** (the frozen prefix of a dataset, the suffix under one or more adapters, i.e. the
  training-set embeddings for the signature and the head, and every evaluation pass) are sharded by whole
  batches: rank r takes the contiguous block :func:`shard_range` of the batch list, and
  :func:`all_gather_rows` concatenates the ranks' outputs in rank order, which is the original order. Each
  batch is the same batch a single process would run, so the gathered tensor is bit-identical to the
  single-process one (given the same per-process thread count).
* **Adapter training** (Eq. 15): every rank draws the same permutation and the same batches; rank r runs
  the forward and backward on its contiguous shard of each batch, with its cross-entropy weighted by
  ``len(shard) / len(batch)``; the gradients of all trainable tensors (new LoRA directions, S, the
  temporary classifier) are summed across ranks in one flat ``all_reduce``. The sum is exactly the
  gradient of the full batch's mean loss (a DistributedDataParallel average would be off when the last
  batch does not split evenly), so Adam, and the proximal elastic-net step on S, get identical inputs and
  take identical steps on every rank. The trained tensors are broadcast from rank 0 once at the end of
  the task, so every rank freezes bit-identical adapters whatever the hardware.
  A manual all-reduce was chosen over DistributedDataParallel because the trainable tensors are not the
  parameters of one module (they are created per task inside the LoRA units, and S is updated outside the
  optimiser), DDP would broadcast the whole frozen backbone at construction, and DDP averages per-rank
  means instead of weighting them by shard size.
* **Signature fit and head update** run on every rank on the gathered (identical) embeddings: they are
  cheap next to the embedding passes, and every rank then holds the same learner without a broadcast.
* **Writes**: only rank 0 writes the knowledge base, results.json and logs; the others wait at a
  :func:`barrier` and read the committed manifest back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from proteus.errors import ProteusError

__all__ = [
    "DeviceError",
    "all_gather_rows",
    "all_reduce_sum_",
    "barrier",
    "broadcast_",
    "describe",
    "device_for_rank",
    "env_world_size",
    "init_from_env",
    "is_distributed",
    "launched_by_torchrun",
    "is_main",
    "local_rank",
    "rank",
    "shard_range",
    "shutdown",
    "world_size",
]


# ---------------------------------------------------------------------------------------------- setup
def env_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when absent)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def local_rank() -> int:
    """``LOCAL_RANK`` as torchrun sets it (0 when absent): this process's GPU on its node."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def launched_by_torchrun() -> bool:
    """Whether torchrun (``torch.distributed.run``) started this process, whatever its number of processes."""
    return "TORCHELASTIC_RUN_ID" in os.environ or env_world_size() > 1


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0, device: str | None = None) -> bool:
    """Join the default process group from torchrun's environment; True when this process is in one.

    ``backend=None`` picks ``nccl`` when CUDA is available and the requested ``device`` is not the CPU (and
    binds this process to ``cuda:LOCAL_RANK``), else ``gloo`` (``--device cpu`` on a GPU machine runs on the
    CPU: NCCL there would bind each rank to a GPU it may not have). Does nothing (returns False) outside
    torchrun, and nothing more when already joined. A torchrun world of one joins too: every collective
    then runs through the backend with one rank.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if not launched_by_torchrun() or not dist.is_available():
        return False
    if backend is None:
        on_cpu = device is not None and str(device).strip().lower().startswith("cpu")
        backend = "nccl" if torch.cuda.is_available() and not on_cpu else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    """Leave the process group (safe to call when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """Whether this process is in a process group (a torchrun launch, of any size)."""
    return dist.is_available() and dist.is_initialized()


def describe() -> str:
    """``"torch.distributed: nccl, 2 processes"``, or ``"one process"`` outside a process group."""
    if not is_distributed():
        return "one process"
    n = dist.get_world_size()
    return f"torch.distributed: {dist.get_backend()}, {n} process{'es' if n != 1 else ''}"


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on rank 0 (and in a plain single process): the process that writes files."""
    return rank() == 0


class DeviceError(ProteusError, ValueError):
    """A requested device that does not exist on this machine; the message says what to use instead."""


#: the device names :func:`device_for_rank` accepts (``mps`` too, where torch has an Apple GPU)
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def _cuda_build() -> str:
    return f"yes, CUDA {torch.version.cuda}" if torch.version.cuda else "no"


def _torch_version() -> str:
    return torch.__version__.split("+")[0]


def known_device(name: object) -> bool:
    """Whether ``name`` is a device name :func:`device_for_rank` knows (``auto``, ``cpu``, ``cuda``,
    ``cuda:N``, ``mps``, any case), whether or not that device exists on this machine."""
    if not isinstance(name, str):
        return False
    kind, colon, index = name.strip().lower().partition(":")
    if not colon:
        return kind in ("auto", "cpu", "cuda", "mps")
    return kind in ("cpu", "cuda", "mps") and index.isascii() and index.isdigit()


def device_for_rank(name: str) -> torch.device:
    """The device ``name`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, or ``mps`` where available) denotes.

    ``auto`` is CUDA when torch sees a GPU, else the CPU; ``auto``/``cuda`` mean the current GPU by its index
    (``cuda:0``), under torchrun ``cuda:LOCAL_RANK``. A device that does not exist here raises
    :class:`DeviceError` (a ``ValueError``):

    * ``"device 'cuda' was requested but no CUDA GPU is visible to torch (torch X.Y, CUDA build: yes/no);
      use --device cpu"``;
    * ``"device 'cuda:N' was requested but torch sees only K CUDA GPU(s) (cuda:0 .. cuda:K-1); ..."``;
    * ``"unknown device 'tpu'; use auto, cpu, cuda or cuda:N"`` for any other name.
    """
    raw = name
    key = str(name).strip().lower()
    if key == "auto":
        key = "cuda" if torch.cuda.is_available() else "cpu"
    if key == "cpu":
        return torch.device("cpu")
    if key.startswith("cpu:") and key[len("cpu:") :].isdigit():
        return torch.device(key)
    if key == "mps" or key.startswith("mps:"):
        mps = getattr(torch.backends, "mps", None)
        if key in ("mps", "mps:0") and mps is not None and mps.is_available():
            return torch.device("mps")
        raise DeviceError(
            f"device {raw!r} (Apple GPU) is not available to torch {_torch_version()} on this machine; "
            f"use {DEVICE_CHOICES}"
        )
    if key == "cuda" or key.startswith("cuda:"):
        index: int | None = None
        if key != "cuda":
            suffix = key[len("cuda:") :]
            if not suffix.isdigit():
                raise DeviceError(f"unknown device {raw!r}; use {DEVICE_CHOICES} (N = 0, 1, ...)")
            index = int(suffix)
        if not torch.cuda.is_available():
            hint = ""
            if torch.version.cuda and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
                hint = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
            raise DeviceError(
                f"device {raw!r} was requested but no CUDA GPU is visible to torch (torch "
                f"{_torch_version()}, CUDA build: {_cuda_build()}){hint}; use --device cpu"
            )
        count = torch.cuda.device_count()
        if index is None and is_distributed():
            index = local_rank()
            if index >= count:
                raise DeviceError(
                    f"device {raw!r} under torchrun means cuda:LOCAL_RANK = cuda:{index}, but torch sees "
                    f"only {count} CUDA GPU(s) on this node; start at most {count} processes per node "
                    "(--nproc_per_node) or use --device cpu"
                )
        if index is None:  # the current GPU, by its index: a plain run and torchrun record the same name
            return torch.device("cuda", torch.cuda.current_device())
        if index >= count:
            raise DeviceError(
                f"device {raw!r} was requested but torch sees only {count} CUDA GPU(s) "
                f"(cuda:0 .. cuda:{count - 1}); use one of those, or --device cuda"
            )
        return torch.device("cuda", index)
    raise DeviceError(f"unknown device {raw!r}; use {DEVICE_CHOICES}")


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if not is_distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- sharding
def shard_range(n: int, r: int | None = None, w: int | None = None) -> range:
    """Rank r's contiguous block of ``range(n)``: ``[n r / w, n (r + 1) / w)``. The blocks of ranks
    0..w-1 concatenate to ``range(n)`` in order; their sizes differ by at most one."""
    r = rank() if r is None else r
    w = world_size() if w is None else w
    return range(n * r // w, n * (r + 1) // w)


# ---------------------------------------------------------------------------------------------- collectives
def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` along dim 0, in rank order (row counts may differ).

    A rank with no rows passes ``None`` (its trailing shape and dtype are taken from the others). Returns
    ``None`` only when every rank passed ``None``. In a single process returns ``t`` unchanged.
    """
    if not is_distributed():
        return t
    meta = None if t is None else (int(t.shape[0]), tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))
    metas: list = [None] * world_size()
    dist.all_gather_object(metas, meta)
    shapes = {(m[1], m[2]) for m in metas if m is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise RuntimeError(f"all_gather_rows: ranks disagree on trailing shape or dtype: {sorted(shapes)}")
    trail, dtype_name = next(iter(shapes))
    dtype = getattr(torch, dtype_name)
    counts = [0 if m is None else m[0] for m in metas]
    out_device = t.device if t is not None else torch.device("cpu")
    dev = _comm_device()
    n_max = max(counts)
    buf = torch.zeros((n_max, *trail), dtype=dtype, device=dev)
    if t is not None and t.shape[0]:
        buf[: t.shape[0]] = t.to(dev)
    parts = [torch.empty_like(buf) for _ in counts]
    dist.all_gather(parts, buf)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(out_device)


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks, in place (through the backend's device); returns ``t``."""
    if not is_distributed():
        return t
    dev = _comm_device()
    buf = t.to(dev)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if buf is not t:
        t.copy_(buf)
    return t


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (one flat broadcast)."""
    if not is_distributed() or not tensors:
        return
    dev = _comm_device()
    flat = torch.cat([t.detach().reshape(-1).to(dev, torch.float64) for t in tensors])
    dist.broadcast(flat, src=src)
    i = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[i : i + n].view_as(t).to(t.dtype))
            i += n
