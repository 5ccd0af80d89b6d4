"""``proteus compare``: several methods x seeds on one split, summarised like the paper's Table 1 and Fig. 3.

Each (method, seed) is an ordinary ``proteus run`` into ``<out>/<method>/seed<k>`` (results.json, KB,
figures, report.md). The comparison reports, per method, the mean +- sample std over seeds of the final
average accuracy ACC_m (Table 1), the final forgetting F_m (Appendix forgetting table), the final retrieval
accuracy (Table "matching comparison") and the oracle accuracy with the true task's adapter, and draws the
average accuracy after each task for all methods (Fig. 3). Outputs: ``compare.md``, ``compare.json`` and
``compare_accuracy.png`` in ``<out>``; the table is also printed.

A (method, seed) directory that already holds a finished run of the same configuration (``report.*`` keys
aside) is reused, and one such run that stopped part-way is continued from its last committed task, so an
interrupted comparison resumes where it stopped; a run of a different configuration is an error naming the
directory. The cells run through an executor (:mod:`proteus.experiment.executors`: this process, a pool of
processes, a SLURM job array) and the comparison is gathered from their results.json files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from proteus import distributed as dist
from proteus.config import ConfigError, RunConfig, flatten
from proteus.experiment.executors import CellsFailed, Executor, Job, LocalExecutor, run_jobs
from proteus.experiment.provenance import merged
from proteus.report import fmt
from proteus.report.figures import plot_compare

__all__ = ["COLUMNS", "compare", "compare_markdown", "pending_jobs", "summarise", "write_comparison"]

#: (results.json value, column title, higher is better)
COLUMNS: list[tuple[str, str, bool]] = [
    ("final_avg_acc", "final avg acc (%)", True),
    ("forgetting", "forgetting", False),
    ("retrieval_acc", "retrieval (%)", True),
    ("oracle_acc", "oracle (%)", True),
    ("seconds", "seconds", False),
]


def _final(v: Any) -> float | None:
    if isinstance(v, list):
        v = v[-1] if v else None
    return None if v is None else float(v)


def _row(res: dict[str, Any]) -> dict[str, Any]:
    return {
        "final_avg_acc": _final(res.get("final_avg_acc")),
        "forgetting": _final(res.get("forgetting")),
        "retrieval_acc": _final(res.get("retrieval_acc")),
        "oracle_acc": _final(res.get("oracle_avg_acc")),
        "seconds": _final(res.get("seconds")),
        "avg_acc": list(res.get("avg_acc") or []),
        "provenance": res.get("provenance"),
    }


def _stat(values: Sequence[float | None]) -> dict[str, Any]:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
    return {"mean": float(np.mean(vals)), "std": std, "n": len(vals)}


def summarise(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per method: mean / std / n over seeds of every column, and the mean ACC curve."""
    out: dict[str, dict[str, Any]] = {}
    for method, by_seed in runs.items():
        rows = list(by_seed.values())
        s: dict[str, Any] = {key: _stat([r[key] for r in rows]) for key, _, _ in COLUMNS}
        curves = [r["avg_acc"] for r in rows if r["avg_acc"]]
        n = min((len(c) for c in curves), default=0)
        s["avg_acc_mean"] = [float(np.mean([c[i] for c in curves])) for i in range(n)]
        out[method] = s
    return out


def _cell(st: dict[str, Any], bold: bool) -> str:
    if st["mean"] is None:
        return "-"
    txt = fmt(st["mean"]) + ("" if st["std"] is None else f" ± {fmt(st['std'])}")
    return f"**{txt}**" if bold else txt


def compare_markdown(summary: dict[str, dict[str, Any]], title: str, seeds: Sequence[int]) -> str:
    """Table 1 style: mean ± std over seeds per method (best mean in bold), then ACC after each task."""
    best: dict[str, float | None] = {}
    for key, _, higher in COLUMNS:
        means = [s[key]["mean"] for s in summary.values() if s[key]["mean"] is not None]
        best[key] = (max(means) if higher else min(means)) if len(means) > 1 else None
    lines = [
        f"# {title}",
        "",
        f"Mean ± sample std over seeds {', '.join(map(str, seeds))} (best mean in bold). Final values after "
        "the last task; retrieval = task retrieval accuracy, oracle = accuracy with the true task's adapter; "
        "seconds = each run's wall time under the machine's load of its day (a run reused from an earlier "
        "comparison, or run beside others, is not comparable on it).",
        "",
        "| method | " + " | ".join(t for _, t, _ in COLUMNS) + " |",
        "| --- | " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for method, s in summary.items():
        cells = [_cell(s[k], best[k] is not None and s[k]["mean"] == best[k]) for k, _, _ in COLUMNS]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    n = max((len(s["avg_acc_mean"]) for s in summary.values()), default=0)
    if n:
        lines += [
            "",
            "Average accuracy (%) after each task, mean over seeds (Fig. 3):",
            "",
            "| method | " + " | ".join(str(i + 1) for i in range(n)) + " |",
            "| --- | " + " | ".join("---:" for _ in range(n)) + " |",
        ]
        for method, s in summary.items():
            cells = [fmt(v, 1) for v in s["avg_acc_mean"]] + ["-"] * (n - len(s["avg_acc_mean"]))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _comparable(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The dotted keys that decide a run's results: the config read as stored (a key added by a later
    release reads as what the run did without it: :meth:`RunConfig.from_stored`), without ``report.*``."""
    try:
        cfg_dict = RunConfig.from_stored(cfg_dict).to_dict()
    except (ConfigError, TypeError, ValueError):
        pass  # compared as written: any difference is reported
    return {k: v for k, v in flatten(cfg_dict).items() if not k.startswith("report.")}


#: keys that name a file or folder: the same run whichever way the path is written (``../data``, ``/w/data``)
PATH_KEYS = ("benchmark.data", "benchmark.tasks_file", "backbone.weights")


def _same(key: str, a: Any, b: Any) -> bool:
    if a == b:
        return True
    if key in PATH_KEYS and isinstance(a, str) and isinstance(b, str):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


def resumable(run_dir: Path, cfg: RunConfig) -> bool:
    """True when ``run_dir`` holds a run of ``cfg`` interrupted part-way (a knowledge base, its config.yaml
    the same configuration, no results.json): its job continues it from the last committed task."""
    if (run_dir / "results.json").exists() or not (run_dir / "kb" / "manifest.json").is_file():
        return False
    try:
        _check_config(run_dir, cfg)
    except (ConfigError, OSError, yaml.YAMLError):
        return False
    return True


def _finished(run_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The results of a finished run of ``cfg`` in ``run_dir``; None when there is none yet, or a run of
    ``cfg`` that stopped part-way (:func:`resumable`: its job continues it)."""
    res_file = run_dir / "results.json"
    if not res_file.is_file():
        for started in ("kb/manifest.json", "model.json"):  # model.json: a baseline run of an earlier release
            if (run_dir / started).is_file() and not resumable(run_dir, cfg):
                raise ConfigError(
                    f"{run_dir}: holds an unfinished run ({started} but no results.json) of another or no "
                    "configuration; remove the directory to run it again"
                )
        return None
    _check_config(run_dir, cfg)
    return json.loads(res_file.read_text())


def _check_config(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse ``run_dir`` when its config.yaml is missing, unreadable or of a configuration not ``cfg``."""
    cfg_file = run_dir / "config.yaml"
    old = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else None
    if not isinstance(old, dict):
        raise ConfigError(
            f"{run_dir}: holds a run without a readable config.yaml; choose a new --out or remove it"
        )
    a, b = _comparable(old), _comparable(cfg.to_dict())
    diff = sorted(k for k in a.keys() | b.keys() if not _same(k, a.get(k), b.get(k)))
    if diff:
        shown = ", ".join(f"{k} ({a.get(k)!r} there, {b.get(k)!r} now)" for k in diff[:3])
        raise ConfigError(
            f"{run_dir}: holds a run with a different configuration: {shown}"
            f"{f' and {len(diff) - 3} more' if len(diff) > 3 else ''}; choose a new --out or remove it"
        )


def pending_jobs(
    cfgs: dict[tuple[str, int], RunConfig], out: Path, progress: bool = True, label: str = ""
) -> list[Job]:
    """The cells of ``cfgs`` ((method, seed) -> config, run into ``out/<method>/seed<k>``) that have no
    finished run of the same configuration yet (the finished ones are named as reused)."""
    jobs = []
    for (m, s), cfg in cfgs.items():
        run_dir = out / m / f"seed{s}"
        if _finished(run_dir, cfg) is None:
            jobs.append(Job(f"{label}{m}, seed {s}", run_dir, cfg))
        elif progress and dist.is_main():
            print(f"== {label}{m}, seed {s}: reusing the finished run in {run_dir}", flush=True)
    return jobs


def compare(
    make_config: Callable[[str, int], RunConfig],
    methods: Sequence[str],
    seeds: Sequence[int],
    out: str | Path,
    progress: bool = True,
    stem: str = "compare",
    executor: Executor | None = None,
) -> dict[str, Any]:
    """Run every method with every seed into ``out/<method>/seed<k>`` (through ``executor``, this process by
    default) and write the comparison (``<stem>.md``, ``<stem>.json``, ``<stem>_accuracy.png``; ``proteus
    reproduce`` names them after its table, so that tables sharing ``out`` keep their own)."""

    if not methods:
        raise ConfigError("compare: no methods given")
    if not seeds:
        raise ConfigError("compare: no seeds given")
    out = Path(out)
    # resolve every configuration first: a misspelt method fails before hours of runs
    cfgs = {(m, s): make_config(m, s) for m in methods for s in seeds}
    executor = executor or LocalExecutor()
    try:
        run_jobs(executor, pending_jobs(cfgs, out, progress), out, progress)
    except CellsFailed:
        write_comparison(cfgs, out, stem)  # what finished, then the failed cells named
        raise
    if executor.dry_run:
        return {}
    return write_comparison(cfgs, out, stem)


def write_comparison(
    cfgs: dict[tuple[str, int], RunConfig], out: Path, stem: str = "compare"
) -> dict[str, Any]:
    """Gather the finished runs of ``cfgs`` from their results.json files and write the comparison."""
    main = dist.is_main()
    methods = list(dict.fromkeys(m for m, _ in cfgs))
    seeds = list(dict.fromkeys(s for _, s in cfgs))
    runs: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in methods}
    for m, s in cfgs:
        run_dir = out / m / f"seed{s}"
        try:
            res = json.loads((run_dir / "results.json").read_text())
        except (OSError, ValueError):
            continue  # not run (a failed cell): left out of the means, named by the caller
        runs[m][s] = {**_row(res), "dir": str(run_dir.relative_to(out))}
    first = next(iter(cfgs.values()))
    num_tasks = max((len(r["avg_acc"]) for by in runs.values() for r in by.values()), default=0)
    title = f"{first.benchmark.name} ({num_tasks} tasks, {first.backbone.name}): methods compared"
    summary = summarise(runs)
    md = compare_markdown(summary, title, seeds)
    report: dict[str, Any] = {
        "benchmark": first.benchmark.name,
        "backbone": first.backbone.name,
        "num_tasks": num_tasks,
        "methods": list(methods),
        "seeds": list(seeds),
        "runs": {m: {str(s): r for s, r in by.items()} for m, by in runs.items()},
        "summary": summary,
        "provenance": merged(r.get("provenance") for by in runs.values() for r in by.values()),
    }
    if main:
        out.mkdir(parents=True, exist_ok=True)
        curves = {m: [r["avg_acc"] for r in by.values() if r["avg_acc"]] for m, by in runs.items()}
        try:
            plot_compare(curves, out / f"{stem}_accuracy.png", title=title)
            report["figure"] = f"{stem}_accuracy.png"
            md += f"\n\n![average accuracy after each task]({stem}_accuracy.png)\n"
        except Exception as e:  # noqa: BLE001 - the table matters more than the figure
            report["figure_error"] = f"{type(e).__name__}: {e}"
        links = [
            f"[{m} seed {s}]({r['dir']}/report.md)"
            for m, by in runs.items()
            for s, r in by.items()
            if (out / r["dir"] / "report.md").is_file()
        ]
        if links:
            md += "\nPer-run reports: " + ", ".join(links) + "\n"
        (out / f"{stem}.md").write_text(md + "\n")
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        print(md.split("\n\n![")[0])
        print(f"comparison: {out / f'{stem}.md'}")
    return report
