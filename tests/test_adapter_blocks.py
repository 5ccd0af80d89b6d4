"""``adapter.blocks``: which of the adaptable blocks carry adapters (the paper's LoRA on the first 8 or 4
blocks, l. 1034), and the parameters a task trains (the paper's parameter count)."""

from __future__ import annotations

import pytest

from proteus.adapters import AdaptedBackbone
from proteus.backbones import build_backbone
from proteus.backbones.base import block_indices
from proteus.config import ConfigError, resolve_config
from proteus.core.parts import trainable_params


def _blocks(model: AdaptedBackbone) -> set[int]:
    return {int(name.split("blocks.")[1].split(".")[0]) for name in model.units}


def test_first_last_and_listed_blocks() -> None:
    """ViT-Ti has 12 blocks: first:8 and first:2/3 are blocks 0-7 (the paper's first 8), last:4 the
    last four, a list those blocks; with adapt_last the indices count from the first adaptable block."""
    cases = (("all", range(12)), ("first:8", range(8)), ("first:2/3", range(8)), ("first:1/3", range(4)),
             ("last:4", range(8, 12)), ("0,5,11", (0, 5, 11)))  # fmt: skip
    for spec, want in cases:
        bb = build_backbone("vit_ti16", pretrained=False, img_size=32, adapt_blocks=spec)
        assert _blocks(AdaptedBackbone(bb)) == set(want), spec
        assert bb.split == 0  # nothing frozen: the prefix is not cached
    bb = build_backbone("vit_ti16", pretrained=False, img_size=32, adapt_last=6, adapt_blocks="first:2/3")
    assert bb.split == 6 and _blocks(AdaptedBackbone(bb)) == {6, 7, 8, 9}
    assert bb.identity()["adapted"] == [0, 1, 2, 3]  # a knowledge base records the placement
    assert "adapted" not in build_backbone("vit_ti16", pretrained=False, img_size=32).identity()


def test_bad_block_specs_name_the_key() -> None:
    with pytest.raises(ConfigError, match="adapter.blocks=first:13: 13 blocks, but the backbone adapts 12"):
        block_indices("first:13", 12)
    for bad in ("first:0", "middle:3", "1,x", "first:3/2"):
        with pytest.raises(ConfigError, match="adapter.blocks must be all, first:K"):
            block_indices(bad, 12)
    with pytest.raises(ConfigError, match="adapter.blocks must be all"):
        resolve_config(benchmark="quickstart", method="proteus-paper", sets=["adapter.blocks=halfway"])


def test_trainable_params_count_the_tasks_tensors() -> None:
    """A task's count: its A and B on every adapted map (q and v rows of each block's qkv), its learned S
    over the older directions, and the training head's (d + 1) per class."""
    bb = build_backbone("vit_ti16", pretrained=False, img_size=32, adapt_blocks="first:4")
    model = AdaptedBackbone(bb)
    d, r = bb.embed_dim, 4
    maps = 2 * 4  # q and v of 4 blocks
    model.begin_task(r, "learned", True, seed=0)
    model.end_task()
    assert trainable_params(model, "learned", 10) == maps * 2 * d * r + (d + 1) * 10
    model.begin_task(r, "learned", True, seed=1)
    model.end_task()  # the second task also learns S over the first task's r directions per map
    assert trainable_params(model, "learned", 10) == maps * (2 * d * r + r) + (d + 1) * 10
    assert trainable_params(model, "zero", 10) == maps * 2 * d * r + (d + 1) * 10
