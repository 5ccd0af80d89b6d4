"""Parameter-free task retrieval (Section 3.1, Eq. 1 with the multi-key signatures of Eq. 18).

Each test input ``x`` is embedded by every task's adapter, ``h_k(x)``, and scored by task k's signature:
``task_scores[k]`` is the (N, T_k) matrix ``S_k(x; m_k^t, Lambda_k^t)`` (lower is better). The paper's
rule is ``(k*, t*) = argmin_{k, t} S_k(x; m_k^t, Lambda_k^t)``.

``top_k > 1`` is the appendix ablation "Top-K Gaussians": the K largest likelihoods of a task are summed
and the task with the largest sum wins. With scores that are negative log-likelihoods, the likelihood of
component t is ``exp(-S_t)``, so the per-task reduced score is ``-logsumexp(-S_(1..K))`` over the K
smallest scores of the task (all of them when the task has fewer than K components). This is exactly the
negative log of the summed top-K likelihoods, computed stably; with Mahalanobis or standardised scores it
is the same soft-min of the K best scores. The reported component is the task's best one (smallest score).

Tasks are padded to a common width with ``+inf`` so everything is one batched tensor operation; NaN scores
(e.g. from NaN embeddings) are treated as ``+inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RetrievalResult", "retrieve", "pad_scores"]


@dataclass
class RetrievalResult:
    """Retrieved task and component per input.

    ``task (N,) long``, ``component (N,) long`` (index within the retrieved task's signature),
    ``score (N,)`` the retrieved task's reduced score, ``task_scores (N, m)`` every task's reduced score
    (lower is better: the best component's score for ``top_k = 1``, else ``-logsumexp`` of the K best).
    ``novelty (N,)``: where the keys carry a detector of inputs from no learned task
    (:mod:`proteus.engine.novelty`) and the result answers :meth:`proteus.Proteus.predict` (not an
    evaluation), each input's score minus its threshold (> 0: unknown); else None.
    """

    task: Tensor
    component: Tensor
    score: Tensor
    task_scores: Tensor
    novelty: Tensor | None = None


def pad_scores(task_scores: list[Tensor]) -> Tensor:
    """Stack per-task (N, T_k) score matrices into (N, m, T_max), padding with ``+inf`` (NaN -> ``+inf``)."""
    if not task_scores:
        raise ValueError("retrieve needs at least one task's scores")
    N = task_scores[0].shape[0]
    for k, s in enumerate(task_scores):
        if s.ndim != 2 or s.shape[0] != N or s.shape[1] < 1:
            raise ValueError(f"task_scores[{k}] must be (N={N}, T_k >= 1), got {tuple(s.shape)}")
    device = task_scores[0].device
    dtype = torch.promote_types(torch.float32, task_scores[0].dtype)
    for s in task_scores[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    t_max = max(s.shape[1] for s in task_scores)
    out = torch.full((N, len(task_scores), t_max), float("inf"), dtype=dtype, device=device)
    for k, s in enumerate(task_scores):
        out[:, k, : s.shape[1]] = s.to(device=device, dtype=dtype)
    return out.nan_to_num_(nan=float("inf"))


def retrieve(task_scores: list[Tensor], top_k: int = 1) -> RetrievalResult:
    """Retrieve ``(k*, t*)`` per input from the per-task score matrices (Section 3.1).

    ``top_k = 1``: ``argmin`` over tasks and components. ``top_k > 1``: the Top-K Gaussians ablation,
    ``argmax_k sum`` of the K largest likelihoods, i.e. ``argmin_k -logsumexp(-S_(1..K))``.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    S = pad_scores(task_scores)  # (N, m, T)
    best, comp = S.min(dim=2)  # (N, m)
    if top_k == 1:
        reduced = best
    else:
        K = min(int(top_k), S.shape[2])
        smallest = torch.topk(S, K, dim=2, largest=False).values  # (N, m, K), padding stays +inf
        reduced = -torch.logsumexp(-smallest, dim=2)
    score, task = reduced.min(dim=1)
    component = comp.gather(1, task[:, None])[:, 0]
    return RetrievalResult(task=task, component=component, score=score, task_scores=reduced)
