"""What depends on the device beyond where tensors live (the device itself:
:func:`proteus.distributed.device_for_rank`).

* The numeric precision of the backbone's forward passes: bfloat16 autocast on CUDA by default, float32
  elsewhere (``precision`` in the config; ``--precision`` on the command line). Only the backbone runs
  under autocast: the DP-GMM signatures (Eq. 18), the retrieval scores and the RanPAC head (Eq. 23) compute
  in float32 or float64 on the embeddings cast back to float32.
* Sums by class that give the same bits in every process (:func:`index_add`): a knowledge base learned
  task by task in separate processes, or recovered after a crash, must equal the one a single run writes.
* Clocks that wait for the device's queued work (per-phase timings of GPU work), and peak GPU memory.
* ``torch.compile`` of the backbone's inference forwards (``compile`` in the config,
  :class:`CompiledForward`): the issue's "``torch.compile`` as an option measured in the bench"; eager
  when it cannot compile.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a function needs it: the CLI's parser reads this module's names
    import torch

__all__ = [
    "COMPILE_MODES",
    "PRECISIONS",
    "CompiledForward",
    "Precision",
    "autocast",
    "autocast_dtype",
    "clock",
    "compile_failure",
    "compiles",
    "index_add",
    "peak_memory_mb",
    "reset_peak_memory",
]


@dataclass(frozen=True)
class Precision:
    """How the backbone's forward passes compute: autocast to ``dtype`` (None: plain float32), on CUDA only
    (``cuda_only``), and with float32 matmuls and convolutions on TF32 tensor cores (``tf32``, CUDA)."""

    #: the name of a torch dtype (``bfloat16``)
    dtype: str | None
    cuda_only: bool = False
    tf32: bool = False


#: ``precision``: ``auto`` (bf16 autocast on CUDA, fp32 elsewhere), ``bf16`` (also on the CPU: slower there,
#: but the numbers of a GPU's bf16 forward, which is how that path is tested without a GPU), ``fp32`` (exact
#: reproduction), ``tf32`` (float32 tensors, TF32 matmuls on CUDA: about 3 significant digits fewer in
#: each product, several times faster on Ampere and later; the same as fp32 elsewhere)
PRECISIONS: dict[str, Precision] = {
    "auto": Precision("bfloat16", cuda_only=True),
    "bf16": Precision("bfloat16"),
    "fp32": Precision(None),
    "tf32": Precision(None, tf32=True),
}


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The dtype the backbone's forward passes autocast to on ``device`` (None: plain float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    import torch

    p = PRECISIONS[precision]
    return None if p.dtype is None or (p.cuda_only and device.type != "cuda") else getattr(torch, p.dtype)


@contextlib.contextmanager
def autocast(device: torch.device, precision: str = "auto") -> Iterator[None]:
    """The precision context of the backbone's forward passes on ``device`` (autocast, TF32 switches; the
    switches are restored on exit)."""
    import torch

    dtype = autocast_dtype(device, precision)
    tf32 = PRECISIONS[precision].tf32 and device.type == "cuda"
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            yield
    finally:
        if tf32:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


#: ``compile``: ``none`` (eager, the default: the numbers every release wrote) or the ``torch.compile`` mode
#: of the backbone's inference forwards (same results to float round-off: fused kernels may sum in another
#: order)
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")


def compiles(mode: str) -> bool:
    """Whether ``compile`` mode ``mode`` compiles the forwards (every mode but the eager ``none``)."""
    return mode != COMPILE_MODES[0]


#: the ``torch.compile`` backend of :class:`CompiledForward` (tests use ``eager``: no C++ build)
COMPILE_BACKEND = "inductor"

#: why ``torch.compile`` failed in this process (set once; every compiled forward then runs eagerly)
_compile_failure: str | None = None


def compile_failure() -> str | None:
    """Why ``torch.compile`` failed in this process (None: it has not)."""
    return _compile_failure


class CompiledForward:
    """``fn`` compiled by ``torch.compile(mode=mode, dynamic=True)`` on its first call, for any device and
    dtype. Batches of other sizes reuse one graph with a symbolic batch size (ints held by modules, such
    as a LoRA wrapper's group count, are symbolic too), so a stream of varying batches compiles a few
    graphs, not one per size. If compiling or running the compiled graph fails (no C++ compiler, an op
    the compiler does not support), the call runs ``fn`` eagerly, one warning naming the ``compile`` key
    is given, and every compiled forward of the process stays eager from then on; an error that the
    eager ``fn`` raises too is raised as is."""

    def __init__(self, fn: Callable[..., Any], mode: str) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
        self.fn, self.mode = fn, mode
        self._compiled: Callable[..., Any] | None = None

    @property
    def active(self) -> bool:
        """Whether calls go through ``torch.compile`` (not ``none``, and nothing failed to compile)."""
        return compiles(self.mode) and _compile_failure is None

    def __call__(self, *args: Any) -> Any:
        global _compile_failure
        import torch

        if not self.active:
            return self.fn(*args)
        try:
            if self._compiled is None:
                mode = None if self.mode == "default" else self.mode
                self._compiled = torch.compile(self.fn, mode=mode, dynamic=True, backend=COMPILE_BACKEND)
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
                return self._compiled(*args)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler falls back to eager
            out = self.fn(*args)  # an error of the forward itself is raised here, not hidden
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            _compile_failure = f"{type(e).__name__}: {reason}"
            warnings.warn(
                f"compile={self.mode!r}: torch.compile failed ({_compile_failure}); the backbone's forward "
                "passes run eagerly in this process (set compile=none to silence this)",
                RuntimeWarning,
                stacklevel=2,
            )
            return out


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_mb` (CUDA; nothing elsewhere)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak GPU memory allocated since the last :func:`reset_peak_memory` (MiB); None off CUDA."""
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def index_add(
    target: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, one_hot: bool | None = None
) -> torch.Tensor:
    """``target.index_add_(dim, index, source)`` for 2-D tensors (``dim`` 0 or 1), in place, with the same
    result in every run. CUDA's ``index_add_`` sums with atomics in an order that changes from run to run, so
    two processes that learn the same task stored heads that differed in the last bits (found by the first
    ``make gpu-check``'s test run on a GPU); there (``one_hot=None`` on CUDA, or ``one_hot=True``) the rows
    are summed by one product with a one-hot matrix, whose order is fixed. Elsewhere ``index_add_`` as is."""
    import torch

    if not (one_hot if one_hot is not None else target.device.type == "cuda"):
        return target.index_add_(dim, index, source)
    n, k = index.shape[0], target.shape[dim]
    hot = torch.zeros(n, k, dtype=source.dtype, device=source.device)
    hot[torch.arange(n, device=source.device), index.to(source.device)] = 1
    return target.add_(hot.T @ source if dim == 0 else source @ hot)
