"""`proteus bench`: the harness runs end to end (tiny sizes) and writes the JSON contract.

No timing is asserted: the figures depend on the machine. Only the shape of the report is checked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "perf"))
from harness import FIGURES, format_table  # noqa: E402

from proteus.cli import main

pytestmark = pytest.mark.slow  # the whole harness at tiny sizes: about a minute on 2 cores


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "tmp.json"
    mp = pytest.MonkeyPatch()
    mp.setenv("PROTEUS_BENCH_TINY", "1")
    mp.delenv("PROTEUS_BENCH_ONLY", raising=False)
    try:
        assert main(["bench", "--quick", "--out", str(out), "--device", "cpu"]) == 0
    finally:
        mp.undo()
    return json.loads(out.read_text()), out


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_every_figure_is_a_number_or_null_with_reason(report: tuple[dict, Path]) -> None:
    rep, _ = report
    required = [
        "predict_vs_limit",
        "predict_vs_peft_mixed_batch",
        "dpgmm_speedup_vs_sklearn",
        "dpgmm_heldout_loglik_rel_diff",
        "train_step_overhead",
        "kb_mb_per_task",
        "kb_retrieval_acc_delta",
        "ridge_sweep_speedup",
    ]
    assert set(required) == set(FIGURES)
    for key in required:
        rec = rep[key]
        assert {"value", "target", "op", "pass", "reason", "details"} <= set(rec), key
        assert rec["target"] == FIGURES[key][1] and rec["op"] == FIGURES[key][0], key
        if rec["value"] is None:
            assert isinstance(rec["reason"], str) and rec["reason"], key
            assert rec["pass"] is None, key
        else:
            assert _is_number(rec["value"]), (key, rec["value"])
            assert isinstance(rec["pass"], bool), key


def test_device_settings_latency_and_memory(report: tuple[dict, Path]) -> None:
    rep, out = report
    assert rep["device"]["type"] == "cpu" and rep["settings"]["mode"] == "tiny"
    lat = rep["latency_vs_m"]
    if lat["value"] is None:
        assert lat["reason"]
    else:
        assert [p["m"] for p in lat["value"]] == sorted(p["m"] for p in lat["value"])
        for p in lat["value"]:
            assert all(_is_number(p[k]) for k in ("ours_s", "limit_s", "ratio")), p
        assert lat["paper"]["cifar100"]["m"][-1] == 50
        assert Path(lat["figure"]) == out.with_suffix(".png") and out.with_suffix(".png").is_file()
    assert "predict_vs_limit_adapt_last6" in rep["beyond_paper"]
    assert set(rep["memory"]) >= {"predict", "train"}
    # the figures the test can check without timing: the default storage is exact and the two fits agree
    if rep["kb_retrieval_acc_delta"]["value"] is not None:
        kb = rep["kb_retrieval_acc_delta"]["details"]
        assert kb["agreement"] >= 99.5 and abs(rep["kb_retrieval_acc_delta"]["value"]) <= 0.5, kb
        assert rep["kb_mb_per_task"]["details"]["signature_bytes"] > 0
    if rep["dpgmm_heldout_loglik_rel_diff"]["value"] is not None:
        assert rep["dpgmm_heldout_loglik_rel_diff"]["value"] < 1e-6


def test_table_lists_every_figure(report: tuple[dict, Path]) -> None:
    table = format_table(report[0])
    for key in FIGURES:
        assert key in table
    assert "target" in table and "measured" in table


def test_without_a_checkout_bench_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """An installed wheel has no tools/perf/: one line naming the missing script, exit code 2."""
    import proteus.cli.commands as commands

    monkeypatch.setattr(commands, "__file__", str(tmp_path / "site-packages" / "proteus" / "cli" / "x.py"))
    assert main(["bench", "--quick", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: proteus bench runs the performance harness of a source checkout")
    assert str(tmp_path / "tools" / "perf" / "run.py") in err and err.count("\n") == 1


def test_the_performance_page_states_each_figures_declared_target() -> None:
    """Each ``### `figure` — target OP V`` of docs/performance.md matches :data:`FIGURES` (no slow run)."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    ops = {"≥": ">=", "≤": "<="}
    stated = {
        name: (ops[op], float(v)) for name, op, v in re.findall(r"`(\w+)` — target ([≥≤]) ([\d.]+)", page)
    }
    assert stated == FIGURES, "docs/performance.md's '### `figure` — target' headings differ from FIGURES"
