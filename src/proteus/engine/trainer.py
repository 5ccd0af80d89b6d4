"""Training one task's adapter (Algorithm 1 line 5, Eq. 15).

The loss is the cross-entropy over the task's classes through a fresh linear classifier, plus the
elastic net ``lambda_k (alpha ||S||_1 + (1 - alpha) ||S||_2)`` on the transfer coefficients S of the old
directions; the new directions stay orthogonal to the old ones by construction (:mod:`proteus.adapters`).

How S is updated is a strategy (``adapter.s_update``, registry :data:`S_UPDATES`):

* ``prox`` (default): S takes a plain gradient step of the cross-entropy with step ``adapter.s_lr``, then
  the proximal operator of the elastic net (soft threshold for l1, group shrinkage for l2), so
  coefficients that do not earn their penalty are exactly zero;
* ``adam``: S is trained with the LoRA optimiser on the loss plus a subgradient of the penalty.

Under ``torchrun`` each rank trains on its block of every batch and gradients are summed across ranks,
weighted so that the sum is the full batch's gradient (:mod:`proteus.distributed`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proteus import distributed as dist
from proteus.adapters import AdaptedBackbone
from proteus.adapters import options as adapter_options
from proteus.config import AdapterConfig, TrainConfig
from proteus.engine.embedder import Embedder, ImageDataset
from proteus.engine.records import TrainStats, loss_summary
from proteus.registry import Registry
from proteus.streams import Task

log = logging.getLogger("proteus")

__all__ = ["AdamSUpdate", "AdapterTrainer", "OpenTask", "ProxSUpdate", "S_UPDATES", "SUpdate"]


class SUpdate(Protocol):
    """How the transfer coefficients S of Eq. 15 are optimised."""

    #: S is in the optimiser's parameter list
    in_optimizer: bool

    def penalty(self, s_params: list[nn.Parameter], lam: float) -> torch.Tensor | float:
        """The penalty added to the loss (0 when it is applied outside the gradient)."""
        ...

    def after_step(self, s_params: list[nn.Parameter], lam: float) -> None:
        """Called after each optimiser step."""
        ...


S_UPDATES: Registry[Callable[[AdapterConfig], SUpdate]] = adapter_options.S_UPDATES


def elastic_net(s_params: list[nn.Parameter], lam: float, alpha: float) -> torch.Tensor:
    """lambda (alpha ||s||_1 + (1 - alpha) ||s||_2), summed over the adapted maps."""
    tot = torch.zeros((), device=s_params[0].device if s_params else None)
    for s in s_params:
        tot = tot + alpha * s.abs().sum() + (1 - alpha) * s.norm()
    return lam * tot


@S_UPDATES.register(
    "prox", help="proximal SGD step on S (soft threshold + group shrinkage); exact zeros", reads_s_lr=True
)
class ProxSUpdate:
    in_optimizer = False

    def __init__(self, cfg: AdapterConfig) -> None:
        self.alpha, self.eta = cfg.alpha, cfg.s_lr

    def penalty(self, s_params: list[nn.Parameter], lam: float) -> float:
        return 0.0

    @torch.no_grad()
    def after_step(self, s_params: list[nn.Parameter], lam: float) -> None:
        """Gradient step on the cross-entropy, then the proximal operator of the elastic net."""
        eta, alpha = self.eta, self.alpha
        for s in s_params:
            if s.grad is not None:
                s.sub_(eta * s.grad)  # in place, as -=
            s.copy_(torch.sign(s) * (s.abs() - eta * lam * alpha).clamp_min(0))
            n = s.norm()
            if n > 0:
                s.mul_((1 - eta * lam * (1 - alpha) / n).clamp_min(0))


@S_UPDATES.register("adam", help="S trained by Adam with a subgradient of the elastic net")
class AdamSUpdate:
    in_optimizer = True

    def __init__(self, cfg: AdapterConfig) -> None:
        self.alpha = cfg.alpha

    def penalty(self, s_params: list[nn.Parameter], lam: float) -> torch.Tensor | float:
        return elastic_net(s_params, lam, self.alpha) if s_params else 0.0

    def after_step(self, s_params: list[nn.Parameter], lam: float) -> None:
        pass


@dataclass
class OpenTask:
    """The task being trained: its adapter's rank (requested and per map), lambda, classifier, optimiser
    and parameters."""

    k: int
    rank: int
    ranks: dict[str, int]
    lam: float
    clf: nn.Linear
    opt: torch.optim.Optimizer
    s_params: list[nn.Parameter]
    trainable: list[nn.Parameter]


class AdapterTrainer:
    """Trains the open task's adapter of ``embedder.model`` (Eq. 15).

    ``adapter`` and ``train`` are the run's settings; :meth:`rank_for` and :meth:`lam_for` give the
    per-task rank (budget schedule) and lambda (decayed by ``lam_decay`` after each task)."""

    def __init__(
        self, embedder: Embedder, adapter: AdapterConfig, train: TrainConfig, train_transform: Callable
    ):
        self.embedder = embedder
        self.adapter = adapter
        self.train = train
        self.train_transform = train_transform
        self.s_update: SUpdate = S_UPDATES.get(adapter.s_update)(adapter)
        #: the last :meth:`fit`'s training curve, one row per optimisation step: ``epoch`` and ``step``
        #: (1-based), ``loss`` (the cross-entropy), ``lr`` and ``penalty`` (the elastic net on S after the
        #: step); the experiment loop writes it to the run's train_log.csv
        self.train_log_: list[dict[str, Any]] = []

    @property
    def model(self) -> AdaptedBackbone:
        return self.embedder.model

    def rank_for(self, k: int) -> int:
        a = self.adapter
        if a.budget_decay is None:
            return a.rank
        return max(a.min_rank, int(round(a.rank * math.exp(-a.budget_decay * k))))

    def lam_for(self, k: int) -> float:
        """lambda for task k (0-based): the initial lambda decayed by ``lam_decay`` after each task."""
        return self.adapter.lam * self.adapter.lam_decay**k

    def open_task(self, classes: list[int], k: int, seed: int) -> OpenTask:
        """Open task k's adapter (new directions orthogonal to the old ones, S over them), a fresh
        classifier over the task's classes, and the optimiser."""
        a, tc = self.adapter, self.train
        torch.manual_seed(seed)
        rank = self.rank_for(k)
        ranks = self.model.begin_task(rank, a.transfer, a.orthogonal, seed)
        if ranks and min(ranks.values()) < rank:
            capped = {n: r for n, r in ranks.items() if r < rank}
            log.warning(
                "task %d: rank reduced on %d maps (no orthogonal room left): %s", k, len(capped), capped
            )
        clf = nn.Linear(self.model.embed_dim, len(classes)).to(self.embedder.device)
        params: list[nn.Parameter] = self.model.lora_parameters() + list(clf.parameters())
        s_params = self.model.transfer_parameters()
        if self.s_update.in_optimizer:
            params += s_params
        opt = torch.optim.Adam(params, lr=tc.lr, weight_decay=tc.weight_decay)
        trainable = params + [s for s in s_params if all(s is not q for q in params)]
        return OpenTask(k, rank, ranks, self.lam_for(k), clf, opt, s_params, trainable)

    def step(self, t: OpenTask, zb: torch.Tensor, yb: torch.Tensor, part: float = 1.0) -> torch.Tensor:
        """One optimisation step on a batch of prefix outputs ``zb`` with local labels ``yb`` (under
        torchrun: this rank's ``part`` of the batch); returns the (summed) cross-entropy."""
        distributed = dist.is_distributed()
        t.opt.zero_grad(set_to_none=True)
        for s in t.s_params:
            s.grad = None
        loss = torch.zeros((), device=self.embedder.device)
        if len(yb):
            with self.embedder.autocast():
                h = self.model.suffix(zb)
                loss = F.cross_entropy(t.clf(h.float()), yb)
            penalty = self.s_update.penalty(t.s_params, t.lam) if t.s_params else 0.0
            total = loss * part + penalty / dist.world_size() if distributed else loss + penalty
            total.backward()
        if distributed:
            loss = all_reduce_grads(t.trainable, loss.detach() * part)
        t.opt.step()
        if t.s_params:
            self.s_update.after_step(t.s_params, t.lam)
        return loss

    def fit(
        self, task: Task, k: int, seed: int, z_train: torch.Tensor | None, y_train: torch.Tensor
    ) -> TrainStats:
        """Open task k's adapter, train it and freeze it. ``z_train``: cached prefix outputs (None: run
        the prefix on augmented images every step). On an exception the adapter is left open: the caller
        rolls back with ``model.truncate``."""
        tc, emb = self.train, self.embedder
        device = emb.device
        classes = list(task.classes)
        t = self.open_task(classes, k, seed)
        local = {c: i for i, c in enumerate(classes)}
        y_local = torch.as_tensor([local[int(c)] for c in y_train.tolist()])
        g = torch.Generator().manual_seed(seed)
        losses: list[float] = []
        n = y_local.shape[0]
        bs = tc.batch_size
        steps = tc.epochs * math.ceil(n / bs)
        bar = emb.bar(range(steps), f"task {k + 1}: training its adapter", total=steps)
        it: Iterator[Any] = iter(())
        img_loader = None
        if z_train is None:
            img_loader = emb.loader(ImageDataset(task.train, self.train_transform), True, seed, bs)
        distributed = dist.is_distributed()
        part = 1.0
        per_epoch = max(1, math.ceil(n / bs))
        self.train_log_ = []
        for i in bar:
            if z_train is not None:
                try:
                    idx = next(it)
                except StopIteration:
                    it = iter(torch.randperm(n, generator=g).split(bs))
                    idx = next(it)
                if distributed:
                    mine = dist.shard_range(len(idx))
                    part, idx = len(mine) / len(idx), idx[mine.start : mine.stop]
                zb, yb = z_train[idx].to(device), y_local[idx].to(device)
            else:
                try:
                    xb, yb_g = next(it)
                except StopIteration:
                    assert img_loader is not None
                    it = iter(img_loader)
                    xb, yb_g = next(it)
                if distributed:
                    mine = dist.shard_range(len(yb_g))
                    part = len(mine) / len(yb_g)
                    xb, yb_g = xb[mine.start : mine.stop], yb_g[mine.start : mine.stop]
                zb = emb.prefix(xb)  # frozen: under the embedder's autocast, as the cached prefix
                yb = torch.as_tensor([local[int(c)] for c in yb_g.tolist()], device=device)
            loss = self.step(t, zb, yb, part)
            losses.append(float(loss.detach()))
            self.train_log_.append(
                {
                    "epoch": i // per_epoch + 1,
                    "step": i + 1,
                    "loss": losses[-1],
                    "lr": t.opt.param_groups[0]["lr"],
                    "penalty": self.penalty_value(t),
                }
            )
            if hasattr(bar, "set_postfix") and len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        return self.close_task(t, losses, steps)

    @torch.no_grad()
    def penalty_value(self, t: OpenTask) -> float:
        """The elastic net of Eq. 15 on the open task's S now (0 without old directions); read only."""
        if not t.s_params:
            return 0.0
        return float(elastic_net(t.s_params, t.lam, self.adapter.alpha))

    def close_task(self, t: OpenTask, losses: list[float], steps: int) -> TrainStats:
        """Freeze the trained directions and S (they never change again) and summarise the training."""
        if (
            dist.is_distributed()
        ):  # identical on every rank already; make it bit-identical whatever the hardware
            dist.broadcast_(self.model.lora_parameters() + t.s_params)
        s_all = torch.cat([s.detach().flatten() for s in t.s_params]) if t.s_params else torch.zeros(0)
        self.model.end_task()
        loss_first, loss_last = loss_summary(losses)
        return TrainStats(
            rank=t.rank,
            ranks_min=min(t.ranks.values()) if t.ranks else 0,
            lam=t.lam,
            loss_first=loss_first,
            loss_last=loss_last,
            steps=steps,
            s_mean_abs=float(s_all.abs().mean()) if s_all.numel() else None,
            s_nonzero_frac=float((s_all != 0).float().mean()) if s_all.numel() else None,
        )


def all_reduce_grads(tensors: Sequence[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    """Sum the gradients of ``tensors`` and ``loss`` over ranks in one flat all_reduce; returns the summed
    loss. A tensor without a gradient on every rank keeps ``grad = None``."""
    dev = loss.device
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
    parts = [g.reshape(-1).float().to(dev) for g in grads]
    flags = torch.tensor([float(t.grad is not None) for t in tensors], device=dev)
    flat = torch.cat([*parts, flags, loss.reshape(1).float()])
    dist.all_reduce_sum_(flat)
    i = 0
    for t, flag in zip(tensors, flat[-1 - len(tensors) : -1].tolist()):
        n = t.numel()
        t.grad = flat[i : i + n].view_as(t).to(t.dtype).clone() if flag > 0 else None
        i += n
    return flat[-1]
