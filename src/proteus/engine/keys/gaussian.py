"""Gaussian retrieval keys (Sec. 3.1, Eq. 18): ``signature.keys`` = ``adapter`` (the paper: a DP-GMM
signature of ``h_k(x)`` under task k's own adapter, ``(k*, t*) = argmin_{k, t} S_k(h_k(x); m_k^t,
Lambda_k^t)``), ``frozen`` and ``adapter+frozen`` (signatures of the frozen backbone's features, alone or
summed with the adapter keys; the adapter signature is still fitted, since the theory checks of Sec. 3.2
are about it). With ``retrieval.candidates = c`` a task also leaves an LDA key in one space (accumulated
like G, no old data, no training), and only the c best tasks by it are scored with the exact Gaussian keys
(:meth:`GaussianKeys.shortlist`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from proteus.engine.embedder import Embedder
from proteus.engine.errors import TaskError
from proteus.engine.keys.base import GLOBAL_PREFIX, GLOBAL_RECORD, KEYS, KeyFit, KeyKind, RetrievalKeys, Under
from proteus.engine.keys.lda import LDAKeys
from proteus.engine.keys.space import FROZEN
from proteus.heads.persist import classes_outside, is_head_meta
from proteus.signatures import RetrievalResult, Signature, fit_signature, retrieve
from proteus.signatures.dpgmm import SignatureFitError
from proteus.tensor_rules import TENSOR_RULES, Check, Mount, NeedsRecord

__all__ = ["GaussianKeys"]

#: the global record of the shortlist's LDA keys (:meth:`GaussianKeys.global_state` wraps their meta)
_SHORTLIST = f"{GLOBAL_RECORD}/shortlist"
#: a task's signatures (:meth:`GaussianKeys.task_state`: its ``signature`` and ``frozen_signature``, each
#: a :class:`~proteus.signatures.Signature`'s tensors and meta, the role ``"signature"``) and the
#: shortlist's LDA keys (inputs per task, their head in the head's object)
TENSOR_RULES.declare(
    "proteus", "GaussianKeys",
    *(rule for key in ("signature", "frozen_signature") for rule in (
        NeedsRecord(f"{key}/", key),
        Mount("signature", prefix=f"{key}/", record=key, when=lambda r: isinstance(r, dict), on="task"),
    )),
    Mount("lda inputs", prefix="shortlist/", on="task"),
    Mount("ranpac columns", prefix="shortlist/", on="task"),
    Mount("ranpac", prefix=GLOBAL_PREFIX, record=_SHORTLIST, when=is_head_meta, on="head"),
    Check(lambda tasks, meta, where: classes_outside(tasks, meta, where, _SHORTLIST)),
)  # fmt: skip


def _scores(sigs: list[Signature | None], X: Callable[[int], Tensor]) -> list[Tensor]:
    """Each task's (N, T_k) scores on ``X(j)``; a removed (forgotten) signature scores +inf."""
    out: list[Tensor] = []
    for j, s in enumerate(sigs):
        if s is None:
            out.append(torch.full((X(j).shape[0], 1), float("inf")))
        else:
            out.append(s.score(X(j).to(s.device)).cpu())
    return out


def _sub(prefix: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {n[len(prefix) :]: v for n, v in tensors.items() if n.startswith(prefix)}


class GaussianKeys(RetrievalKeys):
    """DP-GMM signatures (Eq. 18) whose scores retrieve: under each task's own adapter (``adapter``, the
    paper), of the frozen backbone's features (``frozen``: keys in one space) or both (scores summed per
    task; the component reported is the adapter key's). The adapter signature is fitted in every case."""

    def __init__(self, *args: Any, adapter: bool = True, frozen: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.adapter_keys, self.frozen_keys = adapter, frozen
        #: frozen keys alone live in one space: prediction takes the one-space route
        self.space = FROZEN if frozen and not adapter else None
        self.signatures: list[Signature | None] = []
        self.frozen_signatures: list[Signature | None] = []
        #: the cheap keys that shortlist candidates (``retrieval.candidates``; adapter keys only)
        self.shortlist_keys: LDAKeys | None = None
        if self.candidates is not None and adapter and not frozen:
            lda_cfg = dataclasses.replace(self.cfg, normalize="l2")
            self.shortlist_keys = LDAKeys(
                lda_cfg, 1, self.device, self.new_head, space=self.candidate_space,
                keep_inputs=self.keep_inputs, prefix="shortlist/",
            )  # fmt: skip

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        return self.signatures

    @property
    def needs_frozen(self) -> bool:
        return self.frozen_keys or (self.shortlists and self.candidate_space.needs_frozen)

    @property
    def route(self) -> str:
        return "candidates" if self.shortlists else super().route

    def predict(
        self, embedder: Embedder, z: Tensor, m: int, classes: list[list[int]], taps: Tensor | None = None
    ) -> tuple[RetrievalResult, Under]:
        """With a shortlist (:attr:`shortlists`): a forward in the cheap keys' space, the c best tasks per
        input, each input under those c adapters (one grouped forward), Eq. 1 among them (c + 1 forwards
        per input); ``under`` gives the embeddings under shortlisted tasks. Otherwise the base routes.
        ``taps`` is not read (these keys keep no detector of their own)."""
        if not self.shortlists:
            return super().predict(embedder, z, m, classes, taps)
        space = self.candidate_space
        X = space.embed(embedder, z, shard=False)
        short = self.shortlist(X, m, classes)  # (N, c)
        N, c = short.shape
        rows = torch.arange(N).repeat_interleave(c)
        Hc = embedder.embed_under(z[rows.to(z.device)], short.flatten(), space.known(X[rows])).view(N, c, -1)
        res = self.retrieve_among(Hc, short, m)

        def under(cand: Tensor) -> Tensor:
            pos = (short[:, None, :] == cand[:, :, None]).float().argmax(2)  # (N, K) places in the shortlist
            if not bool((short.gather(1, pos) == cand).all()):
                raise ValueError("the candidate route embeds only the shortlisted tasks")
            return Hc[torch.arange(N)[:, None], pos]

        return res, under

    @property
    def shortlists(self) -> bool:
        """Retrieval scores only the shortlisted tasks: ``candidates`` is set (it may change after the
        fit) and the cheap keys and every exact key are there (a knowledge base written without the cheap
        keys scores every task)."""
        sl = self.shortlist_keys
        return (
            self.candidates is not None and sl is not None and sl.head is not None
            and sl.n_tasks == len(self.signatures)
            and all(s is not None for j, s in enumerate(self.signatures) if j not in self.forgotten)
        )  # fmt: skip

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        if self.space is None:
            return super().retrieve_space(X, m, classes)
        return retrieve(_scores(self.frozen_signatures[:m], lambda j: X), self.top_k)

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
            rows, cols = (cand == t).nonzero(as_tuple=True)
            if len(rows) == 0 or sig is None:  # not shortlisted, or forgotten
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
        if self.frozen_keys:
            fsig = self._fit(fit.embed(None)[0], fit.seed + 1, "frozen-key ", fit.k)
            stats["n_active_frozen"] = int(fsig.n_active)
        if self.shortlist_keys is not None and self.candidate_space.available(fit.num_adapters):
            self.shortlist_keys.add_task(fit)  # else not for every task: every task is scored exactly
        self.signatures.append(sig)
        self.frozen_signatures.append(fsig)
        return stats or None

    def truncate(self, m: int) -> None:
        del self.signatures[m:], self.frozen_signatures[m:]
        if self.shortlist_keys is not None:
            self.shortlist_keys.truncate(m)

    def settle(self) -> None:
        if self.shortlist_keys is not None:
            self.shortlist_keys.settle()

    def check_forget(self, k: int) -> None:
        if self.shortlist_keys is not None:
            self.shortlist_keys.check_forget(k)

    def forget(self, k: int, classes: list[int]) -> None:
        """The task's signatures are dropped (a removed signature scores +inf), as are its cheap keys."""
        if self.shortlist_keys is not None:
            self.shortlist_keys.forget(k, classes)
        self.signatures[k] = self.frozen_signatures[k] = None
        super().forget(k, classes)

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        m = H.shape[0]
        if self.shortlists:  # the same rule as the candidate route: exact keys of the candidates only
            cand = self.shortlist(self.candidate_space.select(H, F), m, classes)
            return self.retrieve_among(H[cand, torch.arange(H.shape[1])[:, None]], cand, m)
        if self.space is not None:  # frozen keys alone
            return super().retrieve(H, F, classes)
        res = retrieve(_scores(self.signatures[:m], lambda j: H[j]), self.top_k)
        if not self.frozen_keys:
            return res
        if F is None:
            raise ValueError("signature.keys='adapter+frozen' needs the frozen-backbone features F")
        fres = retrieve(_scores(self.frozen_signatures[:m], lambda j: F), self.top_k)
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

    def task_state(
        self, k: int, classes: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta: dict[str, Any] = {"signature": None, "frozen_signature": None}
        tensors: dict[str, Tensor] = {}
        if self.shortlist_keys is not None:
            tensors.update(self.shortlist_keys.task_state(k, classes)[1])
        for key, sig in (("signature", self.signatures[k]), ("frozen_signature", self.frozen_signatures[k])):
            if sig is not None:
                st, meta[key] = sig.to_tensors()
                tensors.update({f"{key}/{n}": v for n, v in st.items()})
        return meta, tensors

    def load_task(self, meta: dict[str, Any], tensors: Mapping[str, Tensor]) -> None:
        for key, dest in (("signature", self.signatures), ("frozen_signature", self.frozen_signatures)):
            sig = None
            if meta.get(key) is not None:
                sig = Signature.from_tensors(_sub(f"{key}/", tensors), meta[key]).to(self.device)
            dest.append(sig)
        if self.shortlist_keys is not None:
            self.shortlist_keys.load_task(meta, tensors)
        super().load_task(meta, tensors)

    # the cheap keys live in the head's object, as the LDA keys do (``task_head/`` tensors)
    def global_state(
        self, classes: list[list[int]] | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        if self.shortlist_keys is None:
            return None, {}
        meta, tensors = self.shortlist_keys.global_state()
        return (None if meta is None else {"shortlist": meta}), tensors

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        if self.shortlist_keys is not None and meta is not None and "shortlist" in meta:
            self.shortlist_keys.load_global(meta["shortlist"], tensors)


#: trait ``signatures``: the keys are Gaussian-mixture signatures (``signature.*`` and the shortlist's
#: ``retrieval.*`` options are read)
KEYS.register(
    "adapter", help="the paper: DP-GMM signatures under each task's own adapter (Eq. 18)", signatures=True
)(KeyKind(GaussianKeys, False))
KEYS.register("frozen", help="DP-GMM signatures of the frozen backbone's features", signatures=True)(
    KeyKind(GaussianKeys, True, {"adapter": False, "frozen": True})
)
KEYS.register("adapter+frozen", help="both signatures, scores summed", signatures=True)(
    KeyKind(GaussianKeys, False, {"frozen": True})
)
