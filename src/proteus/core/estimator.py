"""The public face of proteus: :class:`Proteus`, a continual learner in the scikit-learn manner.

For each task k (Algorithm 1): the frozen prefix once per image, the adapter by Eq. 15
(:mod:`proteus.engine.trainer`), the task's retrieval keys (Eq. 18, :mod:`proteus.engine.keys`), and the
head's statistics G and e(c) (lines 8-12, :class:`~proteus.heads.RanPACHead`). At test time (Algorithm 2)
every input is embedded under every task's adapter in one batched forward, the best key is retrieved and
Eq. 23 classifies the embedding under the retrieved adapter -- in three public steps that prediction,
evaluation, analysis and the performance harness all use (``predict`` itself embeds only what the keys
read when they live in one space or shortlist candidates: ``clf.parts_.route``)::

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

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from PIL import Image

from proteus.config import ConfigError, RunConfig, flatten, per_task, resolve_config, validate
from proteus.core.codec import KB_LAYOUT, learner_state, restore
from proteus.core.parts import OPTION_SECTIONS, ProteusParts, check_options
from proteus.engine.compositions import COMPOSITIONS
from proteus.engine.errors import TaskError
from proteus.engine.records import Prediction, TaskRecords, TaskStats
from proteus.errors import NotFittedError
from proteus.heads import RanPACHead
from proteus.kb import KnowledgeBase
from proteus.learners import LEARNERS, LearnerState, TestCache, TestOutcome, learner_header, load_from_kb
from proteus.signatures import RetrievalResult
from proteus.streams import Task

if TYPE_CHECKING:
    from proteus.adapters import AdaptedBackbone
    from proteus.backbones import Backbone
    from proteus.engine.class_heads import ClassHeads
    from proteus.engine.embedder import Embedder
    from proteus.engine.keys import RetrievalKeys

__all__ = ["Prediction", "Proteus", "TaskError"]


@LEARNERS.register("proteus", help="PROTEUS and its ablations (a method is a configuration)")
class Proteus:
    """A PROTEUS continual learner (a method is a configuration: :meth:`from_method`).

    Args:
        config: the hyper-parameters (:class:`~proteus.config.RunConfig`; validated by :meth:`fit_task`
            and :meth:`load`, never modified: :meth:`set_params` replaces it); default: ``proteus`` on
            MobileNetV2.
        progress: show progress bars.

    Fitted attributes (created by the first :meth:`fit_task` or by :meth:`load`): ``parts_`` (the
    :class:`~proteus.core.parts.ProteusParts`) and its parts by name, ``backbone_``, ``model_`` (the backbone
    with every task's adapter), ``embedder_``, ``trainer_``, ``keys_`` (the retrieval keys), ``heads_``
    (``head_``: the LDA head over every class), ``device_``, ``eval_transform_``; ``records_`` (one
    :class:`~proteus.engine.records.TaskRecord` per learned task).
    """

    #: the configuration's sections that hold PROTEUS's options (:meth:`get_params`); its KB's rules' role
    option_sections, kb_layout = OPTION_SECTIONS, KB_LAYOUT

    # fitted attributes that _build sets from parts_ (each part by its name and "_"), typed
    device_: torch.device
    backbone_: Backbone
    model_: AdaptedBackbone
    eval_transform_: Callable[[Any], torch.Tensor]
    embedder_: Embedder
    heads_: ClassHeads
    keys_: RetrievalKeys

    def __init__(self, config: RunConfig | None = None, *, progress: bool = True) -> None:
        self.config = config if config is not None else RunConfig()
        self.progress = progress

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Check PROTEUS's options (:func:`proteus.config.validate` gathers this)."""
        check_options(cfg)

    # ------------------------------------------------------------------ scikit-learn parameters
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """``config`` and ``progress``; with ``deep`` also PROTEUS's own options, dotted (``"train.epochs"``;
        the run's settings such as the benchmark or the report are not the estimator's parameters)."""
        out: dict[str, Any] = {"config": self.config, "progress": self.progress}
        own = {s: dataclasses.asdict(getattr(self.config, s)) for s in self.option_sections}
        return {**out, **flatten(own)} if deep else out

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
            if hasattr(self, "parts_"):
                self.parts_.configure(cfg)
        return self

    @classmethod
    def from_method(
        cls, method: str = "proteus", backbone: str | None = None, *, benchmark: str | None = None,
        progress: bool = True, **overrides: Any,
    ) -> Proteus:  # fmt: skip
        """A learner for a registered method; ``overrides`` are dotted config keys (``"train.epochs": 5``).
        ``benchmark`` (``"quickstart"``, ``"cifar100"``, ...) applies the benchmark's packaged config first,
        as ``proteus run --benchmark`` does (defaults < benchmark < method < ``overrides``); without it the
        config is the method's on the paper's defaults (224 px, the whole backbone adapted)."""
        sets = {"backbone.name": backbone} if backbone else {}
        return cls(resolve_config(benchmark, method=method, dotted={**sets, **overrides}), progress=progress)

    def _build(self) -> None:
        if hasattr(self, "parts_"):
            return
        validate(self.config)
        self.parts_ = ProteusParts.build(self.config, self.progress)
        for f in dataclasses.fields(self.parts_):  # each part is also a fitted attribute (``model_`` ...)
            if f.name != "config":
                setattr(self, f"{f.name}_", getattr(self.parts_, f.name))
        self.records_ = TaskRecords()

    # ------------------------------------------------------------------ what it holds
    @property
    def head_(self) -> RanPACHead | None:
        """The RanPAC head over every class (Eq. 23), None before the first task."""
        if not hasattr(self, "heads_"):
            raise AttributeError("head_: not fitted yet (fit_task or Proteus.load)")
        return self.heads_.head

    @property
    def supports(self) -> frozenset[str]:
        """:data:`proteus.learners.CAPABILITIES`: every Proteus loads and has the run's analyses; with task
        retrieval it also rejects, forgets and calibrates."""
        retrieves = COMPOSITIONS.get(self.config.retrieval.mode).retrieves
        return frozenset({"load", "analysis", "retrieval"} if retrieves else {"load", "analysis"})

    @property
    def train_log_(self) -> list[dict[str, Any]]:
        """The adapter training's curve of the task learned last (the trainer's), one row per step."""
        trainer = getattr(self, "trainer_", None)
        return list(trainer.train_log_) if trainer is not None else []

    @property
    def num_tasks(self) -> int:
        return len(getattr(self, "records_", ()))

    @property
    def classes_(self) -> list[str]:
        """The learned classes' names, indexed by global label (``pred.label``): ``clf.classes_[label]``."""
        self._check_fitted()
        return self.records_.class_names()

    # ------------------------------------------------------------------ Algorithm 1
    def fit_task(self, task: Task) -> TaskStats:
        """Learn one task (Algorithm 1, lines 5-12); transactional. Returns what it measured."""
        self._build()
        k = self.num_tasks
        if task.index != k:
            raise TaskError(f"task {task.index + 1}: the learner holds {k} tasks, so task {k + 1} comes next")
        if len(task.train) == 0:
            raise TaskError(f"task {task.index + 1}: the training set is empty")
        dup = sorted({c for cs in self.records_.classes() for c in cs} & set(task.classes))
        if dup:
            names = [task.class_names[task.classes.index(c)] for c in dup]
            raise TaskError(f"task {k + 1}: classes {names} already belong to an earlier task")
        self.records_.append(self.parts_.learn(task, k, self.records_))
        return self.records_[-1].stats

    # ------------------------------------------------------------------ Algorithm 2, in public steps
    def transform_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """PIL images -> a batch under the backbone's evaluation transform."""
        self._build()
        return torch.stack([self.eval_transform_(im) for im in images])

    def prefix_dataset(self, ds: Any, desc: str = "prefix") -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen-prefix outputs and labels of a (PIL image, label) dataset (cacheable for all tasks)."""
        self._build()
        z, y = self.embedder_.prefix_dataset(ds, desc)  # without taps: the outputs and the labels
        return z, y

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
        z = self.embedder_.prefix(x)
        H = self.embed_prefix(z, list(range(min(self._m(num_tasks), self.parts_.num_adapters))), shard=False)
        return H, self.embed_prefix(z, None, shard=False)[0] if self.parts_.needs_frozen else None

    def retrieve(self, H: torch.Tensor, F: torch.Tensor | None = None) -> RetrievalResult:
        """Task retrieval (Sec. 3.1) among the first ``H.shape[0]`` tasks."""
        return self.keys_.retrieve(H, F, self.records_.classes())

    def classify(self, h: torch.Tensor, tasks: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 23: the head's scores (N, C) for embeddings (N, d) under the adapters of ``tasks`` (N,);
        with ``head.scope=task`` each row is scored by its task's own head (-inf outside its classes,
        ``tasks`` needed). Classes of forgotten tasks score -inf."""
        self._check_fitted()
        r = self.records_
        return self.heads_.logits(h, tasks, r.num_classes, r.forgotten_classes())

    def predict_embedded(self, H: torch.Tensor, F: torch.Tensor | None = None) -> Prediction:
        """Retrieve, take each input's embedding under its retrieved (or candidate) adapters, classify."""
        rows = torch.arange(H.shape[1])
        under = lambda cand: H[cand, rows[:, None]]  # noqa: E731 - each input under its candidate tasks
        return self.parts_.decide(self.retrieve(H, F), under, self.classify, self.records_)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, num_tasks: int | None = None) -> Prediction:
        """Algorithm 2 on a batch of transformed images (:meth:`transform_images`); ``num_tasks = m``
        retrieves among the first m tasks only (App. "Complexity of PROTEUS Inference"). Keys in one space
        or a shortlist take 2 (c + 1) forwards per input instead of m: :meth:`predict_embedded` on
        :meth:`embed`'s result, to float round-off."""
        self._check_fitted()
        if self.parts_.retrieves and self.keys_.uses_taps:  # the detector reads the prefix's channel stats
            z, taps = self.embedder_.prefix_taps(x)
            return self.parts_.predict_prefix(z, self._m(num_tasks), self.records_, taps)
        return self.parts_.predict_prefix(self.embedder_.prefix(x), self._m(num_tasks), self.records_)

    def forget_task(self, k: int) -> None:
        """Remove task k (0-based) from what can be predicted (``kb forget``): :meth:`ProteusParts.forget`."""
        self._check_fitted()
        self.parts_.forget(k, self.records_)

    def predict_test(self, cache: TestCache, tau: int, k: int) -> TestOutcome:
        """Test set tau after task k from the evaluation's caches: the prediction, the retrieved tasks and
        the oracle labels (each input under its true task's adapter and head), or the head's labels alone."""
        if self.parts_.retrieves:
            H = torch.stack([cache.embedding(tau, "task", j) for j in range(self.parts_.num_adapters)])
            F = cache.embedding(tau, "task", None) if self.parts_.needs_frozen else None
            pred = self.predict_embedded(H, F)
            own = torch.full_like(cache.labels(tau), tau)
            oracle = self.classify(cache.embedding(tau, "task", tau), own).argmax(1)
            return TestOutcome(pred.label, pred.task, oracle)
        tasks, kind = self.parts_.head_tasks(k)
        h = cache.embedding(tau, kind, None if tasks is None else tasks[0])
        return TestOutcome(self.classify(h).argmax(1))

    # ------------------------------------------------------------------ state (the knowledge base's share)
    def state(self) -> LearnerState:
        """Everything learned (:mod:`proteus.core.codec`); :meth:`from_state` is the inverse."""
        return learner_state(self.parts_, self.records_) if hasattr(self, "parts_") else LearnerState()

    @classmethod
    def from_state(cls, config: RunConfig, state: LearnerState, *, progress: bool = False) -> Proteus:
        """The learner that :meth:`state` described (validated like :meth:`fit_task`)."""
        return cls(config, progress=progress).restore(state)

    def restore(self, state: LearnerState) -> Proteus:
        """Load a :meth:`state` into this learner, which holds no task yet."""
        self._build()
        restore(self.parts_, self.records_, state)
        return self

    def adopt(self, kb: KnowledgeBase) -> None:
        """After a commit to ``kb`` (or a load from it): each task committed since last time holds its share
        of the keys and heads as the tensors of its object, memory-mapped (the same values), so that a
        learner that keeps learning does not keep every task's detector and expert in its own memory. A
        task whose record equals the one its tensors were read from, in the same folder (another opening of
        the knowledge base: :meth:`save`, or a commit after :meth:`load` through a new opening), keeps them
        where they are: the same object, not read again for every task at every save."""
        if not hasattr(self, "parts_"):
            return
        root = kb.root.resolve()
        same_folder = getattr(self, "_adopted_root", None) == root
        for k, rec in enumerate(self.records_):
            record = rec.stored
            if record is None or rec.adopted is record or kb.manifest["tasks"][k] is not record:
                continue
            if not (same_folder and rec.adopted == record):
                self.parts_.adopt(k, kb.read_task(record))
            rec.adopted = record
        self._adopted_root = root

    def kb_header(self) -> dict[str, Any]:
        """What a new knowledge base records about this learner (version, backbone identity, config)."""
        self._build()
        return learner_header(self.config, self.backbone_.identity())

    def save(self, kb_dir: str | Path) -> None:
        """Write the learner to a knowledge base directory: a new one, or the next state of the one there.
        The opening of its last save or load is used again while the folder's manifest is the state it read
        or wrote (:meth:`KnowledgeBase.is_current`: a save after each task then costs the commit, not a new
        opening of every task's record); another process's commit since makes it open the folder anew."""
        kb = self.__dict__.get("_kb")
        if kb is None or kb.root.resolve() != Path(kb_dir).resolve() or not kb.is_current():
            kb = (
                KnowledgeBase.open(kb_dir)
                if KnowledgeBase.exists(kb_dir)
                else KnowledgeBase.new(kb_dir, self.kb_header())
            )
        kb.check_backbone(self.kb_header()["backbone"])
        state = self.state()
        kb.commit_state(state.tasks, state.head)
        self.adopt(kb)
        self._kb = kb

    def __getstate__(self) -> dict[str, Any]:
        """The learner's attributes for a copy or a pickle, without the opening of its knowledge base (its
        files, mapped: this process's; a copy opens the folder itself when it saves)."""
        state = dict(self.__dict__)
        state.pop("_kb", None)
        return state

    @classmethod
    def load(cls, kb_dir: str | Path, **kw: Any) -> Proteus:
        """The learner held by a knowledge base directory (every checksum verified); keywords ``device``,
        ``precision`` (for this process) and ``progress``."""
        kb = KnowledgeBase.open(kb_dir)
        clf = cast(Proteus, load_from_kb(kb, "Proteus.load", expect=cls, **kw))
        clf._adopted_root = kb.root.resolve()  # its tasks' tensors are this folder's objects (:meth:`adopt`)
        clf._kb = kb  # (:meth:`save` commits through it while the folder is unchanged)
        return clf

    def _m(self, num_tasks: int | None) -> int:
        return self.num_tasks if num_tasks is None else max(1, min(int(num_tasks), self.num_tasks))

    def _check_fitted(self) -> None:
        if getattr(self, "head_", None) is None:
            raise NotFittedError("this Proteus has learned no task yet: call fit_task or Proteus.load first")

    def __repr__(self) -> str:
        c = self.config
        return f"Proteus(method={c.method!r}, backbone={c.backbone.name!r}, tasks={self.num_tasks})"
