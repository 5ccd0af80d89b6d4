"""``proteus reproduce``: a table or figure of the PROTEUS paper by one command, ours beside the paper's.

The catalogue (:mod:`proteus.experiment.paper_tables`) says what each table of Sec. 5 and the Appendix
runs: benchmarks, methods and settings (its *variants*), seeds, metrics, and the published numbers.
:func:`make_plan` resolves every cell's configuration without running anything (``--plan``);
:func:`reproduce` runs the grid's cells through an executor (:mod:`proteus.experiment.executors`: finished
cells reused, an interrupted cell continued from its last committed task), reads each run's results.json and
writes the table in the paper's layout (``<out>/<name>.md``, ``.csv``, ``.json``): our mean ± sample std
over seeds beside the paper's number in each cell, and a footnote with every resolved setting of every cell
that departs from what the paper states (:mod:`proteus.experiment.paper_settings`: the backbone and data,
the choices the paper leaves open, the choices of the code), each named by its row of the differences table
in docs/experiments.md.

Without a benchmark the paper's own benchmarks run with their packaged ViT-B/16 presets (a GPU job);
``benchmark="domains5"`` (or ``"domains5:vtab5t"``) runs every cell on that local stream instead and
compares it with one column of the paper (:data:`~proteus.experiment.paper_tables.LOCAL_STANDS_FOR`).

Layout of ``out``: ``<out>/<benchmark>/<cell>/seed<k>`` holds each run (``<cell>`` is the method, with
the variant's settings appended), so tables that share a run (``main-table``'s PROTEUS, ``ablationS``'s
S*, ...) reuse it when given the same ``out``.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from proteus.backbones import has_tokens
from proteus.config import LEARNERS, METHODS, ConfigError, RunConfig, flatten, resolve_config
from proteus.config.schema import parse_set
from proteus.experiment.executors import Executor
from proteus.experiment.paper_settings import Departure, departures, paper_family
from proteus.experiment.paper_tables import (
    ENTRIES,
    LOCAL_STANDS_FOR,
    METRICS,
    PAPER_BENCHMARKS,
    Entry,
    Published,
    Variant,
    entry,
)
from proteus.experiment.provenance import UNKNOWN, merged
from proteus.experiment.table_metrics import READERS, fmt

__all__ = [
    "Cell", "Column", "Plan", "catalogue_lines", "make_plan", "plan_lines", "reproduce", "status_lines",
    "table_rows",
]  # fmt: skip


@dataclass(frozen=True)
class Column:
    """A benchmark of the table as it runs here: ``key`` names its folder under ``out``, ``benchmark``
    is what ``--benchmark`` resolves, ``paper`` the paper benchmark whose numbers stand beside ours;
    ``local`` when a local stream stands in for it; ``skip`` says why it cannot run."""

    key: str
    benchmark: str | None
    paper: str
    data: str | None
    local: bool
    skip: str = ""

    @property
    def title(self) -> str:
        return self.key if self.local else PAPER_BENCHMARKS[self.paper].title


@dataclass
class Cell:
    """One run: a variant on a column with a seed; ``config`` is None when it cannot run (``skip``)."""

    column: Column
    variant: Variant
    seed: int
    cell_id: str
    config: RunConfig | None
    skip: str = ""
    #: every way this cell departs from what the paper states (:func:`paper_settings.departures`)
    departures: list[Departure] = field(default_factory=list)

    def run_dir(self, out: Path) -> Path:
        return out / self.column.key / self.cell_id / f"seed{self.seed}"


@dataclass
class Plan:
    entry: Entry
    columns: list[Column]
    seeds: tuple[int, ...]
    cells: list[Cell]
    #: footnote lines: per variant (and column), every resolved setting that departs from the paper
    differences: list[str] = field(default_factory=list)

    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if c.config is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.entry.name,
            "kind": self.entry.kind,
            "title": self.entry.title,
            "paper_lines": self.entry.lines,
            "seeds": list(self.seeds),
            "columns": [
                {"benchmark": c.key, "paper_benchmark": c.paper, "local": c.local, "skip": c.skip or None}
                for c in self.columns
            ],
            "cells": [
                {
                    "benchmark": c.column.key,
                    "paper_benchmark": c.column.paper,
                    "variant": c.variant.label,
                    "method": c.variant.method,
                    "settings": [*self.entry.settings, *c.variant.settings],
                    "seed": c.seed,
                    "cell": c.cell_id,
                    "runnable": c.config is not None,
                    "skip": c.skip or None,
                    "config": c.config.to_dict() if c.config is not None else None,
                    "departures": [d.to_dict() for d in c.departures],
                }
                for c in self.cells
            ],
            "differences": self.differences,
            "unsupported": self.entry.unsupported or None,
        }


def catalogue_lines() -> list[str]:
    """``--list``: one line per table and figure."""
    width = max(len(e.name) for e in ENTRIES)
    return [f"{e.name:<{width}}  {e.summary()}" for e in ENTRIES]


# ---------------------------------------------------------------------------- planning
def _cell_id(variant: Variant, settings: Sequence[str]) -> str:
    """The run folder of a variant: its method, then its settings (``proteus-paper+adapter.alpha=0.1``)."""
    parts = [variant.method, *(s.replace("/", "_").replace(" ", "") for s in settings)]
    return "+".join(parts)


def _columns(e: Entry, benchmark: str | None, data: str | None) -> list[Column]:
    if benchmark is None:
        out = []
        for b in e.benchmarks:
            pb = PAPER_BENCHMARKS[b]
            root = str(Path(data) / pb.data) if data and pb.data else None
            out.append(Column(b, pb.preset, b, root, local=False, skip=pb.why if pb.preset is None else ""))
        return out
    local, _, paper = benchmark.partition(":")
    if not local:
        raise ConfigError(f"--benchmark {benchmark!r}: give a benchmark (e.g. domains5 or domains5:vtab5t)")
    if paper:
        if paper not in e.benchmarks:
            raise ConfigError(
                f"--benchmark {benchmark}: {e.name} has no column {paper!r}; its benchmarks: "
                f"{', '.join(e.benchmarks)}"
            )
    elif local in e.benchmarks:
        paper = local
    elif LOCAL_STANDS_FOR.get(local) in e.benchmarks:
        paper = LOCAL_STANDS_FOR[local]
    else:
        paper = e.benchmarks[0]
    own = PAPER_BENCHMARKS.get(local)
    if own is not None and local == paper:  # one of the paper's own benchmarks, by itself
        root = data
        return [
            Column(local, own.preset, paper, root, local=False, skip=own.why if own.preset is None else "")
        ]
    return [Column(local, local, paper, data, local=True)]


def _skip_reason(method: str, cfg: RunConfig) -> str:
    learner = LEARNERS.get(METHODS.get(method).learner)
    if getattr(learner, "needs_tokens", False) and not has_tokens(cfg.backbone.name):
        return f"{method} is a prompt method: it needs a ViT (tokens), not {cfg.backbone.name}"
    return ""


def _resolve(
    e: Entry,
    col: Column,
    v: Variant,
    seed: int | None,
    config_files: Sequence[str],
    sets: Sequence[str],
    overrides: dict[str, Any] | None,
) -> RunConfig:
    released = [] if col.local or v.configs.get(col.paper) is None else [v.configs[col.paper]]
    o: dict[str, Any] = copy.deepcopy(overrides or {})
    if seed is not None:
        o["seed"] = seed
    if col.data is not None:
        o.setdefault("benchmark", {})["data"] = col.data
    return resolve_config(
        benchmark=col.benchmark,
        method=v.method,
        config_files=[*released, *config_files],
        sets=[*e.settings, *v.settings, *sets],
        overrides=o,
    )


def make_plan(
    name: str,
    benchmark: str | None = None,
    data: str | None = None,
    seeds: Sequence[int] | None = None,
    config_files: Sequence[str] = (),
    sets: Sequence[str] = (),
    overrides: dict[str, Any] | None = None,
) -> Plan:
    """Every cell of table ``name`` with its resolved configuration (nothing runs). ``benchmark``: a local
    stream (``domains5``) or ``LOCAL:PAPER``; None for the paper's benchmarks and presets. ``data``: the
    data root (for the paper's benchmarks, the root holding each benchmark's folder: ``ROOT/cifar100``,
    ``ROOT/imagenet-r``, ``ROOT/vtab``, ``ROOT/vtab-large``)."""

    e = entry(name)
    seeds = tuple(int(s) for s in (seeds if seeds is not None else e.seeds))
    if not seeds:
        raise ConfigError("--seeds: give at least one seed")
    columns = _columns(e, benchmark, data)
    cells: list[Cell] = []
    for col in columns:
        for v in e.variants:
            cid = _cell_id(v, [*e.settings, *v.settings])
            why = col.skip or (e.unsupported and f"not measured: {e.unsupported}")
            if not why and v.method not in METHODS:
                why = f"method {v.method!r} is not declared (`proteus list methods`)"
            for s in seeds:
                if why:
                    cells.append(Cell(col, v, s, cid, None, why))
                    continue
                cfg = _resolve(e, col, v, s, config_files, sets, overrides)
                skip = _skip_reason(v.method, cfg)
                cells.append(Cell(col, v, s, cid, None if skip else cfg, skip))
    plan = Plan(e, columns, seeds, cells)
    _departures(plan)
    plan.differences = _differences(plan)
    return plan


def _departures(plan: Plan) -> None:
    """Each runnable cell's departures from the paper: its resolved settings against what the paper
    states for it (the method, the table's and the variant's settings; for a method the paper gives no
    recipe of its own, its settings on the paper's benchmark and preset)."""
    e = plan.entry
    for col in plan.columns:
        pb = PAPER_BENCHMARKS[col.paper]
        for v in e.variants:
            cells = [c for c in plan.runnable() if c.column == col and c.variant == v]
            if not cells:
                continue
            cell_settings = flatten(parse_set([*e.settings, *v.settings]))
            own, released = None, v.configs.get(col.paper)
            if paper_family(v.method) == "own" and pb.preset is not None:
                paper_col = Column(col.paper, pb.preset, col.paper, None, local=False)
                ref = _resolve(e, paper_col, v, None, (), (), None)
                own = flatten(ref.to_dict())
            skipped = released if col.local and released is not None else None
            for c in cells:
                flat = flatten(c.config.to_dict())  # type: ignore[union-attr]
                c.departures = departures(flat, col.paper, v.method, cell_settings, own, skipped)


def _differences(plan: Plan) -> list[str]:
    """The footnote: per variant, its departures from the paper, one line per column (columns whose lines
    are the same are named together)."""
    lines: list[str] = []
    for v in plan.entry.variants:
        by_text: dict[tuple[str, ...], list[str]] = {}
        for col in plan.columns:
            cell = next((c for c in plan.runnable() if c.column == col and c.variant == v), None)
            if cell is not None:
                by_text.setdefault(tuple(d.text() for d in cell.departures), []).append(col.title)
        for texts, cols in by_text.items():
            where = "every column" if len(cols) == len(plan.columns) > 1 else ", ".join(cols)
            head = f"{v.label} (`{v.method}`), {where}"
            lines.append(head + (":" if texts else ": as the paper states it."))
            lines += [f"  - {t}" for t in texts]
    return lines


def plan_lines(plan: Plan) -> list[str]:
    """``--plan``'s text: every cell (benchmark, variant, run folder, seed, whether it runs), then every
    departure from the paper of each variant (:func:`_differences`)."""
    lines = []
    for c in plan.cells:
        state = f"skip: {c.skip}" if c.config is None else "run"
        lines.append(f"{c.column.key:<14} {c.variant.label:<34} {c.cell_id:<40} seed {c.seed}  {state}")
    if plan.differences:
        lines += ["", "Departures from the paper (# is the row of docs/experiments.md's differences table):"]
        lines += [f"- {d}" if not d.startswith("  ") else d for d in plan.differences]
    return lines


# ---------------------------------------------------------------------------- reading runs
def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def metric_values(metric: str, res: dict[str, Any], split: dict[str, Any] | None) -> dict[int | None, float]:
    """The values of ``metric`` in one run (its reader, :data:`~proteus.experiment.table_metrics.READERS`):
    ``{None: value}`` for a final metric, ``{task: value}`` (1-based) for a per-task one (``acc@``,
    ``latency@`` by m, ``delta@`` ...). Missing values are left out."""
    out = READERS.get(metric)(res, split)
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}


def _stat(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    std = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return {"mean": float(np.mean(values)), "std": std, "n": len(values)}


# ---------------------------------------------------------------------------- the table
def _fmt(metric: str, v: float | None) -> str:
    return "-" if v is None else fmt(metric, v)


def _fmt_stat(metric: str, st: dict[str, Any]) -> str:
    if st["mean"] is None:
        return "-"
    txt = _fmt(metric, st["mean"])
    return txt if st["std"] is None else f"{txt} ± {_fmt(metric, st['std'])}"


def _fmt_paper(metric: str, p: Published | None) -> str:
    if p is None:
        return "-"
    if isinstance(p, str):
        return p
    mean, std = p
    return _fmt(metric, mean) + ("" if std is None else f" ± {_fmt(metric, std)}")


def table_rows(
    plan: Plan, out: Path, runs: list[dict[str, Any] | None] | None = None
) -> list[dict[str, Any]]:
    """Every (variant, column, metric, task) cell of the table: ours over seeds (their mean, sample std and
    each seed's value, read from the runs in ``out``) and the paper's number; the long form behind the CSV
    and the Markdown. ``runs`` collects each run's provenance (results.json's)."""
    e = plan.entry
    rows: list[dict[str, Any]] = []
    runs = [] if runs is None else runs
    for col in plan.columns:
        for v in e.variants:
            cells = [c for c in plan.cells if c.column == col and c.variant == v]
            skip = next((c.skip for c in cells if c.skip), "")
            per_seed: list[tuple[int, dict[str, dict[int | None, float]]]] = []
            for c in cells:
                if c.config is None:
                    continue
                d = c.run_dir(out)
                res = _load(d / "results.json")
                if res is None:
                    continue
                split = _load(d / "split.json")
                per_seed.append((c.seed, {m: metric_values(m, res, split) for m in e.metrics}))
                runs.append(res.get("provenance"))
            for m in e.metrics:
                per_task = m.endswith("@")
                keys: set[int | None] = set()
                for _, vals in per_seed:
                    keys |= set(vals[m])
                if per_task and not col.local:
                    keys |= set(e.tasks)
                if not per_task:
                    keys = {None}
                for t in sorted(keys, key=lambda x: -1 if x is None else x):
                    by_seed = {seed: vals[m][t] for seed, vals in per_seed if t in vals[m]}
                    st = _stat(list(by_seed.values()))
                    paper = e.paper.get((v.label, col.paper, m, t))
                    rows.append(
                        {
                            "table": e.name,
                            "benchmark": col.key,
                            "paper_benchmark": col.paper,
                            "variant": v.label,
                            "method": v.method,
                            "settings": " ".join([*e.settings, *v.settings]),
                            "metric": m,
                            "task": t,
                            "ours_mean": st["mean"],
                            "ours_std": st["std"],
                            "seeds": st["n"],
                            "ours_by_seed": {str(k): v for k, v in by_seed.items()},
                            "paper": paper,
                            "skip": skip,
                            "extra": v.extra,
                        }
                    )
    _gains(e, rows)
    return rows


def _gains(e: Entry, rows: list[dict[str, Any]]) -> None:
    """Fill each ``retrieval_gain`` row (in place): (the reference's retrieval - the variant's) / (the
    reference's inference time - the variant's), from the means over seeds; None where a term is missing."""
    by = {(r["benchmark"], r["variant"], r["metric"]): r for r in rows}
    for r in rows:
        if r["metric"] != "retrieval_gain" or not e.reference or r["variant"] == e.reference:
            continue
        terms = [
            by.get((r["benchmark"], v, m))
            for v in (e.reference, r["variant"])
            for m in ("retrieval", "inference")
        ]
        if any(t is None or t["ours_mean"] is None for t in terms):
            continue
        ret_ref, t_ref, ret_v, t_v = (t["ours_mean"] for t in terms)  # type: ignore[index]
        if t_ref != t_v:
            r["ours_mean"] = (ret_ref - ret_v) / (t_ref - t_v)
            r["seeds"] = min(int(t["seeds"]) for t in terms)  # type: ignore[index]


def _axis_label(plan: Plan, axis: str, value: Any) -> str:
    if axis == "benchmark":
        col = next(c for c in plan.columns if c.key == value)
        return col.title
    if axis == "metric":
        return METRICS[value][0]
    if axis == "task":
        metrics = plan.entry.metrics
        return f"m = {value}" if metrics == ("latency@",) else f"task {value}"
    return str(value)


def markdown(plan: Plan, rows: list[dict[str, Any]], command: str = "") -> str:
    """The table in the paper's layout (``Entry.rows`` by ``Entry.cols``), ours beside the paper's."""
    e = plan.entry
    values: dict[str, list[Any]] = {
        "variant": [v.label for v in e.variants],
        "benchmark": [c.key for c in plan.columns],
        "metric": list(e.metrics),
        "task": sorted({r["task"] for r in rows if r["task"] is not None}),
    }
    index = {(r["variant"], r["benchmark"], r["metric"], r["task"]): r for r in rows}
    has_paper = any(r["paper"] is not None for r in rows)
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    def lookup(assign: dict[str, Any]) -> dict[str, Any] | None:
        metric = assign.get("metric", e.metrics[0])
        task = assign.get("task") if metric.endswith("@") else None
        return index.get(
            (
                assign.get("variant", e.variants[0].label),
                assign.get("benchmark", plan.columns[0].key),
                metric,
                task,
            )
        )

    row_keys = list(product(*(values[a] for a in e.rows)))
    col_keys = list(product(*(values[a] for a in e.cols)))
    head = [" / ".join(e.rows)]
    for ck in col_keys:
        label = ", ".join(_axis_label(plan, a, x) for a, x in zip(e.cols, ck))
        head += [f"{label}: ours", f"{label}: paper"] if has_paper else [label]
    lines = [
        f"# {e.name}: {e.title}",
        "",
        f"The paper's {e.kind} `{e.name}` (source lines {e.lines}). Ours: "
        f"mean ± sample std over seeds {', '.join(map(str, plan.seeds))}"
        + (" beside the paper's number." if has_paper else "; the paper prints no numbers for it."),
        "",
        "| " + " | ".join(head) + " |",
        "| --- | " + " | ".join("---:" for _ in head[1:]) + " |",
    ]
    for rk in row_keys:
        assign = dict(zip(e.rows, rk))
        label = ", ".join(_axis_label(plan, a, x) for a, x in zip(e.rows, rk))
        cells = [label]
        for ck in col_keys:
            r = lookup({**assign, **dict(zip(e.cols, ck))})
            metric = ({**assign, **dict(zip(e.cols, ck))}).get("metric", e.metrics[0])
            if r is None:
                ours, paper = "-", "-"
            else:
                ours = (
                    "n/a " + note(r["skip"])
                    if r["skip"]
                    else _fmt_stat(metric, {"mean": r["ours_mean"], "std": r["ours_std"]})
                )
                paper = _fmt_paper(metric, r["paper"])
            cells += [ours, paper] if has_paper else [ours]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    extra = [v for v in e.variants if v.extra]
    if extra:
        lines += [f"Rows beyond the paper: {', '.join(f'`{v.method}`' for v in extra)}.", ""]
    missing = sorted({r["variant"] for r in rows if not r["skip"] and r["seeds"] < len(plan.seeds)})
    if missing:
        lines += [f"Not (yet) run for every seed: {', '.join(missing)} (rerun the command to resume).", ""]
    if notes:
        lines += [f"[{i + 1}] {t}" for i, t in enumerate(notes)] + [""]
    if plan.differences:
        lines += [
            "**Settings that differ from the paper's**: every resolved setting of each cell that departs "
            "from what the paper states, or that the paper leaves open; # is the row of the differences "
            "table in docs/experiments.md.",
            "",
        ]
        lines += [f"- {d}" if not d.startswith("  ") else d for d in plan.differences]
        lines += [""]
    for col in plan.columns:
        if col.local:
            lines += [
                f"The local stream `{col.key}` stands in for the paper's "
                f"{PAPER_BENCHMARKS[col.paper].title}: "
                "another dataset, so the paper's numbers are a reference, not a target.",
                "",
            ]
    lines += [f"- {n}" for n in e.notes]
    lines += [
        "",
        "Methods: "
        + ", ".join(
            f"{v.label} = `{v.method}`" + (f" ({' '.join(v.settings)})" if v.settings else "")
            for v in e.variants
        )
        + (f"; every cell: {' '.join(e.settings)}" if e.settings else "")
        + ".",
    ]
    if command:
        lines += ["", f"Made by: `{command}`"]
    return "\n".join(lines) + "\n"


def _csv_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        p = r["paper"]
        out.append(
            {
                **{
                    k: r[k]
                    for k in ("table", "benchmark", "paper_benchmark", "variant", "method", "settings")
                },
                "metric": r["metric"],
                "task": "" if r["task"] is None else r["task"],
                "ours_mean": "" if r["ours_mean"] is None else r["ours_mean"],
                "ours_std": "" if r["ours_std"] is None else r["ours_std"],
                "seeds": r["seeds"],
                "paper_mean": p[0] if isinstance(p, tuple) else "",
                "paper_std": p[1] if isinstance(p, tuple) and p[1] is not None else "",
                "paper_text": p if isinstance(p, str) else "",
                "skip": r["skip"],
            }
        )
    return out


# ---------------------------------------------------------------------------- running
def _restart_interrupted(plan: Plan, out: Path, progress: bool) -> None:
    """A cell whose run stopped part-way (a knowledge base, no results.json) is continued by its job from the
    last committed task when it ran the cell's configuration (:func:`compare.resumable`); any other is moved
    aside (``seed<k>.interrupted-<time>``) so that it starts again. A cell whose knowledge base another
    process holds is left alone (compare then names it)."""
    from proteus.experiment.compare import resumable
    from proteus.kb.lock import lock_holder

    for c in plan.runnable():
        d = c.run_dir(out)
        if (d / "results.json").is_file() or not (d / "kb").exists() or lock_holder(d / "kb") is not None:
            continue
        if resumable(d, c.config):  # type: ignore[arg-type]
            if progress:
                print(f"== {c.cell_id}, seed {c.seed}: interrupted earlier; its job continues it")
            continue
        dest = d.with_name(f"{d.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}")
        d.rename(dest)
        if progress:
            print(f"== {c.cell_id}, seed {c.seed}: interrupted earlier, kept in {dest}; starting it again")


def _column_configs(plan: Plan) -> dict[str, dict[tuple[str, int], RunConfig]]:
    """Per column (its folder's key): (cell id, seed) -> the cell's configuration, of every runnable cell."""
    out: dict[str, dict[tuple[str, int], RunConfig]] = {}
    for c in plan.runnable():
        out.setdefault(c.column.key, {})[(c.cell_id, c.seed)] = c.config  # type: ignore[assignment]
    return out


def status_lines(plan: Plan, out: str | Path) -> list[str]:
    """``--status``: each runnable cell's state from its folder (done, running, failed with the last line of
    its log, interrupted, missing), where it ran, then the count of each state."""
    from proteus.experiment.cell import cell_state

    out = Path(out)
    lines, counts = [], dict.fromkeys(("done", "running", "failed", "interrupted", "missing"), 0)
    for c in plan.runnable():
        st = cell_state(c.run_dir(out))
        counts[st.state] += 1
        where = ", ".join(f"{k} {v}" for k, v in st.where().items() if v)
        text = st.state + (f" ({where})" if where else "") + (f": {st.detail}" if st.detail else "")
        lines.append(f"{c.column.key:<14} {c.variant.label:<34} seed {c.seed}  {text}")
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items() if n) + f" of {len(plan.runnable())} cells")
    return lines


def reproduce(
    plan: Plan, out: str | Path, progress: bool = True, command: str = "", executor: Executor | None = None
) -> dict[str, Any]:
    """Run every runnable cell of ``plan`` under ``out`` (finished ones reused; through ``executor``, this
    process by default, every column's cells together) and write the table: ``<out>/<name>[-<benchmark>].md``,
    ``.csv`` and ``.json``, gathered from the runs' files. Returns the JSON's content ({} for a dry run). When
    cells fail, the table of the others is written and :class:`CellsFailed` names the failed ones."""
    from proteus.experiment.compare import pending_jobs
    from proteus.experiment.executors import CellsFailed, LocalExecutor, run_jobs

    out = Path(out)
    executor = executor or LocalExecutor()
    if not executor.dry_run:
        _restart_interrupted(plan, out, progress)
    columns = _column_configs(plan)
    jobs = [j for key, cfgs in columns.items() for j in pending_jobs(cfgs, out / key, progress, f"{key}/")]
    try:
        run_jobs(executor, jobs, out, progress)
    except CellsFailed:
        _write_tables(plan, out, columns, False, command)
        raise
    if executor.dry_run:
        return {}
    return _write_tables(plan, out, columns, progress, command)


def _write_tables(
    plan: Plan, out: Path, columns: dict[str, dict[tuple[str, int], RunConfig]], progress: bool, command: str
) -> dict[str, Any]:
    from proteus import distributed as dist
    from proteus.experiment.cell import cell_state
    from proteus.experiment.compare import write_comparison

    e = plan.entry
    for key, cfgs in columns.items():
        write_comparison(cfgs, out / key, stem=e.name)
    runs: list[dict[str, Any] | None] = []
    rows = table_rows(plan, out, runs)
    stem = (
        e.name if len(plan.columns) != 1 or not plan.columns[0].local else f"{e.name}-{plan.columns[0].key}"
    )
    md = markdown(plan, rows, command)
    report = {**plan.to_dict(), "rows": rows, "table_md": f"{stem}.md", "table_csv": f"{stem}.csv"}
    report["provenance"] = {**merged(runs), "command": command or UNKNOWN}
    for c, cell in zip(report["cells"], plan.cells):
        c.pop("config", None)  # each run's config.yaml holds it
        if cell.config is not None:  # where it ran: the executor, host and device of its state.json
            c["ran"] = cell_state(cell.run_dir(out)).where()
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(md)
        with open(out / f"{stem}.csv", "w", newline="") as f:
            data = _csv_rows(rows)
            w = csv.DictWriter(f, fieldnames=list(data[0]) if data else ["table"])
            w.writeheader()
            w.writerows(data)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        if progress:
            print(md)
        print(f"table: {out / (stem + '.md')}")
    return report
