"""MOS: Mixture of Adapters with self-refined selection (Sun et al., AAAI 2025), class-incrementally.

The method as the authors' released code runs it (sun-hailong/AAAI25-MOS @ 8d5e07c: ``models/mos.py``,
``backbone/vit_mos.py``, ``utils/inc_net.py``, ``exps/mos_*.json``), rebuilt on the shared adapters of
:mod:`proteus.baselines.adaptformer`. Per task t:

* **train**: the open parallel adapter (task 1 opens it; later tasks continue from where the last one
  ended) and a new linear head over task t's classes (the release's one ``nn.Linear`` over all classes,
  row block by row block), SGD with momentum, the head at 0.1 times the adapter's learning rate, weight
  decay on both and on every earlier head (their logits are masked, their gradients zero). Loss: the
  cross-entropy over task t's classes plus ``baseline.ortho_weight`` (the release's ``reg``) times the
  contrastive term of the features against every stored class mean (temperature 0.8, HiDe-Prompt's
  ``orth_loss``). From task 2 on the adapter is merged with the earlier ones while it trains (Sec. 3.2,
  "adapter merging"): a *pull* sets every block's tensors to ``(1 - beta) w + beta mean_{i<t}(w_i)``
  (beta = ``baseline.adapter_momentum``; the mean of the earlier tasks' adapters as their training left
  them). The release pulls in place once before each adapted block of every forward (its
  ``reweight_adapter`` runs inside the block loop and rewrites all blocks) and once after each step; we
  do the same, by the same ``.data`` assignment, so block l of a forward sees the adapter pulled l + 1
  times and the backward the weights after the last pull;
* **after training**: task t's adapter is kept; each of task t's classes keeps its Gaussian statistics
  under the open adapter, class by class in batches of 3 ``train.batch_size``, each forward pulling as in
  training (the release computes them with ``train=True``); the prototype classifier gets task t's class
  means under the first task's adapter (``replace_fc``); from task 2 on, every head is re-aligned on
  pseudo-features of every seen class (SGD at ``baseline.ca_lr``, ``CosineAnnealingLR`` over
  ``baseline.ca_epochs``);
* **test** (Sec. 3.3, self-refined adapter retrieval): the prototype classifier (cosine to the class
  means under the first adapter) picks a class, hence a task; the input's logits under that task's adapter
  pick a class again, hence a task, until the task repeats (at most ``baseline.refine_steps`` = 4 looks);
  with ``baseline.ensemble`` the class maximises ``softmax(those logits) + softmax(T x prototype
  logits)`` (T tasks seen). The last adapter looked at is the retrieved task.

One deliberate difference (``docs/experiments.md``, "MOS"): the release's test pass pulls the stored
adapter of task t >= 2 in place at every forward (its evaluation rewrites the adapters it evaluates, so a
prediction depends on how many batches were evaluated before it). Here a prediction never changes the
learner: task t's adapter is used as the release's first test batch sees it, block l pulled l + 1 times.

This module is the whole method -- its learner and its declaration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.adaptformer import (
    KEYS,
    AdapterClassifier,
    AdapterOptions,
    AdapterSet,
    align_heads,
    class_gaussians,
    fit_epochs,
    task_stats,
)
from proteus.baselines.hideprompt import orth_loss
from proteus.baselines.learner import TrainingOptions
from proteus.baselines.persist import need
from proteus.config import declare
from proteus.engine.errors import TaskError
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS
from proteus.options import AT_LEAST_1, NON_NEGATIVE, UNIT, option
from proteus.streams import Task

__all__ = ["MOS", "prefix_sums", "pull", "self_refine"]


@dataclasses.dataclass
class MOSOptions(AdapterOptions, TrainingOptions):
    adapter_momentum: float = option(
        0.1, help="beta: each pull's weight on the earlier adapters' mean (0: no merging)", range=UNIT
    )
    ortho_weight: float = option(
        0.1, help="the contrastive term's weight against the stored class means (the release's reg)",
        range=NON_NEGATIVE,
    )  # fmt: skip
    ensemble: bool = option(True, help="add the prototype classifier's probabilities (the release: true)")
    refine_steps: int = option(
        4, help="self-refinement: at most this many looks (MAX_ITER)", range=AT_LEAST_1
    )


def prefix_sums(adapters: list[AdapterSet]) -> list[AdapterSet]:
    """``sums[t] = w_t + sums[t - 1]`` (the release's ``sum_adapter_param``: the mean of the first t adapters
    is ``sums[t - 1] / t``)."""
    out: list[AdapterSet] = []
    for a in adapters:
        out.append([{k: t + out[-1][i][k] if out else t for k, t in blk.items()} for i, blk in enumerate(a)])
    return out


def pull(w: torch.Tensor, total: torch.Tensor, idx: int, beta: float) -> torch.Tensor:
    """One pull of ``w`` towards the mean ``total / idx`` of the first ``idx`` adapters (the release's
    ``reweight_adapter``, in its order of operations)."""
    return (1 - beta) * w + beta * total / idx


def self_refine(
    logits: torch.Tensor, owner: torch.Tensor, start: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MOS's self-refined retrieval. ``logits`` (m, B, C): every seen class's logits under each task's
    adapter; ``owner`` (C,): each column's task; ``start`` (B,): the first task to look at. Each look
    takes the logits under the current task; the task of their best class is the next one; it stops when
    the task repeats or after ``steps`` looks. Returns the logits of the last look (B, C) and its task."""
    rows = torch.arange(logits.shape[1], device=logits.device)
    cur, active = start.clone(), torch.ones_like(start, dtype=torch.bool)
    final = logits.new_zeros(logits.shape[1:])
    for look in range(1, steps + 1):
        now = logits[cur, rows]
        nxt = owner[now.argmax(1)]
        stop = active & ((nxt == cur) | (look >= steps))
        final[stop] = now[stop]
        cur = torch.where(active & ~stop, nxt, cur)
        active &= ~stop
    return final, cur


@LEARNERS.register("mos", help="MOS: an adapter per task, merged while training, chosen by self-refinement")
class MOS(AdapterClassifier):
    """MOS: adapters merged with the earlier ones while they train; the task by self-refined retrieval."""

    name = "mos"
    Options = MOSOptions
    #: the head at 0.1 times the adapter's learning rate (the release's ``init_lr * 0.1``)
    head_lr_scale = 0.1

    def _setup(self) -> None:
        super()._setup()
        #: (C_seen, d) the prototype classifier: each class's mean under the first task's adapter
        self.prototypes_ = torch.zeros(0, self.embed_dim)
        self._sums: list[AdapterSet] = []
        self._tests: list[AdapterSet] = []

    # ------------------------------------------------------------------ the pulls
    @torch.no_grad()
    def _pull_open(self, idx: int) -> None:
        """One in-place pull of the open adapter towards the mean of the first ``idx`` adapters."""
        assert self.open_ is not None
        beta = self.options_.adapter_momentum
        if beta == 0 or idx == 0:
            return
        for blk, total in zip(self.open_, self._sums[idx - 1]):
            for key in KEYS:
                blk[key].data = pull(blk[key].data, total[key], idx, beta)

    def test_adapter(self, t: int) -> AdapterSet:
        """Task t's adapter as a prediction uses it: block l pulled l + 1 times towards the mean of the
        adapters before it (the release's first test forward); task 1's as stored."""
        while len(self._tests) <= t:
            j, beta = len(self._tests), self.options_.adapter_momentum
            adapter = [dict(blk) for blk in self.adapters_[j]]
            if j and beta:
                for i, blk in enumerate(adapter):
                    for key in KEYS:
                        for _ in range(i + 1):
                            blk[key] = pull(blk[key], self._sums[j - 1][i][key], j, beta)
            self._tests.append(adapter)
        return self._tests[t]

    # ------------------------------------------------------------------ one task
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        b = self.options_
        classes = [int(c) for c in task.classes]
        local = {c: i for i, c in enumerate(classes)}
        known = len(self.labels_)
        head = nn.utils.skip_init(nn.Linear, self.embed_dim, len(classes), device=self.device_)
        means = torch.stack([self.stats_[c].mean for c in self.labels_]).to(self.device_) if known else None

        def groups() -> list[dict[str, Any]]:  # after the adapter opens; the head drawn after it
            head.reset_parameters()
            fc = [p for h in [*self.heads_, head] for p in h.parameters()]
            return [{"params": self.trainable()}, {"params": fc, "lr_scale": self.head_lr_scale}]

        def step_loss(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            assert self.open_ is not None
            h = self.embed(z, self.open_, train=True, before_block=lambda _: self._pull_open(k))
            logits = head(h.float())
            if known:  # the earlier classes' logits masked: zero gradients, so weight decay moves them
                old = torch.cat([hd(h.float()) for hd in self.heads_], 1)
                logits = torch.cat(
                    [old.masked_fill(torch.ones_like(old, dtype=torch.bool), float("-inf")), logits], 1
                )
            target = torch.as_tensor([known + local[int(c)] for c in y.tolist()], device=z.device)
            aux = (
                b.ortho_weight * orth_loss(h.float(), means).float()
                if b.ortho_weight
                else logits.new_zeros(())
            )
            return F.cross_entropy(logits, target), aux

        for h in self.heads_:
            h.requires_grad_(True)
        try:
            losses, (z, y, _) = fit_epochs(
                self, task, k, groups, step_loss, after_step=lambda: self._pull_open(k)
            )
        finally:
            for h in self.heads_:
                h.requires_grad_(False)
        self._end_training(task, k, head)
        self._sums = prefix_sums(self.adapters_)
        assert self.open_ is not None
        hf, yy = self.plain_features(task, z, y, self.open_, before_block=lambda _: self._pull_open(k))
        self.stats_.update(class_gaussians(hf, yy, classes))
        h0, y0 = self.plain_features(task, z, y, self.adapters_[0])
        protos = torch.stack([h0[y0 == c].mean(0) for c in classes]).to(self.prototypes_)
        self.prototypes_ = torch.cat([self.prototypes_, protos])
        stats = task_stats(losses, self.trainable() + list(head.parameters()))
        if k > 0:
            align = self._align(k)
            stats["align_loss_last"] = align[-1] if align else None
        return stats

    def _align(self, k: int) -> list[float]:
        """Every head on pseudo-features of every seen class (the release's ``classifer_align``)."""
        b = self.options_
        stats = [self.stats_[c] for c in self.labels_]
        params = [p for h in self.heads_ for p in h.parameters()]
        for p in params:
            p.requires_grad_(True)
        try:
            return align_heads(
                lambda x: torch.cat([h(x) for h in self.heads_], 1), params, [s.mean for s in stats],
                [s.covariance(b.ca_storage) for s in stats], n=self.config.train.batch_size * b.ca_draws,
                epochs=b.ca_epochs, lr=b.ca_lr, wd=self.config.train.weight_decay, period=b.ca_epochs,
                generator=self._generator(k), device=self.device_,
            )  # fmt: skip
        finally:
            for p in params:
                p.requires_grad_(False)

    def abort_task(self, k: int) -> None:
        super().abort_task(k)
        self.prototypes_ = self.prototypes_[: len(self.labels_)]
        self._sums, self._tests = prefix_sums(self.adapters_), self._tests[:k]

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C_seen) ``log((softmax(refined logits) + softmax(T x prototype logits)) / 2)`` (without
        ``ensemble``: the log-softmax of the refined logits) and (N,) the retrieved tasks."""
        m = self.num_tasks
        if not m or len(self.adapters_) != m:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        b = self.options_
        sizes = torch.as_tensor([len(c) for c in self.task_classes_])
        owner = torch.repeat_interleave(torch.arange(m), sizes).to(self.device_)
        protos = F.normalize(self.prototypes_.to(self.device_), dim=1)
        outs, picks = [], []
        for chunk in z.split(self.config.eval.batch_size):
            chunk = chunk.to(self.device_)
            with self.embedder_.autocast():
                feats = [self.embed(chunk, self.test_adapter(t)).float() for t in range(m)]
                orig = F.normalize(feats[0], dim=1) @ protos.T
                logits = torch.stack([torch.cat([h(f) for h in self.heads_], 1) for f in feats])
            final, task = self_refine(logits, owner, owner[orig.argmax(1)], b.refine_steps)
            out = (
                torch.log((F.softmax(final, 1) + F.softmax(orig / (1 / m), 1)) / 2)
                if b.ensemble
                else F.log_softmax(final, 1)
            )
            outs.append(out.cpu())
            picks.append(task.cpu())
        return torch.cat(outs), torch.cat(picks)

    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        return self.infer(z)[0]

    # ------------------------------------------------------------------ knowledge base
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """As every adapter learner's, and the prototype classifier ``prototypes`` (C_seen, d)."""
        return {**super().state_tensors(), "prototypes": self.prototypes_.detach().cpu().contiguous()}

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        super().load_state(meta, tensors)
        protos = need(tensors, "prototypes")
        if protos.shape != (len(self.labels_), self.embed_dim):
            raise TaskError(
                f"prototypes: shape {tuple(protos.shape)}, expected ({len(self.labels_)}, {self.embed_dim})"
            )
        self.prototypes_ = protos.float()
        self._sums, self._tests = prefix_sums(self.adapters_), []


declare(
    "mos",
    "MOS (Sun et al., AAAI 2025): a parallel adapter per task merged with the earlier ones while it trains, "
    "the task by self-refined retrieval; heads aligned on Gaussian pseudo-features",
    base=None,
    learner="mos",
    baseline__optimizer="sgd", baseline__lr=0.03, baseline__momentum=0.9,
    baseline__schedule="cosine-annealing", baseline__adapter_rank=16, baseline__adapter_momentum=0.1,
    baseline__ortho_weight=0.1, baseline__ca_lr=5e-3, baseline__ca_epochs=30, train__weight_decay=5e-3,
)  # fmt: skip
