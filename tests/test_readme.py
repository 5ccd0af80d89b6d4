"""The README says what the code does: its Python example runs as written (every ```python block, verbatim,
in a fresh directory; it uses the quickstart's pretrained MobileNetV2 and skips when the weights are neither
in torch's hub cache nor in ``../shared/weights``), its demo table holds the numbers recorded by
``tools/parity/results_parity.py`` for the methods ``make demo`` compares, its methods table names every
registered method, and it stays short; the figures that move with the thread count (the README's
``proteus-paper`` sentence, docs/reliability.md's table of 1 against 2 threads) are the recorded ones
(``tools/parity/`` with one thread, ``tools/parity/threads2/`` with two); its times of ``make demo`` are
``tools/perf/busy_demo.py``'s record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from proteus.backbones.weights import WeightsError, ensure_weights

README = Path(__file__).resolve().parents[1] / "README.md"
SHARED_WEIGHTS = README.parent.parent / "shared" / "weights"
PARITY = README.parent / "tools" / "parity"
RELIABILITY = README.parent / "docs" / "reliability.md"
#: a row of the demo's table: | `method` | final accuracy | retrieval at the last task or - |
DEMO_ROW = re.compile(r"^\| `([a-z0-9-]+)` \| ([0-9.]+) \| ([0-9.]+|-) \|$", flags=re.M)


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


def test_the_demo_table_is_what_the_recorded_runs_give() -> None:
    """Each row against ``tools/parity/<method>.json`` (quickstart, seed 0, one thread, the public CLI), and
    the rows are the methods ``make demo`` compares."""
    rows = DEMO_ROW.findall(README.read_text())
    demo = re.search(r"--methods ([a-z0-9,-]+)", (README.parent / "Makefile").read_text())
    assert demo and [m for m, _, _ in rows] == demo.group(1).split(","), rows
    for method, acc, retrieval in rows:
        rec = json.loads((PARITY / f"{method}.json").read_text())
        assert rec["benchmark"] == "quickstart" and rec["seed"] == 0, method
        assert acc == f"{rec['final_avg_acc']:.2f}", (method, acc, rec["final_avg_acc"])
        last = "-" if rec["retrieval_acc"] is None else f"{rec['retrieval_acc'][-1]:.2f}"
        assert retrieval == last, (method, retrieval, last)


def recorded(method: str, threads: int) -> dict:
    """``method``'s quickstart recording with ``threads`` threads (1 or 2)."""
    return json.loads((PARITY / ("" if threads == 1 else "threads2") / f"{method}.json").read_text())


def pct(x: float) -> str:
    return f"{x:.2f}"


def test_the_readme_s_proteus_paper_figures_are_the_recorded_ones() -> None:
    text = " ".join(README.read_text().split())
    m = re.search(r"recorded here: ([0-9.]+)% with one thread, ([0-9.]+)% with two\) while its retrieval "
                  r"stays at ([0-9.]+)%", text)  # fmt: skip
    assert m, "the README's proteus-paper sentence changed: update this test with it"
    one, two = recorded("proteus-paper", 1), recorded("proteus-paper", 2)
    assert m.groups() == (pct(one["final_avg_acc"]), pct(two["final_avg_acc"]), pct(one["retrieval_acc"][-1]))
    assert one["retrieval_acc"] == two["retrieval_acc"]  # retrieval does not move with the threads


def test_reliability_s_thread_table_is_the_recorded_one() -> None:
    text = " ".join(RELIABILITY.read_text().split())
    for method in ("proteus", "proteus-lda", "frozen", "ranpac-accumulated"):
        assert recorded(method, 1) == recorded(method, 2), f"{method} moved with the thread count"
    assert f"| `proteus` | identical ({pct(recorded('proteus', 1)['final_avg_acc'])};" in text
    one, two = recorded("ranpac", 1), recorded("ranpac", 2)
    assert one["final_avg_acc"] == two["final_avg_acc"]
    pairs = ", ".join(
        f"{pct(a)} / {pct(b)}" for a, b in zip(one["acc_matrix"][2][:3], two["acc_matrix"][2][:3])
    )
    final = pct(one["final_avg_acc"])
    row = f"final accuracy identical ({final}); the accuracies after task 3 move: tasks 1-3 "
    assert row + pairs + "%" in text, row + pairs
    there = f"({pct(one['avg_acc'][2])}% there with one thread, {pct(two['avg_acc'][2])}% with two)"
    assert there in text, there


def test_the_methods_table_names_every_method_and_the_readme_is_short() -> None:
    from proteus.config import METHODS

    text = README.read_text()
    missing = [m for m in METHODS.names() if f"`{m}`" not in text]
    assert not missing, f"methods the README's table does not name: {missing}"
    assert len(text.splitlines()) <= 150


#: tools/perf/busy_demo.py's record of `make demo` (its two commands) quiet and beside two busy processes
DEMO_LOAD = README.parent / "tools" / "perf" / "records" / "demo-load.json"


def test_the_demo_s_times_are_the_measured_ones() -> None:
    """The README's times of ``make demo`` are those of the record: wall and CPU time with nothing else
    started (and the load average it began at), beside two busy processes (and the CPU ratio), and, where
    the record has it, with the spinning wait of earlier releases beside the same two."""
    rec = json.loads(DEMO_LOAD.read_text())
    run = {(r["policy"], r["busy"]): r for r in rec["runs"]}
    quiet, loaded = run["passive", 0], run["passive", 2]
    for r in rec["runs"]:  # threads change when a thread works, not what it computes
        assert r["final_avg_acc"] == quiet["final_avg_acc"], r["policy"]

    def minutes(seconds: float) -> str:
        return f"{seconds / 60:.1f} min"

    text = " ".join(README.read_text().split())
    want = (
        f"{minutes(quiet['wall_s'])} of wall time and {minutes(quiet['cpu_s'])} of CPU time with nothing "
        f"else started on the {rec['cores']}-core machine (load average {quiet['load_before']:.1f} when it "
        f"began); beside two busy processes on the same cores {minutes(loaded['wall_s'])} of wall time and "
        f"{minutes(loaded['cpu_s'])} of CPU time ({loaded['cpu_s'] / quiet['cpu_s']:.2f}x)"
    )
    assert want in text, want
    if ("spinning", 2) in run:  # the wait policy of earlier releases beside the same busy processes
        spinning = minutes(run["spinning", 2]["cpu_s"])
        said = f"{spinning} of CPU time with the spinning wait of earlier releases"
        assert said in text, said
