"""The retrieval-key protocol (Sec. 3.1): what a key strategy is given when a task ends
(:class:`KeyFit`) and what it must do (:class:`RetrievalKeys`); :mod:`proteus.engine.keys` has the
strategies and their registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from proteus.config import SignatureConfig
from proteus.heads import RanPACHead
from proteus.signatures import RetrievalResult, Signature

__all__ = ["KeyFit", "NoKeys", "RetrievalKeys"]


@dataclass
class KeyFit:
    """What a key strategy gets when task k ends: the task's training inputs as cached prefix outputs
    ``z`` with labels ``y``, and ``embed(tasks)``, which embeds ``z`` under the compositions of ``tasks``
    (None: the frozen backbone) as (G, N, d)."""

    k: int
    z: Tensor
    y: Tensor
    num_classes: int
    seed: int
    num_adapters: int
    embed: Callable[[list[int] | None], Tensor]


class RetrievalKeys:
    """Base class: the per-task signatures or key heads, their scores and their knowledge-base share.

    ``space`` says which embeddings :meth:`retrieve` reads: ``adapter`` (every task's own, ``H``),
    ``frozen`` (the frozen backbone's features ``F``) or ``first-adapter`` (``H[0]``)."""

    space = "adapter"

    def __init__(
        self,
        cfg: SignatureConfig,
        top_k: int,
        device: torch.device,
        new_head: Callable[..., RanPACHead],
        candidates: int | None = None,
        candidate_space: str = "first-adapter",
        keep_inputs: bool = False,
    ):
        self.cfg, self.top_k, self.device, self.new_head = cfg, top_k, device, new_head
        self.candidates, self.candidate_space = candidates, candidate_space
        #: keep what :meth:`forget` needs (``head.forgettable``)
        self.keep_inputs = keep_inputs
        #: tasks removed by :meth:`forget`: never retrieved
        self.forgotten: set[int] = set()

    @property
    def needs_frozen(self) -> bool:
        """:meth:`retrieve` reads the frozen backbone's features F."""
        return self.space == "frozen"

    @property
    def key_space(self) -> str | None:
        """``frozen`` or ``first-adapter`` when every task's key reads that one embedding of an input
        (:meth:`retrieve_space`); None when the keys need every task's adapter."""
        return self.space if self.space in ("frozen", "first-adapter") else None

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        """Retrieval among the first m tasks from the inputs' embeddings X (N, d) in :attr:`key_space`."""
        raise ValueError(f"{type(self).__name__} keys do not live in one space")

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        """The signatures under each task's own adapter (the theory of Sec. 3.2 is about them)."""
        return []

    def add_task(self, fit: KeyFit) -> dict[str, int] | None:
        raise NotImplementedError

    def truncate(self, m: int) -> None:
        raise NotImplementedError

    def forget(self, k: int, classes: list[int]) -> None:
        """Remove task k's key (``proteus kb forget``): it is never retrieved again. Subclasses drop or
        subtract what they hold; :meth:`check_forget` says beforehand whether they can."""
        self.forgotten.add(k)

    def check_forget(self, k: int) -> None:
        """Raise ValueError when :meth:`forget` cannot remove task k exactly."""

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        """H (m, N, d): embeddings under the first m tasks' adapters; F (N, d): frozen features (when
        :attr:`needs_frozen`); ``classes``: each of those tasks' classes."""
        raise NotImplementedError

    # knowledge base: per task (stored in the task's object) and global (stored in the head's object)
    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {"signature": None, "frozen_signature": None}, {}

    def load_task(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        if meta.get("forgotten"):
            self.forgotten.add(int(meta["index"]))

    def global_state(self) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        return None, {}

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        pass


class NoKeys(RetrievalKeys):
    """A method without retrieval (``retrieval.mode`` other than ``signature``)."""

    def add_task(self, fit: KeyFit) -> None:
        return None

    def truncate(self, m: int) -> None:
        pass

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        raise ValueError("this method does not retrieve tasks (retrieval.mode is not 'signature')")
