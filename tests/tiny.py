"""Tiny settings shared by the end-to-end tests: random backbone weights (no download), 32 px,
two adapted blocks, one epoch, small head and signatures. Every test that runs the real CLI builds
its arguments from here, so a change to what "tiny" means is made once."""

from __future__ import annotations

TINY_SETS = [
    "backbone.pretrained=false",
    "backbone.img_size=32",
    "backbone.adapt_last=2",
    "train.epochs=1",
    "head.rp_dim=256",
    "signature.max_components=2",
    "signature.max_iter=20",
    "signature.rank=8",
]


def sets(*extra: str, base: list[str] = TINY_SETS) -> list[str]:
    """``--set`` arguments for the tiny settings plus ``extra`` (later keys win)."""
    return [a for s in [*base, *extra] for a in ("--set", s)]
