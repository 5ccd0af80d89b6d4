"""Which adapters a method trains, and which composition of them embeds an input (Eq. 9, Alg. 2).

Two registries, one per config key:

* :data:`TRAIN_SCHEDULES` (``train.tasks``): ``all`` (PROTEUS: every task trains its adapter),
  ``first`` (RanPAC: only task 1), ``none`` (a frozen backbone);
* :data:`COMPOSITIONS` (``retrieval.mode``): ``signature`` (PROTEUS: the retrieved task's own adapter),
  ``first`` (RanPAC), ``last`` (InfLoRA / SD-LoRA style: the most recent adapter), ``all-units`` (every
  unit up to the task summed, O-LoRA-like), ``none`` (the frozen backbone).

A composition answers two questions: whether inputs are routed by task retrieval, and which
``(tasks, kind)`` embeds the inputs of the head after task k (the ``kind`` is a
:meth:`~proteus.adapters.lora.LoRAUnit.coefficients` kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proteus.config import schema
from proteus.registry import Registry
from proteus.signatures import options as signature_options

__all__ = ["COMPOSITIONS", "TRAIN_SCHEDULES", "Composition"]

TRAIN_SCHEDULES: Registry[Callable[[int], bool]] = schema.TRAIN_SCHEDULES
#: traits: ``trains`` (some task trains an adapter, so ``train.*`` and ``adapter.*`` are read),
#: ``first_session`` (only the first task does: RanPAC's first-session adaptation)
TRAIN_SCHEDULES.register("all", help="every task trains its adapter", trains=True)(lambda k: True)
TRAIN_SCHEDULES.register(
    "first", help="only the first task trains an adapter (RanPAC)", trains=True, first_session=True
)(lambda k: k == 0)
TRAIN_SCHEDULES.register("none", help="no adapter (frozen backbone)", trains=False)(lambda k: False)


def _newest(k: int, m: int) -> int | None:
    return min(k, m - 1)


def _first(k: int, m: int) -> int | None:
    return 0


def _frozen(k: int, m: int) -> int | None:
    return None


@dataclass(frozen=True)
class Composition:
    """How inputs are embedded for the head. ``retrieves``: by the retrieved task's own adapter;
    otherwise ``adapter(k, m)`` names the adapter as of task k with m adapters learned: the newest, the
    first, or None (the frozen backbone)."""

    retrieves: bool
    adapter: Callable[[int, int], int | None] = _newest
    kind: str = "task"

    def head_tasks(self, k: int, m: int) -> tuple[list[int] | None, str]:
        """``(tasks, kind)`` embedding the head's inputs as of task k (0-based) with m adapters learned
        (``tasks=None``: the frozen backbone). With retrieval, task k's own adapter (or the newest)."""
        j = self.adapter(k, m) if m else None
        return (None, "task") if j is None else ([j], self.kind)


COMPOSITIONS: Registry[Composition] = signature_options.COMPOSITIONS
COMPOSITIONS.register("signature", help="the retrieved task's adapter (Alg. 2)")(Composition(retrieves=True))
COMPOSITIONS.register("first", help="the first task's adapter (RanPAC)")(Composition(False, _first))
COMPOSITIONS.register("last", help="the newest adapter (InfLoRA / SD-LoRA style)")(
    Composition(False, _newest)
)
COMPOSITIONS.register("all-units", help="all units summed (O-LoRA-like)")(
    Composition(False, _newest, "all-units")
)
COMPOSITIONS.register("none", help="the frozen backbone")(Composition(False, _frozen))
