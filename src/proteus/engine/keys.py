"""Retrieval keys: what a task leaves behind to be found again, and how an input finds it (Sec. 3.1).

A key strategy (``signature.keys``, registry :data:`KEYS`) owns its fitted state, its share of the
knowledge base (per-task and global tensors), and its rollback (:meth:`RetrievalKeys.truncate`):

* ``adapter`` -- the paper (Eq. 18): a DP-GMM signature of ``h_k(x)`` under task k's own adapter;
  ``(k*, t*) = argmin_{k, t} S_k(h_k(x); m_k^t, Lambda_k^t)``.
* ``frozen`` / ``adapter+frozen`` -- signatures of the frozen backbone's features (one space for all
  tasks), alone or summed with the adapter keys. The adapter signature is still fitted (the theory
  checks of Sec. 3.2 are about it).
* ``frozen-lda`` / ``first-adapter-lda`` -- beyond the paper (docs/retrieval.md): an LDA (ridge) head
  over all classes accumulated like G, on the frozen features or under the first task's adapter (which
  never changes after task 1); a task's score is minus its best class score.

Scores are "lower is better" everywhere (:class:`~proteus.signatures.RetrievalResult`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from proteus.config import SignatureConfig
from proteus.engine.errors import TaskError
from proteus.heads import RanPACHead
from proteus.registry import Registry
from proteus.signatures import RetrievalResult, Signature, fit_signature, retrieve
from proteus.signatures.dpgmm import SignatureFitError

__all__ = ["KEYS", "GaussianKeys", "KeyFit", "LDAKeys", "RetrievalKeys"]


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
        self, cfg: SignatureConfig, top_k: int, device: torch.device, new_head: Callable[..., RanPACHead]
    ):
        self.cfg, self.top_k, self.device, self.new_head = cfg, top_k, device, new_head

    @property
    def needs_frozen(self) -> bool:
        """:meth:`retrieve` reads the frozen backbone's features F."""
        return self.space == "frozen"

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        """The signatures under each task's own adapter (the theory of Sec. 3.2 is about them)."""
        return []

    def add_task(self, fit: KeyFit) -> dict[str, int] | None:
        raise NotImplementedError

    def truncate(self, m: int) -> None:
        raise NotImplementedError

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        """H (m, N, d): embeddings under the first m tasks' adapters; F (N, d): frozen features (when
        :attr:`needs_frozen`); ``classes``: each of those tasks' classes."""
        raise NotImplementedError

    # knowledge base: per task (stored in the task's object) and global (stored in the head's object)
    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {"signature": None, "frozen_signature": None}, {}

    def load_task(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        pass

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


def _sub(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n[len(prefix) :]: v for n, v in tensors.items() if n.startswith(prefix)}


class GaussianKeys(RetrievalKeys):
    """DP-GMM signatures (Eq. 18); ``spaces`` are those whose scores retrieve: ``("adapter",)`` (the
    paper), ``("frozen",)`` or both (scores summed per task; the component reported is the adapter
    key's). The adapter signature is fitted in every case."""

    def __init__(self, *args: Any, spaces: tuple[str, ...] = ("adapter",), **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.spaces = spaces
        self.signatures: list[Signature | None] = []
        self.frozen_signatures: list[Signature | None] = []

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        return self.signatures

    @property
    def needs_frozen(self) -> bool:
        return "frozen" in self.spaces

    def _fit(self, H: Tensor, seed: int, what: str, k: int) -> Signature:
        try:
            return fit_signature(H.to(self.device), self.cfg, seed=seed)
        except SignatureFitError as e:
            raise TaskError(f"task {k + 1}: {what}signature fit failed: {e}") from None

    def add_task(self, fit: KeyFit) -> dict[str, int] | None:
        stats: dict[str, int] = {}
        sig = fsig = None
        if fit.num_adapters > 0:
            sig = self._fit(fit.embed([min(fit.k, fit.num_adapters - 1)])[0], fit.seed, "", fit.k)
            stats["n_active"] = int(sig.n_active)
        if "frozen" in self.spaces:
            fsig = self._fit(fit.embed(None)[0], fit.seed + 1, "frozen-key ", fit.k)
            stats["n_active_frozen"] = int(fsig.n_active)
        self.signatures.append(sig)
        self.frozen_signatures.append(fsig)
        return stats or None

    def truncate(self, m: int) -> None:
        del self.signatures[m:], self.frozen_signatures[m:]

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        m = H.shape[0]
        res = None
        if "adapter" in self.spaces:
            sigs = self.signatures[:m]
            res = retrieve([s.score(H[j].to(s.device)).cpu() for j, s in enumerate(sigs) if s], self.top_k)
        if "frozen" not in self.spaces:
            assert res is not None
            return res
        if F is None:
            raise ValueError(f"signature.keys={'+'.join(self.spaces)!r} needs the frozen-backbone features F")
        fres = retrieve([s.score(F.to(s.device)).cpu() for s in self.frozen_signatures[:m] if s], self.top_k)
        if res is None:
            return fres
        total = res.task_scores + fres.task_scores
        task = total.argmin(1)
        rows = torch.arange(len(task))
        res.task, res.score, res.task_scores = task, total[rows, task], total
        component = torch.zeros_like(task)  # the chosen task's best adapter-key component
        for t in task.unique().tolist():
            idx = (task == t).nonzero().flatten()
            sig = self.signatures[t]
            assert sig is not None
            component[idx] = sig.score(H[t, idx].to(sig.device)).cpu().argmin(1)
        res.component = component
        return res

    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta: dict[str, Any] = {"signature": None, "frozen_signature": None}
        tensors: dict[str, Tensor] = {}
        for key, sig in (("signature", self.signatures[k]), ("frozen_signature", self.frozen_signatures[k])):
            if sig is not None:
                st, meta[key] = sig.to_tensors()
                tensors.update({f"{key}/{n}": v for n, v in st.items()})
        return meta, tensors

    def load_task(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        for key, dest in (("signature", self.signatures), ("frozen_signature", self.frozen_signatures)):
            sig = None
            if meta.get(key) is not None:
                sig = Signature.from_tensors(_sub(f"{key}/", tensors), meta[key]).to(self.device)
            dest.append(sig)


class LDAKeys(RetrievalKeys):
    """An LDA (ridge) head over all classes in one fixed key space (``frozen`` or ``first-adapter``),
    accumulated task by task like the head's G; L2-normalised features when ``signature.normalize`` is
    ``l2``. Kept in the knowledge base inside the head's object (``task_head/`` tensors)."""

    def __init__(self, *args: Any, space: str = "frozen", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.space = space
        self.head: RanPACHead | None = None
        self.n_tasks = 0
        self._before: RanPACHead | None = None

    def features(self, X: Tensor) -> Tensor:
        return F.normalize(X.float(), dim=1) if self.cfg.normalize == "l2" else X

    def add_task(self, fit: KeyFit) -> None:
        if self.space == "frozen":
            X = fit.embed(None)[0]
        else:  # the first task's adapter, frozen since task 1
            if fit.num_adapters == 0:
                raise TaskError("signature.keys='first-adapter-lda' needs the first task to train an adapter")
            X = fit.embed([0])[0]
        # a copy (d x d statistics, cheap): a later step of this task may still fail, and the rollback
        # must find the key head as it was before the task
        head = copy.deepcopy(self.head) if self.head is not None else self.new_head(rp_dim=0)
        try:
            head.update(self.features(X).to(self.device), fit.y.to(self.device), num_classes=fit.num_classes)
        except (ValueError, FloatingPointError) as e:
            raise TaskError(f"task {fit.k + 1}: LDA key update failed: {e}") from None
        self._before, self.head = self.head, head
        self.n_tasks += 1
        return None

    def truncate(self, m: int) -> None:
        if m >= self.n_tasks:
            return
        if m != self.n_tasks - 1:
            raise ValueError("LDA keys can only drop the task learned last")
        self.head, self._before, self.n_tasks = self._before, None, m

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        X = F if self.space == "frozen" else H[0]
        if X is None or self.head is None:
            raise ValueError(f"LDA keys in the {self.space} space need their features and a fitted key head")
        logits = self.head.decision_function(self.features(X).to(self.device)).float().cpu()
        m = H.shape[0]
        scores = torch.full((X.shape[0], m), float("inf"))
        for j, cls in enumerate(classes[:m]):
            scores[:, j] = -logits[:, cls].max(1).values
        task = scores.argmin(1)
        rows = torch.arange(len(task))
        return RetrievalResult(
            task=task, component=torch.zeros_like(task), score=scores[rows, task], task_scores=scores
        )

    def load_task(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.n_tasks += 1

    def global_state(self) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        if self.head is None:
            return None, {}
        return self.head.meta(), self.head.state_tensors()

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        if meta is None:
            return
        self.head = self.new_head(rp_dim=0)
        self.head.load_state_tensors({k: v.to(self.device) for k, v in tensors.items()}, meta)


KEYS: Registry[Callable[..., RetrievalKeys]] = Registry("signature.keys")
KEYS.register("adapter", help="the paper: DP-GMM signatures under each task's own adapter (Eq. 18)")(
    partial(GaussianKeys, spaces=("adapter",))
)
KEYS.register("frozen", help="DP-GMM signatures of the frozen backbone's features")(
    partial(GaussianKeys, spaces=("frozen",))
)
KEYS.register("adapter+frozen", help="both signatures, scores summed")(
    partial(GaussianKeys, spaces=("adapter", "frozen"))
)
KEYS.register("frozen-lda", help="LDA keys on frozen features (beyond the paper)")(
    partial(LDAKeys, space="frozen")
)
KEYS.register("first-adapter-lda", help="LDA keys under the first task's adapter (beyond the paper)")(
    partial(LDAKeys, space="first-adapter")
)
