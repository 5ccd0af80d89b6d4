"""The one learner protocol (Mammoth's shape: a method is a class with hooks, the loop is the framework's).

:class:`proteus.Proteus` and every Table 1 baseline (:mod:`proteus.baselines`) implement
:class:`ContinualLearner`; a method declaration names its learner (``Method.learner``), resolved once
through :data:`LEARNERS`, and :mod:`proteus.experiment` runs every learner with one loop
(:func:`proteus.experiment.loop.run`), one evaluation (:class:`proteus.experiment.evaluate.Evaluator`,
built on :func:`proteus.metrics.accuracy`) and one persistence layer (:mod:`proteus.experiment.store`:
:meth:`ContinualLearner.state` into a knowledge base, and back).

What a learner supports beyond learning and evaluating is declared in :attr:`ContinualLearner.supports`
(:data:`CAPABILITIES`); a command that needs more than the learner supports refuses by name.

What a knowledge base accepted by ``proteus kb verify`` holds, every command loads: :func:`load_problems`
makes the checks of :func:`load_from_kb` (the config, the learner's rules of its state, the restore into
a fresh learner), on a backbone of random weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast, overload, runtime_checkable

import torch
from torch import Tensor

from proteus._version import __version__
from proteus.collector import collector_paused
from proteus.config import LEARNERS, ConfigError, RunConfig, learner_of, validate
from proteus.devices import PRECISIONS
from proteus.distributed import DEVICE_CHOICES, known_device
from proteus.engine.records import Prediction, TaskRecords, TaskStats
from proteus.errors import ProteusError
from proteus.kb import KBError, KnowledgeBase
from proteus.streams import Task

if TYPE_CHECKING:
    from proteus.engine.embedder import Embedder
    from proteus.engine.keys import RetrievalKeys

__all__ = [
    "CAPABILITIES", "LEARNERS", "ContinualLearner", "LearnerState", "Part", "RetrievalLearner", "TaskParts",
    "TestCache", "TestOutcome", "check_supports", "learner_header", "load_from_kb", "load_problems",
    "retrieval_learner",
]  # fmt: skip

#: what a learner may support beyond ``fit_task`` and evaluation: ``load`` (rebuilt from a knowledge base:
#: ``proteus learn`` in a new process, ``evaluate``, ``predict``, ``serve``), ``retrieval`` (task
#: retrieval: rejection, ``kb forget``, ``kb calibrate``, theory checks), ``analysis`` (the run's analyses
#: of PROTEUS's adapters, keys and heads: :func:`proteus.report.analysis.analyse_run`)
CAPABILITIES = ("load", "retrieval", "analysis")


@dataclass
class TestOutcome:
    """A learner's answer on one test set: the predicted labels, and (retrieval learners) the retrieved
    task of each input and the oracle labels (each input under its true task)."""

    label: Tensor
    task: Tensor | None = None
    oracle: Tensor | None = None


class TestCache(Protocol):
    """The test sets' frozen-prefix outputs and embeddings, computed once (an adapter never changes after
    its task): :class:`proteus.experiment.evaluate.Evaluator`."""

    def prefix(self, tau: int) -> Tensor: ...

    def labels(self, tau: int) -> Tensor: ...

    def embedding(self, tau: int, kind: str, j: int | None) -> Tensor: ...


#: one task's share of a learner's state: its record (JSON) and its tensors
Part = tuple[dict[str, Any], dict[str, Tensor]]


class TaskParts(Sequence[Part]):
    """A learner's per-task parts, each built when it is first asked for (``parts[k]``; kept while this
    object lives, so that it reads like a list), with what a knowledge base needs to leave the unchanged
    ones alone: ``stored(k)``, the record task k was committed as or read from while the task has not
    changed since (None once it has, or before it was ever stored), which the store keeps without building
    the part (``tokens()``: every task's at once); and ``committed(k, record)``, called by the store after
    a commit for every task whose record is not already its token, so that the learner keeps the record
    as task k's token. A learner invalidates a token wherever it changes a stored task (``kb forget``,
    ``kb calibrate``)."""

    def __init__(
        self,
        n: int,
        build: Callable[[int], Part],
        stored: Callable[[int], Any] | None = None,
        committed: Callable[[int, Any], None] | None = None,
        tokens: Callable[[], list[Any]] | None = None,
    ) -> None:
        self._n, self._build = n, build
        self._stored, self._committed, self._tokens = stored, committed, tokens
        self._built: dict[int, Part] = {}

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, k: int) -> Part: ...

    @overload
    def __getitem__(self, k: slice) -> list[Part]: ...

    def __getitem__(self, k: int | slice) -> Part | list[Part]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        if not -self._n <= k < self._n:
            raise IndexError(f"task index {k} out of range ({self._n} tasks)")
        k %= self._n
        if k not in self._built:
            self._built[k] = self._build(k)
        return self._built[k]

    def stored(self, k: int) -> Any:
        return None if self._stored is None else self._stored(k)

    def tokens(self) -> list[Any]:
        """``stored(k)`` of every task, in one pass (``tokens``: the learner's own, when it has one)."""
        return self._tokens() if self._tokens is not None else [self.stored(k) for k in range(self._n)]

    def committed(self, k: int, record: Any) -> None:
        if self._committed is not None:
            self._committed(k, record)


@dataclass
class LearnerState:
    """What a learner leaves in a knowledge base: one (record, tensors) per task (a list, or
    :class:`TaskParts` built on demand) and one global (meta, tensors) or None
    (:mod:`proteus.experiment.store` writes it, content-addressed)."""

    tasks: Sequence[Part] = field(default_factory=list)
    head: Part | None = None


@runtime_checkable
class ContinualLearner(Protocol):
    """What the shared loop, evaluation and persistence call (and, once fitted, ``device_``: the device
    the loop's clocks wait for)."""

    @property
    def supports(self) -> frozenset[str]:
        """The capabilities of :data:`CAPABILITIES` the learner has."""
        ...

    #: the role of :data:`proteus.tensor_rules.TENSOR_RULES` whose rules its knowledge base follows (its
    #: parts declare what they store under it)
    kb_layout: str
    config: RunConfig
    #: show progress bars on long passes
    progress: bool
    #: one record per learned task: classes and their names, images, statistics, settings
    records_: TaskRecords

    @property
    def num_tasks(self) -> int: ...

    @property
    def classes_(self) -> list[str]:
        """The learned classes' names, indexed by global label (``Prediction.label``)."""
        ...

    def transform_images(self, images: Sequence[Any]) -> Tensor:
        """A batch (N, 3, H, W) of PIL images under the evaluation transform, on the learner's device."""
        ...

    def predict(self, x: Tensor) -> Prediction:
        """The answer for a batch of transformed images over every task learned."""
        ...

    def set_params(self, **params: Any) -> Any:
        """Set ``progress`` or config keys (dotted, or with ``__``); after task 1 only per-task keys."""
        ...

    @property
    def train_log_(self) -> list[dict[str, Any]]:
        """The training curve of the task learned last, one row per optimisation step (``epoch``,
        ``step``, ``loss``, ...); empty for a method that does not train."""
        ...

    def fit_task(self, task: Task) -> TaskStats:
        """Learn one task, transactionally; returns what it measured (the loop adds its timings)."""
        ...

    def prefix_dataset(self, ds: Any, desc: str = "prefix") -> tuple[Tensor, Tensor]:
        """Frozen-prefix outputs and labels of a (PIL image, label) dataset."""
        ...

    def predict_test(self, cache: TestCache, tau: int, k: int) -> TestOutcome:
        """The prediction on test set tau after task k (0-based), from the cache."""
        ...

    def state(self) -> LearnerState: ...

    def restore(self, state: LearnerState) -> Any:
        """Load a :meth:`state` into this learner, which holds no task yet; returns the learner (learners
        that support ``load``)."""
        ...

    def kb_header(self) -> dict[str, Any]: ...


class RetrievalLearner(ContinualLearner, Protocol):
    """A learner that supports ``retrieval`` (:data:`CAPABILITIES`): its keys retrieve a task for each
    input, so it rejects inputs of no learned task, forgets a task and is calibrated (``proteus kb
    forget``, ``proteus kb calibrate``); :func:`retrieval_learner` narrows a learner to it."""

    #: the retrieval keys (:mod:`proteus.engine.keys`)
    keys_: RetrievalKeys
    #: the frozen prefix and the adapted passes (:class:`~proteus.engine.embedder.Embedder`)
    embedder_: Embedder

    def forget_task(self, k: int) -> Any:
        """Remove task k (0-based) from what can be predicted."""
        ...

    def embed_prefix(
        self, z: Tensor, tasks: list[int] | None, kind: str = "task", shard: bool = True
    ) -> Tensor:
        """(G, N, d) embeddings of prefix outputs ``z`` under the compositions of ``tasks`` (None: the
        frozen backbone's)."""
        ...


def retrieval_learner(learner: ContinualLearner, command: str) -> RetrievalLearner:
    """``learner`` as a :class:`RetrievalLearner`; ``command`` refused by name when it lacks retrieval."""
    check_supports(learner, "retrieval", command)
    return cast(RetrievalLearner, learner)


class FittedLearner(ContinualLearner, Protocol):
    """A :class:`ContinualLearner` once fitted, for the type checker (not checked at run time: an unfitted
    learner has no ``device_``)."""

    #: the device the loop's clocks wait for
    device_: torch.device


def check_supports(learner: Any, capability: str, command: str) -> None:
    """Refuse ``command`` by name when the learner lacks ``capability`` (:data:`CAPABILITIES`)."""
    from proteus.engine.errors import TaskError

    if capability not in learner.supports:
        name = getattr(learner.config, "method", type(learner).__name__)
        raise TaskError(
            f"{command}: method {name} ({type(learner).__name__}) does not support {capability!r} "
            f"(it supports {', '.join(sorted(learner.supports)) or 'learning and evaluation only'}); "
            + _HINTS[capability]
        )


#: what to do instead, per capability a learner lacks
_HINTS = {
    "load": "run it on a whole stream with `proteus run` or `proteus compare`",
    "analysis": "the analyses read PROTEUS's adapters, keys and heads (a PROTEUS method)",
    "retrieval": "this needs a PROTEUS method with task retrieval (retrieval.mode=signature)",
}


def load_from_kb(
    kb: KnowledgeBase,
    command: str,
    *,
    expect: type | None = None,
    device: str | None = None,
    precision: str | None = None,
    progress: bool = False,
) -> ContinualLearner:
    """The learner a knowledge base holds, for ``command``: its method's learner on its stored config
    (``device`` and ``precision`` replace the stored ones for this process), the backbone identity checked
    before a tensor is read, then its state, checked by the learner's rules, restored. Refused by name
    when the learner lacks ``load`` or (``expect``) is another learner class."""
    clf = _stored_learner(kb, expect=expect, device=device, precision=precision, progress=progress)
    check_supports(clf, "load", command)
    kb.check_backbone(clf.kb_header()["backbone"])
    with collector_paused():  # :mod:`proteus.collector`
        return clf.restore(LearnerState(*kb.read_state(getattr(clf, "kb_layout", None))))


def load_problems(kb: KnowledgeBase) -> list[str]:
    """What :func:`load_from_kb` would refuse in ``kb`` (an empty list when every command loads it): its
    config (read and validated as a load does), its state by its method's learner's rules, and, for a
    learner that supports ``load``, the restore into a fresh one on the CPU -- on a backbone of random
    weights (the architecture the config names, no weights read: the backbone's identity is checked but,
    for pretrained weights, which weights and their hash). ``proteus kb verify`` reports them."""
    try:
        clf = _stored_learner(kb, checking=True)
        state = LearnerState(*kb.read_state(getattr(clf, "kb_layout", None)))
        if "load" in clf.supports:
            _check_identity(kb, clf.kb_header()["backbone"])
            clf.restore(state)
    except ProteusError as e:
        return [str(e)]
    return []


def _check_identity(kb: KnowledgeBase, identity: dict[str, Any]) -> None:
    """The knowledge base's backbone identity against ``identity``, that of its config's backbone built
    with random weights: all of it for a config of random weights; for pretrained ones (which weights,
    their hash: this machine's business when it loads them) the architecture, and that the knowledge base
    was not learned on random weights."""
    stored = RunConfig.from_stored(kb.manifest["config"]).backbone
    mine = kb.manifest.get("backbone") or {}
    if stored.pretrained or stored.weights is not None:
        if str(mine.get("weights_id")).startswith("random"):
            raise KBError(
                f"{kb.root}: knowledge base was written with random backbone weights (weights_id="
                f"{mine.get('weights_id')!r}), but its config's backbone loads pre-trained ones "
                f"(backbone.pretrained={stored.pretrained}, backbone.weights={stored.weights!r})"
            )
        identity = {**identity, **{k: mine.get(k) for k in ("weights_id", "weights_sha256")}}
    kb.check_backbone(identity)


def _stored_learner(
    kb: KnowledgeBase,
    *,
    expect: type | None = None,
    device: str | None = None,
    precision: str | None = None,
    progress: bool = False,
    checking: bool = False,
) -> Any:
    """A fresh learner of the knowledge base's method on its stored config, validated (``checking``: then
    moved to the CPU, its backbone built without its weights)."""
    from proteus.engine.errors import TaskError

    where = kb.root / "manifest.json"
    stored = kb.manifest.get("config")
    if not isinstance(stored, dict):
        raise KBError(
            f"{where}: holds no learner's state (no config: the store wrote it, not a learner); learn into "
            "it with `proteus learn`"
        )
    if precision and precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    try:
        cfg = RunConfig.from_stored(stored)
        cls = learner_of(cfg)
        validate(cfg)
        if not known_device(cfg.device):  # whether it exists here is checked where it is used
            raise ConfigError(f"device: unknown device {cfg.device!r}; use {DEVICE_CHOICES}")
        if checking:
            backbone = dataclasses.replace(cfg.backbone, pretrained=False, weights=None)
            cfg = dataclasses.replace(cfg, device="cpu", backbone=backbone)
    except ConfigError as e:
        raise ConfigError(f"{where}: config: {e}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # a value no config key holds
        raise ConfigError(f"{where}: config: {type(e).__name__}: {e}") from None
    if expect is not None and cls is not expect:
        raise TaskError(f"{kb.root}: holds method {cfg.method}, not a {expect.__name__} method")
    cfg = dataclasses.replace(cfg, device=device or cfg.device, precision=precision or cfg.precision)
    return cls(cfg, progress=progress)


def learner_header(config: RunConfig, backbone: dict[str, Any]) -> dict[str, Any]:
    """What a new knowledge base records about a learner: version, backbone identity, config, split."""
    return {
        "proteus_version": __version__,
        "backbone": backbone,
        "config": config.to_dict(),
        "split": {"benchmark": config.benchmark.name, "sha256": None, "class_order": None},
        "evaluation": [],
    }
