"""Within-task experts, and how task retrieval and the head combine (beyond the paper; docs/retrieval.md).

Algorithm 2 retrieves one task and classifies the input under that task's adapter with Eq. 23's head, a
ridge (LDA) head over every class learned so far. Two strategies go beyond it, one config key each:

* ``head.scope`` (:data:`HEAD_SCOPES`): ``global`` is Eq. 23; ``task`` gives each task its own ridge head
  over its own classes (:class:`TaskExperts`), fitted with RanPAC's closed form (γ chosen on a held-out
  part, no random projection) on the task's embeddings under its own adapter when the task is learned,
  and never changed after: the expert for "which class, given this task".
* ``retrieval.combine`` (:data:`COMBINATIONS`): ``hard`` is Alg. 2, the best task and then its head;
  ``soft`` weighs the ``retrieval.soft_top`` most likely tasks. The predicted class maximises

      log p(t|x) + log p(c|x, t),    p(t|x) = softmax_t(-s_t(x) / T_key),
                                      p(c|x, t) = softmax_{c in t}(f_c(h_t(x)) / T_head),

  with s_t the keys' task score (lower is better), h_t(x) the input under task t's adapter and f the
  head's scores (``retrieval.key_temperature`` T_key, ``retrieval.head_temperature`` T_head). A confident
  key reproduces ``hard``; where two tasks are close, the one whose head is surer of a class wins.

Every expert reads only its own task's data when the task is learned, so the method stays
parameter-free across tasks: nothing is trained on, or stored from, more than one task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from proteus.config import RetrievalConfig
from proteus.engine.errors import TaskError
from proteus.heads import RanPACHead
from proteus.heads import options as head_options
from proteus.registry import Registry
from proteus.signatures import RetrievalResult
from proteus.signatures import options as signature_options
from proteus.tensor_rules import TENSOR_RULES, F, Fields, NeedsRecord, Required, ShapeRule

__all__ = [
    "COMBINATIONS", "HEAD_SCOPES", "Combination", "HeadScope", "TaskExpert", "TaskExperts", "candidates",
    "combine_soft", "decide",
]  # fmt: skip


class TaskExpert:
    """A task's own ridge head: its classes (global labels), the closed-form weights ``W`` (d, C_t) and
    the γ that was chosen for them. ``W`` is held, or read from the task's stored tensors when used
    (``stored``, ``device``: a task committed to a knowledge base, :meth:`TaskExperts.adopt`)."""

    __slots__ = ("_W", "_stored", "classes", "device", "gamma")

    def __init__(
        self, classes: list[int], W: Tensor | None, gamma: float,
        stored: Mapping[str, Tensor] | None = None, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        if W is None and stored is None:
            raise ValueError("a task expert needs its weights or its stored tensors")
        self.classes, self.gamma, self._W, self._stored, self.device = classes, gamma, W, stored, device

    @property
    def W(self) -> Tensor:
        if self._W is not None:
            return self._W
        assert self._stored is not None
        W = self._stored["expert/W"]
        return W if self.device is None else W.to(self.device)

    def scores(self, h: Tensor) -> Tensor:
        """(N, C_t) scores of embeddings h (N, d) under this task's adapter."""
        W = self.W
        return (h.to(W.device, W.dtype) @ W).float()


#: each task's own head (``head.scope=task``, :meth:`TaskExperts.task_state`): its record's ``expert``
#: and the tensor ``expert/W`` (d, the task's classes)
TENSOR_RULES.declare(
    "proteus",
    "TaskExperts",
    Fields({"expert": F("map", fields={"gamma": F("positive", True)})}),
    NeedsRecord("expert/", "expert"),
    Required(("expert/W",), lambda r: isinstance(r, dict), path="expert"),
    ShapeRule(r"expert/W", ("kb.expert_d", "classes"), "the task head has one column per class of the task"),
)


class TaskExperts:
    """One :class:`TaskExpert` per learned task (``head.scope = task``); ``new_head`` builds the ridge
    head whose closed form gives an expert's weights (the global head's settings, no projection)."""

    def __init__(self, new_head: Callable[..., RanPACHead]) -> None:
        self.new_head = new_head
        self.experts: list[TaskExpert] = []

    def __len__(self) -> int:
        return len(self.experts)

    def add_task(self, h: Tensor, y: Tensor, classes: list[int]) -> TaskExpert:
        """Fit task k's expert on its training embeddings h (N, d) under its own adapter, labels y."""
        local = {int(c): i for i, c in enumerate(classes)}
        y_local = torch.as_tensor([local[int(c)] for c in y.tolist()], dtype=torch.long)
        head = self.new_head(rp_dim=0)
        head.update(h, y_local.to(h.device), num_classes=len(classes))
        assert head.W_out_ is not None and head.gamma_ is not None
        expert = TaskExpert([int(c) for c in classes], head.W_out_.detach(), float(head.gamma_))
        self.experts.append(expert)
        return expert

    def truncate(self, m: int) -> None:
        del self.experts[m:]

    def logits(self, h: Tensor, tasks: Tensor, num_classes: int) -> Tensor:
        """(N, C): row i scored by task ``tasks[i]``'s expert in that task's columns, -inf elsewhere. The
        distinct tasks' weights are stacked (padded to the most classes) and every row scored by its own in
        one batched product: a batch spread over many tasks costs a few operations, not a few per task."""
        out = torch.full((h.shape[0], num_classes + 1), float("-inf"))  # the last column: padding's
        tasks = tasks.cpu()
        distinct, which = tasks.unique(return_inverse=True)
        experts = [self.experts[int(t)] for t in distinct.tolist()]
        Ws = [e.W for e in experts]
        dtype = torch.promote_types(Ws[0].dtype, h.dtype) if Ws else h.dtype
        width = max((len(e.classes) for e in experts), default=0)
        W = h.new_zeros((len(Ws), h.shape[1], width), dtype=dtype)
        cols = torch.full((len(Ws), width), num_classes, dtype=torch.long)
        for i, (e, w) in enumerate(zip(experts, Ws, strict=True)):
            W[i, :, : w.shape[1]] = w
            cols[i, : len(e.classes)] = torch.as_tensor(e.classes)
        idx = which.to(h.device)
        scores = torch.bmm(h.to(dtype)[:, None, :], W[idx]).squeeze(1).float().cpu()  # (N, width)
        out.scatter_(1, cols[which], scores)
        return out[:, :num_classes].contiguous()

    # knowledge base: each expert lives in its task's object
    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        if k >= len(self.experts):
            return {}, {}
        e = self.experts[k]
        return {"expert": {"gamma": e.gamma}}, {"expert/W": e.W}  # the same object at every commit

    def load_task(self, meta: dict[str, Any], tensors: Mapping[str, Tensor], device: torch.device) -> None:
        """Task k's expert from its stored ``tensors``: its weights read from them when used."""
        k = len(self.experts)
        if "expert/W" not in tensors or not meta.get("expert"):
            raise TaskError(
                f"task {k + 1}: no task head in the knowledge base (head.scope=task needs one per task)"
            )
        classes = [int(c) for c in meta["classes"]]
        shape = tensors.shape("expert/W") if callable(getattr(tensors, "shape", None)) else None  # type: ignore[attr-defined]
        shape = tuple(tensors["expert/W"].shape) if shape is None else tuple(shape)
        if len(shape) != 2 or shape[1] != len(classes):
            raise TaskError(f"task {k + 1}: task head of shape {shape} for {len(classes)} classes")
        gamma = float(meta["expert"]["gamma"])
        self.experts.append(
            TaskExpert(classes, None, gamma, tensors, None if device.type == "cpu" else device)
        )

    def adopt(self, k: int, tensors: Mapping[str, Tensor]) -> None:
        """Task k is stored as ``tensors``: its expert's weights are read from them when used."""
        if k < len(self.experts) and "expert/W" in tensors:
            e = self.experts[k]
            device = e.W.device if e._W is not None else e.device
            self.experts[k] = TaskExpert(
                e.classes, None, e.gamma, tensors, None if device is None or device.type == "cpu" else device
            )


def candidates(task_scores: Tensor, top: int) -> Tensor:
    """(N, K): the K = min(top, m) tasks of lowest score per input, best first."""
    return task_scores.topk(min(int(top), task_scores.shape[1]), dim=1, largest=False).indices


def combine_soft(
    task_scores: Tensor, cand: Tensor, class_scores: Tensor, key_temperature: float, head_temperature: float
) -> Tensor:
    """(N, C) ``log p(t|x) + log p(c|x, t)`` for the classes of each input's candidate tasks (-inf for the
    others). ``task_scores`` (N, m): the keys' scores (lower is better; +inf for a task never retrieved);
    ``cand`` (N, K) candidate tasks; ``class_scores`` (N, K, C): the head's scores of the input under each
    candidate's adapter, -inf outside that candidate's classes."""
    log_pt = torch.log_softmax(-task_scores.double() / key_temperature, dim=1).gather(1, cand)  # (N, K)
    log_pc = torch.log_softmax(class_scores.double() / head_temperature, dim=2)  # within each task
    return (log_pt[:, :, None] + log_pc).amax(dim=1).float()  # a class belongs to one candidate only


Under = Callable[[Tensor], Tensor]
Classify = Callable[[Tensor, Tensor], Tensor]


def decide(
    res: RetrievalResult, under: Under, classify: Classify, rc: RetrievalConfig, task_of: Tensor
) -> RetrievalResult:
    """The task and class of every input from the keys' result ``res`` (:data:`COMBINATIONS`).

    ``under(cand)`` gives the inputs' embeddings (N, K, d) under the adapters of ``cand`` (N, K);
    ``classify(h, tasks)`` the head's scores (n, C) of embeddings under those tasks' adapters;
    ``task_of`` (C,) the task of each class. Returns the final retrieval (task, component, score: those
    of the task of the predicted class) and, as ``task_scores``, the class scores (N, C) whose argmax is
    the prediction: the head's scores for ``hard``, ``log p(t|x) + log p(c|x, t)`` for ``soft``."""
    return COMBINATIONS.get(rc.combine).decide(res, under, classify, rc, task_of)


def _hard(
    res: RetrievalResult, under: Under, classify: Classify, rc: RetrievalConfig, task_of: Tensor
) -> RetrievalResult:
    logits = classify(under(res.task[:, None])[:, 0], res.task)
    return RetrievalResult(res.task, res.component, res.score, logits)


def _soft(
    res: RetrievalResult, under: Under, classify: Classify, rc: RetrievalConfig, task_of: Tensor
) -> RetrievalResult:
    rows = torch.arange(res.task.shape[0])
    cand = candidates(res.task_scores, rc.soft_top)
    N, K = cand.shape
    scores = classify(under(cand).reshape(N * K, -1), cand.flatten()).view(N, K, -1)
    own = task_of[None, None, : scores.shape[2]] == cand[:, :, None]  # each candidate's own classes
    scores = scores.masked_fill(~own, float("-inf"))
    logits = combine_soft(res.task_scores, cand, scores, rc.key_temperature, rc.head_temperature)
    task = task_of[logits.argmax(1)]
    component = torch.where(task == res.task, res.component, torch.zeros_like(res.component))
    return RetrievalResult(task, component, res.task_scores[rows, task], logits)


@dataclass(frozen=True)
class Combination:
    """A way the keys' task posterior and the head combine (``retrieval.combine``): ``decide`` is its
    :func:`decide`; ``weighs_tasks``: several tasks' heads are weighed by the keys' posterior, so the keys
    must score every task in one space and the learner must retrieve tasks."""

    decide: Callable[..., RetrievalResult]
    weighs_tasks: bool


#: ``retrieval.combine``: the best task, then its head (Alg. 2), or the task posterior times the head's
COMBINATIONS: Registry[Combination] = signature_options.COMBINATIONS
COMBINATIONS.register("hard", help="the best task, then its head (Alg. 2)")(Combination(_hard, False))
COMBINATIONS.register("soft", help="log p(t|x) + log p(c|x, t) over the likeliest tasks")(
    Combination(_soft, True)
)


@dataclass(frozen=True)
class HeadScope:
    """What ``head.scope`` builds besides Eq. 23's head: ``experts(new_head)`` gives the per-task heads (or
    None); ``per_task``: it does, so the learner must retrieve each input's task."""

    experts: Callable[[Callable[..., RanPACHead]], TaskExperts | None]
    per_task: bool


#: ``head.scope``: Eq. 23's head over every class (no per-task heads), or one head per task over its own
#: classes (:class:`TaskExperts`)
HEAD_SCOPES: Registry[HeadScope] = head_options.HEAD_SCOPES
HEAD_SCOPES.register("global", help="Eq. 23's head over every class")(HeadScope(lambda new_head: None, False))
HEAD_SCOPES.register("task", help="each task's own ridge head over its own classes")(
    HeadScope(TaskExperts, True)
)
