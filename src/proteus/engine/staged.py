"""Prediction whose backbone cost does not grow with the number of tasks m (beyond the paper).

Algorithm 2 embeds every input under every task's adapter, m forwards per input (App. "Complexity of
PROTEUS Inference": 0.41 s per batch at 1 task, 3.29 s at 10 on an A40). Two routes need fewer, with the
same retrieval rule (the same tasks, scores and labels as the m-forward path, to float round-off):

* **one key space** (:attr:`RetrievalKeys.key_space`: ``frozen-lda``, ``first-adapter-lda``, ``frozen``):
  one forward in the key space, retrieval (Sec. 3.1), then one forward of each input under its
  retrieved adapter only -- every input in one batched forward, grouped by task
  (:meth:`Embedder.embed_each`). Two forwards per input whatever m is; one when the retrieved adapter
  is the key space's own (task 1 for ``first-adapter``).
* **candidates** (``retrieval.candidates = c`` with the paper's per-adapter Gaussian keys, Eq. 18): the
  cheap keys in one space shortlist c tasks per input (:meth:`GaussianKeys.shortlist`), which are scored
  with the exact keys on the input's embeddings under those c adapters: c + 1 forwards per input.

Each route returns the retrieval result and a function that embeds the inputs under candidate tasks'
adapters (the retrieved one for Alg. 2; the few most likely ones for ``retrieval.combine=soft``,
:mod:`proteus.engine.experts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from proteus.engine.embedder import Embedder
from proteus.engine.keys import GaussianKeys, RetrievalKeys
from proteus.signatures import RetrievalResult

__all__ = ["ROUTES", "embed_under", "predict_candidates", "predict_one_space", "predict_staged", "route"]

#: the prediction routes of :func:`route`
ROUTES = ("one-space", "candidates", "all-adapters")


def route(keys: RetrievalKeys) -> str:
    """Which route prediction takes with these keys (:data:`ROUTES`)."""
    if keys.key_space is not None:
        return "one-space"
    if isinstance(keys, GaussianKeys) and keys.shortlists:
        return "candidates"
    return "all-adapters"


def _space_embedding(embedder: Embedder, z: Tensor, space: str) -> Tensor:
    """(N, d): the inputs in a key space, ``frozen`` (no adapter) or ``first-adapter`` (task 1's)."""
    return embedder.embed_prefix(z, None if space == "frozen" else [0], shard=False)[0]


def embed_under(embedder: Embedder, z: Tensor, task: Tensor, known: dict[int, Tensor]) -> Tensor:
    """(N, d): prefix output i under task ``task[i]``'s adapter, in one grouped forward per batch;
    ``known[t]`` (N, d) are embeddings under task t already computed (reused, not recomputed)."""
    task = task.cpu()
    out = torch.empty(z.shape[0], embedder.model.embed_dim)
    todo = torch.ones(len(task), dtype=torch.bool)
    for t, H in known.items():
        sel = task == t
        out[sel] = H[sel].float()
        todo &= ~sel
    if bool(todo.any()):
        idx = todo.nonzero().flatten()
        out[idx] = embedder.embed_each(z[idx.to(z.device)], task[idx])
    return out


#: the inputs' embeddings (N, K, d) under the adapters of candidate tasks (N, K)
Under = Callable[[Tensor], Tensor]


def predict_one_space(
    embedder: Embedder, keys: RetrievalKeys, z: Tensor, m: int, classes: list[list[int]]
) -> tuple[RetrievalResult, Under]:
    """Keys in one space: a forward there and retrieval among the first m tasks. Returns the retrieval and
    ``under``, which embeds the inputs under any candidate tasks' adapters (each input under each of its K
    candidates, in one grouped forward; the key space's own embedding is reused for task 1)."""
    space = keys.key_space
    assert space is not None
    X = _space_embedding(embedder, z, space)
    res = keys.retrieve_space(X, m, classes)

    def under(cand: Tensor) -> Tensor:
        N, K = cand.shape
        rows = torch.arange(N).repeat_interleave(K)
        known = {0: X[rows]} if space == "first-adapter" else {}
        return embed_under(embedder, z[rows.to(z.device)], cand.flatten(), known).view(N, K, -1)

    return res, under


def predict_candidates(
    embedder: Embedder, keys: GaussianKeys, z: Tensor, m: int, classes: list[list[int]]
) -> tuple[RetrievalResult, Under]:
    """The paper's Gaussian keys scored on a shortlist: a forward in the cheap keys' space, the c best
    tasks per input, each input under those c adapters (one grouped forward), Eq. 1 among them.
    ``under`` gives the embeddings under shortlisted tasks (the retrieved one among them)."""
    X = _space_embedding(embedder, z, keys.candidate_space)
    short = keys.shortlist(X, m, classes)  # (N, c)
    N, c = short.shape
    rows = torch.arange(N).repeat_interleave(c)
    known = {0: X[rows]} if keys.candidate_space == "first-adapter" else {}
    Hc = embed_under(embedder, z[rows.to(z.device)], short.flatten(), known).view(N, c, -1)
    res = keys.retrieve_among(Hc, short, m)

    def under(cand: Tensor) -> Tensor:
        pos = (short[:, None, :] == cand[:, :, None]).float().argmax(2)  # (N, K) positions in the shortlist
        if not bool((short.gather(1, pos) == cand).all()):
            raise ValueError("the candidate route embeds only the shortlisted tasks")
        return Hc[torch.arange(N)[:, None], pos]

    return res, under


def predict_staged(
    embedder: Embedder, keys: RetrievalKeys, z: Tensor, m: int, classes: list[list[int]]
) -> tuple[RetrievalResult, Under]:
    """The route of :func:`route` (``one-space`` or ``candidates``) on prefix outputs ``z``."""
    if keys.key_space is not None:
        return predict_one_space(embedder, keys, z, m, classes)
    if isinstance(keys, GaussianKeys) and keys.shortlists:
        return predict_candidates(embedder, keys, z, m, classes)
    raise ValueError("these keys need every task's adapter: use Proteus.embed and predict_embedded")
