"""Embedding passes: the frozen prefix h_0(x) once per image, then the adapted suffix under any set of
task compositions in one batched forward (Algorithm 2's "embed every input under every adapter").

Under ``torchrun`` the passes are sharded by whole batches across ranks and gathered back in the
original order (:mod:`proteus.distributed`); every rank then holds the same result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from proteus import distributed as dist
from proteus.adapters import AdaptedBackbone
from proteus.backbones.base import Backbone, pooled_stats
from proteus.devices import autocast as precision_autocast
from proteus.engine.errors import TaskError
from proteus.progress import bar as progress_bar

__all__ = ["Embedder", "ImageDataset", "pooled_stats", "suffix_peak_bytes"]


class ImageDataset(Dataset):
    """Applies a transform to a (PIL image, label) dataset and returns (tensor, label)."""

    def __init__(self, ds: Dataset, transform: Callable) -> None:
        self.ds, self.transform = ds, transform

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img, y = self.ds[i]
        return self.transform(img), int(y)


class Embedder:
    """Runs the adapted backbone over datasets and cached prefix outputs.

    Args:
        model: the backbone with its adapters (for the prefix passes alone: anything with ``prefix(x)``,
            a baseline learner).
        device: where the forward passes run.
        precision: ``auto`` (bfloat16 autocast on CUDA, float32 elsewhere), ``bf16`` or ``fp32``
            (:mod:`proteus.devices`).
        batch_size: images per forward in evaluation passes (split across the requested compositions).
        num_workers: data-loader workers.
        transform: the evaluation transform (PIL image -> tensor).
        progress: show progress bars (only rank 0 shows them under torchrun).
    """

    #: on a CPU, an adapted forward takes at most as many images as keep the suffix's largest activation
    #: within this many bytes (:func:`suffix_peak_bytes`): on 2 cores, MobileNetV2 at 96 px and ViT-Ti/16
    #: at 224 px ran their m compositions 1.2-1.3x faster in chunks of 16-32 images than of 64, whose
    #: activations (39-56 MiB) leave the caches and, past glibc's 32 MiB mmap threshold, are fresh pages
    #: every time (docs/performance.md, "Images per forward on a CPU"). Elsewhere ``batch_size`` alone.
    cpu_chunk_bytes: int = 16 * 2**20

    def __init__(
        self,
        model: AdaptedBackbone,
        device: torch.device,
        batch_size: int,
        num_workers: int,
        transform: Callable,
        progress: bool = True,
        precision: str = "auto",
    ) -> None:
        self.model = model
        self.device = device
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transform
        self.progress = progress and dist.is_main()
        self.precision = precision
        self._peak_bytes: dict[tuple, int] = {}

    def images_per_forward(self, z: torch.Tensor, batch_size: int | None = None) -> int:
        """Images per adapted forward of prefix outputs shaped like ``z``: ``batch_size`` (default the
        evaluation batch size), on a CPU at most :attr:`cpu_chunk_bytes` over the suffix's largest
        activation per image (measured once per row shape)."""
        bs = batch_size or self.batch_size
        if self.device.type != "cpu" or not isinstance(self.model, AdaptedBackbone) or z.shape[0] == 0:
            return bs
        key = (tuple(z.shape[1:]), z.dtype)
        if key not in self._peak_bytes:
            with self.autocast():
                self._peak_bytes[key] = suffix_peak_bytes(self.model.backbone, z[:1].to(self.device))
        return max(1, min(bs, self.cpu_chunk_bytes // self._peak_bytes[key]))

    def loader(self, ds: Dataset, shuffle: bool, seed: int, batch_size: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        return DataLoader(
            ds, batch_size=batch_size, shuffle=shuffle, generator=g, num_workers=self.num_workers
        )

    def bar(self, it: Iterable, desc: str, total: int | None = None) -> Iterable:
        return progress_bar(it, desc=desc, total=total, enabled=self.progress)

    def autocast(self) -> AbstractContextManager[None]:
        return precision_autocast(self.device, self.precision)

    @torch.no_grad()
    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen prefix h_0(x) of a batch of transformed images (shared by every task), float32, computed
        as :meth:`prefix_dataset` computes it (under the same autocast)."""
        with self.autocast():
            return self.model.prefix(x.to(self.device)).float()

    @torch.no_grad()
    def prefix_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefix` of a batch and the pooled statistics of the backbone's tap blocks' outputs
        (``Backbone.tap_blocks``, :func:`pooled_stats`, concatenated) from the same forward: (N, D) float32
        on the CPU, D = 0 for a backbone without taps. The detector of inputs from no learned task reads
        them (:mod:`proteus.engine.novelty`)."""
        with self.autocast():
            z, stats = self.model.prefix_taps(x.to(self.device))
        self._tap_sizes = [t.shape[1] for t in stats]
        taps = torch.cat([t.float() for t in stats], 1).cpu() if stats else torch.zeros(x.shape[0], 0)
        return z.float(), taps

    def tap_sizes(self) -> list[int]:
        """The width of each tap block's statistics in the last :meth:`prefix_taps` ([] before any)."""
        return list(getattr(self, "_tap_sizes", None) or [])

    @torch.no_grad()
    def prefix_dataset(
        self, ds: Dataset, desc: str = "prefix", transform: Callable | None = None, taps: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Frozen-prefix outputs (float32) and labels of a dataset under the evaluation transform (or
        ``transform``); with ``taps`` also the tap statistics of :meth:`prefix_taps` (a third tensor)."""
        if len(ds) == 0:  # type: ignore[arg-type]
            raise TaskError(f"{desc}: empty dataset")
        zs, ys, ts = [], [], []
        bs = self.batch_size
        images: Dataset = ImageDataset(ds, transform or self.transform)
        n = len(images)  # type: ignore[arg-type]
        if dist.is_distributed():  # this rank's block of whole batches (proteus.distributed)
            mine = dist.shard_range(math.ceil(n / bs))
            images = Subset(images, range(mine.start * bs, min(mine.stop * bs, n)))
        for x, y in self.bar(self.loader(images, False, 0, bs), desc):
            if taps:
                z, t = self.prefix_taps(x)
                ts.append(t)
            else:
                with self.autocast():
                    z = self.model.prefix(x.to(self.device))
            zs.append(z.float())
            ys.append(y)
        z_all = dist.all_gather_rows(torch.cat(zs) if zs else None)
        y_all = dist.all_gather_rows(torch.cat(ys) if ys else None)
        assert z_all is not None and y_all is not None
        if not taps:
            return z_all, y_all
        t_all = dist.all_gather_rows(torch.cat(ts) if ts else None)
        assert t_all is not None
        return z_all, y_all, t_all

    @torch.no_grad()
    def embed_prefix(
        self,
        z: torch.Tensor,
        tasks: list[int] | None,
        kind: str = "task",
        batch_size: int | None = None,
        shard: bool = True,
    ) -> torch.Tensor:
        """Embed prefix outputs: (G, N, d) for the compositions of ``tasks`` (None: the frozen backbone,
        (1, N, d)). About one evaluation batch per forward in total (large batches run slower per image
        on CPU caches, and memory stays bounded for many tasks): up to ``batch_size`` images per chunk,
        and as many of the G compositions as fit beside them, so that each composition's group holds
        many images (a merged map runs one plain map per group: :mod:`proteus.adapters.model`).

        Under torchrun (and ``shard``) each rank embeds its block of whole image chunks and the result is
        gathered in the original order; every rank must then call this with the same ``z``."""
        bs = self.images_per_forward(z, batch_size)
        groups = tasks if tasks is not None else [None]
        G, N = len(groups), z.shape[0]
        per, per_g = (max(1, N), G) if G * N <= bs else (min(N, bs), max(1, bs // min(N, bs)))
        starts = range(0, N, per)
        sharded = shard and dist.is_distributed()
        if sharded:
            mine = dist.shard_range(len(starts))
            starts = starts[mine.start : mine.stop]
        out = []
        for i in starts:
            zb = z[i : i + per].to(self.device)
            parts = []
            for j in range(0, G, per_g):
                with self.autocast():
                    if tasks is None:
                        h = self.model.suffix(zb)[None]
                    else:
                        h = self.model.suffix(zb, tasks[j : j + per_g], kind)
                parts.append(h.float().cpu())
            out.append(torch.cat(parts, 0))
        if sharded:
            local = torch.cat(out, 1).transpose(0, 1) if out else None
            gathered = dist.all_gather_rows(local)  # (N, G, d), rows in the original order
            assert gathered is not None
            return gathered.transpose(0, 1).contiguous()
        return torch.cat(out, 1)

    @torch.no_grad()
    def embed_each(
        self, z: torch.Tensor, tasks: torch.Tensor, kind: str = "task", batch_size: int | None = None
    ) -> torch.Tensor:
        """(N, d): prefix output i under the composition of ``tasks[i]``. Rows are sorted by task and
        embedded ``batch_size`` at a time, each chunk in one forward with one group per task
        (:meth:`AdaptedBackbone.suffix_each`); the result is in the original order."""
        bs = self.images_per_forward(z, batch_size)
        order = torch.argsort(tasks.cpu(), stable=True)
        out = torch.empty(z.shape[0], self.model.embed_dim)
        for i in range(0, len(order), bs):
            idx = order[i : i + bs]
            with self.autocast():
                h = self.model.suffix_each(z[idx].to(self.device), tasks.cpu()[idx], kind)
            out[idx] = h.float().cpu()
        return out

    def embed_under(
        self, z: torch.Tensor, task: torch.Tensor, known: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """(N, d): prefix output i under task ``task[i]``'s adapter (:meth:`embed_each`); ``known[t]``
        (N, d) are embeddings under task t already computed (reused, not recomputed)."""
        task = task.cpu()
        out = torch.empty(z.shape[0], self.model.embed_dim)
        todo = torch.ones(len(task), dtype=torch.bool)
        for t, H in known.items():
            sel = task == t
            out[sel] = H[sel].float()
            todo &= ~sel
        if bool(todo.any()):
            idx = todo.nonzero().flatten()
            out[idx] = self.embed_each(z[idx.to(z.device)], task[idx])
        return out


@torch.no_grad()
def suffix_peak_bytes(backbone: Backbone, z1: torch.Tensor) -> int:
    """Bytes of the largest tensor a module of ``backbone``'s suffix outputs for the prefix output ``z1``
    (one image), the input included: an eager forward in evaluation mode with a hook on every module."""
    peak = z1.numel() * z1.element_size()

    def hook(_m: nn.Module, _i: Any, out: Any) -> None:
        nonlocal peak
        if isinstance(out, torch.Tensor):
            peak = max(peak, out.numel() * out.element_size())

    modes = {m: m.training for m in backbone.modules()}
    handles = [m.register_forward_hook(hook) for m in modes]
    backbone.eval()
    try:
        backbone.forward_suffix(z1)
    finally:
        for m, training in modes.items():
            m.training = training
        for h in handles:
            h.remove()
    return peak
