"""The docs show what the runs measured: every number of every record of `proteus reproduce` in docs/measured/
(tools/docs/record_reproduce.py) is the one docs/experiments.md shows in that table's section, and every
number of every record of `proteus compare` in docs/measured/compare/ (tools/docs/record_compare.py) the one
docs/retrieval.md shows in the section headed by the record's name."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "docs" / "measured").glob("*.json"))
COMPARED = sorted((ROOT / "docs" / "measured" / "compare").glob("*.json"))


def _section(page: str, heading: str) -> list[str]:
    """The lines of the section of ``page`` (under the repository) whose heading contains ``heading``, up to
    the next heading."""
    lines = (ROOT / page).read_text().splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("#") and heading in line]
    assert head, f"{page} has no heading naming {heading}"
    end = next((j for j in range(head[0] + 1, len(lines)) if lines[j].startswith("#")), len(lines))
    return lines[head[0] + 1 : end]


def _table(section: list[str], first: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (cells stripped of bold) of the section's Markdown table whose header
    starts with ``| first |``."""
    i = next((k for k, line in enumerate(section) if line.startswith(f"| {first} |")), None)
    assert i is not None, f"no table headed | {first} | in the section"
    split = lambda line: [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    rows = []
    for line in section[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(split(line))
    return split(section[i]), rows


def _cell(header: list[str], rows: list[list[str]], first: str, column: str) -> str:
    """The cell of the row whose first cell is ``first`` under the column titled ``column``."""
    assert column in header, f"no column {column!r} in {header}"
    found = [r for r in rows if r[0] == first]
    assert len(found) == 1, f"one line {first!r} expected, found {len(found)}"
    return found[0][header.index(column)]


def test_there_are_records() -> None:
    assert RECORDS, "docs/measured/ holds no record of a reproduce run"


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_the_page_shows_every_measured_number(path: Path) -> None:
    """Each number of the record in the cell of its variant's line under its metric's column, ours and the
    paper's: a number in another column (two columns swapped) fails."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from record_reproduce import TITLES, _fmt, _paper

    rec = json.loads(path.read_text())
    bench = path.stem.removeprefix(f"{rec['table']}-")
    section = _section("docs/experiments.md", f"`{rec['table']}` on {bench}")
    header, rows = _table(section, "variant")
    for row in rec["rows"]:
        first = f"{row['variant']} (`{row['method']}`)"
        title = TITLES.get(row["metric"], row["metric"])
        ours = _cell(header, rows, first, f"{title}: ours")
        want = "n/a" if row["skip"] else _fmt(row["ours_mean"], row["ours_std"])
        assert ours == want, f"{path.name}: {first} {title}: the page shows {ours}, the record {want}"
        paper = _cell(header, rows, first, f"{title}: paper")
        assert paper == _paper(row["paper"]), f"{path.name}: {first} {title} (paper): {paper}"


@pytest.mark.parametrize("path", COMPARED, ids=[p.stem for p in COMPARED])
def test_the_retrieval_page_shows_every_compared_number(path: Path) -> None:
    """Each method's figures in the cells under their columns (compare's titles)."""
    from proteus.experiment.compare import COLUMNS

    titles = {key: title for key, title, _ in COLUMNS}
    rec = json.loads(path.read_text())
    section = _section("docs/retrieval.md", f"`{rec['name']}`")
    header, rows = _table(section, "method")
    for method, figures in rec["methods"].items():
        for key, (mean, std, n) in figures.items():
            value = f"{mean:.2f}" + (f" ± {std:.2f}" if n > 1 else "")
            cell = _cell(header, rows, method, titles[key])
            assert cell == value, f"{path.name}: {method} {titles[key]}: the page shows {cell}, not {value}"


ALL = sorted((ROOT / "docs" / "measured").rglob("*.json"))


@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(ROOT / "docs" / "measured")) for p in ALL])
def test_every_record_carries_its_provenance(path: Path) -> None:
    """Commit, dirty state, package versions, device, threads and command (``unknown`` where they cannot be
    known: a record made before provenance was recorded says when it was committed and why), and the code
    it measured."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from records import PROVENANCE_KEYS

    rec = json.loads(path.read_text())
    prov = rec.get("provenance")
    assert isinstance(prov, dict), f"{path.name}: no provenance"
    assert not [k for k in PROVENANCE_KEYS if k not in prov], f"{path.name}: provenance lacks a field"
    commits = prov["commit"] if isinstance(prov["commit"], list) else [prov["commit"]]
    for c in commits:
        assert c == "unknown" or (len(c) == 40 and all(x in "0123456789abcdef" for x in c)), (path.name, c)
    if "unknown" in commits:
        assert prov.get("committed_in") or prov.get("source"), f"{path.name}: an unknown commit unexplained"
    assert prov["command"] and "NAME" not in prov["command"].split(), f"{path.name}: a command with NAME"
    assert rec.get("measures") and all((ROOT / m).exists() for m in rec["measures"]), path.name


@pytest.mark.skipif(
    not (ROOT / ".git").exists(), reason="not a git checkout: the records' commits cannot be read"
)
@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(ROOT / "docs" / "measured")) for p in ALL])
def test_a_stale_record_says_so(path: Path) -> None:
    """A record whose commit is unknown, or older than the last commit that changed the code it measured,
    says so (its ``stale`` note) and so does its page (the section starts with **Stale record.**); a fresh
    one says neither (``python tools/docs/stale.py`` sets both)."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from records import PAGES, STALE_MARK, staleness
    from stale import heading, kind

    rec = json.loads(path.read_text())
    why = staleness(rec)
    assert (rec.get("stale") is not None) == (why is not None), (
        f"{path.name}: {'stale (' + why + ')' if why else 'fresh'}, but its note says otherwise: run "
        "`python tools/docs/stale.py`"
    )
    page = PAGES.get(kind(path))
    if page is not None:
        section = [line for line in _section(page, heading(path, rec)) if line.strip()]
        marked = bool(section) and section[0].startswith(STALE_MARK)
        assert marked == (why is not None), (
            f"{page}, section of {path.name}: run `python tools/docs/stale.py`"
        )


@pytest.mark.skipif(
    not (ROOT / ".git").exists(), reason="not a git checkout: the records' commits cannot be read"
)
def test_a_change_of_the_measured_code_makes_a_record_stale() -> None:
    """The staleness check itself: a record made at the commit that last changed the code it measures is
    fresh; at that commit's parent it is stale (the paths it measures are the repository's, read from
    wherever the check runs); made at several commits, it is stale once any of them is."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from records import _git, staleness

    measured = "src/proteus/engine/novelty.py"
    last = (_git("log", "-1", "--format=%H", "--", f":(top){measured}") or "").strip()
    parent = (_git("rev-parse", f"{last}^") or "").strip()
    if not last or not parent or _git("diff", "--quiet", "HEAD", "--", f":(top){measured}") is None:
        pytest.skip("the measured file has uncommitted changes or no history here")

    def rec(commit: object) -> dict:
        return {"provenance": {"commit": commit, "dirty": False}, "measures": [measured]}

    assert staleness(rec(last)) is None
    assert "changed since" in (staleness(rec(parent)) or "")
    assert "changed since" in (staleness(rec([last, parent])) or "")
    dirty = {**rec([last]), "provenance": {"commit": [last], "dirty": [False, True]}}
    assert "uncommitted" in (staleness(dirty) or "")


RIVALS = [p for p in COMPARED if p.stem.startswith("rivals-")]


@pytest.mark.parametrize("path", RIVALS, ids=[p.stem for p in RIVALS])
@pytest.mark.parametrize("page", ["README.md", "docs/retrieval.md"])
def test_the_rivals_summary_shows_each_final_accuracy(path: Path, page: str) -> None:
    """The rivals' summary table (README and docs/retrieval.md) shows each recorded method's mean final
    accuracy on the line of the record's stream (its name after ``rivals-``)."""
    rec = json.loads(path.read_text())
    lines = (ROOT / page).read_text().splitlines()
    values = [f"{f['final_avg_acc'][0]:.2f}" for f in rec["methods"].values()]
    stream = rec["name"].removeprefix("rivals-")
    rows = [line for line in lines if line.startswith(f"| {stream} |")]
    assert any(all(v in row for v in values) for row in rows), f"{page}: no {stream} line shows {values}"


LONG = sorted((ROOT / "docs" / "measured" / "long").glob("*.json"))


@pytest.mark.parametrize("path", LONG, ids=[p.stem for p in LONG])
def test_the_performance_page_shows_each_long_stream_figure(path: Path) -> None:
    """Each run of a long-stream record (tools/docs/record_long.py) has its table line in the section of
    docs/performance.md naming the record, showing its ratios and its memory per task, part by part."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from record_long import kept_ratios

    rec = json.loads(path.read_text())
    section = _section("docs/performance.md", f"`{rec['name']}`")
    assert rec["command"] in "\n".join(section), f"{path.name}: the command is not shown"
    for run in rec["runs"]:
        label = f"| {run['label']} |"
        rows = [line for line in section if line.startswith(label) and " | <= " not in line]  # not a target
        assert len(rows) == 2, f"{path.name}: two lines starting {label!r} expected (figures, seconds)"
        want = ["—" if run.get(k) is None else f"{run[k]:.2f}" for k in kept_ratios(rec["runs"])]
        memory = ("rss_beyond_cache_mb_per_task", "page_cache_mb_per_task", "kb_mb_per_task")
        want += [f"{run[k]:.3f}" for k in memory] + [f"{v:.3f}" for v in run["parts_mb_per_task"].values()]
        seconds = [" / ".join(f"{v:g}" for v in pair) for pair in run["seconds"].values()]
        for row, expected in zip(rows, (want, seconds), strict=True):
            cells = [c.strip(" *") for c in row.strip("|").split("|")]
            assert cells[1 : 1 + len(expected)] == expected, (
                f"{path.name}: {label} shows {cells[1:]}, not {expected}"
            )


@pytest.mark.parametrize("path", LONG, ids=[p.stem for p in LONG])
def test_the_performance_page_says_which_long_stream_targets_are_met(path: Path) -> None:
    """The section of a long-stream record has, per run and target (tools/docs/record_long.py's TARGETS), the
    line ``| run | target | <= most | met / not met (figure) |`` that the record's figure decides (as
    measured, to three decimals, where the record keeps it: the table's figure is rounded)."""
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from record_long import target_line

    rec = json.loads(path.read_text())
    section = _section("docs/performance.md", f"`{rec['name']}`")
    for run in rec["runs"]:
        for key, target in run["targets"].items():
            most, met, *figure = target
            assert run[key] is not None and ((figure[0] if figure else run[key]) <= most) == met
            rounded = abs(figure[0] - run[key]) <= 0.005 + 1e-9 if figure else True  # the table's, rounded
            assert rounded, (key, figure)
            want = target_line(run["label"], key, target)
            assert want in section, f"{path.name}: no line {want!r}"


SHORTLIST = sorted((ROOT / "docs" / "measured" / "shortlist").glob("*.json"))


@pytest.mark.parametrize("path", SHORTLIST, ids=[p.stem for p in SHORTLIST])
def test_the_predict_page_shows_the_shortlist_study(path: Path) -> None:
    """Every row of a shortlist record (tools/docs/record_shortlist.py) is a table line of the section of
    docs/predict.md naming the record, and the section's summary states its worst figures at k = 8."""
    rec = json.loads(path.read_text())
    section = _section("docs/predict.md", f"`{rec['name']}`")
    text = " ".join(" ".join(section).split())
    assert rec["command"] in "\n".join(section), f"{path.name}: the command is not shown"
    for r in rec["rows"]:
        cells = [f"{r['tasks']}", f"{r['images']:,}", f"{r['rejected_full']:.2f}%"]
        cells += [
            "—" if (v := r["k"].get(k)) is None else f"{v['equal']:.2f}% / {v['rejected']:.2f}%"
            for k in ("2", "4", "8")
        ]
        want = f"| {r['stream']} | {r['seed']} | " + " | ".join(cells) + " |"
        assert want in section, f"{path.name}: no line {want!r}"
    k8 = [r for r in rec["rows"] if "8" in r["k"]]
    worst = min(r["k"]["8"]["equal"] for r in k8)
    spread = max(abs(r["k"]["8"]["rejected"] - r["rejected_full"]) for r in k8)
    assert f"at least {worst:.2f}% of the inputs" in text and f"within {spread:.2f} points" in text


RIVALS_PREDICT = sorted((ROOT / "docs" / "measured" / "rivals_predict").glob("*.json"))


@pytest.mark.parametrize("path", RIVALS_PREDICT, ids=[p.stem for p in RIVALS_PREDICT])
def test_the_performance_page_shows_the_rivals_prediction_cost(path: Path) -> None:
    """Every method's line of a prediction-cost record (tools/docs/record_rivals_predict.py) is a table line
    of the section of docs/performance.md naming the record: milliseconds per batch at each m, and the
    growth from the first m to the last."""
    rec = json.loads(path.read_text())
    section = _section("docs/performance.md", f"`{rec['name']}`")
    assert rec["command"] in "\n".join(section), f"{path.name}: the command is not shown"
    for n in rec["methods"]:
        cells = [f"{r['seconds'][n] * 1e3:.1f}" for r in rec["rows"]]
        want = f"| `{n}` | " + " | ".join(cells) + f" | {rec['ratio_last_vs_first'][n]:.2f} |"
        assert want in section, f"{path.name}: no line {want!r}"


def test_the_rivals_claims_hold_on_every_record() -> None:
    """What docs/retrieval.md says of the rivals holds on every stream's record: the default `proteus` ends
    above every rival measured, and `klda` below `ranpac`."""
    for path in RIVALS:
        methods = json.loads(path.read_text())["methods"]
        acc = {m: f["final_avg_acc"][0] for m, f in methods.items()}
        assert max(acc, key=acc.get) == "proteus", (path.name, acc)
        if "klda" in acc:
            assert acc["klda"] < acc["ranpac"], (path.name, acc)


FUZZ = sorted((ROOT / "docs" / "measured" / "fuzz").glob("*.json"))


@pytest.mark.parametrize("path", FUZZ, ids=[p.stem for p in FUZZ])
def test_the_reliability_page_shows_the_fuzz_run(path: Path) -> None:
    """Each target's line of a fuzz run's record (tools/docs/record_fuzz.py) is in the section of
    docs/reliability.md naming the record, with the command, and the record holds every target of
    tests/test_fuzz.py (a target added since the run is not claimed to have passed it)."""
    import ast

    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from record_fuzz import table

    rec = json.loads(path.read_text())
    section = "\n".join(_section("docs/reliability.md", f"`{rec['name']}`"))
    assert rec["command"] in section, f"{path.name}: the command is not shown"
    for line in table(rec).splitlines():
        assert line in section, f"{path.name}: no line {line!r}"
    source = (ROOT / "tests" / "test_fuzz.py").read_text()
    default = int(re.search(r'environ.get\("FUZZ_EXAMPLES", (\d+)\)', source).group(1))  # type: ignore[union-attr]
    assert f"`FUZZ_EXAMPLES` inputs per target ({default:,} by default)" in " ".join(section.split())
    tree = ast.parse(source)
    tests = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    assert tests <= set(rec["targets"]), f"{path.name}: not run: {sorted(tests - set(rec['targets']))}"


#: how the status page names each target of the long-stream harness
STATUS_NAMES = {
    "commit_ratio_last_vs_10": "the commit",
    "learn_ratio_without_training_growth": "learning without the training step's growth",
    "predict_ratio_last_vs_10": "predict with the detector",
    "open_predict_ratio_last_vs_10": "opening a knowledge base and predicting one image",
    "rss_beyond_cache_mb_per_task": "resident memory beyond the caches",
    "kb_mb_per_task": "the knowledge base's growth per task",
}


def test_the_status_page_says_which_thousand_task_targets_the_record_meets() -> None:
    """The status page's row of the thousand-task stream names the targets the record of `long-1000` meets
    before "meet their targets", and those it does not meet between that and "do not"."""
    rec = json.loads((ROOT / "docs" / "measured" / "long" / "long-1000.json").read_text())
    (targets,) = [run["targets"] for run in rec["runs"]]
    assert set(targets) == set(STATUS_NAMES)
    (row,) = [
        r for r in (ROOT / "docs" / "status.md").read_text().splitlines() if "over a thousand tasks" in r
    ]
    met, _, rest = row.partition(" meet their targets")
    unmet = rest.partition(" do not ")[0]
    for key, (_, is_met, *_) in targets.items():
        name = STATUS_NAMES[key]
        assert name in (met if is_met else unmet) and name not in (unmet if is_met else met), (key, is_met)
