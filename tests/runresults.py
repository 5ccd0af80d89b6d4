"""A run's results.json as computed, for the tests that compare two runs: wall-clock figures (every key
naming ``seconds``) and the run's ``provenance`` (the time, the thread count, the commit) describe how a run
went, not what it computed, so they are left out; a test drops more keys with ``drop``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: results.json keys that describe a run, not its results
NOT_COMPUTED = ("provenance",)


def computed(d: Any, drop: Callable[[str], bool] = lambda key: False) -> Any:
    """``d`` (a results.json, or any part of one) without its wall-clock times, its provenance and the keys
    ``drop`` names, at every depth."""
    if isinstance(d, dict):
        return {k: computed(v, drop) for k, v in d.items()
                if "seconds" not in k and k not in NOT_COMPUTED and not drop(k)}  # fmt: skip
    if isinstance(d, list):
        return [computed(v, drop) for v in d]
    return d
