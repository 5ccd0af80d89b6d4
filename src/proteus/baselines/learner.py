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
(the embedding of a batch of prefix outputs, under training or inference), :meth:`_begin_task` /
:meth:`_end_task` (open and freeze a task's state) and :meth:`trainable` (what the optimiser sees). The
backbone's frozen prefix (``backbone.adapt_last``) is computed once per image when there is no
augmentation, as for PROTEUS. The backbone stays in eval mode throughout (BatchNorm statistics of
MobileNetV2 never move; the ViTs have no dropout), so frozen means bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proteus import distributed as dist
from proteus.config import LEARNERS, ConfigError, RunConfig, check_sections, typed_options
from proteus.engine.embedder import ImageDataset
from proteus.engine.errors import TaskError
from proteus.engine.records import loss_summary
from proteus.engine.runtime import Runtime, task_seed
from proteus.errors import NotFittedError
from proteus.learners import LearnerState, TestCache, TestOutcome, check_supports, learner_header
from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, option, options_of
from proteus.progress import bar as progress_bar
from proteus.registry import Registry
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, Check, Claim, Fields, Schema, ShapeRule
from proteus.tensor_rules import F as Field

log = logging.getLogger("proteus")

__all__ = [
    "OPTIMIZERS", "SCHEDULES", "BaselineOptions", "ContinualClassifier", "NoOptions", "TrainingOptions",
    "epoch_lr",
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

    Fitted attributes: ``backbone_``, ``heads_`` (one ``nn.Linear`` per task), ``classes_`` (the global
    label of each logit column, task after task), ``task_classes_``.
    """

    #: registry name (:data:`proteus.learners.LEARNERS`)
    name: str = "baseline"
    #: the rules its knowledge base follows (:data:`KB_LAYOUT`)
    kb_layout: str = KB_LAYOUT
    #: capabilities beyond learning and evaluation (:data:`proteus.learners.CAPABILITIES`): none yet
    #: (a baseline is not rebuilt from a knowledge base, and it does not retrieve tasks)
    supports: frozenset[str] = frozenset()
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

    def __init__(self, config: RunConfig, *, progress: bool = True) -> None:
        self.config = config
        self.progress = progress
        self.heads_ = nn.ModuleList()
        self.classes_: list[int] = []
        self.task_classes_: list[list[int]] = []
        #: one record per learned task (what its knowledge base lists: classes, names, images, stats)
        self.records_: list[dict[str, Any]] = []
        #: the last task's training curve, one row per optimisation step: ``epoch`` and ``step`` (1-based),
        #: ``loss`` (the cross-entropy), ``lr`` and ``penalty`` (the method's auxiliary loss); the experiment
        #: loop writes it to the run's train_log.csv
        self.train_log_: list[dict[str, Any]] = []
        self._stream_tasks: int | None = None

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Check the sections a baseline reads and its options (the configuration's validation gathers
        this): a value out of its declared range or choices is an error; a ``baseline.*`` key of another
        method's options is ignored (with a warning when it differs from that method's default); a key of
        no method's options is an error."""
        check_sections(cfg, cls.option_sections)
        typed_options(cls.Options, cfg.baseline, "baseline")
        own = {f.name for f, _ in options_of(cls.Options)}
        others = [LEARNERS.get(n) for n in LEARNERS.names()]
        for key, value in cfg.baseline.items():
            if key in own:
                continue
            defaults = [
                f.default
                for c in others
                if isinstance(getattr(c, "Options", None), type)
                for f, _ in options_of(c.Options)
                if f.name == key
            ]
            if not defaults:
                known = sorted(
                    {f.name for c in others for f, _ in options_of(getattr(c, "Options", NoOptions))}
                )
                raise ConfigError(
                    f"unknown config key 'baseline.{key}'; the baselines' options: {', '.join(known)}"
                )
            if all(value != d for d in defaults):
                mine = ", ".join(f"baseline.{k}" for k in sorted(own)) or "none"
                log.warning(
                    "%s: baseline.%s set, not among its options (%s): no effect", cfg.method, key, mine
                )

    @functools.cached_property
    def options_(self) -> Any:
        """The method's ``baseline.*`` options, typed (:attr:`Options`; read from the config once)."""
        return typed_options(self.Options, self.config.baseline, "baseline")

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
        self.eval_transform_, self.train_transform_ = rt.eval_transform, rt.train_transform
        self._setup()
        #: the prefix passes (the frozen part of the forward, :meth:`prefix`) under the run's precision
        self.embedder_ = rt.embedder(self, self.progress)
        self.embedder_.own_generator = False

    def _setup(self) -> None:
        """Build the method's state on ``self.backbone_`` (wrap layers, create prompts)."""

    @property
    def embed_dim(self) -> int:
        return int(self.backbone_.embed_dim)

    @property
    def num_tasks(self) -> int:
        return len(self.heads_)

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

    def prefix_batch(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`prefix` of a batch on the device, under the learner's autocast, in float32: one way for the
        cached pass, augmented training batches and prediction alike."""
        return self.embedder_.prefix(x)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """(N, d) embeddings of prefix outputs ``z`` under the current state (``train``: the open task's
        training forward; may set :attr:`aux_loss`)."""
        raise NotImplementedError

    def trainable(self) -> list[nn.Parameter]:
        """The method's parameters trained in the open task (besides its head)."""
        return []

    def weight_decay(self, k: int) -> float:
        """Task k's weight decay: ``train.weight_decay`` (S-Prompt decays its first task more)."""
        return self.config.train.weight_decay

    def _begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        """Open task k's state; ``z`` (cached prefix outputs) or ``loader`` (augmented batches) give its
        training inputs for methods that look at them first (InfLoRA)."""

    def _end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        """Freeze task k's state."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything learned, as named tensors (written to ``model.safetensors``)."""
        return {
            f"head.{k}.{n}": t.detach().cpu().contiguous()
            for k, h in enumerate(self.heads_)
            for n, t in h.state_dict().items()
        }

    # ------------------------------------------------------------------ training
    def _batches(
        self, z: torch.Tensor | None, y: torch.Tensor | None, loader: Any, g: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of (prefix outputs, global labels): shuffled cached outputs, or augmented images."""
        if z is not None and y is not None:
            for idx in torch.randperm(len(z), generator=g).split(self.config.train.batch_size):
                yield z[idx], y[idx]
        else:
            for xb, yb in loader:
                yield self.prefix_batch(xb), yb

    def input_pass(self, z: torch.Tensor | None, loader: Any) -> Iterator[torch.Tensor]:
        """The task's training inputs once, in order, as prefix outputs on the device (no grad)."""
        bs = self.config.eval.batch_size
        if z is not None:
            for chunk in z.split(bs):
                yield chunk.to(self.device_)
        else:
            for xb, _ in loader:
                yield self.prefix_batch(xb)

    def fit_task(self, task: Task, stream_tasks: int | None = None) -> dict[str, Any]:
        """Learn one task: open its state, train it with its head, freeze it. Returns training stats. On an
        exception (Ctrl-C included) the task's state is dropped: the learner is as before the call."""
        self._build()
        if len(task.train) == 0:  # type: ignore[arg-type]
            raise TaskError(f"{self.name}: task {task.index + 1} has no training images")
        self._stream_tasks = stream_tasks or task.stream_tasks
        k = self.num_tasks
        try:
            stats = self._fit_task(task, k)
        except BaseException:
            del self.heads_[k:]
            del self.task_classes_[k:]
            self.classes_ = [c for cs in self.task_classes_ for c in cs]
            self._abort_task(k)
            raise
        names = [str(n) for n in task.class_names]
        n_train = len(task.train)  # type: ignore[arg-type]
        self.records_.append(
            {"index": k, "classes": self.task_classes_[k], "class_names": names, "n_train": n_train}
        )
        return stats

    def _abort_task(self, k: int) -> None:
        """Drop whatever task k (not finished) added to the method's state."""

    def _task_inputs(self, task: Task, k: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None, Any]:
        """Task k's seed (torch's global stream seeded with it) and its training inputs: the cached
        prefix outputs and labels ``(z, y)`` without augmentation, else a shuffling, augmenting loader
        (``z``, ``y`` None). Every baseline's training starts here."""
        cfg = self.config
        seed = task_seed(cfg.seed, k)
        torch.manual_seed(seed)
        if not cfg.train.augment:
            z, y_all = self.prefix_dataset(task.train, f"task {k + 1}: prefix")
            return seed, z, y_all, None
        gl = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            ImageDataset(task.train, self.train_transform_), batch_size=cfg.train.batch_size,
            shuffle=True, generator=gl, num_workers=cfg.train.num_workers,
        )  # fmt: skip
        return seed, None, None, loader

    def _fit_task(self, task: Task, k: int) -> dict[str, Any]:
        cfg, b = self.config, self.options_
        classes = [int(c) for c in task.classes]
        local = {c: i for i, c in enumerate(classes)}
        seed, z, y_all, loader = self._task_inputs(task, k)
        self._begin_task(k, z, loader)
        head = nn.Linear(self.embed_dim, len(classes)).to(self.device_)
        own = [p for p in self.trainable() if p.requires_grad]
        params = own + list(head.parameters())
        groups: list[Any] = params
        if self.head_lr_scale != 1.0:
            groups = [{"params": own}, {"params": list(head.parameters()), "lr_scale": self.head_lr_scale}]
        opt = OPTIMIZERS.get(b.optimizer)(groups, b, self.weight_decay(k))
        g = torch.Generator().manual_seed(seed)
        n = len(task.train)  # type: ignore[arg-type]
        steps_per_epoch = math.ceil(n / cfg.train.batch_size)
        losses: list[float] = []
        total = cfg.train.epochs * steps_per_epoch
        bar = progress_bar(total=total, desc=f"task {k + 1}: train {self.name}", enabled=self.progress)
        self.train_log_ = []
        for epoch in range(cfg.train.epochs):
            for group in opt.param_groups:
                group["lr"] = epoch_lr(b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, cfg.train.epochs)
            for zb, yb in self._batches(z, y_all, loader, g):
                target = torch.as_tensor([local[int(c)] for c in yb.tolist()], device=self.device_)
                self.aux_loss: torch.Tensor | float = 0.0
                with self._autocast():
                    h = self.features(zb.to(self.device_), train=True)
                    loss = F.cross_entropy(head(h.float()), target)
                total_loss = loss + self.aux_loss
                opt.zero_grad(set_to_none=True)
                total_loss.backward()
                if b.clip_grad is not None:
                    torch.nn.utils.clip_grad_norm_(params, b.clip_grad)
                opt.step()
                losses.append(float(loss.detach()))
                self.train_log_.append(
                    {
                        "epoch": epoch + 1,
                        "step": len(losses),
                        "loss": losses[-1],
                        "lr": opt.param_groups[0]["lr"],
                        "penalty": float(torch.as_tensor(self.aux_loss).detach()),
                    }
                )
                bar.update(1)
                if len(losses) % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        bar.close()
        opt.zero_grad(set_to_none=True)
        head.requires_grad_(False)
        self.heads_.append(head)
        self.task_classes_.append(classes)
        self.classes_ += classes
        self._end_task(k, z, loader)
        first, last = loss_summary(losses)
        return {
            "steps": len(losses),
            "loss_first": first,
            "loss_last": last,
            "trainable_params": int(sum(p.numel() for p in params)),
        }

    def _autocast(self) -> AbstractContextManager[None]:
        return self.embedder_.autocast()

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
        """(N, C_seen) logits of prefix outputs over every class seen so far (columns: :attr:`classes_`)."""
        if not self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        outs = []
        for chunk in z.split(self.config.eval.batch_size):
            with self._autocast():
                h = self.features(chunk.to(self.device_), train=False).float()
            outs.append(torch.cat([head(h) for head in self.heads_], 1).cpu())
        return torch.cat(outs)

    def predict_prefix(self, z: torch.Tensor) -> torch.Tensor:
        """Global labels: the argmax over the seen classes (class-incremental)."""
        idx = self.logits_prefix(z).argmax(1)
        return torch.as_tensor(self.classes_)[idx]

    def backbone_identity(self) -> dict[str, Any]:
        """Backbone name, weights and adapted split: what a knowledge base must match."""
        self._build()
        return self.backbone_.identity()

    def kb_header(self) -> dict[str, Any]:
        return learner_header(self.config, self.backbone_identity())

    def predict_test(self, cache: TestCache, tau: int, k: int) -> TestOutcome:
        """Test set tau after task k: the argmax over every seen class (no task retrieval)."""
        return TestOutcome(self.predict_prefix(cache.prefix(tau)))

    def state(self) -> LearnerState:
        """One record per task (its classes) and, as the global object, every learned tensor."""
        tasks: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = [(dict(r), {}) for r in self.records_]
        return LearnerState(
            tasks, ({"method": self.name, "task_classes": self.task_classes_}, self.state_tensors())
        )

    def restore(self, state: LearnerState) -> ContinualClassifier:
        """Load a :meth:`state` into this learner, which holds no task yet (the baselines that support
        ``load``)."""
        check_supports(self, "load", f"{self.name}: restore")
        raise NotImplementedError

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Global labels of a batch of transformed images."""
        self._build()
        return self.predict_prefix(self.prefix_batch(x))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.name!r}, tasks={self.num_tasks})"
