"""``adapter.*``: the adaptive LoRA update of each task (Eq. 9: old frozen rank-1 directions mixed by a
sparse diagonal S, plus r new directions; Eq. 15: the new ones orthogonal to the old, an elastic net on S)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, UNIT, Interval, option
from proteus.registry import Registry

__all__ = ["S_UPDATES", "TRANSFER_INIT", "AdapterConfig"]

#: ``adapter.s_update``: how S is updated (:data:`proteus.engine.trainer.S_UPDATES`, which registers them:
#: created here, beside the option that names it)
S_UPDATES: Registry[Any] = Registry("adapter.s_update", plugins=("proteus.engine.trainer",))

#: ``adapter.transfer`` -> how S starts: learned from 0 (Eq. 15), fixed at 0 or fixed at 1
TRANSFER_INIT = {"learned": None, "zero": 0.0, "identity": 1.0}


@dataclass
class AdapterConfig:
    """Eq. 9 and Eq. 15: old frozen rank-1 directions mixed by S, plus r new orthogonal ones."""

    enabled: bool = option(True, help="train a LoRA adapter at all (false: the frozen backbone)")
    rank: int = option(4, help="r: the new directions each task adds per adapted map", range=AT_LEAST_1)
    scaling: float = option(
        1.0, help="factor on every adapter update (the paper has none: 1)", range=Interval(-1000, 1000)
    )
    transfer: str = option(
        "learned",
        help="how old directions enter a new task: learned (S*, Eq. 15), zero (S = 0), identity (S = I)",
        choices=TRANSFER_INIT,
    )
    orthogonal: bool = option(
        True, help="keep each new A in the orthogonal complement of the old A's span (Eq. 15's constraint)"
    )
    lam: float = option(
        0.006, help="lambda: the elastic net's weight on S (the paper: 0.006)", range=NON_NEGATIVE
    )
    lam_decay: float = option(
        0.8, help="lambda's factor per task (the paper: 20% less each task)", range=Interval(0, 1, "right")
    )
    alpha: float = option(0.8, help="alpha: the elastic net's L1 share (the paper: 0.8)", range=UNIT)
    s_update: str = option(
        "prox",
        help="how S is trained: prox (a proximal soft-threshold step after each SGD step) or adam (with the "
        "LoRA optimiser and a subgradient of the penalty)",
        choices="adapter.s_update",
    )
    s_lr: float = option(0.05, help="the learning rate of S's proximal step", range=POSITIVE)
    budget_decay: float | None = option(
        None,
        help="the rank budget: r_m = round(r_0 exp(-budget_decay (m - 1))) (null: a fixed rank)",
        range=NON_NEGATIVE,
    )
    min_rank: int = option(1, help="the budget schedule's smallest rank", range=AT_LEAST_1)
    blocks: str = option(
        "all",
        help="which of the adaptable blocks (every block, or the last backbone.adapt_last) carry adapters: "
        "all, first:K, last:K (K blocks, or a share P/Q of them rounded: first:2/3) or block indices "
        "counted from the first adaptable block (0,1,5)",
    )
