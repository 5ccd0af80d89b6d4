"""``benchmark.download`` (issue 26): when CIFAR is not under ``benchmark.data``, torchvision downloads it
there if asked (online); offline, or without the switch, one line says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchvision

from proteus.config import resolve_config
from proteus.streams import build_benchmark
from proteus.streams.errors import DataNotFoundError


def _cfg(root: Path, download: bool):  # noqa: ANN202
    return resolve_config("cifar10", dotted={"benchmark.data": str(root), "benchmark.download": download})


def test_missing_data_names_the_switch(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="benchmark.download=true"):
        build_benchmark(_cfg(tmp_path / "nothing", False).benchmark)


def test_download_asks_torchvision_and_says_when_it_fails(tmp_path: Path, monkeypatch) -> None:
    calls = []

    class Offline:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, train, download))
            raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", Offline)
    root = tmp_path / "cifar"
    with pytest.raises(DataNotFoundError, match=r"cifar10: could not download it into .*cifar.*put the data"):
        build_benchmark(_cfg(root, True).benchmark)
    assert calls == [(str(root), True, True)]


def test_download_is_a_per_task_key() -> None:
    from proteus.config import per_task

    assert per_task("benchmark.download")
