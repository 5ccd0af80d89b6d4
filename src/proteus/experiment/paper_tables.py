"""The PROTEUS paper's experiments as data: every table and figure of Sec. 5 and the Appendix, named by its
``\\label`` in the paper's source, with the benchmarks, methods, settings, seeds and metrics that make it
and the numbers the paper publishes (each transcribed with the line of the paper's LaTeX source it comes
from, ``shared/spec/000_b8a2b9b06c209d3d.txt``).

The catalogue is packaged data, ``paper_tables.yaml`` beside this module; this module reads it into the
types below and checks it when imported (a typo in the data fails at once, naming the entry).
:mod:`proteus.experiment.reproduce` runs an entry (``proteus reproduce NAME``) and lays our numbers out
beside these. Nothing here runs anything: an entry is plain data.

A table is a grid of cells; each cell is one (variant, benchmark, metric[, task]) and holds our mean over
seeds beside the paper's number. ``rows`` and ``cols`` name the axes of the paper's layout (``variant``,
``benchmark``, ``metric``, ``task``). A *variant* is a method with dotted settings on top of it: one row
(or column) of the paper's table, run with ``proteus compare``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

__all__ = [
    "DATA",
    "ENTRIES",
    "LOCAL_STANDS_FOR",
    "METRICS",
    "PAPER_BENCHMARKS",
    "Entry",
    "PaperBenchmark",
    "Published",
    "Variant",
    "entry",
    "load_data",
]

#: the packaged catalogue, beside this module
DATA = "paper_tables.yaml"


@dataclass(frozen=True)
class PaperBenchmark:
    """A benchmark of the paper: its title in the tables, the packaged preset that builds it (None: none
    does, ``why`` says why) and the folder under a data root that holds it."""

    title: str
    preset: str | None
    data: str | None = None
    why: str = ""


@dataclass(frozen=True)
class Variant:
    """One row (or column) of a table: a method and the dotted settings on top of it (``KEY=VALUE``, as
    ``--set`` writes them). ``configs`` maps a paper benchmark to the method's packaged config used on it
    when the paper's own benchmarks run (a baseline's released settings; not used on a local stream)."""

    label: str
    method: str
    settings: tuple[str, ...] = ()
    configs: dict[str, str] = field(default_factory=dict)
    #: beyond the paper: a row of ours the paper does not have (shown without a paper number)
    extra: bool = False


#: a published number: (mean, std) or (mean, None), or a string the paper prints instead ("OOM")
Published = tuple[float, float | None] | str


@dataclass(frozen=True)
class Entry:
    """A table or figure of the paper (see the module docstring).

    ``paper`` holds the published numbers by (variant label, benchmark, metric, task or None);
    ``settings`` apply to every cell (before the variant's own, after ``--config``); ``unsupported``
    says why the harness cannot measure it (the plan still lists its cells); ``notes`` go under the
    table."""

    name: str
    kind: str  # "table" or "figure"
    title: str
    lines: str  # where the paper's source defines it
    benchmarks: tuple[str, ...]
    variants: tuple[Variant, ...]
    metrics: tuple[str, ...]
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    paper: dict[tuple[str, str, str, int | None], Published] = field(default_factory=dict)
    settings: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0, 1, 2)
    #: the variant a ``retrieval_gain`` is measured against (PROTEUS): (its retrieval - the variant's) / (its
    #: inference time - the variant's), from the means over seeds
    reference: str = ""
    #: the paper's task indices of a per-task table (on a local stream: our own tasks)
    tasks: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()
    unsupported: str = ""
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        what = "table" if self.kind == "table" else "figure"
        bench = ", ".join(self.benchmarks)
        return f"{what}, {self.title} ({bench}; {len(self.variants)} variants; l. {self.lines})"


def load_data() -> dict[str, Any]:
    """The packaged catalogue as its YAML reads (each published row with the line of the paper it is from)."""
    text = resources.files("proteus.experiment").joinpath(DATA).read_text(encoding="utf-8")
    data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return _fields("the top level", data, ("benchmarks", "local_stands_for", "metrics", "released_for",
                                           "variants", "entries"))  # fmt: skip


def _fields(
    where: str, spec: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``spec``, a mapping with every ``required`` key and no key beyond ``optional``."""
    if not isinstance(spec, dict):
        raise ValueError(f"{DATA}: {where}: expected a mapping, not {spec!r}")
    missing = [k for k in required if k not in spec]
    unknown = [str(k) for k in spec if k not in required and k not in optional]
    if missing or unknown:
        raise ValueError(
            f"{DATA}: {where}: missing {missing or 'nothing'}, unknown {unknown or 'none'} "
            f"(keys: {', '.join(required + optional)})"
        )
    return spec


def _variant(where: str, spec: Any, released_for: dict[str, str], label: str | None = None) -> Variant:
    """A variant; ``released`` lists the released settings its method's packaged configs hold
    (``<method>-<name>``): on each paper benchmark the one ``released_for`` names, or else the first."""
    f = _fields(where, spec, ("method",) if label else ("label", "method"), ("settings", "released", "extra"))
    method, released = f["method"], list(f.get("released", ()))
    configs = (
        {}
        if not released
        else {b: f"{method}-{s if s in released else released[0]}" for b, s in released_for.items()}
    )
    settings = tuple(f.get("settings", ()))
    return Variant(label or f["label"], method, settings, configs, f.get("extra", False))


def _number(where: str, v: Any) -> Published:
    """A published number: a mean, [mean, std], or the string the paper prints."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int | float) for x in v):
        return (v[0], v[1])
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (v, None)
    raise ValueError(f"{DATA}: {where}: {v!r} is not a mean, [mean, std] or a printed string")


def _paper(
    where: str, rows: list[Any], benchmarks: tuple[str, ...], tasks: tuple[int, ...]
) -> dict[tuple[str, str, str, int | None], Published]:
    """An entry's published numbers by cell, from its rows: ``values`` one per benchmark, ``per_task`` one
    per task on ``benchmark``, or one ``value`` on ``benchmark``."""
    out: dict[tuple[str, str, str, int | None], Published] = {}
    for i, row in enumerate(rows):
        at = f"{where}: paper row {i + 1}"
        f = _fields(at, row, ("variant", "metric", "line"), ("benchmark", "values", "per_task", "value"))
        label, metric, bench = f["variant"], f["metric"], str(f.get("benchmark", ""))
        given = [k for k in ("values", "per_task", "value") if k in f]
        if len(given) != 1 or ("benchmark" in f) == (given == ["values"]):
            raise ValueError(f"{DATA}: {at}: give `values` (one per benchmark), or `benchmark` and `per_task`"
                             " or `value`")  # fmt: skip
        keys: list[tuple[str, str, str, int | None]]
        values = f[given[0]] if given != ["value"] else [f["value"]]
        if given == ["values"]:
            keys = [(label, b, metric, None) for b in benchmarks]
        elif given == ["per_task"]:
            keys = [(label, bench, metric, t) for t in tasks]
        else:
            keys = [(label, bench, metric, None)]
        if len(values) != len(keys):
            raise ValueError(f"{DATA}: {at}: {len(values)} values for {len(keys)} cells")
        out.update((k, _number(at, v)) for k, v in zip(keys, values))
    return out


_ENTRY = ("name", "kind", "title", "lines", "benchmarks", "variants", "metrics", "rows", "cols")
_TUPLES = ("settings", "seeds", "tasks", "aliases", "notes")


def _entry(spec: Any, shared: dict[str, Variant], released_for: dict[str, str]) -> Entry:
    f = _fields("an entry", spec, _ENTRY, ("paper", "reference", "unsupported", *_TUPLES))
    where = f"entry {f['name']}"
    variants = []
    for v in f["variants"]:
        if isinstance(v, str) and v not in shared:
            raise ValueError(f"{DATA}: {where}: no shared variant {v!r}; one of: {', '.join(shared)}")
        variants.append(shared[v] if isinstance(v, str) else _variant(where, v, released_for))
    benchmarks, tasks = tuple(f["benchmarks"]), tuple(f.get("tasks", ()))
    optional: dict[str, Any] = {k: tuple(f[k]) for k in _TUPLES if k in f}
    optional.update((k, f[k]) for k in ("reference", "unsupported") if k in f)
    return Entry(
        f["name"], f["kind"], f["title"], str(f["lines"]), benchmarks, tuple(variants), tuple(f["metrics"]),
        tuple(f["rows"]), tuple(f["cols"]), paper=_paper(where, f.get("paper", []), benchmarks, tasks),
        **optional,
    )  # fmt: skip


def _load() -> tuple[dict[str, PaperBenchmark], dict[str, str], dict[str, tuple[str, str]], list[Entry]]:
    raw = load_data()
    benchmarks = {
        k: PaperBenchmark(**_fields(f"benchmark {k}", v, ("title", "preset"), ("data", "why")))
        for k, v in raw["benchmarks"].items()
    }
    if set(raw["released_for"]) != set(benchmarks):
        raise ValueError(f"{DATA}: released_for must name every benchmark: {', '.join(benchmarks)}")
    released_for = {b: raw["released_for"][b] for b in benchmarks}
    metrics = {k: (title, unit) for k, (title, unit) in raw["metrics"].items()}
    shared = {k: _variant(f"variant {k}", v, released_for, label=k) for k, v in raw["variants"].items()}
    entries = [_entry(spec, shared, released_for) for spec in raw["entries"]]
    return benchmarks, dict(raw["local_stands_for"]), metrics, entries


#: the paper's benchmarks (Sec. 5.1 and the Appendix) and the presets that build them; the paper benchmark
#: whose numbers a local stream is compared with by default; metric name -> (column title, unit); every
#: table and figure (``paper_tables.yaml`` says what each holds)
PAPER_BENCHMARKS, LOCAL_STANDS_FOR, METRICS, ENTRIES = _load()


def entry(name: str) -> Entry:
    """The entry named ``name`` (its label or an alias); a KeyError lists every name."""
    for e in ENTRIES:
        if name == e.name or name in e.aliases:
            return e
    raise KeyError(
        f"no table or figure {name!r} of the paper; one of: {', '.join(e.name for e in ENTRIES)} "
        "(`proteus reproduce --list`)"
    )


def _check(entries: list[Entry]) -> None:
    """Catalogue invariants: unique names, known benchmarks and metrics, published numbers on known
    variants (checked at import: a typo in the data fails at once)."""
    seen: set[str] = set()
    for e in entries:
        for n in (e.name, *e.aliases):
            if n in seen:
                raise ValueError(f"{DATA}: {n!r} named twice")
            seen.add(n)
        labels = {v.label for v in e.variants}
        if e.kind not in ("table", "figure"):
            raise ValueError(f"{DATA}: entry {e.name}: kind {e.kind!r} is neither table nor figure")
        for b in e.benchmarks:
            if b not in PAPER_BENCHMARKS:
                raise ValueError(f"{DATA}: entry {e.name}: unknown benchmark {b!r}")
        for m in e.metrics:
            if m not in METRICS:
                raise ValueError(f"{DATA}: entry {e.name}: unknown metric {m!r}")
        if e.reference and e.reference not in labels:
            raise ValueError(f"{DATA}: entry {e.name}: reference {e.reference!r} is not a variant")
        for label, b, m, _ in e.paper:
            if label not in labels or b not in e.benchmarks or m not in e.metrics:
                raise ValueError(f"{DATA}: entry {e.name}: a published number on ({label}, {b}, {m})")


_check(ENTRIES)
