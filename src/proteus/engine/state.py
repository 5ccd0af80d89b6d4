"""The knowledge-base side of the estimator (Algorithm 1 line 7): what a learned task and the head leave
in the KB, and the way back. A mixin of :class:`proteus.Proteus` (as scikit-learn's mixins add a
capability to an estimator), kept apart so that the estimator's own file is the learning.

A task's object holds its adapter directions (``adapter/<map>/{A,B,s}``) and its keys
(``signature/...``, ``frozen_signature/...``); the head's object holds G, e(c) and any global keys
(``task_head/...``); the manifest holds one record per task (:class:`~proteus.engine.records.TaskRecord`,
wall-clock timings left out: same seed, same bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from proteus import __version__
from proteus.config import ConfigError, RunConfig
from proteus.devices import PRECISIONS
from proteus.engine.errors import TaskError
from proteus.engine.records import TaskRecord
from proteus.kb import KnowledgeBase

if TYPE_CHECKING:
    from proteus.adapters import AdaptedBackbone
    from proteus.engine.experts import TaskExperts
    from proteus.engine.keys import RetrievalKeys
    from proteus.heads import RanPACHead

L = TypeVar("L", bound="KnowledgeBaseState")

__all__ = ["KnowledgeBaseState", "without_timings"]


def without_timings(d: Any) -> Any:
    """``d`` without the keys that hold measurements of the run rather than of the model (wall-clock
    seconds, peak GPU memory), recursively."""
    if isinstance(d, dict):
        return {k: without_timings(v) for k, v in d.items() if "seconds" not in k and k != "peak_gpu_mb"}
    if isinstance(d, list):
        return [without_timings(v) for v in d]
    return d


class KnowledgeBaseState:
    """``task_state`` / ``load_task``, ``head_state`` / ``load_head``, ``commit`` / ``from_kb``,
    ``save`` / ``load`` for :class:`~proteus.Proteus`, which provides what is declared here."""

    config: RunConfig
    records_: list[TaskRecord]
    model_: AdaptedBackbone
    keys_: RetrievalKeys
    experts_: TaskExperts
    head_: RanPACHead | None
    device_: torch.device
    forget_inputs_: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, config: RunConfig | None = None, *, progress: bool = True) -> None:
        raise NotImplementedError

    @property
    def num_tasks(self) -> int:
        raise NotImplementedError

    def _build(self) -> None:
        raise NotImplementedError

    def _new_head(self, rp_dim: int | None = None) -> RanPACHead:
        raise NotImplementedError

    def _check_fitted(self) -> None:
        raise NotImplementedError

    def backbone_identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Task k's record (JSON) and tensors (its adapter directions and its keys)."""
        rec = self.records_[k]
        tensors: dict[str, torch.Tensor] = {}
        if rec.has_adapter:
            for name, u in self.model_.units.items():
                tensors.update({f"adapter/{name}/{key}": v for key, v in u.task_tensors(k).items()})
        key_meta, key_tensors = self.keys_.task_state(k)
        expert_meta, expert_tensors = self.experts_.task_state(k)
        if k in self.forget_inputs_:
            tensors["forget/h"], tensors["forget/y"] = self.forget_inputs_[k]
        return {**rec.to_dict(), **key_meta, **expert_meta}, {**tensors, **key_tensors, **expert_tensors}

    def load_task(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Append a task from its record and tensors (the inverse of :meth:`task_state`)."""
        self._build()
        k = self.num_tasks
        if meta["index"] != k:
            raise TaskError(f"knowledge base task {meta['index'] + 1} is out of order (expected {k + 1})")
        if meta["has_adapter"]:
            for name, u in self.model_.units.items():
                key = f"adapter/{name}"
                if f"{key}/A" not in tensors:
                    raise TaskError(
                        f"task {k + 1}: adapter tensors for {name!r} missing from the knowledge base"
                    )
                u.append_task(tensors[f"{key}/A"], tensors[f"{key}/B"], tensors[f"{key}/s"])
        self.keys_.load_task(meta, tensors)
        if self.config.head.scope == "task":
            self.experts_.load_task(meta, tensors, self.device_)
        if "forget/h" in tensors:
            self.forget_inputs_[k] = (tensors["forget/h"].float(), tensors["forget/y"].long())
        self.records_.append(TaskRecord.from_dict(meta))

    def head_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """The head's statistics (and global keys, under ``task_head``), or None before any task."""
        if self.head_ is None:
            return None
        meta, tensors = self.head_.meta(), dict(self.head_.state_tensors())
        kmeta, ktensors = self.keys_.global_state()
        if kmeta is not None:
            meta = {**meta, "task_head": kmeta}
            tensors.update({f"task_head/{n}": v for n, v in ktensors.items()})
        return meta, tensors

    def load_head(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._build()
        pre = "task_head/"
        own = {k: v.to(self.device_) for k, v in tensors.items() if not k.startswith(pre)}
        self.head_ = self._new_head()
        self.head_.load_state_tensors(own, {k: v for k, v in meta.items() if k != "task_head"})
        self.keys_.load_global(
            meta.get("task_head"), {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}
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
        if k not in self.forget_inputs_:
            raise TaskError(
                f"task {k + 1}: learned without head.forgettable=true, so its contribution to the head "
                "cannot be subtracted exactly; learn with --set head.forgettable=true to be able to forget"
            )
        try:
            self.keys_.check_forget(k)
        except ValueError as e:
            raise TaskError(str(e)) from None
        assert self.head_ is not None
        h, y = self.forget_inputs_[k]
        self.head_.downdate(h.to(self.device_), y.to(self.device_), rec.classes)  # atomic
        self.keys_.forget(k, rec.classes)
        del self.forget_inputs_[k]
        rec.forgotten = True

    # ------------------------------------------------------------------ the knowledge base
    def commit(self, kb: KnowledgeBase, evaluation: list[dict[str, Any]] | None = None) -> None:
        """Write this learner as the KB's next state (atomic: the old state or the new one). Wall-clock
        timings stay out of the KB (same seed, same bytes); ``evaluation``: the rows to keep with it."""
        manifest = dict(kb.manifest)
        tasks = []
        for k in range(self.num_tasks):
            meta, tensors = self.task_state(k)
            rel, sha = kb.write_object(f"task{k:03d}", tensors)
            tasks.append({**without_timings(meta), "object": rel, "sha256": sha})
        manifest["tasks"] = tasks
        head = self.head_state()
        if head is not None:
            rel, sha = kb.write_object("head", head[1])
            manifest["head"] = {"meta": head[0], "object": rel, "sha256": sha}
        manifest["evaluation"] = (
            list(kb.manifest.get("evaluation", []))[: self.num_tasks] if evaluation is None else evaluation
        )
        kb.commit(manifest)

    def kb_header(self) -> dict[str, Any]:
        """What a new knowledge base records about this learner (version, backbone identity, config)."""
        return {
            "proteus_version": __version__,
            "backbone": self.backbone_identity(),
            "config": self.config.to_dict(),
            "split": {"benchmark": self.config.benchmark.name, "sha256": None, "class_order": None},
            "evaluation": [],
        }

    @classmethod
    def from_kb(
        cls: type[L],
        kb: KnowledgeBase,
        *,
        device: str | None = None,
        precision: str | None = None,
        progress: bool = False,
    ) -> L:
        """The learner a knowledge base holds (backbone identity checked); ``device`` and ``precision``
        (:mod:`proteus.devices`) replace the stored ones for this process."""
        cfg = RunConfig.from_stored(kb.manifest["config"])
        if device:
            cfg.device = device
        if precision:
            if precision not in PRECISIONS:
                raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
            cfg.precision = precision
        clf = cls(cfg, progress=progress)
        kb.check_backbone(clf.backbone_identity())
        for t in kb.manifest["tasks"]:
            clf.load_task(t, kb.read(t["object"], t["sha256"]))
        head = kb.manifest.get("head")
        if head:
            clf.load_head(head["meta"], kb.read(head["object"], head["sha256"]))
        return clf

    def save(self, kb_dir: str | Path) -> None:
        """Write the learner to a knowledge base directory: a new one, or the next state of the one there."""
        if KnowledgeBase.exists(kb_dir):
            kb = KnowledgeBase.open(kb_dir)
            kb.check_backbone(self.backbone_identity())
        else:
            kb = KnowledgeBase.new(kb_dir, self.kb_header())
        self.commit(kb)

    @classmethod
    def load(
        cls: type[L],
        kb_dir: str | Path,
        *,
        device: str | None = None,
        precision: str | None = None,
        progress: bool = False,
    ) -> L:
        """The learner held by a knowledge base directory (every checksum verified)."""
        return cls.from_kb(KnowledgeBase.open(kb_dir), device=device, precision=precision, progress=progress)
