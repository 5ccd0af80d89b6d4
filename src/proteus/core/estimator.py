"""The public face of proteus: :class:`Proteus`, a continual learner in the scikit-learn manner.

For each task k (Algorithm 1): the frozen prefix once per image, the adapter by Eq. 15
(:mod:`proteus.engine.trainer`), the task's retrieval keys (Eq. 18, :mod:`proteus.engine.keys`), and the
head's statistics G and e(c) (lines 8-12, :class:`~proteus.heads.RanPACHead`). At test time (Algorithm 2)
every input is embedded under every task's adapter in one batched forward, the best key is retrieved and
Eq. 23 classifies the embedding under the retrieved adapter -- in three public steps that prediction,
evaluation, analysis and the performance harness all use (``predict`` itself embeds only what the keys
read when they live in one space or shortlist candidates: :attr:`Proteus.predict_route`)::

    H = clf.embed(x)                       # (m, N, d): every task's adapter (Alg. 2 line 2)
    res = clf.retrieve(H, F)               # (k*, t*) per input (Sec. 3.1); F = frozen features if needed
    logits = clf.classify(H[res.task, range(N)])   # Eq. 23

:meth:`Proteus.fit_task` is transactional: when it raises (bad data, a failed fit, Ctrl-C) the adapters,
keys and head are exactly those before the task.

Example (the test suite runs it)::

    >>> from proteus import Proteus
    >>> from proteus.streams import build_benchmark
    >>> clf = Proteus.from_method("proteus", backbone="mobilenet_v2", progress=False,
    ...                           **{"backbone.pretrained": False, "backbone.img_size": 32,
    ...                              "backbone.adapt_last": 2, "train.epochs": 1, "head.rp_dim": 256,
    ...                              "signature.max_components": 2})
    >>> stream = build_benchmark(clf.config.benchmark)          # quickstart: digits, 5 tasks
    >>> for task in stream.tasks[:2]:
    ...     _ = clf.fit_task(task)
    >>> pred = clf.predict(clf.transform_images([stream.tasks[1].test[0][0]]))
    >>> pred.label.shape, clf.num_tasks
    (torch.Size([1]), 2)
    >>> name = clf.classes_[pred.label[0]]    # its class's name (clf.classes_: indexed by global label)
    >>> len(clf.classes_), name in clf.classes_, pred.task_number[0].item() in (1, 2)  # 1-based, as the CLI
    (4, True, True)

With ``benchmark="quickstart"`` :meth:`from_method` takes the settings ``proteus run --benchmark quickstart``
uses (the README's example).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from proteus import devices
from proteus import distributed as dist
from proteus.adapters import AdaptedBackbone
from proteus.backbones import Backbone, build_backbone
from proteus.backbones.transforms import build_transform
from proteus.config import (
    CACHE_PREFIX,
    METHODS,
    ConfigError,
    RunConfig,
    check_sections,
    flatten,
    per_task,
    resolve_config,
    validate,
)
from proteus.devices import PRECISIONS
from proteus.engine import experts
from proteus.engine.batches import ImageBatch, predict_batches
from proteus.engine.class_heads import ClassHeads
from proteus.engine.compositions import COMPOSITIONS, TRAIN_SCHEDULES, Composition
from proteus.engine.embedder import Embedder
from proteus.engine.errors import TaskError
from proteus.engine.keys import KEYS, KeyFit, NoKeys, RetrievalKeys, Under
from proteus.engine.novelty import Calibration, holdout_split
from proteus.engine.records import Prediction, TaskRecord, TaskStats, without_timings
from proteus.engine.trainer import AdapterTrainer
from proteus.errors import NotFittedError
from proteus.faults import crash_point
from proteus.heads import RanPACHead
from proteus.kb import KnowledgeBase
from proteus.learners import LEARNERS, LearnerState, TestCache, TestOutcome, learner_header
from proteus.signatures import RetrievalResult
from proteus.streams import Task

__all__ = ["ImageBatch", "Prediction", "Proteus", "TaskError"]


@LEARNERS.register("proteus", help="PROTEUS and its ablations (a method is a configuration)")
class Proteus:
    """A PROTEUS continual learner (a method is a configuration: :meth:`from_method`).

    Args:
        config: the hyper-parameters (:class:`~proteus.config.RunConfig`; validated by :meth:`fit_task`
            and :meth:`load`, never modified: :meth:`set_params` replaces it); default: ``proteus`` on
            MobileNetV2.
        progress: show progress bars.

    Fitted attributes (created by the first :meth:`fit_task` or by :meth:`load`): ``backbone_``,
    ``model_`` (the backbone with every task's adapter), ``keys_`` (the retrieval keys), ``head_`` (the
    LDA head), ``records_`` (one :class:`TaskRecord` per learned task), ``forget_inputs_``
    (``head.forgettable``: each task's head inputs, for :meth:`forget_task`).
    """

    #: the sections of the run configuration that hold PROTEUS's own options (the rest are the run's)
    option_sections = ("backbone", "adapter", "train", "signature", "head", "retrieval")

    def __init__(self, config: RunConfig | None = None, *, progress: bool = True) -> None:
        self.config = config if config is not None else RunConfig()
        self.progress = progress

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Check PROTEUS's options by their declarations and the rules between them (the configuration's
        validation, :func:`proteus.config.validate`, gathers this)."""
        check_sections(cfg, cls.option_sections)
        h, r = cfg.head, cfg.retrieval
        if r.mode != "signature" and (h.scope, r.combine) != ("global", "hard"):
            raise ConfigError(
                f"head.scope={h.scope} and retrieval.combine={r.combine} need task retrieval, but "
                f"retrieval.mode={r.mode}; add --set head.scope=global --set retrieval.combine=hard"
            )
        if cfg.retrieval.combine == "soft" and not KEYS.get(cfg.signature.keys).one_space:
            one_space = [n for n in KEYS if KEYS.get(n).one_space]
            raise ConfigError(
                f"retrieval.combine=soft needs task keys in one space ({', '.join(one_space)}); got "
                f"signature.keys={cfg.signature.keys}; add --set retrieval.combine=hard (the paper's "
                "Gaussian keys: --method proteus-dpgmm)"
            )
        if cfg.head.gamma_max_exp <= cfg.head.gamma_min_exp:
            raise ConfigError(
                f"head.gamma_max_exp ({cfg.head.gamma_max_exp}) must be above head.gamma_min_exp "
                f"({cfg.head.gamma_min_exp})"
            )

    # ------------------------------------------------------------------ scikit-learn parameters
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """``config`` and ``progress``; with ``deep`` also PROTEUS's own options, dotted (``"train.epochs"``;
        :attr:`option_sections`: the run's settings such as the benchmark or the report are not the
        estimator's parameters)."""
        out: dict[str, Any] = {"config": self.config, "progress": self.progress}
        if not deep:
            return out
        own = {s: dataclasses.asdict(getattr(self.config, s)) for s in self.option_sections}
        return {**out, **flatten(own)}

    def set_params(self, **params: Any) -> Proteus:
        """Set ``config``, ``progress`` or config keys, dotted (``**{"train.epochs": 5}``) or with ``__``
        (``train__epochs=5``). The new config is validated before it replaces the old one (which is never
        modified); once a task is learned only per-task keys (``train.*``, device, ...) may change."""
        cfg = params.pop("config", self.config)
        self.progress = params.pop("progress", self.progress)
        keys = {k.replace("__", "."): v for k, v in params.items()}
        if keys:
            fixed = [k for k in keys if not per_task(k)]
            if fixed and self.num_tasks:
                raise ConfigError(
                    f"{', '.join(sorted(fixed))}: define the learned model and cannot change after task 1 "
                    "(only per-task keys such as train.epochs may); build a new Proteus"
                )
            cfg = cfg.with_values(keys)
        if cfg is not self.config:
            validate(cfg)
            self.config = cfg
        return self

    @classmethod
    def from_method(
        cls,
        method: str = "proteus",
        backbone: str | None = None,
        *,
        benchmark: str | None = None,
        progress: bool = True,
        **overrides: Any,
    ) -> Proteus:
        """A learner for a registered method; ``overrides`` are dotted config keys (``"train.epochs": 5``).

        ``benchmark`` (``"quickstart"``, ``"cifar100"``, ...) applies the benchmark's packaged config first,
        exactly as ``proteus run --benchmark`` does (defaults < benchmark < method < ``overrides``): the
        quickstart's 64 px images and partial adaptation, for instance. Without it the config is the
        method's on the paper's defaults (224 px, the whole backbone adapted): minutes per task on a CPU.
        """
        sets = {"backbone.name": backbone} if backbone else {}
        cfg = resolve_config(benchmark, method=method, dotted={**sets, **overrides})
        return cls(cfg, progress=progress)

    # ------------------------------------------------------------------ set-up (lazy: built on first use)
    def _build(self) -> None:
        if hasattr(self, "model_"):
            return
        cfg = self.config
        validate(cfg)
        self.records_: list[TaskRecord] = []
        self.device_ = dist.device_for_rank(cfg.device)
        b = cfg.backbone
        self.backbone_: Backbone = build_backbone(
            b.name, pretrained=b.pretrained, weights=b.weights, img_size=b.img_size, adapt_last=b.adapt_last
        )
        self.model_ = AdaptedBackbone(
            self.backbone_, scaling=cfg.adapter.scaling, enabled=cfg.adapter.enabled
        )
        mb = cfg.eval.merge_budget_mb
        self.model_.merge_budget_bytes = None if mb is None else int(mb * 2**20)
        self.model_.to(self.device_)
        self.model_.compile_mode = cfg.compile
        self.eval_transform_ = build_transform(self.backbone_.data_config, train=False)
        train_tf = build_transform(self.backbone_.data_config, train=True, augment=cfg.train.augment)
        self.embedder_ = Embedder(
            self.model_, self.device_, cfg.eval.batch_size, cfg.train.num_workers, self.eval_transform_,
            progress=self.progress, precision=cfg.precision,
        )  # fmt: skip
        self.trainer_ = AdapterTrainer(self.embedder_, cfg.adapter, cfg.train, train_tf)
        self.heads_ = ClassHeads(self._new_head, cfg.head.scope, cfg.head.forgettable, self.device_)
        keys = KEYS.get(cfg.signature.keys) if self.composition.retrieves else NoKeys.from_config
        self.keys_: RetrievalKeys = keys(cfg, self.device_, self._new_head)

    def _new_head(self, rp_dim: int | None = None, dim: int | None = None) -> RanPACHead:
        """An empty RanPAC head on the config's settings, for ``dim``-dimensional features (default: the
        backbone's embeddings; a key space may have its own)."""
        h = self.config.head
        return RanPACHead(
            self.model_.embed_dim if dim is None else dim,
            rp_dim=h.rp_dim if rp_dim is None else rp_dim,
            gamma_min_exp=h.gamma_min_exp,
            gamma_max_exp=h.gamma_max_exp,
            holdout=h.holdout,
            selection=h.gamma_selection,
            prototypes=h.prototypes,
            seed=self.config.seed,
            device=self.device_,
        )

    def backbone_identity(self) -> dict[str, Any]:
        """Backbone name, weights and adapted split: what a knowledge base must match."""
        self._build()
        return self.backbone_.identity()

    # ------------------------------------------------------------------ properties
    @property
    def composition(self) -> Composition:
        return COMPOSITIONS.get(self.config.retrieval.mode)

    @property
    def head_(self) -> RanPACHead | None:
        """The RanPAC head over every class (Eq. 23), None before the first task."""
        if not hasattr(self, "heads_"):
            raise AttributeError("head_: not fitted yet (fit_task or Proteus.load)")
        return self.heads_.head

    @property
    def supports(self) -> frozenset[str]:
        """:data:`proteus.learners.CAPABILITIES`: every Proteus loads; methods with task retrieval
        also reject, forget and calibrate."""
        return frozenset({"load", "retrieval"} if self.composition.retrieves else {"load"})

    @property
    def num_tasks(self) -> int:
        return len(getattr(self, "records_", ()))

    @property
    def num_adapters(self) -> int:
        return self.model_.num_tasks if hasattr(self, "model_") else 0

    @property
    def num_classes(self) -> int:
        return 1 + max((max(t.classes) for t in getattr(self, "records_", ())), default=-1)

    @property
    def uses_retrieval(self) -> bool:
        return self.composition.retrieves and self.num_adapters > 0

    @property
    def needs_frozen(self) -> bool:
        """Retrieval reads the frozen backbone's features (frozen-space keys)."""
        return self.uses_retrieval and self.keys_.needs_frozen

    def task_seed(self, k: int) -> int:
        return int(self.config.seed) * 100_003 + 7919 * (k + 1)

    @property
    def classes_(self) -> list[str]:
        """The learned classes' names, indexed by global label (``pred.label``): ``clf.classes_[label]``
        (scikit-learn's name; :meth:`class_names` gives the same list)."""
        self._check_fitted()
        return self.class_names()

    def class_names(self) -> list[str]:
        """The learned classes' names, indexed by global label (empty before the first task)."""
        names: dict[int, str] = {}
        for t in getattr(self, "records_", ()):
            names.update(zip(t.classes, t.class_names))
        return [names.get(c, str(c)) for c in range(self.num_classes)]

    def head_composition(self, k: int) -> tuple[list[int] | None, str]:
        """Which composition embeds inputs for the head as of task k (0-based)."""
        return self.composition.head_tasks(k, self.num_adapters)

    def trains_adapter(self, k: int) -> bool:
        return self.config.adapter.enabled and TRAIN_SCHEDULES.get(self.config.train.tasks)(k)

    # ------------------------------------------------------------------ Algorithm 1
    def fit_task(self, task: Task) -> TaskStats:
        """Learn one task (Algorithm 1, lines 5-12); transactional. Returns what it measured."""
        self._build()
        k = self.num_tasks
        if task.index != k:
            raise TaskError(f"task {task.index + 1}: the learner holds {k} tasks, so task {k + 1} comes next")
        if len(task.train) == 0:
            raise TaskError(f"task {task.index + 1}: the training set is empty")
        seen = {c for t in self.records_ for c in t.classes}
        dup = sorted(seen & set(task.classes))
        if dup:
            names = [task.class_names[task.classes.index(c)] for c in dup]
            raise TaskError(f"task {k + 1}: classes {names} already belong to an earlier task")
        m0, head0 = self.num_adapters, self.head_
        try:
            return self._fit_task(task, k)
        except BaseException:  # each part rolls back what task k added
            self.model_.truncate(m0)
            self.keys_.truncate(k)
            self.heads_.truncate(k, head0)
            raise

    def _fit_task(self, task: Task, k: int) -> TaskStats:
        stats = TaskStats(task=k)
        sec = stats.seconds
        devices.reset_peak_memory(self.device_)
        clock = partial(devices.clock, self.device_)  # waits for the GPU's queued work
        t0 = clock()
        z, y = self.embedder_.prefix_dataset(task.train, f"task {k + 1}: prefix")
        sec["prefix"] = clock() - t0
        crash_point("learn:prefix")
        t0 = clock()
        if self.trains_adapter(k):
            cache = CACHE_PREFIX[self.config.train.cache_prefix] and not self.config.train.augment
            stats.train = self.trainer_.fit(task, k, self.task_seed(k), z if cache else None, y)
        sec["train"] = clock() - t0
        crash_point("learn:train")

        t0 = clock()  # line 6: the task's retrieval keys
        num_classes = max(task.classes) + 1
        rc = self.config.retrieval
        zk, yk, held = z, y, None
        if rc.reject and self.composition.retrieves:  # keep a part out of the key fit to calibrate on
            keep, held = holdout_split(len(y), rc.calibration_holdout, self.task_seed(k) + 2)
            zk, yk = z[keep], y[keep]
        seed, m = self.task_seed(k), self.num_adapters
        fit = KeyFit(k, zk, yk, num_classes, seed, m, self.embedder_)
        stats.signature = self.keys_.add_task(fit)
        calibration = None if held is None else self._calibrate(k, z[held], list(task.classes))
        sec["signature"] = clock() - t0
        crash_point("learn:signature")

        t0 = clock()  # lines 8-12: head statistics from the embeddings the method predicts with
        tasks, kind = self.head_composition(k)
        h = self.embed_prefix(z, tasks, kind)[0]
        stats.gamma = self.heads_.update(k, h, y, list(task.classes), num_classes)
        sec["head"] = clock() - t0
        crash_point("learn:head")
        self.records_.append(
            TaskRecord(
                k,
                [int(c) for c in task.classes],
                list(task.class_names),
                int(len(task.train)),
                self.trains_adapter(k),
                stats,
                {**self.config.task_settings(), "device": str(self.device_)},
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                calibration,
                source_classes=task.source_classes,
            )
        )
        stats.peak_gpu_mb = devices.peak_memory_mb(self.device_)
        return stats

    def _calibrate(self, k: int, z_held: torch.Tensor, classes: list[int]) -> dict[str, Any] | None:
        """Task k's held-out inputs scored by its own key (proteus.engine.novelty)."""
        m = min(k + 1, self.num_adapters)
        if m <= k:
            return None  # no key of its own to score with
        H = self.embed_prefix(z_held, list(range(m)))
        F = self.embed_prefix(z_held, None)[0] if self.keys_.needs_frozen else None
        scores = self.keys_.retrieve(H, F, [t.classes for t in self.records_] + [classes]).task_scores[:, k]
        return Calibration.from_scores(scores, self.config.retrieval.reject_tpr).to_dict()

    def calibrate_novelty(
        self, images: Sequence[str | os.PathLike[str]], labels: Sequence[int], tpr: float | None = None
    ) -> list[float]:
        """Fit the class-Gaussian thresholds of inputs from no learned task (``retrieval.novelty``) on
        held-out image files: ``labels`` their global classes (-1: unknown, the nearest class is taken),
        ``tpr`` a new true-positive rate (None: keep it). Returns each task's threshold."""
        self._check_fitted()
        space = self.keys_.space
        if space is None:  # keys under each task's own adapter: no one space, no class statistics
            return self.keys_.calibrate(torch.zeros(0), torch.zeros(0), [], tpr)

        def embed(ims: list[Image.Image]) -> torch.Tensor:  # the key space's features of a decoded batch
            return space.embed(self.embedder_, self.embedder_.prefix(self.transform_images(ims)), shard=False)

        ec = self.config.eval
        batches = predict_batches(
            images, embed, ec.batch_size, progress=self.progress, max_pixels=ec.max_image_pixels
        )  # type: ignore[arg-type]
        X = torch.cat([b.prediction for b in batches])  # type: ignore[misc]
        y = torch.as_tensor(list(labels), dtype=torch.long)
        return self.keys_.calibrate(X, y, [t.classes for t in self.records_], tpr)

    def thresholds(self) -> torch.Tensor | None:
        """Each task's rejection threshold on its key score, or None unless every task is calibrated."""
        cals = [t.calibration for t in self.records_]
        if not cals or any(c is None for c in cals):
            return None
        return torch.tensor([float(c["threshold"]) for c in cals if c is not None])

    # ------------------------------------------------------------------ Algorithm 2, in public steps
    def transform_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """PIL images -> a batch under the backbone's evaluation transform."""
        self._build()
        return torch.stack([self.eval_transform_(im) for im in images])

    def prefix_dataset(self, ds: Any, desc: str = "prefix") -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen-prefix outputs and labels of a (PIL image, label) dataset (cacheable for all tasks)."""
        self._build()
        return self.embedder_.prefix_dataset(ds, desc)

    def embed_prefix(
        self, z: torch.Tensor, tasks: list[int] | None, kind: str = "task", shard: bool = True
    ) -> torch.Tensor:
        """(G, N, d) embeddings of prefix outputs under the compositions of ``tasks`` (None: frozen)."""
        return self.embedder_.embed_prefix(z, tasks, kind, shard=shard)

    @torch.no_grad()
    def embed(
        self, x: torch.Tensor, num_tasks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Alg. 2 line 2 for a batch of transformed images: ``(H, F)``, H (m, N, d) under each of the first
        m tasks' adapters (one batched forward), F (N, d) the frozen features where the keys need them."""
        self._check_fitted()
        m = self._m(num_tasks)
        z = self.embedder_.prefix(x)
        H = self.embed_prefix(z, list(range(min(m, self.num_adapters))), shard=False)
        F = self.embed_prefix(z, None, shard=False)[0] if self.needs_frozen else None
        return H, F

    def retrieve(self, H: torch.Tensor, F: torch.Tensor | None = None) -> RetrievalResult:
        """Task retrieval (Sec. 3.1) among the first ``H.shape[0]`` tasks."""
        return self.keys_.retrieve(H, F, [t.classes for t in self.records_])

    def classify(self, h: torch.Tensor, tasks: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 23: the head's scores (N, C) for embeddings (N, d) under the adapters of ``tasks`` (N,);
        with ``head.scope=task`` each row is scored by its task's own head (-inf outside its classes,
        ``tasks`` needed). Classes of forgotten tasks score -inf."""
        self._check_fitted()
        gone = [c for t in self.records_ if t.forgotten for c in t.classes]
        return self.heads_.logits(h, tasks, self.num_classes, gone)

    def predict_embedded(self, H: torch.Tensor, F: torch.Tensor | None = None) -> Prediction:
        """Retrieve, take each input's embedding under its retrieved (or candidate) adapters, classify."""
        rows = torch.arange(H.shape[1])
        return self._prediction(self.retrieve(H, F), lambda cand: H[cand, rows[:, None]])

    def _prediction(self, res: RetrievalResult, under: Under) -> Prediction:
        """The keys' result combined with the head (``retrieval.combine``, proteus.engine.experts)."""
        task_of = torch.zeros(self.num_classes, dtype=torch.long)
        for t in self.records_:
            task_of[t.classes] = t.index
        novelty = res.novelty  # the keys' own detector (proteus.engine.novelty), if they carry one
        res = experts.decide(res, under, self.classify, self.config.retrieval, task_of)
        logits = res.task_scores
        pred = Prediction(logits.argmax(1), res.task, res.component, res.score, logits)
        thr = self.thresholds()
        if thr is not None:  # retrieval.reject: the key scores' thresholds
            novelty = res.score.double() - thr.double()[res.task]
        if novelty is not None:
            pred.novelty, pred.known = novelty.double(), novelty <= 0
        return pred

    @torch.no_grad()
    def predict(self, x: torch.Tensor, num_tasks: int | None = None) -> Prediction:
        """Algorithm 2 on a batch of transformed images (:meth:`transform_images`).

        ``num_tasks = m`` retrieves among the first m tasks only (the head stays the full one): the
        inference latency as a function of m (App. "Complexity of PROTEUS Inference"). Keys in one space
        or a candidate shortlist take 2 (c + 1) forwards per input instead of m (:attr:`predict_route`),
        with the result of :meth:`predict_embedded` on :meth:`embed` (to float round-off)."""
        self._check_fitted()
        if self.uses_retrieval:  # the keys' own route (proteus.engine.keys.base)
            m = min(self._m(num_tasks), self.num_adapters)
            z, classes = self.embedder_.prefix(x), [t.classes for t in self.records_]
            return self._prediction(*self.keys_.predict(self.embedder_, z, m, classes))
        tasks, kind = self.head_composition(self._m(num_tasks) - 1)
        h = self.embed_prefix(self.embedder_.prefix(x), tasks, kind, shard=False)[0]
        logits = self.classify(h)
        return Prediction(logits.argmax(1), None, None, None, logits)

    @property
    def predict_route(self) -> str:
        """How :meth:`predict` embeds: ``one-space`` (keys in one space: a forward there, then one under
        the retrieved adapter), ``candidates`` (``retrieval.candidates``: the shortlist's c adapters),
        ``all-adapters`` (Alg. 2: every task's adapter), or ``none`` (a method without retrieval)."""
        return self.keys_.route if self.uses_retrieval else "none"

    def predict_images(
        self,
        images: Iterable[str | os.PathLike[str] | Image.Image],
        batch_size: int | None = None,
        *,
        progress: bool | None = None,
        max_pixels: int | None = None,
        skip_unreadable: bool = False,
    ) -> Iterator[ImageBatch]:
        """:meth:`predict` over image files (or PIL images), decoded a batch at a time: one
        :class:`~proteus.engine.batches.ImageBatch` per batch (files, prediction, skipped files, images per
        second so far); ``progress`` (default: the learner's) shows a bar of images and images/s.
        Defaults: ``eval.batch_size``, ``eval.max_image_pixels``."""
        self._check_fitted()
        ec = self.config.eval
        return predict_batches(
            images,
            lambda ims: self.predict(self.transform_images(ims)),
            batch_size or ec.batch_size,
            progress=self.progress if progress is None else progress,
            max_pixels=max_pixels or ec.max_image_pixels,
            skip_unreadable=skip_unreadable,
        )

    def forget_task(self, k: int) -> None:
        """Remove task k (0-based) from what can be predicted (``proteus kb forget``): its contribution to
        the head's statistics is subtracted exactly (:meth:`RanPACHead.downdate`), its key removed (never
        retrieved), its classes never predicted. Its adapter directions stay: later tasks' compositions
        use them. Needs ``head.forgettable`` (the task's embeddings kept). Everything is checked before
        anything changes; the knowledge base changes only when the result is committed."""
        self._check_fitted()
        if not 0 <= k < self.num_tasks:
            raise TaskError(f"task {k + 1}: the learner holds tasks 1..{self.num_tasks}")
        rec = self.records_[k]
        if rec.forgotten:
            raise TaskError(f"task {k + 1} is already forgotten")
        self.heads_.check_forget(k)
        try:
            self.keys_.check_forget(k)
        except ValueError as e:
            raise TaskError(str(e)) from None
        self.heads_.forget(k, rec.classes)  # atomic
        self.keys_.forget(k, rec.classes)
        rec.forgotten = True

    # ------------------------------------------------------------------ evaluation (the shared loop's)
    def cached_embeddings(self, cache: TestCache, tau: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(H, F)`` of test set tau, as :meth:`embed` gives them, from the evaluation's caches."""
        H = torch.stack([cache.embedding(tau, "task", j) for j in range(self.num_adapters)])
        F = cache.embedding(tau, "task", None) if self.needs_frozen else None
        return H, F

    def predict_test(self, cache: TestCache, tau: int, k: int) -> TestOutcome:
        """Test set tau after task k: the prediction, the retrieved tasks and the oracle labels (each input
        under its true task's adapter and head) -- or the head's labels alone without retrieval."""
        if self.uses_retrieval:
            pred = self.predict_embedded(*self.cached_embeddings(cache, tau))
            own = torch.full_like(cache.labels(tau), tau)
            oracle = self.classify(cache.embedding(tau, "task", tau), own).argmax(1)
            return TestOutcome(pred.label, pred.task, oracle)
        tasks, kind = self.head_composition(k)
        return TestOutcome(
            self.classify(cache.embedding(tau, kind, None if tasks is None else tasks[0])).argmax(1)
        )

    # ------------------------------------------------------------------ state (the knowledge base's share)
    def _task_state(self, k: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Task k's record (JSON, timings left out) and tensors: its adapter directions, keys, head."""
        rec = self.records_[k]
        tensors = self.model_.task_tensors(k) if rec.has_adapter else {}
        key_meta, key_tensors = self.keys_.task_state(k)
        head_meta, head_tensors = self.heads_.task_state(k)
        meta = without_timings({**rec.to_dict(), **key_meta, **head_meta})
        return meta, {**tensors, **key_tensors, **head_tensors}

    def _load_task(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        k = self.num_tasks
        if meta["index"] != k:
            raise TaskError(f"knowledge base task {meta['index'] + 1} is out of order (expected {k + 1})")
        if meta["has_adapter"]:
            try:
                self.model_.append_task_tensors(tensors, f"task {k + 1}")
            except KeyError as e:
                raise TaskError(e.args[0]) from None
        self.keys_.load_task(meta, tensors)
        self.heads_.load_task(k, meta, tensors)
        self.records_.append(TaskRecord.from_dict(meta))

    def _head_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        state = self.heads_.state()
        if state is None:
            return None
        meta, tensors = state
        kmeta, ktensors = self.keys_.global_state()
        if kmeta is not None:  # global keys (LDA key heads) ride in the head's object, under task_head/
            meta = {**meta, "task_head": kmeta}
            tensors.update({f"task_head/{n}": v for n, v in ktensors.items()})
        return meta, tensors

    def _load_head(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        pre = "task_head/"
        own = {k: v for k, v in tensors.items() if not k.startswith(pre)}
        self.heads_.load({k: v for k, v in meta.items() if k != "task_head"}, own)
        sub = {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}
        self.keys_.load_global(meta.get("task_head"), sub)

    def state(self) -> LearnerState:
        """Everything learned: per task its record and tensors (adapter directions, keys, the task's head),
        and the head's statistics (with any global keys). :meth:`from_state` is the inverse; a knowledge
        base stores it (:meth:`proteus.kb.KnowledgeBase.commit_state`)."""
        return LearnerState([self._task_state(k) for k in range(self.num_tasks)], self._head_state())

    @classmethod
    def from_state(cls, config: RunConfig, state: LearnerState, *, progress: bool = False) -> Proteus:
        """The learner that :meth:`state` described (validated like :meth:`fit_task`)."""
        clf = cls(config, progress=progress)
        clf._restore(state)
        return clf

    def _restore(self, state: LearnerState) -> None:
        self._build()
        if self.num_tasks:
            raise TaskError("a learner is restored from a state only before it learns any task")
        for meta, tensors in state.tasks:  # untrusted input: a failure names the task and its file
            with _loading(f"task {self.num_tasks + 1} ({meta.get('object', 'no object')})"):
                self._load_task(meta, tensors)
        if state.head is not None:
            with _loading(f"the head ({state.head[0].get('object', 'its object')})"):
                self._load_head(*state.head)

    def kb_header(self) -> dict[str, Any]:
        """What a new knowledge base records about this learner (version, backbone identity, config)."""
        return learner_header(self.config, self.backbone_identity())

    @classmethod
    def from_kb(
        cls,
        kb: KnowledgeBase,
        *,
        device: str | None = None,
        precision: str | None = None,
        progress: bool = False,
    ) -> Proteus:
        """The learner a knowledge base holds (backbone identity checked); ``device`` and ``precision``
        (:mod:`proteus.devices`) replace the stored ones for this process."""
        cfg = RunConfig.from_stored(kb.manifest["config"])
        if cfg.method in METHODS and LEARNERS.get(METHODS.get(cfg.method).learner) is not cls:
            raise TaskError(f"{kb.root}: holds method {cfg.method}, not a {cls.__name__} method")
        if precision and precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        cfg = dataclasses.replace(cfg, device=device or cfg.device, precision=precision or cfg.precision)
        clf = cls(cfg, progress=progress)
        kb.check_backbone(clf.backbone_identity())
        clf._restore(LearnerState(*kb.read_state()))
        return clf

    def save(self, kb_dir: str | Path) -> None:
        """Write the learner to a knowledge base directory: a new one, or the next state of the one there."""
        if KnowledgeBase.exists(kb_dir):
            kb = KnowledgeBase.open(kb_dir)
            kb.check_backbone(self.backbone_identity())
        else:
            kb = KnowledgeBase.new(kb_dir, self.kb_header())
        state = self.state()
        kb.commit_state(state.tasks, state.head)

    @classmethod
    def load(
        cls,
        kb_dir: str | Path,
        *,
        device: str | None = None,
        precision: str | None = None,
        progress: bool = False,
    ) -> Proteus:
        """The learner held by a knowledge base directory (every checksum verified)."""
        return cls.from_kb(KnowledgeBase.open(kb_dir), device=device, precision=precision, progress=progress)

    def _m(self, num_tasks: int | None) -> int:
        return self.num_tasks if num_tasks is None else max(1, min(int(num_tasks), self.num_tasks))

    def _check_fitted(self) -> None:
        if getattr(self, "head_", None) is None:
            raise NotFittedError("this Proteus has learned no task yet: call fit_task or Proteus.load first")

    def __repr__(self) -> str:
        c = self.config
        return f"Proteus(method={c.method!r}, backbone={c.backbone.name!r}, tasks={self.num_tasks})"


@contextlib.contextmanager
def _loading(what: str) -> Iterator[None]:
    """Re-raise a failure to load a stored part (wrong shapes, types or values) as a TaskError naming it."""
    try:
        yield
    except TaskError as e:  # already names the task ("task 2: ..."): add the file once
        raise TaskError(f"{what}: {str(e).removeprefix(what.split(' (')[0] + ': ')}") from None
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        msg = e.args[0] if e.args else type(e).__name__
        raise TaskError(f"{what}: cannot be loaded: {msg}") from None
