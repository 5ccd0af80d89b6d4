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

Keys in one space (:attr:`RetrievalKeys.key_space`: ``frozen``, ``frozen-lda``, ``first-adapter-lda``)
retrieve from a single embedding per input (:meth:`RetrievalKeys.retrieve_space`), so prediction needs
one forward in that space and one under the retrieved adapter, whatever m is
(:mod:`proteus.engine.staged`). The paper's per-adapter keys can shortlist: with ``retrieval.candidates
= c`` a task also leaves an LDA key in one space (accumulated like G, no old data, no training), and only
the c best tasks by it are scored with the exact Gaussian keys (:meth:`GaussianKeys.shortlist`).
"""

from __future__ import annotations

import copy
import dataclasses
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
        self,
        cfg: SignatureConfig,
        top_k: int,
        device: torch.device,
        new_head: Callable[..., RanPACHead],
        candidates: int | None = None,
        candidate_space: str = "first-adapter",
    ):
        self.cfg, self.top_k, self.device, self.new_head = cfg, top_k, device, new_head
        self.candidates, self.candidate_space = candidates, candidate_space

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
        #: the cheap keys that shortlist candidates (``retrieval.candidates``; adapter keys only)
        self.shortlist_keys: LDAKeys | None = None
        if self.candidates is not None and spaces == ("adapter",):
            lda_cfg = dataclasses.replace(self.cfg, normalize="l2")
            self.shortlist_keys = LDAKeys(lda_cfg, 1, self.device, self.new_head, space=self.candidate_space)

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        return self.signatures

    @property
    def needs_frozen(self) -> bool:
        return "frozen" in self.spaces or (self.shortlists and self.candidate_space == "frozen")

    @property
    def key_space(self) -> str | None:
        return "frozen" if self.spaces == ("frozen",) else None

    @property
    def shortlists(self) -> bool:
        """Retrieval scores only the shortlisted tasks: ``candidates`` is set (it may change after the
        fit) and the cheap keys and every exact key are there (a knowledge base written without the cheap
        keys scores every task)."""
        sl = self.shortlist_keys
        return (
            self.candidates is not None and sl is not None and sl.head is not None
            and sl.n_tasks == len(self.signatures) and all(s is not None for s in self.signatures)
        )  # fmt: skip

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        if self.key_space != "frozen":
            return super().retrieve_space(X, m, classes)
        return retrieve([s.score(X.to(s.device)).cpu() for s in self.frozen_signatures[:m] if s], self.top_k)

    def shortlist(self, X: Tensor, m: int, classes: list[list[int]]) -> Tensor:
        """(N, c) the c best of the first m tasks by the cheap keys, best first (X in their space)."""
        assert self.shortlist_keys is not None and self.candidates is not None
        scores = self.shortlist_keys.retrieve_space(X, m, classes).task_scores
        c = min(int(self.candidates), m)
        return scores.topk(c, dim=1, largest=False).indices

    def retrieve_among(self, Hc: Tensor, cand: Tensor, m: int) -> RetrievalResult:
        """Eq. 1 among each input's candidates: ``Hc`` (N, c, d) the input under task ``cand[i, j]``'s
        adapter. Every other task scores +inf, so with every task a candidate this is :meth:`retrieve`."""
        N = cand.shape[0]
        scores = []
        for t in range(m):
            sig = self.signatures[t]
            assert sig is not None
            rows, cols = (cand == t).nonzero(as_tuple=True)
            if len(rows) == 0:
                scores.append(torch.full((N, 1), float("inf")))
                continue
            st = sig.score(Hc[rows, cols].to(sig.device)).cpu()
            S = torch.full((N, st.shape[1]), float("inf"), dtype=st.dtype)
            S[rows] = st
            scores.append(S)
        return retrieve(scores, self.top_k)

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
        if self.shortlist_keys is not None and (fit.num_adapters > 0 or self.candidate_space == "frozen"):
            self.shortlist_keys.add_task(fit)  # else not for every task: every task is scored exactly
        self.signatures.append(sig)
        self.frozen_signatures.append(fsig)
        return stats or None

    def truncate(self, m: int) -> None:
        del self.signatures[m:], self.frozen_signatures[m:]
        if self.shortlist_keys is not None:
            self.shortlist_keys.truncate(m)

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        m = H.shape[0]
        if self.shortlists:  # the same rule as the staged prediction: exact keys of the candidates only
            X = F if self.candidate_space == "frozen" else H[0]
            if X is None:
                raise ValueError("retrieval.candidates with frozen cheap keys needs the frozen features F")
            cand = self.shortlist(X, m, classes)
            return self.retrieve_among(H[cand, torch.arange(H.shape[1])[:, None]], cand, m)
        if self.key_space == "frozen":
            if F is None:
                raise ValueError("signature.keys='frozen' needs the frozen-backbone features F")
            return self.retrieve_space(F, m, classes)
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
        if self.shortlist_keys is not None:
            self.shortlist_keys.load_task(meta, tensors)

    # the cheap keys live in the head's object, as the LDA keys do (``task_head/`` tensors)
    def global_state(self) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        if self.shortlist_keys is None:
            return None, {}
        meta, tensors = self.shortlist_keys.global_state()
        return (None if meta is None else {"shortlist": meta}), tensors

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        if self.shortlist_keys is not None and meta is not None and "shortlist" in meta:
            self.shortlist_keys.load_global(meta["shortlist"], tensors)


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
        if X is None:
            raise ValueError(f"LDA keys in the {self.space} space need their features")
        return self.retrieve_space(X, H.shape[0], classes)

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        if self.head is None:
            raise ValueError(f"LDA keys in the {self.space} space need a fitted key head")
        logits = self.head.decision_function(self.features(X).to(self.device)).float().cpu()
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
