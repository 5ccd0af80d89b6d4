"""Parallel bottleneck adapters on any backbone, and what TUNA and MOS share around them.

TUNA (Wang, Zhou & Ye, ICCV 2025) and MOS (Sun et al., AAAI 2025) both train one AdaptFormer adapter per
task (Chen et al., NeurIPS 2022, "parallel" form): beside the MLP of each adapted block, a bottleneck
``a(x) = s * up(dropout(relu(down(x))))`` reads the block's MLP input and adds to its output,

    ViT block:          x1 = x + attn(norm1(x));   out = x1 + (mlp(norm2(x1)) + a(x1))
    MobileNetV2 block:  out = block(x) + a(x)       (down, up: 1x1 convolutions; down strided as the block)

``down`` maps the block's input width to the rank r (16 in both releases), ``up`` r to the block's output
width; both start as the releases' "lora" initialisation (down: U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
biases and up: 0), s = 0.1, dropout 0.1 on the bottleneck while training. On a ViT the adapted blocks are
the suffix's (``backbone.adapt_last``; all of them in the releases); on MobileNetV2 the same blocks carry a
parallel 1x1 branch, the CNN counterpart (docs/experiments.md, "TUNA and MOS": the placement).

Also here, shared by both learners (their ``_compute_mean`` and ``classifer_align``): a class's Gaussian
statistics (mean, and the covariance kept as a factor F with cov = F^T F + 1e-4 I), the pseudo-features
drawn from them as ``torch.distributions.MultivariateNormal`` draws them (mean + L eps, L the Cholesky
factor), the alignment of heads on those draws, EMR merging of adapters (TUNA's universal adapter), and
the training loop over a task's batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.learner import (
    KB_LAYOUT,
    OPTIMIZERS,
    ContinualClassifier,
    epoch_lr,
    task_stats,
)
from proteus.baselines.persist import need
from proteus.config import ConfigError
from proteus.engine.errors import TaskError
from proteus.engine.runtime import task_seed
from proteus.engine.task_identity import cosine_sgd
from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, UNIT, option
from proteus.progress import bar as progress_bar
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, ShapeRule

__all__ = [
    "KEYS", "RIDGE", "AdapterClassifier", "AdapterLike", "AdapterOptions", "AdapterSet", "ClassGaussian",
    "ParallelAdapterOptions", "Site", "adapted_suffix", "align_heads", "cholesky", "class_gaussians",
    "clone_set", "emr_merge", "fit_epochs", "init_set", "load_set", "pseudo_features", "set_tensors",
    "sites_of", "task_stats",
]  # fmt: skip

#: the tensors of one block's adapter: down (r, c_in) and its bias, up (c_out, r) and its bias
KEYS = ("down_w", "down_b", "up_w", "up_b")
#: the releases' ridge on a class covariance (``torch.cov(...) + 1e-4 I``)
RIDGE = 1e-4

AdapterSet = list[dict[str, torch.Tensor]]
"""One adapter: per adapted block (in order) its four tensors (:data:`KEYS`)."""
AdapterLike = Sequence[Mapping[str, torch.Tensor]]
"""An adapter as the functions read it (a trainable one's tensors are parameters)."""

_A = r"adapter\.(?:\d+|open)\.(?P<b>\d+)"
#: what an adapter learner (TUNA, MOS) adds to a baseline's head object: every task's adapter and the open
#: one (per block, the same widths in each), every seen class's statistics and MOS's prototype classifier
TENSOR_RULES.declare(
    KB_LAYOUT, "AdapterClassifier",
    ShapeRule(_A + r"\.down_w", ("obj.adapter_rank", "obj.adapter_in_{b}"),
              "block {b}'s down projection: rank x the block's input width, in every adapter", on="head"),
    ShapeRule(_A + r"\.down_b", ("obj.adapter_rank",), "block {b}'s down bias: one per rank", on="head"),
    ShapeRule(_A + r"\.up_w", ("obj.adapter_out_{b}", "obj.adapter_rank"),
              "block {b}'s up projection: the block's output width x rank, in every adapter", on="head"),
    ShapeRule(_A + r"\.up_b", ("obj.adapter_out_{b}",), "block {b}'s up bias: one per output channel",
              on="head"),
    ShapeRule(r"class_stats\.\d+\.mean", ("kb.linear_d",), "a class's mean is an embedding", on="head"),
    ShapeRule(r"class_stats\.\d+\.factor", ("*", "kb.linear_d"), "a class's covariance factor (n, d)",
              on="head"),
    ShapeRule(r"prototypes", ("*", "kb.linear_d"), "MOS's prototype classifier: a row per class", on="head"),
)  # fmt: skip


@dataclasses.dataclass
class ParallelAdapterOptions:
    """The parallel adapter's options (``baseline.*``): TUNA's, MOS's and MoAL's."""

    adapter_rank: int = option(
        16, help="the adapter's bottleneck width (the releases' ffn_num)", range=AT_LEAST_1
    )
    adapter_scale: float = option(
        0.1, help="the adapter's output scale s (the releases: 0.1)", range=POSITIVE
    )
    adapter_dropout: float = option(0.1, help="dropout on the bottleneck while training (0.1)", range=UNIT)


@dataclasses.dataclass
class AdapterOptions(ParallelAdapterOptions):
    """The adapters' and the class statistics' options that TUNA and MOS share (``baseline.*``)."""

    ca_lr: float = option(5e-3, help="the classifier alignment's SGD learning rate", range=POSITIVE)
    ca_epochs: int = option(30, help="the classifier alignment's epochs (crct_epochs)", range=NON_NEGATIVE)
    ca_draws: int = option(
        5,
        help="pseudo-features per class and epoch, in train.batch_size's (the releases: 5)",
        range=AT_LEAST_1,
    )
    ca_storage: str = option(
        "covariance",
        help="a class's stored statistics: covariance (full) or variance (its diagonal)",
        choices=("covariance", "variance"),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- placement
@dataclasses.dataclass(frozen=True)
class Site:
    """One adapted block: its input and output widths, the stride of its spatial map (1 for tokens), and
    whether it is convolutional (a feature map) or a ViT block (tokens)."""

    c_in: int
    c_out: int
    stride: int
    conv: bool


def _blocks(backbone: nn.Module) -> list[nn.Module]:
    """The adapted suffix's blocks (``backbone.adapt_last``)."""
    if hasattr(backbone, "vit"):
        return list(backbone.vit.blocks[backbone.split :])  # type: ignore[union-attr,index]
    if hasattr(backbone, "blocks") and hasattr(backbone, "pool"):
        return list(backbone.blocks[backbone.split :])  # type: ignore[index]
    raise ConfigError(
        f"{getattr(backbone, 'name', backbone)}: parallel adapters need a timm ViT or MobileNetV2 backbone"
    )


@torch.no_grad()
def sites_of(backbone: Any) -> list[Site]:
    """The adapted blocks' :class:`Site`s (a ViT's from its width; a CNN's from one pass of a blank image
    at the backbone's input size)."""
    blocks = _blocks(backbone)
    if hasattr(backbone, "vit"):
        d = int(backbone.embed_dim)
        return [Site(d, d, 1, False) for _ in blocks]
    size = int(backbone.data_config.input_size)
    p = next(backbone.parameters())
    x = backbone.forward_prefix(torch.zeros(1, 3, size, size, device=p.device, dtype=p.dtype))
    out = []
    for blk in blocks:
        y = blk(x)
        out.append(Site(int(x.shape[1]), int(y.shape[1]), max(1, x.shape[-1] // y.shape[-1]), True))
        x = y
    return out


def init_set(sites: Sequence[Site], rank: int, device: torch.device) -> list[dict[str, nn.Parameter]]:
    """A new trainable adapter, the releases' "lora" initialisation: down ~ U(-1/sqrt(c_in), 1/sqrt(c_in))
    (``kaiming_uniform_(a=sqrt(5))``), biases and up 0; drawn from torch's global stream, block by block."""
    out = []
    for s in sites:
        bound = 1 / math.sqrt(s.c_in)
        down = (torch.rand(rank, s.c_in) * 2 - 1) * bound
        tensors = {"down_w": down, "down_b": torch.zeros(rank), "up_w": torch.zeros(s.c_out, rank)}
        tensors["up_b"] = torch.zeros(s.c_out)
        out.append({k: nn.Parameter(t.to(device)) for k, t in tensors.items()})
    return out


def clone_set(adapter: AdapterLike) -> AdapterSet:
    """A detached copy (the releases' ``copy.deepcopy(self.cur_adapter)``)."""
    return [{k: t.detach().clone() for k, t in a.items()} for a in adapter]


def adapter_out(
    x: torch.Tensor, a: Mapping[str, torch.Tensor], site: Site, scale: float, dropout: float, training: bool
) -> torch.Tensor:
    """``s * up(dropout(relu(down(x))))`` on tokens (B, N, c) or a feature map (B, c, H, W)."""
    if site.conv:
        h = F.conv2d(
            x, a["down_w"][:, :, None, None].to(x.dtype), a["down_b"].to(x.dtype), stride=site.stride
        )
    else:
        h = F.linear(x, a["down_w"].to(x.dtype), a["down_b"].to(x.dtype))
    h = F.dropout(F.relu(h), dropout, training)
    if site.conv:
        up = F.conv2d(h, a["up_w"][:, :, None, None].to(h.dtype), a["up_b"].to(h.dtype))
    else:
        up = F.linear(h, a["up_w"].to(h.dtype), a["up_b"].to(h.dtype))
    return up * scale


def adapted_suffix(
    backbone: Any,
    z: torch.Tensor,
    adapter: AdapterLike,
    sites: Sequence[Site],
    *,
    scale: float,
    dropout: float = 0.0,
    training: bool = False,
    before_block: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """(B, d) the embedding of prefix outputs ``z`` with ``adapter`` in parallel to each adapted block;
    ``before_block(l)`` runs before block l (MOS's in-place pulls of the training adapter)."""
    for i, blk in enumerate(_blocks(backbone)):
        if before_block is not None:
            before_block(i)
        if sites[i].conv:
            z = blk(z) + adapter_out(z, adapter[i], sites[i], scale, dropout, training)
        else:
            z = z + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(z))))  # type: ignore[operator]
            a = adapter_out(z, adapter[i], sites[i], scale, dropout, training)
            z = z + (blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(z)))) + a)  # type: ignore[operator]
    if hasattr(backbone, "vit"):
        return backbone.vit.forward_head(backbone.vit.norm(z), pre_logits=True)
    return torch.flatten(backbone.pool(z), 1)


def emr_merge(adapters: Sequence[AdapterSet]) -> AdapterSet:
    """TUNA's universal adapter, EMR merging (Huang et al., NeurIPS 2024) of the task adapters, entry by
    entry: the sign of their mean elects a direction (+1 where the mean is > 0, else -1), and the entry is
    the largest magnitude among the adapters that agree with it (0 where none does). EMR's masks and
    rescalers are computed by the release but not applied, so neither is here."""
    out: AdapterSet = []
    for i in range(len(adapters[0])):
        merged = {}
        for key in KEYS:
            stack = torch.stack([a[i][key] for a in adapters])
            flag = (stack.mean(0) > 0).to(stack.dtype) * 2 - 1
            agree = (((stack * flag) > 0) * stack).abs()
            merged[key] = agree.max(0).values * flag
        out.append(merged)
    return out


def set_tensors(prefix: str, adapter: AdapterLike) -> dict[str, torch.Tensor]:
    """``<prefix>.<block>.<key>`` for every tensor of an adapter (CPU, contiguous)."""
    return {
        f"{prefix}.{i}.{k}": t.detach().cpu().contiguous()
        for i, a in enumerate(adapter)
        for k, t in a.items()
    }


def load_set(
    tensors: dict[str, torch.Tensor], prefix: str, sites: Sequence[Site], rank: int, device: torch.device
) -> AdapterSet:
    """:func:`set_tensors`' form back, each tensor checked against its block's shape."""
    out: AdapterSet = []
    for i, s in enumerate(sites):
        want = {"down_w": (rank, s.c_in), "down_b": (rank,), "up_w": (s.c_out, rank), "up_b": (s.c_out,)}
        a = {}
        for key, shape in want.items():
            t = need(tensors, f"{prefix}.{i}.{key}")
            if tuple(t.shape) != shape:
                raise TaskError(f"{prefix}.{i}.{key}: shape {tuple(t.shape)}, expected {shape}")
            a[key] = t.float().to(device)
        out.append(a)
    return out


# ---------------------------------------------------------------------------------------------- statistics
@dataclasses.dataclass
class ClassGaussian:
    """A class's statistics: its mean (d,) and a factor F (n, d) of its covariance, cov = F^T F + 1e-4 I
    (F: the centred features over sqrt(n - 1); their R factor when n > d)."""

    mean: torch.Tensor
    factor: torch.Tensor

    def covariance(self, storage: str) -> torch.Tensor:
        """The release's ``cls_cov`` as a matrix: the full covariance, or its diagonal (``variance``)."""
        F_ = self.factor
        if storage == "variance":
            return torch.diag((F_ * F_).sum(0) + RIDGE)
        return F_.T @ F_ + RIDGE * torch.eye(F_.shape[1], dtype=F_.dtype)


def class_gaussians(h: torch.Tensor, y: torch.Tensor, classes: Iterable[int]) -> dict[int, ClassGaussian]:
    """Per class of ``classes``: the mean and covariance factor of its rows of ``h`` (float32, CPU; the
    release's unbiased ``torch.cov``)."""
    out = {}
    for c in classes:
        x = h[y == c].float().cpu()
        mu = x.mean(0)
        f = (x - mu) / math.sqrt(max(len(x) - 1, 1))
        if f.shape[0] > f.shape[1]:
            f = torch.linalg.qr(f.double(), mode="r").R.float()
        out[int(c)] = ClassGaussian(mu, f.contiguous())
    return out


def cholesky(cov: torch.Tensor) -> torch.Tensor:
    """L with L L^T = cov (float32, as ``MultivariateNormal`` factors it); more ridge where float32 fails."""
    L, info = torch.linalg.cholesky_ex(cov)
    ridge = RIDGE
    while int(info) != 0:
        ridge *= 10
        L, info = torch.linalg.cholesky_ex(cov + ridge * torch.eye(len(cov), dtype=cov.dtype))
    return L


def pseudo_features(
    means: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch's pseudo-features: ``n`` draws ``mean + L eps`` per class (``eps`` N(0, I) from
    ``generator``, class after class), then one shuffle of all. Returns (C n, d) features and (C n,)
    column indices (the class's position in ``means``)."""
    xs = []
    for mu, L in zip(means, factors):
        eps = torch.randn(n, len(mu), generator=generator)
        xs.append(mu + (L @ eps.T).T)
    x = torch.cat(xs)
    y = torch.arange(len(means)).repeat_interleave(n)
    perm = torch.randperm(len(x), generator=generator)
    return x[perm], y[perm]


def align_heads(
    logits: Callable[[torch.Tensor], torch.Tensor],
    params: list[nn.Parameter],
    means: Sequence[torch.Tensor],
    covs: Sequence[torch.Tensor],
    *,
    n: int,
    epochs: int,
    lr: float,
    wd: float,
    period: int,
    generator: torch.Generator,
    device: torch.device,
) -> list[float]:
    """The releases' ``classifer_align``: for ``epochs`` epochs, :func:`pseudo_features` of every seen class
    (``n`` each) and one SGD step (momentum 0.9, weight decay ``wd``) per class on batches of ``n`` of them,
    the cross-entropy of ``logits(x)`` over the seen classes; the learning rate follows
    ``CosineAnnealingLR(T_max=period)`` stepped per epoch (TUNA: 5, MOS: the epochs). Returns the losses."""
    factors = [cholesky(c.float()) for c in covs]

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = pseudo_features(means, factors, n, generator)
        for i in range(len(means)):
            yield x[i * n : (i + 1) * n].to(device), y[i * n : (i + 1) * n].to(device)

    return cosine_sgd(params, batches, logits, lr=lr, weight_decay=wd, epochs=epochs, period=period)


# ---------------------------------------------------------------------------------------------- training
def fit_epochs(
    clf: Any,
    task: Task,
    k: int,
    groups: Callable[[], list[dict[str, Any]]],
    step_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    after_step: Callable[[], None] | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> tuple[list[float], tuple[torch.Tensor | None, torch.Tensor | None, Any]]:
    """Open task k (``clf.begin_task``), then train ``groups()`` (``params`` with an ``lr_scale``) for
    ``train.epochs`` epochs of the task's batches (:meth:`ContinualClassifier.batches`: the cached prefix
    outputs shuffled by the task's generator, or augmented images) under ``baseline.optimizer`` (SGD with
    momentum in both releases) and ``baseline.schedule``; ``step_loss(z, y)`` returns (the classification
    loss, the auxiliary loss) of a batch with global labels ``y``; ``after_step`` runs after each step
    (MOS's pull), ``after_epoch(epoch)`` after each epoch (MoAL's moving average). Returns the
    classification losses and the task's inputs ``(z, y, loader)``."""
    cfg, b = clf.config, clf.options_
    seed, z, y_all, loader = clf.task_inputs(task, k)
    clf.begin_task(k, z, loader)
    opt = OPTIMIZERS.get(b.optimizer)(groups(), b, clf.weight_decay(k))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    steps = cfg.train.epochs * math.ceil(len(task.train) / cfg.train.batch_size)
    bar = progress_bar(total=steps, desc=f"task {k + 1}: train {clf.name}", enabled=clf.progress)
    losses: list[float] = []
    clf.train_log_ = []
    for epoch in range(cfg.train.epochs):
        for group in opt.param_groups:
            group["lr"] = epoch_lr(b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, cfg.train.epochs)
        for zb, yb in clf.batches(z, y_all, loader, g):
            with clf.embedder_.autocast():
                loss, aux = step_loss(zb.to(clf.device_), yb.to(clf.device_))
            opt.zero_grad(set_to_none=True)
            (loss + aux).backward()
            if b.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for grp in opt.param_groups for p in grp["params"]], b.clip_grad
                )
            opt.step()
            if after_step is not None:
                after_step()
            losses.append(float(loss.detach()))
            clf.train_log_.append(
                {"epoch": epoch + 1, "step": len(losses), "loss": losses[-1], "lr": opt.param_groups[0]["lr"],
                 "penalty": float(torch.as_tensor(aux).detach())}
            )  # fmt: skip
            bar.update(1)
            if len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if after_epoch is not None:
            after_epoch(epoch)
    bar.close()
    opt.zero_grad(set_to_none=True)
    return losses, (z, y_all, loader)


# -------------------------------------------------------------------------------------- the learners' base
class AdapterClassifier(ContinualClassifier):
    """A learner with one parallel adapter per task (TUNA, MOS): the open adapter ``open_`` (trained; a task
    starts from where the previous one ended, as both releases carry ``cur_adapter`` on), each task's copy
    of it when its training ends (``adapters_``), every seen class's :class:`ClassGaussian` (``stats_``)
    and one head per task (``heads_``). A subclass trains a task (:meth:`learn_task`) and predicts
    (:meth:`infer`)."""

    Options: type = AdapterOptions

    def _setup(self) -> None:
        self.sites_ = sites_of(self.backbone_)
        self.open_: list[dict[str, nn.Parameter]] | None = None
        self.adapters_: list[AdapterSet] = []
        self.stats_: dict[int, ClassGaussian] = {}
        self._backup: dict[str, Any] | None = None

    def embed(self, z: torch.Tensor, adapter: AdapterLike, train: bool = False, **kw: Any) -> torch.Tensor:
        """(B, d) embeddings of prefix outputs under ``adapter`` (``train``: the bottleneck's dropout on)."""
        b = self.options_
        return adapted_suffix(
            self.backbone_, z, adapter, self.sites_, scale=b.adapter_scale, dropout=b.adapter_dropout,
            training=train, **kw,
        )  # fmt: skip

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """Training: under the open adapter; inference: under the last task's adapter."""
        assert self.open_ is not None
        return self.embed(z, self.open_ if train else self.adapters_[-1], train)

    def trainable(self) -> list[nn.Parameter]:
        return [p for a in self.open_ or [] for p in a.values()]

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        """Keep what task k may change (the open adapter, the old heads) and open the adapter at task 1."""
        self._backup = {
            "open": None if self.open_ is None else clone_set(self.open_),
            "heads": [{n: t.clone() for n, t in h.state_dict().items()} for h in self.heads_],
        }
        if self.open_ is None:
            self.open_ = init_set(self.sites_, self.options_.adapter_rank, self.device_)

    def abort_task(self, k: int) -> None:
        del self.adapters_[k:]
        seen = set(self.labels_)
        for c in [c for c in self.stats_ if c not in seen]:
            del self.stats_[c]
        if self._backup is not None:
            for h, sd in zip(self.heads_, self._backup["heads"]):
                h.load_state_dict(sd)
            old = self._backup["open"]
            self.open_ = None if old is None else [{n: nn.Parameter(t) for n, t in a.items()} for a in old]

    def _end_training(self, task: Task, k: int, head: nn.Linear) -> None:
        """Task k's head and classes join the learner; its adapter is kept as it is now."""
        assert self.open_ is not None
        classes = [int(c) for c in task.classes]
        head.requires_grad_(False)
        self.heads_.append(head)
        self.task_classes_.append(classes)
        self.labels_ += classes
        self.adapters_.append(clone_set(self.open_))

    @torch.no_grad()
    def plain_features(
        self, task: Task, z: torch.Tensor | None, y: torch.Tensor | None,
        adapter: AdapterLike,
        before_block: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The task's un-augmented training images under ``adapter``, class by class in the task's order, in
        batches of 3 ``train.batch_size`` (the releases' ``_compute_mean``): (N, d) float32 on the CPU and
        (N,) labels."""
        if z is None or y is None:
            z, y = self.prefix_dataset(task.train, f"task {task.index + 1}: embedding training images")
        bs = 3 * self.config.train.batch_size
        hs, ys = [], []
        for c in [int(c) for c in task.classes]:
            zc = z[y == c]
            for chunk in zc.split(bs):
                with self.embedder_.autocast():
                    hs.append(
                        self.embed(chunk.to(self.device_), adapter, before_block=before_block).float().cpu()
                    )
                ys.append(torch.full((len(chunk),), c, dtype=torch.long))
        return torch.cat(hs), torch.cat(ys)

    def _generator(self, k: int) -> torch.Generator:
        """The pseudo-features' generator of the alignment after task k."""
        return torch.Generator().manual_seed(task_seed(self.config.seed, k, 700))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The heads, every task's adapter ``adapter.<t>.<block>.<key>``, the open adapter ``adapter.open.*``
        and every seen class's ``class_stats.<class>.{mean,factor}``."""
        out = super().state_tensors()
        for t, a in enumerate(self.adapters_):
            out.update(set_tensors(f"adapter.{t}", a))
        if self.open_ is not None:
            out.update(set_tensors("adapter.open", self.open_))
        for c, s in self.stats_.items():
            out[f"class_stats.{c}.mean"], out[f"class_stats.{c}.factor"] = (
                s.mean.contiguous(),
                s.factor.contiguous(),
            )
        return out

    @torch.no_grad()
    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`state_tensors` back, each adapter's shapes checked against the backbone's blocks."""
        r, dev = self.options_.adapter_rank, self.device_
        self.adapters_ = [
            load_set(tensors, f"adapter.{t}", self.sites_, r, dev) for t in range(self.num_tasks)
        ]
        if self.num_tasks:
            opened = load_set(tensors, "adapter.open", self.sites_, r, dev)
            self.open_ = [{n: nn.Parameter(t) for n, t in a.items()} for a in opened]
        d = self.embed_dim
        for c in self.labels_:
            mu, f = need(tensors, f"class_stats.{c}.mean"), need(tensors, f"class_stats.{c}.factor")
            if mu.shape != (d,) or f.ndim != 2 or f.shape[1] != d:
                raise TaskError(f"class_stats.{c}: mean {tuple(mu.shape)}, factor {tuple(f.shape)}; d = {d}")
            self.stats_[c] = ClassGaussian(mu.float(), f.float())
