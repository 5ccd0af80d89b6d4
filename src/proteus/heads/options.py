"""``head.*``: RanPAC's ridge (LDA) head on the accumulated G and e(c) (Alg. 1 lines 8-12, Eq. 23)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proteus.options import MAX_SQUARE_SIDE, Interval, option
from proteus.registry import Registry

__all__ = ["HEAD_SCOPES", "HeadConfig"]

#: ``head.scope``: the head over every class or one per task (:data:`proteus.engine.experts.HEAD_SCOPES`,
#: which registers them: created here, beside the option that names it)
HEAD_SCOPES: Registry[Any] = Registry("head.scope", plugins=("proteus.engine.experts",))


@dataclass
class HeadConfig:
    """Eq. 23 / Alg. 1 lines 8-12: RanPAC's ridge (LDA) head on accumulated G and e(c)."""

    rp_dim: int = option(
        10000,
        help="M: the random projection's width, with ReLU, in front of the head (RanPAC uses 10000; the "
        "paper writes Eq. 23 on h: 0 disables the projection)",
        range=Interval(0, MAX_SQUARE_SIDE),
    )
    gamma_min_exp: int = option(-8, help="the ridge grid's smallest exponent: gamma from 10^min")
    gamma_max_exp: int = option(14, help="the ridge grid's end exponent (excluded): gamma below 10^max")
    holdout: float = option(
        0.2,
        help="the share of a task's data that scores the ridge candidates",
        range=Interval(0, 1, "neither"),
    )
    gamma_selection: str = option(
        "accumulated",
        help="how gamma is chosen: accumulated (ridge on all statistics so far, scored on the task's "
        "held-out part) or task (RanPAC's rule: this task's data alone)",
        choices="head.gamma_selection",
    )
    prototypes: str = option(
        "sum",
        help="the class prototypes e(c): sum (RanPAC's code: class sums) or task-mean (Alg. 1 line 11: each "
        "task's sums divided by |D_k|)",
        choices="head.prototypes",
        legacy="sum",
    )
    forgettable: bool = option(
        False,
        help="keep each task's training embeddings in the knowledge base so that `proteus kb forget` can "
        "subtract the task from the head exactly (the knowledge base then holds per-image data)",
        legacy=False,
    )
    scope: str = option(
        "task",
        help="the head that classifies once the task is known: global (Eq. 23, one head over every class) "
        "or task (beyond the paper: each task's own ridge head, fitted when the task is learned)",
        choices="head.scope",
        legacy="global",
    )
