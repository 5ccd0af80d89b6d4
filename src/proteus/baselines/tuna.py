"""TUNA: Integrating Task-Specific and Universal Adapters (Wang, Zhou & Ye, ICCV 2025), class-incrementally.

The method as the authors' released code runs it (LAMDA's ICCV2025-TUNA, kept with its logs in the fork
Ngahoang2005/ICCV2025-TUNA; the authors' last commit 77d4f10: ``models/tuna.py``, ``backbone/vit_tuna.py``,
``backbone/linears.py``, ``exps/tuna_*.json``), rebuilt on the shared adapters of
:mod:`proteus.baselines.adaptformer`. Per task t:

* **train**: the open parallel adapter (task 1 opens it; every later task continues from where the last one
  ended) and a new cosine head over task t's classes (rows N(0, 0.02) truncated; the logit of class c is
  ``cos(h, w_c)``), SGD with momentum over the adapter and every head; the loss is CosFace (paper Eq. 3) on
  task t's classes, ``CE(s (cos - m 1_y))`` with s = ``baseline.cos_scale`` and m = ``baseline.margin``,
  plus, from task 2 on, ``baseline.ortho_weight`` exp(-(t+1)) times the orthogonality term of Eq. 4: over
  the earlier adapters i and the adapted blocks j, ``|mean(norm(U_t^j) norm(U_i^j)^T)|`` averaged over
  the blocks (U: the up projection, rows normalised);
* **after training**: task t's adapter is kept as it is; the universal adapter is the EMR merge of all of
  them (Eq. 6-7; :func:`~proteus.baselines.adaptformer.emr_merge`); each of task t's classes keeps its
  Gaussian statistics under the adapter; from task 2 on, every head is re-aligned on pseudo-features drawn
  from the statistics of every seen class (SGD at ``baseline.ca_lr``, ``CosineAnnealingLR(T_max=5)``
  over ``baseline.ca_epochs``), the means scaled as the release scales them (``baseline.ca_mean_decay``,
  below);
* **test** (Eq. 8-9): each input is embedded under every task's adapter; the adapter whose logits (s cos,
  every seen class) have the least entropy is the task-specific one; the class maximises
  ``softmax(universal logits) + softmax(specific logits)``. After task 1, the first adapter's logits alone.
  The selected adapter is the retrieved task (results.json's ``retrieval_acc``).

Two findings about the release, kept (``docs/experiments.md``, "TUNA"): its test pass asks for adapter id
``t + 1`` as the universal one, which its backbone resolves to the *current* adapter (equal to task t's),
not the merged one, so the released predictions use task t's adapter as "universal"
(``baseline.universal = last``; ``merged`` is the paper's); and its mean scaling for the alignment divides
a class index by ``known - total``, a negative task size, so ``0.9 + 0.1 (t_id + 1) / (t + 1)`` sees
``t_id = floor(c / -n)``: 0 for the first class, then -1, -2, ... (``ca_mean_decay``, as released).

This module is the whole method -- its learner and its declaration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.adaptformer import (
    AdapterClassifier,
    AdapterLike,
    AdapterOptions,
    AdapterSet,
    align_heads,
    class_gaussians,
    emr_merge,
    fit_epochs,
    task_stats,
)
from proteus.baselines.learner import TrainingOptions, entropy
from proteus.config import declare
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS
from proteus.options import NON_NEGATIVE, POSITIVE, option
from proteus.streams import Task

__all__ = ["TUNA", "cosface", "entropy_selection", "up_orthogonality"]

#: the releases' entropy guard (``log(p + 1e-10)``)
EPS = 1e-10
#: TUNA's alignment schedule: ``CosineAnnealingLR(T_max=5)`` whatever the epochs
CA_PERIOD = 5


@dataclasses.dataclass
class TUNAOptions(AdapterOptions, TrainingOptions):
    cos_scale: float = option(
        20.0, help="s: the cosine logits' scale (the release's scale: 20)", range=POSITIVE
    )
    margin: float = option(0.0, help="m: CosFace's margin (ImageNet-A: 0.3)", range=NON_NEGATIVE)
    ortho_weight: float = option(
        1e-3, help="the up projections' orthogonality weight (reg; 0: the release's use_orth false)",
        range=NON_NEGATIVE,
    )  # fmt: skip
    ca_mean_decay: bool = option(
        True, help="scale each class mean before the alignment draws, as the release does (its decay)"
    )
    universal: str = option(
        "last",
        help="the universal adapter at test: last (the release runs task t's) or merged (EMR, the paper)",
        choices=("last", "merged"),
    )  # fmt: skip


def cosface(cos: torch.Tensor, target: torch.Tensor, s: float, m: float) -> torch.Tensor:
    """CosFace (the release's ``AngularPenaltySMLoss('cosface')``): the cross-entropy of s (cos - m 1_y)."""
    return F.cross_entropy(s * (cos - m * F.one_hot(target, cos.shape[1]).to(cos.dtype)), target)


def up_orthogonality(open_: AdapterLike, old: Sequence[AdapterSet]) -> torch.Tensor:
    """The release's ``orth_loss``: the sum over earlier adapters of the mean over blocks of
    ``|mean(norm(U_open) norm(U_old)^T)|`` (U: the up projection (c_out, r), rows L2-normalised)."""
    total = open_[0]["up_w"].new_zeros(())
    for a in old:
        per = [
            (F.normalize(o["up_w"], dim=1) @ F.normalize(p["up_w"], dim=1).T).mean().abs()
            for o, p in zip(open_, a)
        ]
        total = total + torch.stack(per).sum() / len(per)
    return total


def entropy_selection(logits: torch.Tensor) -> torch.Tensor:
    """(B,) the adapter whose logits (m, B, C) have the least entropy, ``-sum p log(p + 1e-10)`` (first on
    ties)."""
    return entropy(logits, EPS).argmin(0)


@LEARNERS.register("tuna", help="TUNA: an adapter per task chosen by entropy, with a universal adapter")
class TUNA(AdapterClassifier):
    """TUNA: task-specific adapters chosen by the entropy of their logits, plus a universal adapter."""

    name = "tuna"
    Options = TUNAOptions

    def _setup(self) -> None:
        super()._setup()
        #: the EMR merge of every task's adapter (from task 2 on)
        self.merged_: AdapterSet | None = None

    def _weights(self, extra: tuple[nn.Linear, ...] = ()) -> torch.Tensor:
        """(C, d) every head's rows (the seen classes, then ``extra``), L2-normalised."""
        return F.normalize(torch.cat([h.weight for h in [*self.heads_, *extra]]), dim=1)

    def cosine(self, h: torch.Tensor, extra: tuple[nn.Linear, ...] = ()) -> torch.Tensor:
        """(B, C) the cosine logits of embeddings over every seen class (and ``extra`` heads)."""
        return F.normalize(h.float(), dim=1) @ self._weights(extra).T

    # ------------------------------------------------------------------ one task
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        b = self.options_
        classes = [int(c) for c in task.classes]
        local = {c: i for i, c in enumerate(classes)}
        known = len(self.labels_)
        head = nn.utils.skip_init(nn.Linear, self.embed_dim, len(classes), device=self.device_)

        def groups() -> list[dict[str, Any]]:  # after the adapter opens; the head drawn after it
            nn.init.trunc_normal_(head.weight, std=0.02, a=-2.0, b=2.0)
            nn.init.zeros_(head.bias)
            head.bias.requires_grad_(False)  # a cosine head: the bias is unused
            fc = [h.weight for h in self.heads_] + [head.weight]
            return [{"params": self.trainable()}, {"params": fc}]

        def step_loss(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            assert self.open_ is not None
            cos = self.cosine(self.embed(z, self.open_, train=True), (head,))
            target = torch.as_tensor([local[int(c)] for c in y.tolist()], device=z.device)
            loss = cosface(cos[:, known:], target, b.cos_scale, b.margin)
            aux = cos.new_zeros(())
            if k > 0 and b.ortho_weight:
                aux = up_orthogonality(self.open_, self.adapters_) * b.ortho_weight * math.exp(-(k + 1))
            return loss, aux

        for h in self.heads_:
            h.weight.requires_grad_(True)
        try:
            losses, (z, y, _) = fit_epochs(self, task, k, groups, step_loss)
        finally:
            for h in self.heads_:
                h.requires_grad_(False)
        self._end_training(task, k, head)
        if k > 0:
            self.merged_ = emr_merge(self.adapters_)
        assert self.open_ is not None
        self.stats_.update(class_gaussians(*self.plain_features(task, z, y, self.open_), classes))
        stats = task_stats(losses, self.trainable() + [head.weight])
        if k > 0:
            align = self._align(k)
            stats["align_loss_last"] = align[-1] if align else None
        return stats

    def _align(self, k: int) -> list[float]:
        """Every head on pseudo-features of every seen class (the release's ``classifer_align``)."""
        b = self.options_
        n_k = len(self.task_classes_[-1])
        means, covs = [], []
        for i, c in enumerate(self.labels_):
            mu = self.stats_[c].mean
            if b.ca_mean_decay:  # the release's class_idx // task_size with task_size = known - total < 0
                mu = (mu.double() * (0.9 + (i // -n_k + 1) / (k + 1) * 0.1)).float()
            means.append(mu)
            covs.append(self.stats_[c].covariance(b.ca_storage))
        params = [cast(nn.Parameter, h.weight) for h in self.heads_]
        for p in params:
            p.requires_grad_(True)
        try:
            return align_heads(
                lambda x: b.cos_scale * self.cosine(x), params, means, covs,
                n=self.config.train.batch_size * b.ca_draws, epochs=b.ca_epochs, lr=b.ca_lr,
                wd=self.config.train.weight_decay, period=CA_PERIOD, generator=self._generator(k),
                device=self.device_,
            )  # fmt: skip
        finally:
            for p in params:
                p.requires_grad_(False)

    def abort_task(self, k: int) -> None:
        super().abort_task(k)
        self.merged_ = emr_merge(self.adapters_) if len(self.adapters_) > 1 else None

    # ------------------------------------------------------------------ inference
    def universal(self) -> AdapterSet:
        """The universal adapter of ``baseline.universal``: task t's (what the release runs) or the merge."""
        if self.options_.universal == "merged" and self.merged_ is not None:
            return self.merged_
        return self.adapters_[-1]

    @torch.no_grad()
    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C_seen) ``log((softmax(universal) + softmax(specific)) / 2)`` and (N,) the selected adapters;
        after task 1 the first adapter's log-softmax."""
        if not self.num_tasks or len(self.adapters_) != self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        s, outs, picks = self.options_.cos_scale, [], []
        for chunk in z.split(self.config.eval.batch_size):
            chunk = chunk.to(self.device_)
            with self.embedder_.autocast():
                logits = torch.stack([s * self.cosine(self.embed(chunk, a)) for a in self.adapters_])
                if self.num_tasks == 1:
                    outs.append(F.log_softmax(logits[0], 1).cpu())
                    picks.append(torch.zeros(len(chunk), dtype=torch.long))
                    continue
                pick = entropy_selection(logits)
                specific = logits[pick, torch.arange(len(chunk))]
                uni = (
                    logits[-1]
                    if self.options_.universal == "last"
                    else s * self.cosine(self.embed(chunk, self.universal()))
                )
            outs.append(torch.log((F.softmax(uni, 1) + F.softmax(specific, 1)) / 2).cpu())
            picks.append(pick.cpu())
        return torch.cat(outs), torch.cat(picks)

    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        return self.infer(z)[0]

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The adapters, statistics and heads (:class:`AdapterClassifier`); the merge recomputed from them."""
        super().load_state(meta, tensors)
        self.merged_ = emr_merge(self.adapters_) if len(self.adapters_) > 1 else None


declare(
    "tuna",
    "TUNA (Wang, Zhou & Ye, ICCV 2025): a parallel adapter per task chosen by entropy, plus a universal "
    "adapter; heads aligned on Gaussian pseudo-features",
    base=None,
    learner="tuna",
    baseline__optimizer="sgd", baseline__lr=0.02, baseline__momentum=0.9,
    baseline__schedule="cosine-annealing", baseline__adapter_rank=16, baseline__ortho_weight=1e-3,
    baseline__margin=0.0, baseline__ca_lr=5e-3, baseline__ca_epochs=30, baseline__ca_mean_decay=True,
    train__weight_decay=5e-4,
)  # fmt: skip
