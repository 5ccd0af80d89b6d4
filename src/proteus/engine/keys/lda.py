"""LDA task keys in one fixed space (beyond the paper, docs/retrieval.md): a ridge head over all classes
accumulated task by task like the head's G (Eq. 23's statistics), on the frozen backbone's features or
under the first task's adapter. A task's score (``signature.task_score``, :data:`TASK_SCORES`) is minus
the log of its average class probability, ``-log mean_{c in t} softmax(f / T)_c`` with T =
``signature.class_temperature`` ("mean", so that a task with more classes is not favoured), or minus its
best class score ("max"). The same statistics give the class-Gaussian detector of inputs from no learned
task (``retrieval.novelty``, :mod:`proteus.engine.novelty`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from proteus.config import ConfigError, RunConfig
from proteus.engine.embedder import Embedder
from proteus.engine.errors import TaskError
from proteus.engine.experts import candidates
from proteus.engine.keys.base import GLOBAL_PREFIX, GLOBAL_RECORD, KEYS, KeyFit, KeyKind, RetrievalKeys
from proteus.engine.keys.space import FIRST_ADAPTER, FROZEN, KeySpace
from proteus.engine.novelty import NOVELTY, ClassNovelty
from proteus.engine.stored import TaskShares
from proteus.heads import PROTOTYPES, RanPACHead
from proteus.heads.persist import assemble_columns, classes_outside, column_pieces, is_head_meta
from proteus.registry import Registry
from proteus.signatures import RetrievalResult
from proteus.signatures import options as signature_options
from proteus.signatures.signature import NORMALIZATIONS
from proteus.tensor_rules import TENSOR_RULES, Check, Mount, ShapeRule, Together

__all__ = ["TASK_SCORES", "Groups", "LDAKeys", "groups", "task_scores"]


@dataclass(frozen=True)
class Groups:
    """Which task owns each class: ``task_of`` (C,) the owner of each class the scores cover (-1: none) and
    ``sizes`` (m,) each task's number of classes; built once per list of classes (:func:`groups`)."""

    task_of: Tensor
    sizes: Tensor

    def reduce(self, values: Tensor, how: str) -> Tensor:
        """(N, m): ``values`` (N, C) reduced over each task's classes (``"amax"`` or ``"sum"``); a task with
        no class gets -inf (amax) or 0 (sum)."""
        N, m = values.shape[0], self.sizes.shape[0]
        own = self.task_of >= 0
        idx = self.task_of[own].expand(N, -1)
        if how == "amax":
            out = values.new_full((N, m), float("-inf"))
            return out.scatter_reduce(1, idx, values[:, own], "amax")
        return values.new_zeros((N, m)).scatter_add(1, idx, values[:, own])


#: (the classes list, C, its Groups): the last one computed, kept by identity
_GROUPS: list[Any] = [None, None, None]


def groups(classes: list[list[int]], n_classes: int) -> Groups:
    """The :class:`Groups` of ``classes`` (each task's classes, as the records give them) over ``n_classes``
    scored classes; the last one computed is kept for the same list object (a learner's records keep
    theirs: :meth:`~proteus.engine.records.TaskRecords.classes`)."""
    if _GROUPS[0] is classes and _GROUPS[1] == n_classes:
        return _GROUPS[2]
    task_of = torch.full((n_classes,), -1, dtype=torch.long)
    sizes = torch.as_tensor([len(c) for c in classes], dtype=torch.long)
    flat = torch.as_tensor([i for c in classes for i in c], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(classes)), sizes)
    kept = flat < n_classes
    task_of[flat[kept]] = owner[kept]
    out = Groups(task_of, sizes)
    _GROUPS[:] = [classes, n_classes, out]
    return out


#: ``signature.task_score``: how class scores f (N, C) become every task's score (N, m), lower is better:
#: an entry takes f, ``temperature`` (``signature.class_temperature``) and the tasks' :class:`Groups`, and
#: scores every task at once (a task with no class: +inf)
TASK_SCORES: Registry[Callable[[Tensor, float, Groups], Tensor]] = signature_options.TASK_SCORES


@TASK_SCORES.register(
    "mean", help="-log mean_{c in t} softmax(f / T)_c: the posterior over tasks", tempered=True
)
def _mean_score(logits: Tensor, temperature: float, g: Groups) -> Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=1)
    top = g.reduce(logp, "amax")  # each task's logsumexp, from its largest term
    shift = top.clamp_min(torch.finfo(logp.dtype).min).gather(1, g.task_of.clamp_min(0).expand_as(logp))
    lse = torch.log(g.reduce(torch.exp(logp - shift), "sum")) + top
    return (torch.log(g.sizes.clamp_min(1).double()) - lse).float()


@TASK_SCORES.register("max", help="-max_{c in t} f_c: the task's best class score")
def _max_score(logits: Tensor, temperature: float, g: Groups) -> Tensor:
    return -g.reduce(logits, "amax")


def task_scores(logits: Tensor, classes: list[list[int]], how: str, temperature: float) -> Tensor:
    """(N, m) task scores from class scores ``logits`` (N, C) and each task's classes (:data:`TASK_SCORES`).

    "mean": ``-log mean_{c in t} p(c|x)`` with ``p = softmax(logits / temperature)`` over every class,
    so that ``softmax_t(-scores)`` is the posterior over tasks under a uniform prior on tasks (a task's
    classes share its prior); "max": ``-max_{c in t} logits_c``. One pass over the classes, whatever the
    number of tasks; a task left with no class (forgotten) scores +inf: it is never retrieved."""
    g = groups(classes, logits.shape[1])
    out = TASK_SCORES.get(how)(logits, temperature, g)
    return out.masked_fill(g.sizes[None] == 0, float("inf"))


#: what :meth:`LDAKeys.task_state` stores under its ``prefix`` with ``keep_inputs`` (``kb forget`` subtracts
#: them): a task's key features and labels
TENSOR_RULES.declare(
    "lda inputs",
    "LDAKeys",
    ShapeRule("x", ("obj.n", "kb.d"), "{prefix}x (n, d) and {prefix}y (n) have n rows"),
    ShapeRule("y", ("obj.n",), "{prefix}x (n, d) and {prefix}y (n) have n rows", "int"),
    Together("(?:x|y)", ("x", "y")),
)
#: PROTEUS's LDA keys: their inputs in each task's object, their head (a RanPAC head, :meth:`global_state`)
#: in the head's object
TENSOR_RULES.declare(
    "proteus", "LDAKeys",
    Mount("lda inputs", prefix="lda/", on="task"),
    Mount("ranpac columns", prefix="lda/", on="task"),  # the key head's columns of the task's classes
    Mount("ranpac", prefix=GLOBAL_PREFIX, record=GLOBAL_RECORD, when=is_head_meta, on="head"),
    Check(lambda tasks, meta, where: classes_outside(tasks, meta, where, GLOBAL_RECORD)),
)  # fmt: skip


class LDAKeys(RetrievalKeys):
    """An LDA (ridge) head over all classes in one fixed key space (``frozen`` or ``first-adapter``),
    accumulated task by task like the head's G; L2-normalised features when ``signature.normalize`` is
    ``l2``. Kept in the knowledge base inside the head's object (``task_head/`` tensors). ``novelty``: the
    class-Gaussian detector on the same statistics (its calibration rows in each task's object)."""

    class_statistics = True

    def __init__(
        self,
        *args: Any,
        space: KeySpace = FROZEN,
        prefix: str = "lda/",
        novelty: ClassNovelty | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.space: KeySpace = space
        self.head: RanPACHead | None = None
        self.n_tasks = 0
        self._before: RanPACHead | None = None
        #: with ``keep_inputs``: task -> (its key features, labels), what :meth:`forget` subtracts (read from
        #: its stored tensors once it is stored)
        self.inputs: TaskShares[tuple[Tensor, Tensor]] = TaskShares(
            lambda k, t: (t[f"{prefix}x"].float(), t[f"{prefix}y"].long()), 0
        )
        self.prefix = prefix
        self.novelty = novelty
        #: each loaded task's classes and stored tensors, its columns of the key head under :attr:`prefix`
        #: (:meth:`load_task`), until the head loads
        self._columns: list[tuple[list[int], Mapping[str, Tensor]]] = []
        self.detector = KeysDetector(self)

    @classmethod
    def from_config(cls, cfg: RunConfig, device: torch.device, new_head: Any, **options: Any) -> LDAKeys:
        build = NOVELTY.get(cfg.retrieval.novelty).build
        if build is not None:
            options["novelty"] = build(cfg.retrieval)
        return super().from_config(cfg, device, new_head, **options)

    @property
    def wants_taps(self) -> bool:  # type: ignore[override]
        """The ``task-gaussian`` detector fits each task's Gaussians on its inputs' tap statistics."""
        return self.novelty is not None and self.novelty.tasks

    @property
    def uses_taps(self) -> bool:
        """Every task has its Gaussians: prediction reads the inputs' tap statistics."""
        return self.novelty is not None and self.novelty.uses_taps

    def features(self, X: Tensor) -> Tensor:
        return NORMALIZATIONS.get(self.cfg.normalize)(X.float())

    def add_task(self, fit: KeyFit) -> None:
        self.space.check(fit.num_adapters, f"LDA keys in the {self.space.name} space")
        X = self.features(self.space.embed(fit.embedder, fit.z))
        # a copy (d x d statistics, cheap): a later step of this task may still fail, and the rollback
        # must find the key head as it was before the task
        head = copy.deepcopy(self.head) if self.head is not None else self.new_head(rp_dim=0, dim=X.shape[1])
        try:
            head.update(X.to(self.device), fit.y.to(self.device), num_classes=fit.num_classes)
        except (ValueError, FloatingPointError) as e:
            raise TaskError(f"task {fit.k + 1}: LDA key update failed: {e}") from None
        self._before, self.head = self.head, head
        if self.keep_inputs:
            self.inputs[self.n_tasks] = (X.float().cpu().clone(), fit.y.cpu().clone())
        if self.novelty is not None:
            self.novelty.draw(self.n_tasks, X, fit.y, fit.seed + 3, fit.taps, fit.tap_sizes)
            shortlist_of = None if fit.classes is None else self.detector.shortlist_of(fit.classes)
            if shortlist_of is not None:  # its rows scored under the keys it was learned with
                self.novelty.score_task(self.n_tasks, shortlist_of)
        self.n_tasks += 1
        return None

    def truncate(self, m: int) -> None:
        if m >= self.n_tasks:
            return
        if m != self.n_tasks - 1:
            raise ValueError("LDA keys can only drop the task learned last")
        self.head, self._before, self.n_tasks = self._before, None, m
        self.inputs.pop(m, None)
        if self.novelty is not None:
            self.novelty.drop(m)

    def settle(self) -> None:
        self._before = None  # the rollback copy of the key head (a full head: its statistics grow with C)

    @contextlib.contextmanager
    def without(self, embedder: Embedder, z: Tensor, y: Tensor) -> Iterator[None]:
        """Within the block the key head is the one fitted without the training inputs ``z`` (labels y):
        their key features subtracted from its statistics exactly (:meth:`RanPACHead.downdate`, its γ
        kept), as the class-Gaussian detector subtracts its calibration rows; restored after the block.
        The detector is off within the block (it would refit its Gaussians to the copy)."""
        if self.head is None or self.head.G_ is None or PROTOTYPES.get(self.head.prototypes).stored:
            yield  # (task-mean prototypes: a few rows cannot be taken out exactly, they stay in)
            return
        X = self.features(self.space.embed(embedder, z, shard=False))
        before, novelty = self.head, self.novelty
        head = copy.copy(before)  # downdate assigns new statistics: the keys' head keeps its own
        head.downdate(X.to(self.device), y.to(self.device), [])
        self.head, self.novelty = head, None
        try:
            yield
        finally:
            self.head, self.novelty = before, novelty

    def check_forget(self, k: int) -> None:
        if k not in self.inputs:
            raise ValueError(
                f"task {k + 1}: its LDA key inputs were not kept (learn with --set head.forgettable=true)"
            )

    def forget(self, k: int, classes: list[int]) -> None:
        """Subtract the task from the key head exactly (:meth:`RanPACHead.downdate`)."""
        self.check_forget(k)
        assert self.head is not None
        X, y = self.inputs.pop(k)
        self.head.downdate(X.to(self.device), y.to(self.device), classes)
        self._before = None  # the rollback copy predates the forgetting
        if self.novelty is not None:  # its calibration rows left the statistics with the rest of it
            self.novelty.drop(k)
        super().forget(k, classes)

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        if self.head is None:
            raise ValueError(f"LDA keys in the {self.space.name} space need a fitted key head")
        scores = self._task_scores(self.features(X), m, classes)
        task = scores.argmin(1)
        rows = torch.arange(len(task))
        return RetrievalResult(
            task=task,
            component=torch.zeros_like(task),
            score=scores[rows, task],
            task_scores=scores,
        )

    def _task_scores(self, F: Tensor, m: int, classes: list[list[int]]) -> Tensor:
        """(N, m): the first m tasks' scores of key features F (a forgotten task's: +inf)."""
        assert self.head is not None
        logits = self.head.decision_function(F.to(self.device)).float().cpu()
        first = classes if m == len(classes) else classes[:m]  # the same list: its Groups are kept
        scores = task_scores(logits, first, self.cfg.task_score, self.cfg.class_temperature)
        scores[:, [j for j in self.forgotten if j < m]] = float("inf")
        return scores

    def novelty_of(
        self, X: Tensor, classes: list[list[int]], taps: Tensor | None = None, scores: Tensor | None = None
    ) -> Tensor | None:
        return self.detector.novelty_of(X, classes, taps, scores)

    def novelty_thresholds(self, classes: list[list[int]]) -> list[float]:
        return self.detector.thresholds(classes)

    def calibrate(
        self, X: Tensor, labels: Tensor, classes: list[list[int]], tpr: float | None,
        taps: Tensor | None = None,
    ) -> list[float]:  # fmt: skip
        return self.detector.calibrate(X, labels, classes, tpr, taps)

    def task_state(
        self, k: int, classes: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Task k's share: its detector's rows and Gaussians, its key inputs (``head.forgettable``), and the
        key head's columns of its ``classes`` (the head's object keeps only what has a fixed size)."""
        meta, _ = super().task_state(k, classes)
        tensors: dict[str, Tensor] = {}
        if self.novelty is not None:
            nmeta, tensors = self.novelty.task_state(k)
            meta = {**meta, **nmeta}
        if self.head is not None and classes is not None:
            tensors = {**tensors, **{f"{self.prefix}{n}": t for n, t in self.head.columns(classes).items()}}
        if k not in self.inputs:
            return meta, tensors
        X, y = self.inputs[k]
        return meta, {**tensors, f"{self.prefix}x": X, f"{self.prefix}y": y}

    def load_task(self, meta: dict[str, Any], tensors: Mapping[str, Tensor]) -> None:
        if self.novelty is not None:
            self.novelty.load_task(self.n_tasks, meta, tensors)
        if f"{self.prefix}x" in tensors:
            self.inputs.bind(self.n_tasks, tensors)
        self._columns.append(([int(c) for c in meta["classes"]], tensors))
        self.n_tasks += 1
        super().load_task(meta, tensors)

    def adopt(self, k: int, tensors: Mapping[str, Tensor]) -> None:
        if self.novelty is not None:
            self.novelty.adopt(k, tensors)
        if k in self.inputs and f"{self.prefix}x" in tensors:
            self.inputs.bind(k, tensors)

    def global_state(
        self, classes: list[list[int]] | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        """The key head, and the detector fitted under a shortlist (a reader need not fit it again)."""
        if self.head is None:
            return None, {}
        state = self.detector.fitted_state(classes)
        extra = {} if state is None else {"novelty_fit": state}
        return {**self.head.meta(columns=False), **extra}, self.head.state_tensors(columns=False)

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        """The key head: its object's tensors, with the columns its tasks hold (:meth:`load_task`) when its
        meta says they live there."""
        if meta is None:
            return
        if meta.get("columns") == "tasks":
            tensors = {**tensors, **assemble_columns(meta, column_pieces(self._columns, self.prefix))}
        self._columns = []
        self.head = self.new_head(rp_dim=0, dim=int(meta["embed_dim"]))
        self.head.load_state_tensors({k: v.to(self.device) for k, v in tensors.items()}, meta)
        if self.novelty is not None:
            self.novelty.restore_fitted(meta.get("novelty_fit"), id(self.head))


class KeysDetector:
    """The detector of inputs from no learned task (:class:`~proteus.engine.novelty.ClassNovelty`) of
    :class:`LDAKeys` ``keys``: fitted to the key head's statistics, its calibration rows and the inputs
    scored under the tasks the keys rank highest for them (``retrieval.shortlist``)."""

    def __init__(self, keys: LDAKeys) -> None:
        self.keys = keys

    def shortlist_of(self, classes: list[list[int]]) -> Callable[[Tensor], Tensor] | None:
        """Key features -> their ``retrieval.shortlist`` candidate tasks among those of ``classes``."""
        keys = self.keys
        k = None if keys.novelty is None else keys.novelty.shortlist
        return None if k is None else lambda F: candidates(keys._task_scores(F, len(classes), classes), k)

    def fit(self, classes: list[list[int]]) -> Tensor | None:
        """The detector fitted to the current statistics; returns each class's task (None: no detector or
        no calibration rows)."""
        head, novelty = self.keys.head, self.keys.novelty
        if novelty is None or head is None or head.G_ is None:
            return None
        assert head.Q_ is not None and head.counts_ is not None
        task_of = groups(classes, int(head.counts_.shape[0])).task_of.clamp_min(0)
        fitted = novelty.fit(head.G_, head.Q_, head.counts_, task_of, id(head), self.shortlist_of(classes))
        return task_of if fitted else None

    def fitted_state(self, classes: list[list[int]] | None) -> dict[str, Any] | None:
        """The detector fitted under a shortlist, as the knowledge base keeps it (None: no shortlist)."""
        novelty = self.keys.novelty
        if (
            novelty is None
            or not classes
            or not novelty.shortlisted(len(classes))
            or self.fit(classes) is None
        ):
            return None
        return novelty.fitted_state()

    def novelty_of(
        self, X: Tensor, classes: list[list[int]], taps: Tensor | None = None, scores: Tensor | None = None
    ) -> Tensor | None:
        """The novelty of key-space inputs X with tap statistics ``taps`` (None without calibration rows,
        or without ``taps`` where the task Gaussians need them); ``scores``: their task scores, when the
        caller has them (the shortlist reads them)."""
        task_of, keys = self.fit(classes), self.keys
        if task_of is None or keys.novelty is None:
            return None
        F = keys.features(X)
        cand = None
        if keys.novelty.shortlisted(len(classes)):
            assert keys.novelty.shortlist is not None
            scores = scores if scores is not None else keys._task_scores(F, len(classes), classes)
            cand = candidates(scores, keys.novelty.shortlist)
        return keys.novelty.novelty(F.to(keys.device), task_of, taps, cand)

    def thresholds(self, classes: list[list[int]]) -> list[float]:
        """Each task's threshold ([] without a detector or calibration rows)."""
        if self.fit(classes) is None or self.keys.novelty is None:
            return []
        return self.keys.novelty.thresholds() or []

    def calibrate(
        self, X: Tensor, labels: Tensor, classes: list[list[int]], tpr: float | None,
        taps: Tensor | None = None,
    ) -> list[float]:  # fmt: skip
        """New calibration rows for the detector from held-out inputs X (N, d) in the keys' space that
        were never part of the statistics (``kb calibrate --images``), ``taps`` their tap statistics;
        ``labels`` (N,) their global classes, -1 where unknown (the nearest class is taken). Returns each
        task's threshold."""
        keys = self.keys
        head = keys.head
        if keys.novelty is None or head is None or head.G_ is None:
            raise ConfigError(
                "this knowledge base was learned with retrieval.novelty=none: it keeps no detector of "
                "inputs from no learned task to calibrate (learn with retrieval.novelty=auto)"
            )
        assert head.Q_ is not None and head.counts_ is not None
        task_of = groups(classes, int(head.counts_.shape[0])).task_of
        statistics = (head.G_, head.Q_, head.counts_)
        keys.novelty.calibrate(keys.features(X), labels, task_of, statistics, keys.forgotten, tpr, taps)
        return self.thresholds(classes)


KEYS.register("frozen-lda", help="LDA keys on frozen features (beyond the paper)", lda=True)(
    KeyKind(LDAKeys, True, {"space": FROZEN})
)
KEYS.register(
    "first-adapter-lda", help="LDA keys under the first task's adapter (beyond the paper)", lda=True
)(KeyKind(LDAKeys, True, {"space": FIRST_ADAPTER}))
