"""HiDe-Prompt's parametric task retrieval as PROTEUS retrieval keys (``signature.keys=hide-tii``): the
"RanPAC (w/ Retrieval)" row of the paper's Appendix table ``retrieve_significant`` (RanPAC with HiDe's
parametric retrieval of the LoRA unit of each input).

The keys are HiDe-Prompt's stage 1 (:class:`proteus.engine.task_identity.TaskIdentityInference`, the
released code's task-identity inference, which the ``hide-prompt`` learner runs too) on the frozen
backbone's features: an MLP with one linear head block per task, trained on each task's features with the
cross-entropy over its own classes, then re-aligned on pseudo-features drawn from the multi-centroid
statistics of every class seen so far. The task of an input is the task owning the class the TII predicts;
its adapter then embeds the input for the head (Alg. 2's second half). Unlike PROTEUS's signatures these
keys are trained parameters: a later task's training and alignment move what earlier tasks retrieve by
(the forgetting the paper's table shows).

Settings: ``baseline.tii_epochs``, ``tii_lr``, ``n_centroids``, ``ca_epochs``, ``tii_ca_lr``, ``clip_grad``
(:class:`~proteus.engine.task_identity.TIIOptions`), ``train.batch_size``, ``seed``. Stored in the knowledge
base with the head's object (``task_head/tii.*``, ``task_head/tii_stats.*``); only the task learned last can
be rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from proteus.config import RunConfig
from proteus.engine.errors import TaskError
from proteus.engine.keys import FROZEN, KEYS, KeyFit, KeyKind, KeySpace, RetrievalKeys
from proteus.signatures import RetrievalResult

if TYPE_CHECKING:
    from proteus.engine.task_identity import TaskIdentityInference

__all__ = ["TIIKeys"]


class TIIKeys(RetrievalKeys):
    """HiDe-Prompt's task-identity inference on the frozen features (see the module docstring)."""

    space: KeySpace  # always the frozen space (set in __init__)

    def __init__(self, *args: Any, run_config: RunConfig, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.space = FROZEN
        self.run_config = run_config
        self.tii: TaskIdentityInference | None = None
        #: each task's classes (global labels), in task order
        self.task_classes: list[list[int]] = []
        self._before: tuple[dict[str, Tensor], set[int]] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, device: torch.device, new_head: Any, **options: Any) -> TIIKeys:
        return super().from_config(cfg, device, new_head, run_config=cfg, **options)

    def _new_tii(self, d: int) -> TaskIdentityInference:
        # imported here: only this key kind needs it (and scikit-learn's K-Means)
        from proteus.config.coercion import typed_options
        from proteus.engine.task_identity import TaskIdentityInference, TIIOptions

        options = typed_options(TIIOptions, self.run_config.baseline, "baseline")
        return TaskIdentityInference(self.run_config, options, d, self.device)

    def _batches(self, X: Tensor, y: Tensor) -> Any:
        size = int(self.run_config.train.batch_size)

        def epoch(g: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
            order = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), size):
                idx = order[i : i + size]
                yield X[idx], y[idx]

        return epoch

    def add_task(self, fit: KeyFit) -> None:
        X = self.space.embed(fit.embedder, fit.z).float().cpu()
        y = fit.y.long().cpu()
        classes = sorted(int(c) for c in torch.unique(y).tolist())
        if self.tii is None:
            self.tii = self._new_tii(X.shape[1])
        k = len(self.task_classes)
        self._before = (self.tii.snapshot(), set(self.tii.stats))
        seen = [c for cs in self.task_classes for c in cs]
        try:
            self.tii.fit(k, classes, self._batches(X, y))
            self.tii.store(k, X, y)
            if k > 0:
                self.tii.align(k, [*seen, *classes], steps=len(seen))
        except (ValueError, RuntimeError) as e:
            self.tii.restore(k, self._before[0], self._before[1])
            raise TaskError(f"task {fit.k + 1}: HiDe task-identity inference failed: {e}") from None
        self.task_classes.append(classes)
        return None

    def truncate(self, m: int) -> None:
        n = len(self.task_classes)
        if m >= n:
            return
        if m != n - 1 or self._before is None or self.tii is None:
            raise ValueError("HiDe task-identity keys can only drop the task learned last")
        self.tii.restore(m, self._before[0], self._before[1])
        self.task_classes.pop()
        self._before = None

    def check_forget(self, k: int) -> None:
        raise ValueError("HiDe task-identity keys are trained parameters: a task cannot be removed exactly")

    def retrieve_space(self, X: Tensor, m: int, classes: list[list[int]]) -> RetrievalResult:
        if self.tii is None or not self.task_classes:
            raise ValueError("HiDe task-identity keys need at least one learned task")
        net = self.tii.net
        with torch.no_grad(), torch.autocast(X.device.type, enabled=False):
            logits = net(X.to(self.device).float(), slice(0, m)).float().cpu()
        sizes = [h.out_features for h in net.heads[:m]]
        owner = torch.repeat_interleave(torch.arange(m), torch.as_tensor(sizes))
        # a task's score: minus its best class logit (lower is better); the predicted class's task wins
        scores = torch.full((logits.shape[0], m), float("inf"))
        for j in range(m):
            if j not in self.forgotten:
                scores[:, j] = -logits[:, owner == j].max(1).values
        task = scores.argmin(1)
        rows = torch.arange(len(task))
        return RetrievalResult(
            task=task, component=torch.zeros_like(task), score=scores[rows, task], task_scores=scores
        )

    # knowledge base: the whole TII rides in the head's object (task_head/)
    def global_state(
        self, classes: list[list[int]] | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
        if self.tii is None:
            return None, {}
        meta = {
            "kind": "hide-tii",
            "tii_dim": int(self.tii.net.fc1.in_features),  # not "embed_dim": no RanPAC head meta
            "task_classes": self.task_classes,
            "stats_classes": sorted(int(c) for c in self.tii.stats),
        }
        return meta, self.tii.state_tensors()

    def load_global(self, meta: dict[str, Any] | None, tensors: dict[str, Tensor]) -> None:
        if meta is None:
            return
        self.tii = self._new_tii(int(meta["tii_dim"]))
        self.task_classes = [[int(c) for c in cs] for cs in meta["task_classes"]]
        for cs in self.task_classes:
            self.tii.net.add_head(len(cs))
        net_state = {k[len("tii.") :]: v for k, v in tensors.items() if k.startswith("tii.")}
        self.tii.net.load_state_dict({k: v.to(self.device) for k, v in net_state.items()})
        for c in meta["stats_classes"]:
            self.tii.stats[int(c)] = (tensors[f"tii_stats.{c}.mean"], tensors[f"tii_stats.{c}.var"])
        self._before = None


KEYS.register("hide-tii", help="HiDe-Prompt's task-identity inference on frozen features (RanPAC + HiDe)")(
    KeyKind(TIIKeys, True)
)
