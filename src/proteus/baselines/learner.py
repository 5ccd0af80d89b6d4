"""The shared learner of the trained-classifier baselines (Table 1): one training loop, one masked head.

Every baseline of :mod:`proteus.baselines` is a :class:`ContinualClassifier`: a frozen backbone, the
method's own trainable state (LoRA branches or prompts) and one linear head per task over that task's
classes. Training task t minimises the cross-entropy over task t's classes only (its own head, targets
local to the task) plus the method's auxiliary loss; a prediction is the argmax over the heads of every
task seen so far, concatenated. Released code writes this rule four ways (InfLoRA: a pool of per-task
heads; SD-LoRA: ``logits[:, known:]``; L2P / DualPrompt: logits of other classes set to -inf; CODA: the
same on the seen slice), all of which reduce to the same loss and the same test-time argmax over the seen
classes (docs/experiments.md, "Baselines").

A method implements four hooks: :meth:`_setup` (build its state on the backbone), :meth:`features`
(the embedding of a batch of prefix outputs, under training or inference), :meth:`begin_task` /
:meth:`end_task` (open and freeze a task's state) and :meth:`trainable` (what the optimiser sees); and two
for its knowledge base: :meth:`state_tensors` (everything it learned that a prediction or a later task
reads, generator states included) and :meth:`load_state` (the same back; :mod:`proteus.baselines.persist`
composes them with the heads and records, so that ``proteus learn`` task by task equals ``proteus run``). The
backbone's frozen prefix (``backbone.adapt_last``) is computed once per image when there is no
augmentation, as for PROTEUS. The backbone stays in eval mode throughout (BatchNorm statistics of
MobileNetV2 never move; the ViTs have no dropout), so frozen means bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proteus import distributed as dist
from proteus.baselines import persist
from proteus.config import LEARNERS, ConfigError, RunConfig, check_sections, per_task, typed_options, validate
from proteus.engine.embedder import ImageDataset
from proteus.engine.errors import TaskError
from proteus.engine.records import (
    Prediction,
    TaskRecord,
    TaskRecords,
    TaskStats,
    loss_summary,
    without_timings,
)
from proteus.engine.runtime import Runtime, task_seed
from proteus.errors import NotFittedError
from proteus.learners import LearnerState, TestCache, TestOutcome, learner_header
from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, option, options_of
from proteus.progress import bar as progress_bar
from proteus.registry import Registry
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, Check, Claim, Fields, Schema, ShapeRule
from proteus.tensor_rules import F as Field

log = logging.getLogger("proteus")

__all__ = [
    "OPTIMIZERS", "SCHEDULES", "BaselineOptions", "ContinualClassifier", "NoOptions", "TrainingOptions",
    "check_baseline_config", "column_prediction", "entropy", "epoch_lr", "OpenTask", "task_stats",
]  # fmt: skip

#: ``baseline.optimizer``: (parameters, the method's options, weight decay) -> the task's optimiser
OPTIMIZERS: Registry[Callable[[list[nn.Parameter], Any, float], torch.optim.Optimizer]] = Registry(
    "baseline.optimizer"
)
OPTIMIZERS.register("adam", help="Adam, betas (0.9, 0.999)")(
    lambda params, b, wd: torch.optim.Adam(params, lr=b.lr, betas=(0.9, 0.999), weight_decay=wd)
)
OPTIMIZERS.register("sgd", help="SGD with baseline.momentum")(
    lambda params, b, wd: torch.optim.SGD(params, lr=b.lr, momentum=b.momentum, weight_decay=wd)
)

#: ``baseline.schedule``: (lr, epoch, epochs) -> the epoch's learning rate
SCHEDULES: Registry[Callable[[float, int, int], float]] = Registry("baseline.schedule")
SCHEDULES.register("constant", help="lr throughout")(lambda lr, epoch, epochs: lr)


@SCHEDULES.register("cosine", help="CODA-Prompt's and InfLoRA's CosineSchedule as their loops step it")
def _cosine(lr: float, epoch: int, epochs: int) -> float:
    """lr for the first two epochs (the class resets its step count after construction), then
    lr cos(99 pi (e - 1) / (200 (E - 1))); the last of 20 epochs runs at 9.7% of lr."""
    if epochs <= 1:
        return lr
    return lr * math.cos(99 * math.pi * max(epoch - 1, 0) / (200 * (epochs - 1)))


def epoch_lr(lr: float, schedule: str, epoch: int, epochs: int) -> float:
    """The learning rate of an epoch under ``baseline.schedule`` (:data:`SCHEDULES`)."""
    return SCHEDULES.get(schedule)(lr, epoch, epochs)


# ---------------------------------------------------------------------------------------------- options
@dataclasses.dataclass
class NoOptions:
    """A method without ``baseline.*`` options (no training: NCM)."""


@dataclasses.dataclass
class TrainingOptions:
    """How a baseline's own parameters train (``baseline.*``; ``train.epochs`` and ``train.batch_size``
    apply too; docs/experiments.md gives each method's official setting beside ours)."""

    optimizer: str = option("adam", help="adam (betas 0.9, 0.999) or sgd (with momentum)", choices=OPTIMIZERS)
    lr: float = option(1e-3, help="the method's learning rate", range=POSITIVE)
    momentum: float = option(0.9, help="SGD's momentum", range=NON_NEGATIVE)
    schedule: str = option(
        "constant",
        help="the learning rate over a task's epochs (cosine: CODA's and InfLoRA's)",
        choices=SCHEDULES,
    )
    clip_grad: float | None = option(
        None, help="clip the gradient norm of the trained tensors before each step (L2P, DualPrompt: 1.0)",
        range=POSITIVE,
    )  # fmt: skip


@dataclasses.dataclass
class BaselineOptions(TrainingOptions):
    max_tasks: int | None = option(
        None,
        help="the number of tasks a prompt pool or a threshold schedule is divided over (null: the stream's)",
        range=AT_LEAST_1,
    )


# ---------------------------------------------------------------------------------------------- its parts
# (functions of the learner that its class names: the class stays a readable list of hooks)
def check_baseline_config(cls: type[ContinualClassifier], cfg: RunConfig) -> None:
    """Check the sections a baseline reads and its options (the configuration's validation gathers this): a
    value out of its declared range or choices is an error; a ``baseline.*`` key of another method's
    options is ignored (with a warning when it differs from that method's default); a key of no method's
    options is an error."""
    check_sections(cfg, cls.option_sections)
    typed_options(cls.Options, cfg.baseline, "baseline")
    own = {f.name for f, _ in options_of(cls.Options)}
    others = [LEARNERS.get(n) for n in LEARNERS.names()]
    for key, value in cfg.baseline.items():
        if key in own:
            continue
        defaults = [
            f.default_factory() if callable(f.default_factory) else f.default  # a field has one or the other
            for c in others
            if isinstance(getattr(c, "Options", None), type)
            for f, _ in options_of(c.Options)
            if f.name == key
        ]
        if not defaults:
            known = sorted({f.name for c in others for f, _ in options_of(getattr(c, "Options", NoOptions))})
            raise ConfigError(
                f"unknown config key 'baseline.{key}'; the baselines' options: {', '.join(known)}"
            )
        if all(value != d for d in defaults):
            mine = ", ".join(f"baseline.{k}" for k in sorted(own)) or "none"
            log.warning("%s: baseline.%s set, not among its options (%s): no effect", cfg.method, key, mine)


def column_prediction(logits: torch.Tensor, task: torch.Tensor | None, labels: list[int]) -> Prediction:
    """A :class:`~proteus.engine.records.Prediction` from logits whose columns are the global ``labels``
    (task after task): the label of each row's best column, and the logits re-indexed by global label
    (a label no task holds scores -inf)."""
    cols = torch.as_tensor(labels, dtype=torch.long)
    out = logits.new_full((logits.shape[0], int(cols.max()) + 1), float("-inf"))
    out[:, cols] = logits
    return Prediction(cols[logits.argmax(1)], task, None, None, out)


@dataclasses.dataclass
class OpenTask:
    """Task k while it trains (:meth:`ContinualClassifier.learn_task`): its classes, its inputs (cached
    prefix outputs ``z`` and labels ``y``, or an augmenting ``loader``), its new head, the generator that
    shuffles its batches, and what its training measured (the losses, the parameters of its last phase, a
    method's own numbers in ``extra``)."""

    k: int
    classes: list[int]
    z: torch.Tensor | None
    y: torch.Tensor | None
    loader: Any
    head: nn.Linear
    generator: torch.Generator
    steps_per_epoch: int
    bar: Any
    losses: list[float] = dataclasses.field(default_factory=list)
    params: list[nn.Parameter] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def targets(self, yb: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Global labels ``yb`` as the head's columns (local to the task)."""
        local = {c: i for i, c in enumerate(self.classes)}
        return torch.as_tensor([local[int(c)] for c in yb.tolist()], device=device)


def entropy(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """``-sum p log(p + eps)`` over the last axis, ``p`` the softmax of ``logits`` (the entropy the releases
    of TUNA and TOSCA select a task by, each with its own guard ``eps``)."""
    p = F.softmax(logits, dim=-1)
    return -(p * torch.log(p + eps)).sum(-1)


def task_stats(losses: list[float], params: Iterable[torch.Tensor]) -> dict[str, Any]:
    """A task's statistics as the shared loop reports them."""
    first, last = loss_summary(losses)
    return {
        "steps": len(losses),
        "loss_first": first,
        "loss_last": last,
        "trainable_params": int(sum(p.numel() for p in params)),
    }


#: the role of :data:`~proteus.tensor_rules.TENSOR_RULES` a baseline's knowledge base follows
KB_LAYOUT = "baseline"
#: the head meta :meth:`ContinualClassifier.state` writes
BASELINE_META: Schema = {"method": Field("str", True), "task_classes": Field("list[list[count]]", True)}


def _task_classes(tasks: list[Any], meta: dict[str, Any] | None, where: Callable[[int], str]) -> list[str]:
    """The head's ``task_classes`` are the tasks' classes, task by task."""
    if meta is None or not isinstance(meta.get("task_classes"), list):
        return []
    if meta["task_classes"] != [t.get("classes") if isinstance(t, dict) else None for t in tasks]:
        return ["head.meta.task_classes: differs from the tasks' classes"]
    return []


#: a baseline's records (one per task: index, classes, names, images) and its global object: every task's
#: linear head (:meth:`ContinualClassifier.state_tensors`); a method's own tensors are its own declarations
TENSOR_RULES.declare(
    KB_LAYOUT, "ContinualClassifier",
    Claim(lambda meta: "task_classes" in meta),
    Fields({}, required=("classes", "class_names", "n_train")),
    Fields(BASELINE_META, on="head"),
    Check(_task_classes),
    ShapeRule(r"head\.(?P<t>\d+)\.weight", ("classes[{t}]", "kb.linear_d"),
              "task {t}'s linear head has one row per class of the task", on="head"),
    ShapeRule(r"head\.(?P<t>\d+)\.bias", ("classes[{t}]",), "task {t}'s linear head has one bias per class",
              on="head"),
)  # fmt: skip


class ContinualClassifier:
    """A frozen backbone, a method's trainable state and per-task linear heads (class-incremental).

    Args:
        config: the run's configuration (``backbone``, ``train``, ``baseline``, ``eval``, ``seed``).
        progress: show progress bars.

    Fitted attributes: ``backbone_``, ``embed_dim``, ``heads_`` (one ``nn.Linear`` per task), ``labels_``
    (the global label of each logit column, task after task), ``task_classes_``, ``records_`` (one
    :class:`~proteus.engine.records.TaskRecord` per learned task, as PROTEUS's) and ``classes_`` (the
    learned classes' names, indexed by global label, as PROTEUS's).
    """

    #: registry name (:data:`proteus.learners.LEARNERS`)
    name: str = "baseline"
    #: the rules its knowledge base follows (:data:`KB_LAYOUT`)
    kb_layout: str = KB_LAYOUT
    #: capabilities beyond learning and evaluation (:data:`proteus.learners.CAPABILITIES`): every baseline
    #: is rebuilt from its knowledge base (:mod:`proteus.baselines.persist`); none retrieves tasks by keys
    supports: frozenset[str] = frozenset({"load"})
    #: the ``baseline.*`` options this method reads, with their defaults, help and ranges (each subclass
    #: declares its own dataclass)
    Options: type = BaselineOptions
    #: the sections of the run configuration a baseline reads besides ``baseline``
    option_sections: tuple[str, ...] = ("backbone", "train")
    #: whether the method needs a backbone with tokens (a ViT)
    needs_tokens: bool = False
    #: the head's learning rate over the method's (HiDe-Prompt's ``larger_prompt_lr``: 0.1); at 1 the
    #: optimiser has one parameter group
    head_lr_scale: float = 1.0
    #: the first task's weight decay over ``train.weight_decay`` (:meth:`weight_decay`; S-Prompt's 2.5)
    first_task_decay: float = 1.0
    #: whether an earlier release's knowledge base (no ``state_version``) holds all it needs to learn on
    resumes_legacy: bool = False
    #: the training forward's auxiliary loss (reset to 0 before each step; :meth:`features` may set it)
    aux_loss: torch.Tensor | float

    def __init__(self, config: RunConfig, *, progress: bool = True) -> None:
        self.config = config
        self.progress = progress
        self.heads_ = nn.ModuleList()
        self.labels_: list[int] = []
        self.task_classes_: list[list[int]] = []
        #: one record per learned task (what its knowledge base lists: classes, names, images, stats)
        self.records_ = TaskRecords()
        #: the last task's training curve, one row per step (``epoch``, ``step``, ``loss``, ``lr``,
        #: ``penalty``: the auxiliary loss); the experiment loop writes it to the run's train_log.csv
        self.train_log_: list[dict[str, Any]] = []
        self._stream_tasks: int | None = None
        self._frozen_reason: str | None = None  # why it cannot learn on (restored from an old state)

    #: check the sections a baseline reads and its options (:func:`check_baseline_config`)
    check_config = classmethod(check_baseline_config)

    @functools.cached_property
    def options_(self) -> Any:
        """The method's ``baseline.*`` options, typed (:attr:`Options`; read from the config once)."""
        return typed_options(self.Options, self.config.baseline, "baseline")

    def set_params(self, **params: Any) -> ContinualClassifier:
        """Set ``progress`` or config keys, dotted (``**{"train.epochs": 5}``) or with ``__``; once a task
        is learned only per-task keys may change (``proteus learn`` applies them task by task)."""
        self.progress = params.pop("progress", self.progress)
        keys = {k.replace("__", "."): v for k, v in params.items()}
        fixed = sorted(k for k in keys if not per_task(k))
        if fixed and self.num_tasks:
            raise ConfigError(
                f"{', '.join(fixed)}: define the learned model and cannot change after task 1 (only per-task "
                f"keys such as train.epochs may); build a new {self.name} learner"
            )
        if keys:
            cfg = self.config.with_values(keys)
            validate(cfg)
            self.config = cfg
            self.__dict__.pop("options_", None)
        return self

    # ------------------------------------------------------------------ set-up
    def _build(self) -> None:
        if hasattr(self, "backbone_"):
            return
        if dist.world_size() > 1:
            raise ConfigError(f"{self.name}: the baselines run in one process; launch without torchrun")
        self.check_config(self.config)
        rt = Runtime.build(self.config)
        if self.needs_tokens and not hasattr(rt.backbone, "vit"):
            raise ConfigError(
                f"{self.name} is a prompt method: it needs a backbone with tokens (a timm ViT such as "
                f"vit_ti16 or vit_b16), not {self.config.backbone.name!r}; set backbone.name"
            )
        self.device_, self.backbone_ = rt.device, rt.backbone
        self.embed_dim = int(rt.backbone.embed_dim)
        self.eval_transform_, self.train_transform_ = rt.eval_transform, rt.train_transform
        self._setup()
        #: the prefix passes (the frozen part of the forward, :meth:`prefix`) under the run's precision
        self.embedder_ = rt.embedder(self, self.progress)

    def _setup(self) -> None:
        """Build the method's state on ``self.backbone_`` (wrap layers, create prompts)."""

    @property
    def num_tasks(self) -> int:
        return len(self.heads_)

    @property
    def classes_(self) -> list[str]:
        """The learned classes' names, indexed by global label (``pred.label``), as PROTEUS's."""
        return self.records_.class_names()

    @property
    def task_budget(self) -> int:
        """The number of tasks a pool or threshold schedule is divided over (``baseline.max_tasks``, else
        the stream's number of tasks, given to :meth:`fit_task`; 10 when neither is known)."""
        return int(getattr(self.options_, "max_tasks", None) or self._stream_tasks or 10)

    # ------------------------------------------------------------------ method hooks
    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen part of the forward, shared by all tasks (cached without augmentation)."""
        with torch.no_grad():
            return self.backbone_.forward_prefix(x)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """(N, d) embeddings of prefix outputs ``z`` under the current state (``train``: the open task's
        training forward; may set :attr:`aux_loss`)."""
        raise NotImplementedError

    def trainable(self) -> list[nn.Parameter]:
        """The method's parameters trained in the open task (besides its head)."""
        return []

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        """Open task k's state; ``z`` (cached prefix outputs) or ``loader`` (augmented batches) give its
        training inputs for methods that look at them first (InfLoRA)."""

    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        """Freeze task k's state."""

    def abort_task(self, k: int) -> None:
        """Drop whatever task k (not finished) added to the method's state."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything learned, as named tensors (written to ``model.safetensors``)."""
        return {
            f"head.{k}.{n}": t.detach().cpu().contiguous()
            for k, h in enumerate(self.heads_)
            for n, t in h.state_dict().items()
        }

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Load the method's own learned state from its knowledge base's head object (``meta``: the head's
        meta; ``tensors``: :meth:`state_tensors`' form), after the heads, task classes and records
        (:func:`proteus.baselines.persist.restore`). Each method loads what it stores."""

    # ------------------------------------------------------------------ training
    def batches(
        self, z: torch.Tensor | None, y: torch.Tensor | None, loader: Any, g: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of (prefix outputs, global labels): shuffled cached outputs, or augmented images."""
        if z is not None and y is not None:
            for idx in torch.randperm(len(z), generator=g).split(self.config.train.batch_size):
                yield z[idx], y[idx]
        else:
            for xb, yb in loader:
                yield self.embedder_.prefix(xb), yb

    def fit_task(self, task: Task, stream_tasks: int | None = None) -> TaskStats:
        """Learn one task: open its state, train it with its head, freeze it. Returns what it measured (the
        method's own numbers, :meth:`learn_task`'s, in ``extra``). On an exception (Ctrl-C included) the
        task's state is dropped: the learner is as before the call."""
        self._build()
        if self._frozen_reason is not None:
            raise TaskError(f"{self.name}: cannot learn task {task.index + 1}: {self._frozen_reason}")
        if len(task.train) == 0:
            raise TaskError(f"{self.name}: task {task.index + 1} has no training images")
        self._stream_tasks = stream_tasks or task.stream_tasks
        k = self.num_tasks
        with self.rolled_back(k):
            stats = TaskStats(k, extra=self.learn_task(task, k))
        self.records_.append(self.task_record(task, k, stats))
        return stats

    # ------------------------------------------------------------------ the loop's steps
    @contextlib.contextmanager
    def rolled_back(self, k: int) -> Iterator[None]:
        """Task k's training, transactional: on an exception (Ctrl-C included) its head, classes and the
        method's state of the task are dropped (:meth:`abort_task`) and the method's generator (``_gen``) is
        set back, so the learner is as before, and learning the task again is as the first try."""
        gen = getattr(self, "_gen", None)
        saved = None if gen is None else gen.get_state()
        try:
            yield
        except BaseException:
            del self.heads_[k:]
            del self.task_classes_[k:]
            self.labels_ = [c for cs in self.task_classes_ for c in cs]
            self.abort_task(k)
            if gen is not None and saved is not None:
                gen.set_state(saved)
            raise

    def task_record(self, task: Task, k: int, stats: TaskStats) -> TaskRecord:
        """Task k's record, as PROTEUS's: its classes and names, images, the statistics ``fit_task`` returned
        (without the timings the loop adds later), the per-task settings it was learned with and when."""
        return TaskRecord(
            k, [int(c) for c in task.classes], [str(n) for n in task.class_names], len(task.train),
            False, TaskStats(k, extra=without_timings(dict(stats.extra))),
            {**self.config.task_settings(), "device": str(self.device_)},
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), source_classes=task.source_classes,
        )  # fmt: skip

    def weight_decay(self, k: int) -> float:
        """Task k's weight decay: ``train.weight_decay``, times :attr:`first_task_decay` on the first task
        (S-Prompt decays it more)."""
        wd = self.config.train.weight_decay
        return wd * self.first_task_decay if k == 0 else wd

    def input_pass(self, z: torch.Tensor | None, loader: Any) -> Iterator[torch.Tensor]:
        """The task's training inputs once, in order, as prefix outputs on the device (no grad)."""
        bs = self.config.eval.batch_size
        if z is not None:
            for chunk in z.split(bs):
                yield chunk.to(self.device_)
        else:
            for xb, _ in loader:
                yield self.embedder_.prefix(xb)

    def task_inputs(self, task: Task, k: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None, Any]:
        """Task k's seed (torch's global stream seeded with it) and its training inputs: the cached prefix
        outputs and labels ``(z, y)`` without augmentation, else a shuffling, augmenting loader (``z``, ``y``
        None). Every baseline's training starts here."""
        cfg = self.config
        seed = task_seed(cfg.seed, k)
        torch.manual_seed(seed)
        if not cfg.train.augment:
            z, y_all = self.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
            # results as before the shared embedder: the baselines' own prefix pass drew its DataLoader's
            # base seed from torch's global stream twice (tqdm.auto's bar opens the iterator twice), and every
            # later draw of the task (its head's initial weights ...) follows; the embedder's loader has a
            # generator
            torch.empty(2, dtype=torch.int64).random_()
            return seed, z, y_all, None
        gl = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            ImageDataset(task.train, self.train_transform_), batch_size=cfg.train.batch_size,
            shuffle=True, generator=gl, num_workers=cfg.train.num_workers,
        )  # fmt: skip
        return seed, None, None, loader

    # ------------------------------------------------------------------ the shared loop
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        """Train task k and return the method's numbers: open it (:meth:`open_task`: its inputs,
        :meth:`begin_task`, a new head), train it (:meth:`train_epochs`, the phase a method may replace),
        freeze it (:meth:`close_task`: the head kept, :meth:`end_task`). Methods that train no head or have
        their own schedule of everything (NCM, KLDA, TUNA, MOS, TOSCA, MoAL) replace the whole."""
        run = self.open_task(task, k)
        try:
            self.train_epochs(run)
        finally:
            run.bar.close()
        return self.close_task(run)

    def open_task(self, task: Task, k: int) -> OpenTask:
        """Task k's inputs (:meth:`task_inputs`), the method's state opened (:meth:`begin_task`), a new
        head over the task's classes, its progress bar over :meth:`planned_epochs`."""
        seed, z, y, loader = self.task_inputs(task, k)
        self.begin_task(k, z, loader)
        classes = [int(c) for c in task.classes]
        steps = math.ceil(len(task.train) / self.config.train.batch_size)
        bar = progress_bar(
            total=self.planned_epochs() * steps,
            desc=f"task {k + 1}: train {self.name}",
            enabled=self.progress,
        )
        self.train_log_ = []
        head = self.new_head(len(classes))
        return OpenTask(k, classes, z, y, loader, head, torch.Generator().manual_seed(seed), steps, bar)

    def new_head(self, n: int) -> nn.Linear:
        """The open task's head over its ``n`` classes."""
        return nn.Linear(self.embed_dim, n).to(self.device_)

    def planned_epochs(self) -> int:
        """The epochs a task trains (its progress bar's length): ``train.epochs``."""
        return int(self.config.train.epochs)

    def train_epochs(self, run: OpenTask) -> None:
        """The training phase: ``train.epochs`` epochs (:meth:`run_epoch`) of the method's
        :meth:`trainable` tensors that require a gradient and the head under one optimiser
        (:meth:`optimiser`)."""
        params, opt = self.optimiser(run, [p for p in self.trainable() if p.requires_grad])
        epochs = int(self.config.train.epochs)
        for epoch in range(epochs):
            self.run_epoch(run, epoch, epochs, params, opt)
        opt.zero_grad(set_to_none=True)

    def optimiser(self, run: OpenTask, own: list[nn.Parameter]) -> tuple[list[nn.Parameter], Any]:
        """The parameters ``own`` and the head's, and their optimiser (``baseline.optimizer``; the head's
        learning rate scaled by :attr:`head_lr_scale`)."""
        b = self.options_
        params = own + list(run.head.parameters())
        groups: list[Any] = params
        if self.head_lr_scale != 1.0:
            groups = [
                {"params": own},
                {"params": list(run.head.parameters()), "lr_scale": self.head_lr_scale},
            ]
        run.params = params
        return params, OPTIMIZERS.get(b.optimizer)(groups, b, self.weight_decay(run.k))

    def run_epoch(self, run: OpenTask, epoch: int, epochs: int, params: list[nn.Parameter], opt: Any) -> None:
        """One epoch (of ``epochs`` for the schedule) of steps over :meth:`batches`: the cross-entropy of the
        head over the task's classes plus the method's :attr:`aux_loss`, clipped at ``baseline.clip_grad``;
        each step a row of :attr:`train_log_`."""
        b = self.options_
        for group in opt.param_groups:
            group["lr"] = epoch_lr(b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, epochs)
        for zb, yb in self.batches(run.z, run.y, run.loader, run.generator):
            target = run.targets(yb, self.device_)
            self.aux_loss = 0.0
            with self.embedder_.autocast():
                h = self.features(zb.to(self.device_), train=True)
                loss = F.cross_entropy(run.head(h.float()), target)
            opt.zero_grad(set_to_none=True)
            (loss + self.aux_loss).backward()
            if b.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(params, b.clip_grad)
            opt.step()
            run.losses.append(float(loss.detach()))
            penalty = float(torch.as_tensor(self.aux_loss).detach())
            row = {
                "epoch": epoch + 1,
                "step": len(run.losses),
                "loss": run.losses[-1],
                "lr": opt.param_groups[0]["lr"],
            }
            self.train_log_.append({**row, "penalty": penalty})
            run.bar.update(1)
            if len(run.losses) % 10 == 0:
                run.bar.set_postfix(loss=f"{np.mean(run.losses[-10:]):.3f}")

    def close_task(self, run: OpenTask) -> dict[str, Any]:
        """Freeze the head and keep it, then the method's state (:meth:`end_task`); the task's numbers."""
        run.head.requires_grad_(False)
        self.heads_.append(run.head)
        self.task_classes_.append(run.classes)
        self.labels_ += run.classes
        self.end_task(run.k, run.z, run.loader)
        return {**task_stats(run.losses, run.params), **run.extra}

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def prefix_dataset(
        self, ds: Any, desc: str = "prefix", transform: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix outputs (float32, CPU) and labels of a dataset under the evaluation transform."""
        self._build()
        z, y = self.embedder_.prefix_dataset(ds, desc, transform)
        return z.cpu(), y

    @torch.no_grad()
    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        """(N, C_seen) logits of prefix outputs over every class seen so far (columns: :attr:`labels_`)."""
        if not self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        outs = []
        for chunk in z.split(self.config.eval.batch_size):
            with self.embedder_.autocast():
                h = self.features(chunk.to(self.device_), train=False).float()
            outs.append(torch.cat([head(h) for head in self.heads_], 1).cpu())
        return torch.cat(outs)

    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(N, C_seen) logits of prefix outputs (columns: :attr:`labels_`) and (N,) the task each input was
        retrieved under, or None for a method without task retrieval."""
        return self.logits_prefix(z), None

    def predict_test(self, cache: TestCache, tau: int, k: int) -> TestOutcome:
        """Test set tau after task k: the argmax over every seen class, and the retrieved task (S-Prompt's,
        HiDe-Prompt's; its accuracy goes to results.json's ``retrieval_acc``)."""
        logits, task = self.infer(cache.prefix(tau))
        return TestOutcome(torch.as_tensor(self.labels_)[logits.argmax(1)], task=task)

    def transform_images(self, images: Sequence[Any]) -> torch.Tensor:
        """PIL images -> a batch under the backbone's evaluation transform."""
        self._build()
        return torch.stack([self.eval_transform_(im) for im in images])

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> Prediction:
        """A batch of transformed images (:meth:`transform_images`): the labels (the argmax over every seen
        class), the retrieved tasks (or None) and the logits over the global labels (what
        ``proteus predict`` and ``proteus serve`` show, as for PROTEUS)."""
        self._build()
        logits, task = self.infer(self.embedder_.prefix(x))
        return column_prediction(logits, task, self.labels_)

    # ------------------------------------------------------------------ persistence
    def kb_header(self) -> dict[str, Any]:
        self._build()
        return learner_header(self.config, self.backbone_.identity())

    def state(self) -> LearnerState:
        """One record per task, every learned tensor as the global object (:func:`persist.learner_state`)."""
        return persist.learner_state(self)

    def restore(self, state: LearnerState) -> ContinualClassifier:
        """Load a :meth:`state` into this learner, which holds no task yet (:func:`persist.restore`)."""
        persist.restore(self, state)
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.name!r}, tasks={self.num_tasks})"
