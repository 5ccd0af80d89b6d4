"""Keep what ``tools/perf/perf_long.py`` measured, for the docs:
``python tools/docs/record_long.py RUN/long_stream.json [...] --name NAME --command "python tools/perf/..."``
writes ``docs/measured/long/NAME.json``: per run its merged-weight budget, the ratios of the last task to
task 10 (learn, learn without what the training step grew, training step, commit, predict, opening the
knowledge base and predicting one image), the process's own (anonymous) resident memory beyond the caches
held within budgets (the merged weights, the detector's decoded Gaussians) per task and where it goes (the
learner's tensors by the attribute holding them, the detector's cache apart, the native rest, malloc'd or
not), the page cache it maps per task, the growth of the knowledge base on disk per task, MiB per task, and
the seconds behind the ratios at task 10 and at the last task.
``tests/test_measured_docs.py`` checks that docs/performance.md shows each of them on the run's two table
lines (figures, then seconds) in the section naming `` `NAME` ``, so the page cannot drift from the runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from records import from_checkout, parser, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
from perf_long import _window  # noqa: E402  (the harness's own window, so the seconds match its ratios)

#: the ratios kept, in the order of the page's columns (those measured side by side only: None without)
RATIOS = (
    "learn_ratio_last_vs_10", "learn_ratio_without_training_growth", "train_step_ratio_last_vs_10",
    "commit_ratio_last_vs_10", "predict_ratio_last_vs_10", "predict_ratio_without_composition_growth",
    "predict_same_batch_ratio_last_vs_10", "open_predict_ratio_last_vs_10",
    "open_predict_new_process_ratio_last_vs_10",
)  # fmt: skip
#: ratios kept only by records made since they were measured: an older record's page shows no column for them
LATER = ("open_predict_new_process_ratio_last_vs_10",)


def kept_ratios(runs: list[dict[str, Any]]) -> list[str]:
    """The :data:`RATIOS` a record's ``runs`` have columns for, in order."""
    return [k for k in RATIOS if k not in LATER or any(k in run for run in runs)]


#: the targets a long stream is held to, figure -> (what the page calls it, the most it may be): the record
#: says of each whether the run meets it, and the page shows that line (``tests/test_measured_docs.py``)
TARGETS = {
    "commit_ratio_last_vs_10": ("commit, last task / task 10", 1.3),
    "learn_ratio_without_training_growth": ("learn without the training step's growth, last / task 10", 1.3),
    "predict_ratio_last_vs_10": ("predict with the detector, last / task 10", 1.3),
    "open_predict_ratio_last_vs_10": ("open the knowledge base and predict one image, last / task 10", 2.0),
    "rss_beyond_cache_mb_per_task": ("resident memory beyond the caches, MiB per task", 0.1),
    "kb_mb_per_task": ("knowledge base on disk, MiB per task", 0.38),
}

#: the parts of the resident memory kept (MiB per task; the learner's by the attribute holding them)
PARTS = {
    "novelty detector": ("keys_.novelty",),
    "adapters": ("model_.units",),
    "LDA keys": ("keys_.head", "keys_._before"),  # (a rollback copy while a task is learned)
    "per-task heads": ("heads_.experts", "heads_.head"),
}

#: the native rest split (:mod:`memory_account`): what malloc handed out beyond the tensors, and the rest
NATIVE = {"native: malloc'd": "native_malloc_mb", "native: other": "native_other_mb"}


#: the settings every perf_long.py run makes; any other is the run's own and names it on the page
COMMON = (
    "backbone.name", "backbone.pretrained", "backbone.img_size", "backbone.adapt_last", "adapter.rank",
    "train.epochs", "train.batch_size", "head.rp_dim", "seed", "eval.merge_budget_mb", "device",
)  # fmt: skip


def label(settings: dict[str, object]) -> str:
    """The run's name on the page: its tasks, its merged-weight budget and any setting of its own."""
    mb = float(settings["eval.merge_budget_mb"])  # type: ignore[arg-type]
    own = [f"{k}={v}" for k, v in settings.items() if "." in k and k not in COMMON]
    if settings.get("kernel_caches") == "off":
        own.append("kernel caches off")
    return ", ".join(
        [f"{settings['tasks']} tasks", f"{mb / 1024:g} GiB" if mb >= 1024 else f"{mb:g} MiB", *own]
    )


#: the seconds kept at task 10 and at the last task (medians of the tasks within 2 of each, as the ratios)
SECONDS = {
    "learn": "learn_s", "of which training": "train_s", "signature": "signature_s", "commit": "commit_s",
    "train step": "train_step_s",
}  # fmt: skip


def _seconds(d: dict[str, Any]) -> dict[str, list[float]]:
    """The seconds behind the ratios: measured side by side at the end of the run when it was (task 10's
    learner and the last one each learning one more task, in turns), else the rows' windows."""
    side, last = d.get("side_by_side"), d["settings"]["tasks"]
    if side:
        pairs = {name: [side[s][key] for s in ("ref", "last")] for name, key in SECONDS.items()}
        predict = [side[s]["predict_s"] for s in ("ref", "last")]
    else:
        pairs = {name: [_window(d["rows"], key, k) for k in (10, last)] for name, key in SECONDS.items()}
        predict = [_window(d["rows"], "predict_s", k) for k in (10, last)]
    out = {
        **{name: [round(v, 3) for v in pair] for name, pair in pairs.items()},
        "predict (ms)": [round(v * 1e3) for v in predict],
    }
    if side and "predict_under_s" in side["ref"]:
        for name, key in (("of which: adapters under the candidates (ms)", "predict_under_s"),
                          ("of which: detector (ms)", "predict_detector_s"),
                          ("task 10's batch (ms)", "predict_same_s")):  # fmt: skip
            out[name] = [round(side[s][key] * 1e3) for s in ("ref", "last")]
    for name, key in (("open and predict one image (ms)", "open_predict_s"),
                      ("the same in a new process (ms)", "open_predict_new_s")):  # fmt: skip
        if side and key in side["ref"]:
            out[name] = [round(side[s][key] * 1e3) for s in ("ref", "last")]
    return out


def _slope(d: dict[str, Any], key: str) -> float:
    """MiB the rows' ``key`` (bytes) grows per task from task 10 to the last."""
    rows, ref = d["rows"], min(10, d["settings"]["tasks"])
    span = max(rows[-1]["task"] - ref, 1)
    return (rows[-1][key] - rows[ref - 1][key]) / span / 2**20


def _kb_slope(d: dict[str, Any]) -> float:
    """MiB the knowledge base on disk grows per task from task 10 to the last: the learned state itself."""
    return _slope(d, "kb_bytes")


def summary(path: Path) -> dict[str, object]:
    """One run's figures, rounded as the page shows them."""
    d = json.loads(path.read_text())
    per_task = d["memory_account"]["per_task_mb"]
    learner = per_task["learner_tensors_mb"]
    parts = {name: round(sum(learner.get(k, 0.0) for k in keys), 3) for name, keys in PARTS.items()}
    if "detector_cache_bytes" in d["rows"][0]:  # the detector's decoded Gaussians: a cache within a budget
        parts = {"novelty detector": parts.pop("novelty detector"),
                 "of which: its cache": round(_slope(d, "detector_cache_bytes"), 3), **parts}  # fmt: skip
    return {
        "label": label(d["settings"]),
        "tasks": d["settings"]["tasks"],
        "merge_budget_mb": d["settings"]["eval.merge_budget_mb"],
        "seconds_total": round(d["seconds_total"]),
        **{k: None if d.get(k) is None else round(d[k], 2) for k in RATIOS if k in d},
        "rss_beyond_cache_mb_per_task": round(d["rss_beyond_cache_mb_per_task"], 3),
        "page_cache_mb_per_task": round(d.get("rss_file_mb_per_task", 0.0), 3),
        "kb_mb_per_task": round(_kb_slope(d), 3),
        "parts_mb_per_task": {
            **parts,
            "native rest": round(per_task["native_mb"], 3),
            **{
                name: round(per_task[key], 3) for name, key in NATIVE.items() if per_task.get(key) is not None
            },
        },
        "seconds": _seconds(d),
        "targets": _targets(d),
        "window_ratios": {k: round(v, 2) for k, v in (d.get("window_ratios") or {}).items()},
        "rss_mb_start": round(d["rss_mb_start"]),
        "rss_mb_last": round(d["rss_mb_last"]),
    }


def _targets(d: dict[str, Any]) -> dict[str, list[Any]]:
    """Per :data:`TARGETS` figure the run has, ``[the most it may be, whether the run meets it, the figure]``:
    judged on the figure as measured (to three decimals), not as the page rounds it (1.302 is over 1.3)."""
    exact = {k: d.get(k) for k in RATIOS}
    exact["rss_beyond_cache_mb_per_task"] = d["rss_beyond_cache_mb_per_task"]
    exact["kb_mb_per_task"] = _kb_slope(d)
    return {
        k: [most, round(exact[k], 3) <= most, round(exact[k], 3)]
        for k, (_, most) in TARGETS.items()
        if exact.get(k) is not None
    }


def target_line(label: str, key: str, target: list[Any]) -> str:
    """The page's line of one target: ``| run | target | <= most | met / not met (the figure) |`` (a record
    made before the figure was kept shows none)."""
    most, met, *figure = target
    said = ("**met**" if met else "not met") + (f" ({figure[0]:g})" if figure else "")
    return f"| {label} | {TARGETS[key][0]} | <= {most:g} | {said} |"


#: the page's names of :data:`RATIOS`, in order
RATIO_NAMES = (
    "learn", "learn without the training step's growth", "train step", "commit", "predict",
    "predict without the composition's growth", "predict task 10's batch", "open + predict one image",
    "open + predict one image, new process",
)  # fmt: skip


def tables(rec: dict[str, Any]) -> str:
    """The page's three tables of a record (figures, the seconds behind them, the targets), in Markdown: what
    ``tests/test_measured_docs.py`` checks the page against."""
    runs = rec["runs"]
    parts = list(runs[0]["parts_mb_per_task"])
    kept = kept_ratios(runs)
    names = [name for k, name in zip(RATIOS, RATIO_NAMES, strict=True) if k in kept]
    head = ["run", *names, "beyond the caches", "page cache", "knowledge base", *parts]
    lines = [f"| {' | '.join(head)} |", "| --- |" + " ---: |" * (len(head) - 1)]
    for run in runs:
        cells = ["—" if run.get(k) is None else f"{run[k]:.2f}" for k in kept]
        cells += [
            f"{run[k]:.3f}"
            for k in ("rss_beyond_cache_mb_per_task", "page_cache_mb_per_task", "kb_mb_per_task")
        ]
        cells += [f"{v:.3f}" for v in run["parts_mb_per_task"].values()]
        lines.append(f"| {run['label']} | {' | '.join(cells)} |")
    seconds = list(runs[0]["seconds"])
    lines += ["", f"| run | {' | '.join(seconds)} |", "| --- |" + " --- |" * len(seconds)]
    for run in runs:
        pairs = [" / ".join(f"{v:g}" for v in pair) for pair in run["seconds"].values()]
        lines.append(f"| {run['label']} | {' | '.join(pairs)} |")
    lines += ["", "| run | target | at most | |", "| --- | --- | --- | --- |"]
    for run in runs:
        lines += [target_line(run["label"], key, target) for key, target in run["targets"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, "long")
    ap.add_argument("runs", type=Path, nargs="+", help="long_stream.json of perf_long.py runs")
    args = ap.parse_args()
    rec: dict[str, Any] = {"name": args.name, "command": args.command}
    rec["runs"] = [summary(p) for p in args.runs]
    labels = [r["label"] for r in rec["runs"]]
    for i, run in enumerate(rec["runs"]):  # runs of the same settings (the spread between runs), numbered
        if labels.count(labels[i]) > 1:
            run["label"] = f"{labels[i]}, run {labels[:i].count(labels[i]) + 1}"
    devices = sorted({json.loads(p.read_text())["settings"].get("device", "unknown") for p in args.runs})
    threads = "unknown"
    if "--threads" in args.command.split():
        threads = int(args.command.split()[args.command.split().index("--threads") + 1])
    rec["provenance"] = from_checkout(
        args.command, devices[0] if len(devices) == 1 else str(devices), threads
    )
    print(write(args.out, args.name, rec, "long"))
    print(tables(rec))


if __name__ == "__main__":
    main()
