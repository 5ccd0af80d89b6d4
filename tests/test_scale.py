"""The scale check (tools/studies/scale_check.py) at a reduced size: the signature storage of each recipe
must retrieve what full covariances of the same fit retrieve, and the default storage must be exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "studies"))

from scale_check import STORAGES, Shape, SyntheticStream, run_recipe  # noqa: E402

from proteus.config import resolve_config  # noqa: E402

# components of ~60-100 points in d = 48: the old default budget (rank 8 here, 128 at d = 768) cuts them
SMALL = Shape(d=48, tasks=3, classes=4, train=700, test=150, rank=12, sep=1.0, seed=1)


@pytest.mark.parametrize("method", ["proteus-paper", "proteus"])
def test_default_storage_agrees_with_full_covariances(method: str) -> None:
    cfg = resolve_config(None, method).signature
    default = {"covariance": cfg.covariance, "rank": cfg.rank, "storage_dtype": cfg.storage_dtype}
    storages = {"full": STORAGES["full"], "default": default, "shared": STORAGES["shared"]}
    r = run_recipe(SyntheticStream(SMALL), method, rp_dim=0, storages=storages)
    opts = r["options"]
    assert opts["full"]["agreement"] == 100.0
    assert opts["default"]["agreement"] >= 99.5, opts["default"]
    assert opts["shared"]["agreement"] >= 99.5, opts["shared"]
    for o in opts.values():
        assert 0.0 <= o["retrieval"] <= 100.0 and 0.0 <= o["final"] <= 100.0 and o["bytes_per_task"] > 0


def test_defaults_store_exactly() -> None:
    """No method stores approximate covariances by default: full (float32), or shared with every factor
    row (float16 rows, ~1e-5 of float32: "auto"); float32 stays available as the exact option."""
    for method in ("proteus-paper", "proteus"):
        cfg = resolve_config(None, method).signature
        assert cfg.covariance == "full" or (cfg.covariance == "shared" and cfg.rank is None), method
        assert cfg.storage_dtype == "auto", method
    assert STORAGES["full"]["storage_dtype"] == STORAGES["shared"]["storage_dtype"] == "float32"
