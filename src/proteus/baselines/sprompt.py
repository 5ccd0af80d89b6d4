"""S-Prompt: S-Prompts Learning (Wang et al., NeurIPS 2022), the ViT variant "sip", class-incrementally.

The method as the authors' released code (iamwangyabin/S-Prompts @ a26e822, ``methods/sprompt.py`` and
``models/sinet.py``) runs it, rebuilt here on the shared baseline learner:

* **train, per task t**: a new prompt of ``baseline.prompt_length`` tokens (10 in the release) and a new
  linear head over task t's own classes; only these two are trained, with the cross-entropy over task
  t's classes, the ViT frozen. The prompt tokens enter the input sequence right after the class token,
  after the position embedding, and receive none themselves: ``[CLS + pos_0, P_t, patches + pos]``;
  the head reads the class token after the final norm;
* **keys**: when task t ends, K-Means (k = 5) on the L2-normalised class tokens of a prompt-free pass
  over task t's training images; the 5 centroids are task t's keys;
* **test**: the input's normalised prompt-free class token picks the task of the nearest centroid under
  the release's distance ``(((f - c) ** 2) ** 0.5).sum(1)``, which is the L1 distance
  (:func:`nearest_key_task`); the input is then run with that task's prompt and classified by that
  task's head only (the other heads' logits are -inf).

The optimiser is the release's: SGD with momentum 0.9, lr 0.01, cosine annealing over a task's epochs
(``baseline.schedule = cosine-annealing``, registered here: ``CosineAnnealingLR(T_max=epochs)`` stepped
once per epoch), weight decay 2e-4 and 5e-4 on the first task (:attr:`SPrompt.first_task_decay`
times ``train.weight_decay``). The released configs cover domain-incremental sets only (CDDB, CORe50,
DomainNet); on the class-incremental streams we run the same algorithm (docs/experiments.md, "S-Prompt").

This module is the whole method -- its learner, its schedule and its declaration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.cluster import KMeans
from torch import nn

from proteus.baselines.learner import SCHEDULES, TrainingOptions
from proteus.baselines.persist import need
from proteus.baselines.prompts import PromptClassifier
from proteus.config import declare
from proteus.engine.errors import TaskError
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS
from proteus.options import AT_LEAST_1, option

__all__ = ["N_KEYS", "SPrompt", "nearest_key_task", "task_keys"]

#: K-Means centroids per task (the release's ``KMeans(n_clusters=5)``)
N_KEYS = 5


@SCHEDULES.register("cosine-annealing", help="S-Prompts: CosineAnnealingLR(T_max=epochs) stepped per epoch")
def _cosine_annealing(lr: float, epoch: int, epochs: int) -> float:
    """lr (1 + cos(pi e / E)) / 2: PyTorch's ``CosineAnnealingLR`` with ``T_max = E`` and ``eta_min = 0``,
    stepped after each epoch (the first epoch runs at lr, the last at lr (1 + cos(pi (E-1)/E)) / 2)."""
    return lr * (1 + math.cos(math.pi * epoch / max(epochs, 1))) / 2


def nearest_key_task(q: torch.Tensor, keys: list[torch.Tensor], p: float = 1.0) -> torch.Tensor:
    """(B,) the task whose nearest key is closest to each row of ``q`` (B, d), by the ``p``-norm distance.

    ``keys[t]`` is task t's (k_t, d) centroids. ``p = 1`` is S-Prompts' rule: the released code's
    ``(((f - c) ** 2) ** 0.5).sum(1)`` is the sum of absolute differences."""
    if not keys:
        raise NotFittedError("s-prompt: no task keys yet; call fit_task first")
    best = [torch.cdist(q.float(), c.to(q.device).float(), p=p).min(1).values for c in keys]
    return torch.stack(best, 1).argmin(1)


@dataclasses.dataclass
class SPromptOptions(TrainingOptions):
    prompt_length: int = option(5, help="the task's prompt length (the release: 10)", range=AT_LEAST_1)


@LEARNERS.register("s-prompt", help="S-Prompts: a prompt and a head per task, the task by K-Means keys")
class SPrompt(PromptClassifier):
    """S-Prompts: a prompt and a head per task; the task of an input by its nearest K-Means key (L1)."""

    name = "s-prompt"
    #: input-level prompts only (no ``prompt_layers``) and one prompt per task (no pool to divide)
    Options = SPromptOptions
    #: the first task's weight decay over ``train.weight_decay`` (the release: 5e-4 / 2e-4)
    first_task_decay: float = 2.5

    def _make_state(self, d: int) -> None:
        self._gen = torch.Generator().manual_seed(self.config.seed)
        self.prompts_: list[nn.Parameter] = []
        #: task t's (k_t, d) K-Means centroids of normalised prompt-free class tokens
        self.keys_: list[torch.Tensor] = []

    # ------------------------------------------------------------------ per-task state
    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        # the release's prompt is the weight of an nn.Linear(d, L): U(-1/sqrt(d), 1/sqrt(d))
        d, bound = self.embed_dim, 1 / math.sqrt(self.embed_dim)
        fresh = (torch.rand(self.options_.prompt_length, d, generator=self._gen) * 2 - 1) * bound
        self.prompts_.append(self._to(fresh))

    def trainable(self) -> list[nn.Parameter]:
        return [self.prompts_[-1]]

    @torch.no_grad()
    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        self.prompts_[-1].requires_grad_(False)
        q = torch.cat([F.normalize(self.query(c).float(), dim=-1).cpu() for c in self.input_pass(z, loader)])
        self.keys_.append(task_keys(q).to(self.device_))

    def abort_task(self, k: int) -> None:
        del self.prompts_[k:]
        del self.keys_[k:]

    def _params(self) -> dict[str, nn.Parameter]:
        return {str(t): p for t, p in enumerate(self.prompts_)}  # written as prompt.<t>

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update({f"key.{t}": c.detach().cpu().contiguous() for t, c in enumerate(self.keys_)})
        return out

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Each learned task's prompt (frozen) and K-Means keys ``key.<t>``, then as every prompt method."""
        L, d = self.options_.prompt_length, self.embed_dim
        for t in range(self.num_tasks):
            self.prompts_.append(self._frozen(torch.zeros(L, d)))
            keys = need(tensors, f"key.{t}")
            if keys.ndim != 2 or keys.shape[1] != d or not len(keys):
                raise TaskError(f"key.{t}: shape {tuple(keys.shape)}, expected (centroids, {d})")
            self.keys_.append(keys.float().to(self.device_))
        super().load_state(meta, tensors)

    # ------------------------------------------------------------------ forward
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """(B,) the task of each query: its L2-normalised prompt-free class token's nearest key (L1)."""
        return nearest_key_task(F.normalize(q.float(), dim=-1), getattr(self, "keys_", []), p=1.0)

    def prompted(self, z: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """(B, d) the class token after the final norm with each input's task prompt after the class token
        (no position embedding on the prompt)."""
        P = torch.stack(list(self.prompts_))[task]  # (B, L, d)
        x = self.tokens(z)
        x = torch.cat([x[:, :1], P.to(x.dtype), x[:, 1:]], 1)
        return self.run_blocks(x, {})[:, 0]

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """Training: every input under the open task's prompt. Inference: under its retrieved task's."""
        if train:
            t = torch.full((z.shape[0],), len(self.prompts_) - 1, dtype=torch.long, device=z.device)
        else:
            t = self.select(self.query(z))
        return self.prompted(z, t)

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C_seen) logits of prefix outputs and (N,) retrieved tasks: each input scored by its task's
        head only (every other column -inf)."""
        if not self.num_tasks or len(self.keys_) != self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        sizes = [len(c) for c in self.task_classes_]
        owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.as_tensor(sizes))  # column -> task
        logits, tasks = self.selected_logits(z)
        return logits.masked_fill(owner[None] != tasks[:, None], float("-inf")), tasks

    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        """(N, C_seen) logits: the retrieved task's head, -inf on every other task's classes."""
        return self.infer(z)[0]


def task_keys(q: torch.Tensor, n_keys: int = N_KEYS) -> torch.Tensor:
    """(min(n_keys, N), d) K-Means centroids of a task's (N, d) normalised features, as the release fits
    them (scikit-learn's ``KMeans`` with ``random_state=0``; ten k-means++ starts, the default of its
    time)."""
    n = min(n_keys, len(q))
    km = KMeans(n_clusters=n, random_state=0, n_init=10).fit(q.double().numpy())
    return torch.as_tensor(np.asarray(km.cluster_centers_), dtype=torch.float32)


declare(
    "s-prompt",
    "S-Prompts (Wang et al., NeurIPS 2022): a prompt and a head per task, the task by K-Means keys (L1)",
    base=None,
    learner="s-prompt",
    baseline__optimizer="sgd", baseline__lr=0.01, baseline__momentum=0.9,
    baseline__schedule="cosine-annealing", baseline__prompt_length=10, train__weight_decay=2e-4,
)  # fmt: skip
