"""The working parts of a PROTEUS learner, built from its options, and Algorithm 1 on them.

:class:`ProteusParts` holds the frozen backbone with every task's adapter (Eq. 9), the embedding passes,
the adapter trainer (Eq. 15), the retrieval keys (Eq. 18 or the LDA keys) and the class heads (Eq. 23),
and learns one task with them (:meth:`ProteusParts.learn`, Algorithm 1 lines 5-12). :class:`proteus.Proteus`
is the public face over them; the parts are also its fitted attributes (``model_``, ``keys_``, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from proteus import devices
from proteus import distributed as dist
from proteus.adapters import AdaptedBackbone
from proteus.adapters.options import TRANSFER_INIT
from proteus.backbones import Backbone
from proteus.backbones.base import block_indices
from proteus.config import CACHE_PREFIX, ConfigError, RunConfig, check_sections
from proteus.engine import experts
from proteus.engine.class_heads import ClassHeads
from proteus.engine.compositions import COMPOSITIONS, TRAIN_SCHEDULES, Composition
from proteus.engine.confidence import MIN_ROWS, Confidence, calibration_rows, fit_temperature
from proteus.engine.embedder import Embedder
from proteus.engine.errors import TaskError
from proteus.engine.experts import Classify
from proteus.engine.keys import KEYS, KeyFit, NoKeys, RetrievalKeys, Under
from proteus.engine.novelty import Calibration, holdout_split
from proteus.engine.records import Prediction, TaskRecord, TaskRecords, TaskStats
from proteus.engine.runtime import Runtime
from proteus.engine.trainer import AdapterTrainer
from proteus.faults import crash_point
from proteus.heads import RanPACHead
from proteus.signatures import RetrievalResult
from proteus.streams import Task

__all__ = ["OPTION_SECTIONS", "ProteusParts", "check_options", "task_seed"]

#: the sections of the run configuration that hold PROTEUS's own options (the rest are the run's)
OPTION_SECTIONS = ("backbone", "adapter", "train", "signature", "head", "retrieval")


def check_options(cfg: RunConfig) -> None:
    """PROTEUS's options checked by their declarations and the rules between them."""
    check_sections(cfg, OPTION_SECTIONS)
    block_indices(cfg.adapter.blocks, None)  # the spelling (the count needs the backbone)
    h, r = cfg.head, cfg.retrieval
    picks = experts.HEAD_SCOPES.get(h.scope).per_task or experts.COMBINATIONS.get(r.combine).weighs_tasks
    if not COMPOSITIONS.get(r.mode).retrieves and picks:
        raise ConfigError(
            f"head.scope={h.scope} and retrieval.combine={r.combine} need task retrieval, but "
            f"retrieval.mode={r.mode}; add --set head.scope=global --set retrieval.combine=hard"
        )
    if experts.COMBINATIONS.get(r.combine).weighs_tasks and not KEYS.get(cfg.signature.keys).one_space:
        one_space = [n for n in KEYS if KEYS.get(n).one_space]
        raise ConfigError(
            f"retrieval.combine=soft needs task keys in one space ({', '.join(one_space)}); got "
            f"signature.keys={cfg.signature.keys}; add --set retrieval.combine=hard (the paper's "
            "Gaussian keys: --method proteus-dpgmm)"
        )
    if h.gamma_max_exp <= h.gamma_min_exp:
        raise ConfigError(
            f"head.gamma_max_exp ({h.gamma_max_exp}) must be above head.gamma_min_exp ({h.gamma_min_exp})"
        )


def task_seed(cfg: RunConfig, k: int) -> int:
    """Task k's seed (0-based): its training order, its key fit and its held-out split."""
    return int(cfg.seed) * 100_003 + 7919 * (k + 1)


def trainable_params(model: Any, transfer: str, n_classes: int) -> int:
    """The parameters the last task's training changed (the paper's parameter count, its Appendix table
    "params"): its new directions A and B on every adapted map and its S coefficients where S is learned
    (Eq. 9), counted on the stored tensors, plus the training head over its classes, (d + 1) per class."""
    tensors = model.task_tensors(model.num_tasks - 1)
    learned_s = TRANSFER_INIT[transfer] is None  # S learned, not fixed
    n = sum(int(v.numel()) for name, v in tensors.items() if learned_s or not name.endswith("/s"))
    return n + (int(model.embed_dim) + 1) * n_classes


@dataclass
class ProteusParts:
    """A PROTEUS learner's parts (see the module docstring), built by :meth:`build` from a config."""

    config: RunConfig
    device: torch.device
    backbone: Backbone
    model: AdaptedBackbone
    eval_transform: Callable[[Any], torch.Tensor]
    embedder: Embedder
    trainer: AdapterTrainer
    heads: ClassHeads
    keys: RetrievalKeys

    @classmethod
    def build(cls, cfg: RunConfig, progress: bool) -> ProteusParts:
        """The parts of a learner with no task yet (``cfg`` validated by the caller)."""
        rt = Runtime.build(cfg)
        model = AdaptedBackbone(rt.backbone, scaling=cfg.adapter.scaling, enabled=cfg.adapter.enabled)
        mb = cfg.eval.merge_budget_mb
        model.merge_budget_bytes = None if mb is None else int(mb * 2**20)
        model.to(rt.device)
        model.compile_mode = cfg.compile
        embedder = rt.embedder(model, progress)
        new_head = partial(_new_head, cfg, model.embed_dim, rt.device)
        retrieves = COMPOSITIONS.get(cfg.retrieval.mode).retrieves
        keys = (KEYS.get(cfg.signature.keys) if retrieves else NoKeys.from_config)(cfg, rt.device, new_head)
        return cls(
            cfg, rt.device, rt.backbone, model, rt.eval_transform, embedder,
            AdapterTrainer(embedder, cfg.adapter, cfg.train, rt.train_transform),
            ClassHeads(new_head, cfg.head.scope, cfg.head.forgettable, rt.device), keys,
        )  # fmt: skip

    def configure(self, cfg: RunConfig) -> None:
        """Follow a new config whose model-defining keys equal this one's (:meth:`Proteus.set_params`): the
        per-task keys (epochs, learning rate, batch sizes, workers, precision, compile, the merge budget)
        take effect from the next task or prediction. The device is chosen when the parts are built."""
        if dist.device_for_rank(cfg.device) != self.device:
            raise ConfigError(
                f"device={cfg.device}: the learner is built on {self.device}; give the device when it is "
                "built or loaded (proteus learn --device, Proteus.load(..., device=...))"
            )
        self.config = cfg
        self.trainer.adapter, self.trainer.train = cfg.adapter, cfg.train
        e = self.embedder
        e.batch_size, e.num_workers, e.precision = cfg.eval.batch_size, cfg.train.num_workers, cfg.precision
        mb = cfg.eval.merge_budget_mb
        self.model.merge_budget_bytes = None if mb is None else int(mb * 2**20)
        self.model.compile_mode = cfg.compile

    # ------------------------------------------------------------------ what the recipe decides
    @property
    def composition(self) -> Composition:
        """Which adapters embed an input (``retrieval.mode``)."""
        return COMPOSITIONS.get(self.config.retrieval.mode)

    @property
    def num_adapters(self) -> int:
        return self.model.num_tasks

    @property
    def retrieves(self) -> bool:
        """Task retrieval is on and there is an adapter to retrieve."""
        return self.composition.retrieves and self.num_adapters > 0

    @property
    def needs_frozen(self) -> bool:
        """Retrieval reads the frozen backbone's features (frozen-space keys)."""
        return self.retrieves and self.keys.needs_frozen

    def adopt(self, k: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Task k is stored as ``tensors`` (its committed object, memory-mapped): its share of the keys and
        heads is read from them when needed, no longer held (see :meth:`proteus.Proteus.adopt`)."""
        self.keys.adopt(k, tensors)
        self.heads.adopt(k, tensors)
        self.model.adopt(k, tensors)

    @property
    def generation(self) -> int:
        """Bumped whenever a learned task's stored share changes after its task (``kb forget``, a new
        calibration): every task's record is then written again at the next commit."""
        return self.keys.generation + self.heads.generation

    @property
    def route(self) -> str:
        """How prediction embeds: ``one-space`` (keys in one space: a forward there, then one under the
        retrieved adapter), ``candidates`` (``retrieval.candidates``: the shortlist's c adapters),
        ``all-adapters`` (Alg. 2: every task's adapter), or ``none`` (a method without retrieval)."""
        return self.keys.route if self.retrieves else "none"

    def head_tasks(self, k: int) -> tuple[list[int] | None, str]:
        """Which composition embeds inputs for the head as of task k (0-based)."""
        return self.composition.head_tasks(k, self.num_adapters)

    def trains_adapter(self, k: int) -> bool:
        return self.config.adapter.enabled and TRAIN_SCHEDULES.get(self.config.train.tasks)(k)

    # ------------------------------------------------------------------ Algorithm 1
    def learn(self, task: Task, k: int, records: TaskRecords) -> TaskRecord:
        """Learn task k (Algorithm 1, lines 5-12) and return its record; on an exception every part is as
        before (each rolls back what task k added)."""
        m0, head0 = self.num_adapters, self.heads.head
        try:
            record = self._learn(task, k, records)
        except BaseException:
            self.model.truncate(m0)
            self.keys.truncate(k)
            self.heads.truncate(k, head0)
            raise
        self.keys.settle()
        return record

    def _learn(self, task: Task, k: int, records: TaskRecords) -> TaskRecord:
        cfg, stats = self.config, TaskStats(task=k)
        sec, seed = stats.seconds, task_seed(self.config, k)
        devices.reset_peak_memory(self.device)
        clock = partial(devices.clock, self.device)  # waits for the GPU's queued work
        t0 = clock()
        taps, tap_sizes = None, None
        if self.keys.wants_taps and self.composition.retrieves:  # the detector's channel statistics
            z, y, taps = self.embedder.prefix_dataset(
                task.train, f"task {k + 1}: embedding training images", taps=True
            )
            tap_sizes = self.embedder.tap_sizes()
        else:
            z, y = self.embedder.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
        sec["prefix"] = clock() - t0
        crash_point("learn:prefix")
        t0 = clock()
        if self.trains_adapter(k):
            cache = CACHE_PREFIX[cfg.train.cache_prefix] and not cfg.train.augment
            stats.train = self.trainer.fit(task, k, seed, z if cache else None, y)
            stats.extra["trainable_params"] = trainable_params(
                self.model, cfg.adapter.transfer, len(task.classes)
            )
        sec["train"] = clock() - t0
        crash_point("learn:train")

        t0 = clock()  # line 6: the task's retrieval keys
        rc, zk, yk, held = cfg.retrieval, z, y, None
        if rc.reject and self.composition.retrieves:  # keep a part out of the key fit to calibrate on
            keep, held = holdout_split(len(y), rc.calibration_holdout, seed + 2)
            zk, yk = z[keep], y[keep]
        tk = taps if taps is None or held is None else taps[keep]
        every = [*records.classes(), list(task.classes)]
        fit = KeyFit(
            k, zk, yk, max(task.classes) + 1, seed, self.num_adapters, self.embedder, tk, tap_sizes, every
        )
        stats.signature = self.keys.add_task(fit)
        calibration = None
        if held is not None:
            calibration = self._calibrate(k, z[held], every)
        sec["signature"] = clock() - t0
        crash_point("learn:signature")

        t0 = clock()  # lines 8-12: head statistics from the embeddings the method predicts with
        tasks, kind = self.head_tasks(k)
        h = self.embedder.embed_prefix(z, tasks, kind)[0]
        stats.gamma = self.heads.update(k, h, y, list(task.classes), max(task.classes) + 1)
        sec["head"] = clock() - t0
        crash_point("learn:head")
        rec = TaskRecord(
            k, [int(c) for c in task.classes], list(task.class_names), int(len(task.train)),
            self.trains_adapter(k), stats, {**cfg.task_settings(), "device": str(self.device)},
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), calibration,
            source_classes=task.source_classes,
        )  # fmt: skip
        t0 = clock()  # the temperature of this task's confidence (proteus.engine.confidence)
        rec.confidence = self.fit_confidence(k, z, y, h, TaskRecords([*records, rec]), seed)
        sec["confidence"] = clock() - t0
        stats.peak_gpu_mb = devices.peak_memory_mb(self.device)
        return rec

    def fit_confidence(
        self, k: int, z: torch.Tensor, y: torch.Tensor, h: torch.Tensor, records: TaskRecords, seed: int
    ) -> Confidence | None:
        """Task k's confidence temperature (:mod:`proteus.engine.confidence`): its calibration rows (of its
        training inputs' prefix outputs z, labels y; h their embeddings for its head) predicted by the
        learner holding ``records`` with its keys and heads fitted without those rows, and T fitted to
        their labels. None with too few rows."""
        rows = calibration_rows(len(y), self.config.retrieval.calibration_holdout, seed)
        if len(rows) < MIN_ROWS:
            return None
        with self.keys.without(self.embedder, z[rows], y[rows]), self.heads.without(k, h, y, rows):
            pred = self.predict_prefix(z[rows], k + 1, records)
        T = fit_temperature(pred.logits, y[rows])
        return None if T is None else Confidence(T, len(rows))

    # ------------------------------------------------------------------ Algorithm 2's decision, forgetting
    def predict_prefix(
        self, z: torch.Tensor, m: int, records: TaskRecords, taps: torch.Tensor | None = None
    ) -> Prediction:
        """Algorithm 2 on prefix outputs ``z`` among the first m tasks of ``records``
        (:meth:`proteus.Proteus.predict`; at learn time, the task's calibration rows); ``taps`` the
        inputs' tap statistics, which the detector of inputs from no learned task may read."""

        def classify(h: torch.Tensor, tasks: torch.Tensor | None = None) -> torch.Tensor:
            return self.heads.logits(h, tasks, records.num_classes, records.forgotten_classes())

        if self.retrieves:  # the keys' own route (proteus.engine.keys.base)
            res, under = self.keys.predict(
                self.embedder, z, min(m, self.num_adapters), records.classes(), taps
            )
            return self.decide(res, under, classify, records)
        tasks, kind = self.head_tasks(m - 1)
        logits = classify(self.embedder.embed_prefix(z, tasks, kind, shard=False)[0])
        return Prediction(logits.argmax(1), None, None, None, logits)

    def decide(
        self, res: RetrievalResult, under: Under, classify: Classify, records: TaskRecords
    ) -> Prediction:
        """The keys' result combined with the head (``retrieval.combine``, :mod:`proteus.engine.experts`),
        with each input's novelty (the keys' own detector, or ``retrieval.reject``'s thresholds)."""
        novelty = res.novelty
        res = experts.decide(res, under, classify, self.config.retrieval, records.task_of())
        pred = Prediction(res.task_scores.argmax(1), res.task, res.component, res.score, res.task_scores)
        thr = records.thresholds()
        if thr is not None:
            novelty = res.score.double() - thr.double()[res.task]
        if novelty is not None:
            pred.novelty, pred.known = novelty.double(), novelty <= 0
        return pred

    def forget(self, k: int, records: TaskRecords) -> None:
        """Remove task k (0-based): its contribution to the head's statistics subtracted exactly
        (:meth:`RanPACHead.downdate`), its key removed (never retrieved), its classes never predicted
        (its record marked). Its adapter directions stay: later tasks' compositions use them. Everything
        is checked before anything changes; a knowledge base changes only when the result is committed."""
        if not 0 <= k < len(records):
            raise TaskError(f"task {k + 1}: the learner holds tasks 1..{len(records)}")
        rec = records[k]
        if rec.forgotten:
            raise TaskError(f"task {k + 1} is already forgotten")
        self.heads.check_forget(k)
        try:
            self.keys.check_forget(k)
        except ValueError as e:
            raise TaskError(str(e)) from None
        self.heads.forget(k, rec.classes)  # atomic
        self.keys.forget(k, rec.classes)
        rec.forgotten = True

    def _calibrate(self, k: int, z_held: torch.Tensor, classes: list[list[int]]) -> dict[str, Any] | None:
        """Task k's held-out inputs scored by its own key (:mod:`proteus.engine.novelty`)."""
        m = min(k + 1, self.num_adapters)
        if m <= k:
            return None  # no key of its own to score with
        H = self.embedder.embed_prefix(z_held, list(range(m)))
        F = self.embedder.embed_prefix(z_held, None)[0] if self.keys.needs_frozen else None
        scores = self.keys.retrieve(H, F, classes).task_scores[:, k]
        return Calibration.from_scores(scores, self.config.retrieval.reject_tpr).to_dict()


def _new_head(
    cfg: RunConfig, embed_dim: int, device: torch.device, rp_dim: int | None = None, dim: int | None = None
) -> RanPACHead:
    """An empty RanPAC head on the config's settings, for ``dim``-dimensional features (default: the
    backbone's embeddings; a key space may have its own)."""
    h = cfg.head
    return RanPACHead(
        embed_dim if dim is None else dim,
        rp_dim=h.rp_dim if rp_dim is None else rp_dim,
        gamma_min_exp=h.gamma_min_exp,
        gamma_max_exp=h.gamma_max_exp,
        holdout=h.holdout,
        selection=h.gamma_selection,
        prototypes=h.prototypes,
        seed=cfg.seed,
        device=device,
    )
