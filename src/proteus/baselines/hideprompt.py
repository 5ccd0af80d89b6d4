"""HiDe-Prompt: Hierarchical Decomposition of prompt-based continual learning (Wang et al., NeurIPS 2023).

The method as the authors' released code runs it (thu-ml/HiDe-Prompt @ 0ed4333: ``trainers/tii_trainer.py``
with ``engines/hide_tii_engine.py`` for stage 1, ``trainers/hideprompt_trainer.py`` with
``engines/hide_promtp_wtp_and_tap_engine.py`` for stage 2, ``peft/prompt/hide_prompt.py``,
``vits/hide_prompt_vision_transformer.py``, ``configs/{cifar100,imr}_hideprompt_5e.py`` and
``training_scripts/train_{cifar100,imr}_vit.sh``), rebuilt on the shared baseline learner. Per task t:

* **stage 1, task-identity inference (TII**, :class:`~proteus.engine.task_identity.TaskIdentityInference`,
  shared with ``ranpac-hide``'s keys): an MLP on the frozen
  ViT's prompt-free class token (``MlpMapping`` with hidden ``[2]``: ``LN(x + W2 GELU(W1 x))``, W1 d ->
  2d) and a linear head over every seen class, trained ``baseline.tii_epochs`` with Adam at
  ``baseline.tii_lr`` (constant), the cross-entropy over task t's classes (the other classes' logits
  masked), gradient norm clipped at ``clip_grad``. Then
  the class statistics of task t's classes are stored -- per class, K-Means with ``baseline.n_centroids``
  centroids on the class tokens of its un-augmented training images, each centroid's mean and per-dimension
  variance (the release's ``multi-centroid`` storage) -- and, from task 2 on, the MLP and head are
  re-aligned on pseudo-features of every seen class (:func:`align_on_pseudo_features`);
* **stage 2, within-task and task-adaptive prediction**: one e-prompt per task, prefix tuning (L key and L
  value tokens) in ``baseline.prompt_layers`` (blocks 0-4). Task t's prompt P_t starts as a copy of task
  t-1's (the release's ``shared_prompt_pool``; task 1's from U(-1, 1)) and trains as
  ``(1 - m) P_t + m mean(P_0 .. P_t-1)`` (the old prompts detached, m = ``baseline.prompt_momentum``),
  which becomes P_t when the task ends (:func:`momentum_prompt`). Every training input uses task t's
  prompt; the head reads the class token. Loss: the cross-entropy over task t's classes plus
  ``baseline.ortho_weight`` (the release's ``reg``) times the contrastive :func:`orth_loss` of the
  instructed features against every stored centroid (temperature 0.8). Adam; the prompt at
  ``baseline.lr``, the head at 0.1 ``baseline.lr`` (``larger_prompt_lr``). When the task ends, the
  statistics of the instructed features (task t's prompt) of task t's classes are stored, and from task 2
  on every seen task's head is aligned on pseudo-features of all seen classes (``baseline.ca_lr``);
* **test**: the TII predicts a class among the seen ones; the task owning it picks the prompt; the final
  heads predict over every seen class. The TII's task is reported as ``retrieval_acc``.

Deliberate differences from the release (docs/experiments.md, "HiDe-Prompt"): per-sample (key, value)
prefixes where the release's ``(layers, 2, B) -> (layers, B, 2)`` reshape mixes the batch with the
key/value halves; one process with the release's global batch in place of 8 processes (the contrastive
loss is still taken per group of :attr:`HiDePrompt.contrast_group` features, as each process did); K-Means
with a fixed seed and at most as many centroids as a class has images; the heads scored are the seen
classes' only.

This module is the whole method -- its learner, its schedules and its declaration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.learner import SCHEDULES
from proteus.baselines.prompts import PromptClassifier, PromptOptions
from proteus.config import declare
from proteus.engine.embedder import ImageDataset
from proteus.engine.runtime import task_seed
from proteus.engine.task_identity import (
    ClassStats,
    TaskIdentityInference,
    TIIHead,
    TIIOptions,
    align_on_pseudo_features,
    alignment_generator,
    class_statistics,
    load_class_stats,
    pseudo_features,
)
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS
from proteus.options import NON_NEGATIVE, POSITIVE, UNIT, option
from proteus.streams import Task

__all__ = [
    "ClassStats",
    "HiDePrompt",
    "TIIHead",
    "TaskIdentityInference",
    "align_on_pseudo_features",
    "class_statistics",
    "load_class_stats",
    "momentum_prompt",
    "orth_loss",
    "pseudo_features",
]

#: the release's contrastive temperature (``orth_loss``: ``M M^T / 0.8``)
TEMPERATURE = 0.8
#: timm's schedulers as the release builds them: ``StepLR`` decays by 0.1 every 30 epochs; ``CosineLR`` to
#: ``min_lr`` 1e-5
STEP_EPOCHS, STEP_RATE, COSINE_MIN_LR = 30, 0.1, 1e-5


# ------------------------------------------------------------------ the release's two timm schedules
# Its loop calls ``lr_scheduler.step(epoch)`` after epoch ``epoch``: epoch 0 runs at lr, epoch e >= 1 at the
# scheduler's value at e - 1.
@SCHEDULES.register(
    "hide-step", help="HiDe-Prompt: timm StepLR, x0.1 every 30 epochs, stepped after an epoch"
)
def _hide_step(lr: float, epoch: int, epochs: int) -> float:
    return lr * STEP_RATE ** (max(epoch - 1, 0) // STEP_EPOCHS)


@SCHEDULES.register(
    "hide-cosine", help="HiDe-Prompt: timm CosineLR to 1e-5 over the epochs, stepped after one"
)
def _hide_cosine(lr: float, epoch: int, epochs: int) -> float:
    t = max(epoch - 1, 0)
    return COSINE_MIN_LR + 0.5 * (lr - COSINE_MIN_LR) * (1 + math.cos(math.pi * t / max(epochs, 1)))


# ------------------------------------------------------------------ the method's pieces
def momentum_prompt(raw: torch.Tensor, old: list[torch.Tensor], m: float) -> torch.Tensor:
    """``(1 - m) raw + m mean(old)`` with the old prompts detached (``EPrompt.forward`` with
    ``prompt_momentum``); ``raw`` itself without old prompts or at m = 0."""
    if not old or m == 0:
        return raw
    return (1 - m) * raw + m * torch.stack([o.detach() for o in old]).mean(0).to(raw.dtype)


def orth_loss(
    features: torch.Tensor, means: torch.Tensor | None, temperature: float = TEMPERATURE
) -> torch.Tensor:
    """The release's contrastive ``orth_loss`` (before its ``reg`` weight): M = [stored centroids; features],
    the cross-entropy of ``M M^T / temperature`` with each row's own index as its target, averaged over every
    row of M. Without stored centroids (task 1) M is the features alone. Computed in the centroids' float64,
    as the release's concatenation promotes it."""
    f = features.double()
    M = f if means is None or len(means) == 0 else torch.cat([means.to(f.device, torch.float64), f])
    sim = M @ M.T / temperature
    return F.cross_entropy(sim, torch.arange(len(M), device=M.device))


@dataclasses.dataclass
class HiDeOptions(TIIOptions, PromptOptions):
    """HiDe-Prompt's options: task t's e-prompt trains as (1 - m) P_t + m mean(P_0..P_t-1) and keeps it (m =
    ``prompt_momentum``); stage 1's (:class:`~proteus.engine.task_identity.TIIOptions`: ``tii_epochs`` at
    ``tii_lr``); both stages re-align their heads on pseudo-features of ``n_centroids`` K-Means centroids
    per class for ``ca_epochs`` (SGD, cosine annealing) at ``tii_ca_lr`` / ``ca_lr``."""

    ortho_weight: float = option(
        0.0, help="the contrastive regulariser's weight (the release's reg: 0.1)", range=NON_NEGATIVE
    )
    prompt_momentum: float = option(
        0.01, help="m: the e-prompt's momentum over the earlier tasks' prompts", range=UNIT
    )
    ca_lr: float = option(5e-3, help="stage 2's alignment learning rate", range=POSITIVE)


# ------------------------------------------------------------------ the learner
@LEARNERS.register("hide-prompt", help="HiDe-Prompt: task-identity inference, then a prompt per task")
class HiDePrompt(PromptClassifier):
    """HiDe-Prompt: an MLP head on the frozen class token infers the task (stage 1, :attr:`tii_`, a
    :class:`TaskIdentityInference`), whose e-prompt (prefix) and the heads of every seen class classify
    (stage 2); both heads re-aligned on pseudo-features of stored statistics."""

    name = "hide-prompt"
    Options = HiDeOptions
    #: ``larger_prompt_lr``: the head at 0.1 times the prompt's learning rate
    head_lr_scale = 0.1
    #: pseudo-features drawn per centroid (and the batch) of stage 2's alignment, in ``train.batch_size``s
    #: (the release's per-process count; at the global batch of the configs the 8 processes' together;
    #: stage 1's: :attr:`TaskIdentityInference.ca_draws`)
    ca_draws: int = 5
    #: the release's contrastive loss is computed per process, over its 24 features: ours over groups of
    #: this many features of a batch, averaged (the whole batch when it is smaller)
    contrast_group: int = 24
    #: the open task, its un-augmented training pass (prefix outputs, labels) once computed, and the state a
    #: failed task restores
    _open: Task | None = None
    _plain: tuple[torch.Tensor, torch.Tensor] | None = None
    _backup: dict[str, Any] | None = None

    # ------------------------------------------------------------------ state
    def _make_state(self, d: int) -> None:
        self._gen = torch.Generator().manual_seed(self.config.seed)
        b = self.options_
        #: task t's e-prompt: (blocks, 2 = key / value, L, d)
        self._shape = (len(b.prompt_layers), 2, b.prompt_length, d)
        self.prompts_: list[nn.Parameter] = []
        #: stage 1, with its statistics of the prompt-free class tokens
        self.tii_ = TaskIdentityInference(self.config, self.options_, d, next(self.vit.parameters()).device)
        #: stage 2's class statistics (the instructed class tokens)
        self.stats_: ClassStats = {}

    def _params(self) -> dict[str, nn.Parameter]:
        return {str(t): p for t, p in enumerate(self.prompts_)}  # written as prompt.<t>

    def trainable(self) -> list[nn.Parameter]:
        return [self.prompts_[-1]]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update(self.tii_.state_tensors())
        for c, (mu, var) in self.stats_.items():
            out[f"stats.{c}.mean"], out[f"stats.{c}.var"] = mu.contiguous(), var.contiguous()
        return out

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Each learned task's e-prompt (frozen), stage 1 and both stages' class statistics."""
        for _ in range(self.num_tasks):
            self.prompts_.append(self._frozen(torch.zeros(self._shape)))
        super().load_state(meta, tensors)
        self.tii_.load_state(self.task_classes_, tensors)
        self.stats_ = load_class_stats(tensors, "stats", self.task_classes_)

    # ------------------------------------------------------------------ one task: stage 1, then stage 2
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        self._open, self._plain, self._backup = task, None, None
        try:
            return super().learn_task(task, k)
        finally:
            self._open, self._plain = None, None

    def prefix_dataset(
        self, ds: Any, desc: str = "prefix", transform: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the learner's; the open task's un-augmented training pass is kept for the task's statistics."""
        if (
            transform is None
            and self._plain is not None
            and self._open is not None
            and ds is self._open.train
        ):
            return self._plain
        z, y = super().prefix_dataset(ds, desc, transform)
        if transform is None and self._open is not None and ds is self._open.train:
            self._plain = (z, y)
        return z, y

    def _plain_pass(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The open task's training images once, un-augmented (the release's per-class loaders use the test
        transform), as prefix outputs on the device with their labels."""
        assert self._open is not None
        bs = self.config.eval.batch_size
        if self._plain is not None:
            z, y = self._plain
            for i in range(0, len(z), bs):
                yield z[i : i + bs].to(self.device_), y[i : i + bs]
            return
        loader = torch.utils.data.DataLoader(
            ImageDataset(self._open.train, self.eval_transform_), batch_size=bs
        )
        for x, y in loader:
            yield self.embedder_.prefix(x), y

    @torch.no_grad()
    def _plain_features(
        self, feature: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``feature`` of the open task's un-augmented training pass (float32, CPU) and the labels: what both
        stages' class statistics are taken of."""
        hs, ys = [], []
        for zb, yb in self._plain_pass():
            with self.embedder_.autocast():
                hs.append(feature(zb).float().cpu())
            ys.append(yb)
        return torch.cat(hs), torch.cat(ys)

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        assert self._open is not None
        self._backup = {
            "tii": self.tii_.snapshot(),
            "heads": [{n: t.clone() for n, t in h.state_dict().items()} for h in self.heads_],
        }
        classes = [int(c) for c in self._open.classes]
        # stage 1: the TII on the prompt-free class tokens, their statistics, the alignment from task 2 on
        y = self._plain[1] if z is not None and self._plain is not None else None
        self.tii_.fit(
            k, classes, lambda g: ((self.query(zb), yb) for zb, yb in self.batches(z, y, loader, g))
        )
        self.tii_.store(k, *self._plain_features(self.query))
        if k > 0:
            self.tii_.align(k, [*self.labels_, *classes], steps=len(self.labels_))
        # stage 2: the shared pool's copy of task t-1's prompt (task 1: U(-1, 1))
        fresh = torch.rand(*self._shape, generator=self._gen) * 2 - 1
        start = self.prompts_[-1].detach().cpu().clone() if self.prompts_ else fresh
        self.prompts_.append(self._to(start))
        self._old_means = self._centroids()

    def _centroids(self) -> torch.Tensor | None:
        """Every stored stage-2 centroid (the release's ``cls_mean``), (n, d) float64, or None."""
        if not self.stats_:
            return None
        return torch.cat([mu for mu, _ in self.stats_.values()]).to(self.device_)

    @torch.no_grad()
    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        m = self.options_.prompt_momentum
        P = self.prompts_[k]
        P.data.copy_(momentum_prompt(P.detach(), list(self.prompts_[:k]), m))
        P.requires_grad_(False)
        t = torch.tensor([k], device=self.device_)
        h, y = self._plain_features(lambda zb: self.prompted(zb, t.expand(len(zb))))
        self.stats_.update(class_statistics(h, y, self.options_.n_centroids, task_seed(self.config.seed, k)))
        if k > 0:
            with torch.enable_grad():
                self._align_heads(k)

    def _align_heads(self, k: int) -> list[float]:
        """Stage 2's alignment after task k (k >= 1): every seen task's head (not the prompts) on
        pseudo-features of every seen class, at ``ca_lr``."""
        b = self.options_
        params = list(self.heads_.parameters())
        for p in params:
            p.requires_grad_(True)
        try:
            return align_on_pseudo_features(
                lambda x: torch.cat([h(x) for h in self.heads_], 1), params, self.stats_, list(self.labels_),
                n=self.config.train.batch_size * self.ca_draws,
                steps=sum(len(c) for c in self.task_classes_[:k]), epochs=b.ca_epochs, lr=b.ca_lr,
                generator=alignment_generator(self.config.seed, k, 2), device=self.device_,
            )  # fmt: skip
        finally:
            for p in params:
                p.requires_grad_(False)

    def abort_task(self, k: int) -> None:
        del self.prompts_[k:]
        backup = getattr(self, "_backup", None)
        seen = {c for cs in self.task_classes_[:k] for c in cs}
        self.tii_.restore(k, None if backup is None else backup["tii"], seen)
        if backup is not None:
            for h, sd in zip(self.heads_, backup["heads"]):
                h.load_state_dict(sd)
        for c in [c for c in self.stats_ if c not in seen]:
            del self.stats_[c]

    # ------------------------------------------------------------------ forward
    def prompt_of(self, k: int) -> torch.Tensor:
        """Task k's prompt as its training uses it: while task k is open, :func:`momentum_prompt` of its raw
        prompt and the earlier ones; once closed, the stored prompt (already that)."""
        P = self.prompts_[k]
        if P.requires_grad:
            return momentum_prompt(P, list(self.prompts_[:k]), self.options_.prompt_momentum)
        return P

    def prompted(
        self, z: torch.Tensor, task: torch.Tensor | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, d) the class token after the final norm with each input's task e-prompt as prefixes (a given
        ``prompt`` for every input instead): block ``prompt_layers[j]`` attends to (P[j, 0], P[j, 1])."""
        B = z.shape[0]
        if prompt is None:
            assert task is not None
            P = torch.stack([self.prompts_[t] for t in range(len(self.prompts_))])[task]  # (B, n, 2, L, d)
        else:
            P = prompt[None].expand(B, *prompt.shape)
        prefixes = {layer: (P[:, j, 0], P[:, j, 1]) for j, layer in enumerate(self.options_.prompt_layers)}
        return self.run_blocks(self.tokens(z), prefixes)[:, 0]

    def select(self, q: torch.Tensor) -> torch.Tensor:
        """(B,) the task of each query: the task owning the TII's predicted class among the seen ones."""
        if not self.tii_.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        return self.tii_.predict_task(q)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """Training: every input under the open task's prompt, and the contrastive loss. Inference: under
        the prompt of the task its TII predicts."""
        if not train:
            return self.prompted(z, self.select(self.query(z)))
        k = len(self.prompts_) - 1
        h = self.prompted(z, None, prompt=self.prompt_of(k))
        reg = self.options_.ortho_weight
        if reg:
            groups = h.float().split(self.contrast_group)
            self.aux_loss = reg * torch.stack([orth_loss(g, self._old_means) for g in groups]).mean().float()
        return h

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C_seen) logits of prefix outputs under their TII-selected prompts; (N,) the selected tasks."""
        if not self.num_tasks or self.tii_.num_tasks != self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        return self.selected_logits(z)

    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        return self.infer(z)[0]


declare(
    "hide-prompt",
    "HiDe-Prompt (Wang et al., NeurIPS 2023): task-identity inference by an MLP head, then a prompt per "
    "task; both heads aligned on pseudo-features",
    base=None,
    learner="hide-prompt",
    baseline__optimizer="adam", baseline__lr=0.03 * 24 / 256, baseline__schedule="hide-step",
    baseline__clip_grad=1.0, baseline__prompt_length=5, baseline__prompt_layers=[0, 1, 2, 3, 4],
    baseline__ortho_weight=0.1, baseline__prompt_momentum=0.01, baseline__tii_epochs=20,
    baseline__tii_lr=5e-4 * 24 / 256, baseline__tii_ca_lr=5e-3 * 24 / 256, baseline__ca_lr=5e-3,
    baseline__ca_epochs=30, baseline__n_centroids=10,
)  # fmt: skip
