"""The README's Python example runs as written (issue 26): every ```python block, verbatim, in a fresh
directory. It uses the quickstart's pretrained MobileNetV2: the test skips when the weights are neither in
torch's hub cache nor in ``../shared/weights`` (``proteus weights fetch mobilenet_v2`` places them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proteus.backbones.weights import WeightsError, ensure_weights

README = Path(__file__).resolve().parents[1] / "README.md"
SHARED_WEIGHTS = README.parent.parent / "shared" / "weights"


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_has_a_python_example() -> None:
    blocks = python_blocks(README.read_text())
    assert blocks and all("from proteus import Proteus" in b for b in blocks[:1])


def test_readme_python_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        ensure_weights("mobilenet_v2", allow_download=False, allow_pypi=False, progress=False,
                       search_dirs=[SHARED_WEIGHTS])  # fmt: skip
    except WeightsError as e:
        pytest.skip(f"the README's example needs the MobileNetV2 weights (proteus weights fetch): {e}")
    monkeypatch.chdir(tmp_path)
    for block in python_blocks(README.read_text()):
        exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    match = re.search(r"([\d.]+)% correct", out)
    assert match and float(match.group(1)) > 80, out  # two digit tasks: near 100% in practice
    assert (tmp_path / "kb" / "manifest.json").exists()
