"""The retrieval-key protocol (Sec. 3.1): what a key strategy is given when a task ends
(:class:`KeyFit`), what it must do (:class:`RetrievalKeys`), and how it predicts (its *route*):

* ``all-adapters`` -- Algorithm 2: every input under every task's adapter (m forwards per input), the
  keys read each task's own embedding (the paper's Eq. 18).
* ``one-space`` -- keys that read one embedding per input for every task (:attr:`RetrievalKeys.space`,
  :mod:`proteus.engine.keys.space`): one forward there, retrieval, then one forward under each input's
  retrieved (or candidate) adapter -- two forwards per input whatever m is, one when the retrieved
  adapter is the space's own. The same tasks, scores and labels as the m-forward path, to float round-off.
* ``candidates`` -- per-adapter keys with a shortlist (:class:`~proteus.engine.keys.GaussianKeys`).

:meth:`RetrievalKeys.predict` returns the retrieval and a function that embeds the inputs under candidate
tasks' adapters (the retrieved one for Alg. 2; the few most likely ones for ``retrieval.combine=soft``,
:mod:`proteus.engine.experts`). :mod:`proteus.engine.keys` has the strategies and their registry.

A strategy's share of the knowledge base: per task (in the task's object and record) and global (in the
head's object under :data:`GLOBAL_PREFIX`, its meta at the head meta's ``task_head``); each strategy
declares what it stores there (:data:`proteus.tensor_rules.TENSOR_RULES`, role ``"proteus"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from proteus.config import ConfigError, RunConfig, SignatureConfig
from proteus.engine.embedder import Embedder
from proteus.engine.keys.space import FIRST_ADAPTER, SPACES, KeySpace
from proteus.engine.novelty import NOVELTY
from proteus.heads import RanPACHead
from proteus.registry import Registry
from proteus.signatures import RetrievalResult, Signature
from proteus.signatures import options as signature_options
from proteus.tensor_rules import TENSOR_RULES, F, Fields, NeedsRecord

__all__ = [
    "GLOBAL_PREFIX",
    "GLOBAL_RECORD",
    "KEYS",
    "KeyFit",
    "KeyKind",
    "NewHead",
    "NoKeys",
    "RetrievalKeys",
    "Under",
]

#: the global keys' tensors ride in the head's object under this prefix, their meta at this key of the
#: head's meta (:mod:`proteus.core.codec` puts them there)
GLOBAL_PREFIX, GLOBAL_RECORD = "task_head/", "task_head"
TENSOR_RULES.declare(
    "proteus", "RetrievalKeys",
    Fields({"signature": F("map|null"), "frozen_signature": F("map|null")}),  # task_state(): None, or a key's
    Fields({GLOBAL_RECORD: F("map|null")}, on="head"),
    NeedsRecord(GLOBAL_PREFIX, GLOBAL_RECORD, on="head"),  # without its meta the keys stay unfitted
)  # fmt: skip

K = TypeVar("K", bound="RetrievalKeys")

#: builds an empty ridge head (``rp_dim=0``: no random projection) for keys that are LDA heads
NewHead = Callable[..., RanPACHead]

#: the inputs' embeddings (N, K, d) under the adapters of candidate tasks (N, K)
Under = Callable[[Tensor], Tensor]


@dataclass
class KeyFit:
    """What a key strategy gets when task k ends: the task's training inputs as cached prefix outputs
    ``z`` with labels ``y``, and the embedder that embeds them (:meth:`embed`)."""

    k: int
    z: Tensor
    y: Tensor
    num_classes: int
    seed: int
    num_adapters: int
    embedder: Embedder
    #: the inputs' tap statistics (``Embedder.prefix_taps``) and each tap block's width, where the
    #: detector of inputs from no learned task reads them (:attr:`RetrievalKeys.wants_taps`)
    taps: Tensor | None = None
    tap_sizes: list[int] | None = None
    #: every task's classes, task k's last (None: not known to the caller)
    classes: list[list[int]] | None = None

    def embed(self, tasks: list[int] | None) -> Tensor:
        """(G, N, d): ``z`` under the compositions of ``tasks`` (None: the frozen backbone, G = 1)."""
        return self.embedder.embed_prefix(self.z, tasks)


class RetrievalKeys:
    """Base class: the per-task signatures or key heads, their scores, their prediction route and their
    knowledge-base share.

    :attr:`space` is the one :class:`~proteus.engine.keys.space.KeySpace` every task's key reads, or None
    when each task's key reads the input under that task's own adapter (``H``)."""

    #: the one space of every task's key (None: each task's own adapter)
    space: KeySpace | None = None
    #: the keys keep class statistics in their space (LDA keys): the class-Gaussian detector of inputs
    #: from no learned task can use them (``retrieval.novelty``, :mod:`proteus.engine.novelty`)
    class_statistics: bool = False

    def __init__(
        self,
        cfg: SignatureConfig,
        top_k: int,
        device: torch.device,
        new_head: Callable[..., RanPACHead],
        candidates: int | None = None,
        candidate_space: KeySpace = FIRST_ADAPTER,
        keep_inputs: bool = False,
    ):
        self.cfg, self.top_k, self.device, self.new_head = cfg, top_k, device, new_head
        self.candidates, self.candidate_space = candidates, candidate_space
        #: keep what :meth:`forget` needs (``head.forgettable``)
        self.keep_inputs = keep_inputs
        #: tasks removed by :meth:`forget`: never retrieved
        self.forgotten: set[int] = set()
        self._generation = 0

    @property
    def generation(self) -> int:
        """Bumped whenever a learned task's stored share changes after its task (:meth:`forget`, a new
        calibration), so that a knowledge base writes every task again
        (:class:`proteus.learners.TaskParts`)."""
        novelty = getattr(self, "novelty", None)
        return self._generation + (novelty.generation if novelty is not None else 0)

    @classmethod
    def from_config(
        cls: type[K],
        cfg: RunConfig,
        device: torch.device,
        new_head: Callable[..., RanPACHead],
        **options: Any,
    ) -> K:
        """The keys a configuration asks for (``signature.*``, ``retrieval.*``, ``head.forgettable``)."""
        rc = cfg.retrieval
        if NOVELTY.get(rc.novelty).needs_class_statistics and not cls.class_statistics:
            raise ConfigError(
                f"retrieval.novelty={rc.novelty} needs LDA keys (signature.keys={cfg.signature.keys} keeps "
                "no class statistics); use retrieval.novelty=auto, or retrieval.reject=true to threshold "
                "these keys' own scores"
            )
        return cls(
            cfg.signature, rc.top_k, device, new_head, rc.candidates, SPACES.get(rc.candidate_space),
            keep_inputs=cfg.head.forgettable, **options,
        )  # fmt: skip

    @property
    def needs_frozen(self) -> bool:
        """:meth:`retrieve` reads the frozen backbone's features F."""
        return self.space is not None and self.space.needs_frozen

    @property
    def route(self) -> str:
        """How :meth:`predict` embeds: ``one-space``, ``candidates`` or ``all-adapters`` (module doc)."""
        return "all-adapters" if self.space is None else "one-space"

    #: the detector of inputs from no learned task reads the inputs' tap statistics: learning passes
    #: them (:class:`KeyFit`) ...
    wants_taps: bool = False

    @property
    def uses_taps(self) -> bool:
        """... and prediction needs them (:meth:`predict`'s ``taps``)."""
        return False

    def predict(
        self, embedder: Embedder, z: Tensor, m: int, classes: list[list[int]], taps: Tensor | None = None
    ) -> tuple[RetrievalResult, Under]:
        """Retrieval among the first m tasks for prefix outputs ``z``, along :attr:`route`; ``taps`` the
        inputs' tap statistics where :attr:`uses_taps`."""
        if self.space is not None:
            return self._predict_one_space(self.space, embedder, z, m, classes, taps)
        H = embedder.embed_prefix(z, list(range(m)), shard=False)
        F = embedder.embed_prefix(z, None, shard=False)[0] if self.needs_frozen else None
        rows = torch.arange(H.shape[1])
        return self.retrieve(H, F, classes), lambda cand: H[cand, rows[:, None]]

    def _predict_one_space(
        self, space: KeySpace, embedder: Embedder, z: Tensor, m: int, classes: list[list[int]],
        taps: Tensor | None = None,
    ) -> tuple[RetrievalResult, Under]:  # fmt: skip
        X = space.embed(embedder, z, shard=False)
        res = self.retrieve_space(X, m, classes)
        scores = res.task_scores if m == len(classes) else None
        res.novelty = self.novelty_of(X, classes, taps, scores)  # answering a user: from a learned task?

        def under(cand: Tensor) -> Tensor:
            N, K = cand.shape
            rows = torch.arange(N).repeat_interleave(K)
            known = space.known(X[rows])
            return embedder.embed_under(z[rows.to(z.device)], cand.flatten(), known).view(N, K, -1)

        return res, under

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        """Retrieval among the first m tasks from the inputs' embeddings X (N, d) in :attr:`space`."""
        raise ValueError(f"{type(self).__name__} keys do not live in one space")

    @property
    def adapter_signatures(self) -> list[Signature | None]:
        """The signatures under each task's own adapter (the theory of Sec. 3.2 is about them)."""
        return []

    def add_task(self, fit: KeyFit) -> dict[str, int] | None:
        raise NotImplementedError

    def truncate(self, m: int) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """The task added last is learned for good: drop what only rolling it back needed (:meth:`truncate`
        is not called again for it)."""

    def forget(self, k: int, classes: list[int]) -> None:
        """Remove task k's key (``proteus kb forget``): it is never retrieved again. Subclasses drop or
        subtract what they hold; :meth:`check_forget` says beforehand whether they can."""
        self.forgotten.add(k)
        self._generation += 1

    def check_forget(self, k: int) -> None:
        """Raise ValueError when :meth:`forget` cannot remove task k exactly."""

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        """H (m, N, d): embeddings under the first m tasks' adapters; F (N, d): frozen features (when
        :attr:`needs_frozen`); ``classes``: each of those tasks' classes."""
        if self.space is None:
            raise NotImplementedError
        return self.retrieve_space(self.space.select(H, F), H.shape[0], classes)

    @contextlib.contextmanager
    def without(self, embedder: Embedder, z: Tensor, y: Tensor) -> Iterator[None]:
        """Within the block the keys score inputs as if the training inputs ``z`` (prefix outputs) with
        labels y had not been part of their fit, where the keys can subtract them exactly (LDA keys:
        :meth:`LDAKeys.without`); these keys cannot, and score as they are."""
        yield

    # the class-Gaussian detector of inputs from no learned task (LDA keys only: proteus.engine.novelty)
    def novelty_of(
        self, X: Tensor, classes: list[list[int]], taps: Tensor | None = None, scores: Tensor | None = None
    ) -> Tensor | None:
        """The novelty of inputs X (N, d) in :attr:`space` (> 0: from no learned task), ``taps`` their tap
        statistics, ``scores`` their task scores where known; None for keys without a detector. Computed on
        :meth:`predict`'s route only, not in evaluation."""
        return None

    def novelty_thresholds(self, classes: list[list[int]]) -> list[float]:
        """Each task's class-Gaussian threshold; [] for keys without one."""
        return []

    def calibrate(
        self, X: Tensor, labels: Tensor, classes: list[list[int]], tpr: float | None,
        taps: Tensor | None = None,
    ) -> list[float]:  # fmt: skip
        """New class-Gaussian calibration rows from held-out inputs (LDA keys: :meth:`LDAKeys.calibrate`)."""
        raise ConfigError(
            f"{type(self).__name__} keep no class statistics to calibrate on (they are not LDA keys); learn "
            "with --set retrieval.reject=true to threshold their own scores"
        )

    # knowledge base: per task (stored in the task's object) and global (stored in the head's object)
    def task_state(
        self, k: int, classes: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Task k's share of the knowledge base (its record's fields, its tensors); ``classes``: the task's
        classes, in its record's order (keys with one column per class keep the task's columns)."""
        return {"signature": None, "frozen_signature": None}, {}

    def load_task(self, meta: dict[str, Any], tensors: Mapping[str, Tensor]) -> None:
        if meta.get("forgotten"):
            self.forgotten.add(int(meta["index"]))

    def adopt(self, k: int, tensors: Mapping[str, Tensor]) -> None:
        """Hold task k's share as ``tensors``, the same values read from its committed object (a knowledge
        base's mapping: the page cache instead of this process's memory); keys without such a share keep
        theirs."""

    def global_state(
        self, classes: list[list[int]] | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        """The keys' share of the head's object (meta, tensors); ``classes``: every task's."""
        return None, {}

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        pass


class NoKeys(RetrievalKeys):
    """A method without retrieval (``retrieval.mode`` other than ``signature``)."""

    def add_task(self, fit: KeyFit) -> None:
        return None

    def truncate(self, m: int) -> None:
        pass

    def retrieve(self, H: Tensor, F: Tensor | None, classes: list[list[int]]) -> RetrievalResult:
        raise ValueError("this method does not retrieve tasks (retrieval.mode is not 'signature')")


@dataclass(frozen=True)
class KeyKind:
    """A registered key strategy (``signature.keys``): its class and fixed options; ``one_space`` when
    every task's key reads one embedding of an input (the one-space prediction route, and
    ``retrieval.combine=soft``, which needs it)."""

    cls: type[RetrievalKeys]
    one_space: bool
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, cfg: RunConfig, device: torch.device, new_head: NewHead) -> RetrievalKeys:
        return self.cls.from_config(cfg, device, new_head, **self.options)


#: ``signature.keys``: every key strategy, registered by its module (:mod:`.gaussian`, :mod:`.lda`)
KEYS: Registry[KeyKind] = signature_options.KEYS
