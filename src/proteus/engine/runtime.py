"""What every learner runs on, PROTEUS and the baselines alike: the device, the frozen pre-trained backbone,
its evaluation and training transforms, the embedding passes (the frozen prefix once per image, under
autocast at the run's precision: :class:`~proteus.engine.embedder.Embedder`) and the per-task seeds (the
summary of a training curve: :func:`proteus.engine.records.loss_summary`).

A learner builds its runtime once (:meth:`Runtime.build`), wraps the backbone with its own state (LoRA
units, prompts) and asks the runtime for an embedder over its own prefix function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from proteus import distributed as dist
from proteus.backbones import Backbone, build_backbone
from proteus.backbones.transforms import build_transform
from proteus.config import RunConfig
from proteus.engine.embedder import Embedder

__all__ = ["Runtime", "task_seed"]


def task_seed(seed: int, k: int, offset: int = 0) -> int:
    """A baseline's seed of task k (0-based); ``offset`` names another stream of the same task (HiDe-Prompt's
    task-identity head, its alignments). PROTEUS's own: :func:`proteus.core.parts.task_seed`."""
    return seed * 1000 + k + offset


@dataclass
class Runtime:
    """The device, the frozen backbone (on the device; :class:`~proteus.backbones.Backbone` freezes itself)
    and its transforms."""

    config: RunConfig
    device: torch.device
    backbone: Backbone
    eval_transform: Callable[[Any], torch.Tensor]
    train_transform: Callable[[Any], torch.Tensor]

    @classmethod
    def build(cls, cfg: RunConfig) -> Runtime:
        device = dist.device_for_rank(cfg.device)
        b = cfg.backbone
        backbone = build_backbone(
            b.name, pretrained=b.pretrained, weights=b.weights, img_size=b.img_size, adapt_last=b.adapt_last,
            adapt_blocks=cfg.adapter.blocks,
        )  # fmt: skip
        backbone.to(device)
        return cls(
            cfg,
            device,
            backbone,
            build_transform(backbone.data_config, train=False),
            build_transform(backbone.data_config, train=True, augment=cfg.train.augment),
        )

    def embedder(self, model: Any, progress: bool) -> Embedder:
        """Embedding passes over ``model`` (anything with ``prefix(x)``; an adapted backbone also embeds
        its suffix under task compositions) at the run's batch size, workers and precision."""
        cfg = self.config
        return Embedder(
            model, self.device, cfg.eval.batch_size, cfg.train.num_workers, self.eval_transform,
            progress=progress, precision=cfg.precision,
        )  # fmt: skip
