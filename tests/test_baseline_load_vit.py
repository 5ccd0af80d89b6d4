"""The round trip of tests/test_baseline_load.py for the baselines on a ViT (the prompt methods): ``learn``
task by task equals ``run``, and ``evaluate``, ``predict`` and ``serve`` work on the knowledge base. A file
of its own so that pytest-xdist runs it beside the other half."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_baseline_load import ON_VIT, check_learn_equals_run_and_serves


@pytest.mark.slow
@pytest.mark.parametrize("method", ON_VIT)
def test_learn_task_by_task_equals_run_and_the_kb_serves(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check_learn_equals_run_and_serves(method, tmp_path, capsys)
