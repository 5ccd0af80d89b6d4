"""proteus: continual fine-tuning with provably accurate, parameter-free task retrieval.

An implementation of PROTEUS (Le, Bui, Hoang, Hoang; ICLR 2026 submission): adaptive LoRA
composition (Eq. 9, Eq. 15), DP-GMM multi-key signatures (Eq. 18) and RanPAC's LDA head (Eq. 23).

    from proteus import Proteus
    clf = Proteus.from_method("proteus", backbone="mobilenet_v2")
"""

from __future__ import annotations

from typing import Any

from proteus._version import __version__

__all__ = ["Prediction", "Proteus", "RunConfig", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: `import proteus` stays cheap (no torch) for the CLI's --help
    if name in ("Proteus", "Prediction"):
        from proteus.core import estimator

        return getattr(estimator, name)
    if name == "RunConfig":
        from proteus.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'proteus' has no attribute {name!r}")
