"""``proteus run`` for the trained-classifier baselines (:mod:`proteus.baselines`): the same stream, split
manifest, seeds, evaluation rows and results.json as a PROTEUS run, so ``proteus compare`` sets them side
by side (Table 1).

A baseline keeps no knowledge base: after each task the run directory's ``model.safetensors`` (every
learned tensor: heads, LoRA branches, prompts) and ``model.json`` (the classes of each head) are replaced
atomically, so they always hold a whole task's state. The evaluation after task k is the accuracy on each
seen task's test set of the argmax over all seen classes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from proteus.baselines import ContinualClassifier, build_baseline
from proteus.config import RunConfig
from proteus.experiment.results import build_results
from proteus.experiment.store import setup_run_log
from proteus.streams import TaskStream, build_benchmark

log = logging.getLogger("proteus")

__all__ = ["evaluate_rows", "run_baseline"]


def evaluate_rows(
    clf: ContinualClassifier, stream: TaskStream, k: int, cache: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    """Accuracy (%) on the test sets of tasks 0..k (class-incremental: argmax over every seen class). The
    frozen prefix outputs of each test set are computed once (``cache``)."""
    row = []
    for tau in range(k + 1):
        if tau not in cache:
            cache[tau] = clf.prefix_dataset(stream.tasks[tau].test, desc=f"test {tau + 1}: prefix")
        z, y = cache[tau]
        pred = clf.predict_prefix(z)
        row.append(100.0 * float((pred == y).float().mean()))
    return {"row": row, "retrieval_acc": None, "oracle_row": None}


def save_model(clf: ContinualClassifier, out: Path) -> int:
    """Write ``model.safetensors`` and ``model.json`` (each via a temporary file and a rename)."""
    tensors = clf.state_tensors()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"method": clf.name, "tasks": str(clf.num_tasks)})
    os.replace(tmp, out / "model.safetensors")
    meta = {"method": clf.name, "task_classes": clf.task_classes_, "tensors": sorted(tensors)}
    (out / "model.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(out / "model.json.tmp", out / "model.json")
    return (out / "model.safetensors").stat().st_size


def run_baseline(cfg: RunConfig, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """The whole stream with one baseline; writes config.yaml, split.json, log.txt, model.*, results.json."""
    out = Path(out)
    handler = setup_run_log(out)
    try:
        t0 = time.perf_counter()
        if (out / "results.json").exists() or (out / "model.json").exists():
            raise FileExistsError(f"{out}: holds a run already; choose a new --out")
        (out / "config.yaml").write_text(cfg.to_yaml())
        stream = build_benchmark(cfg.benchmark)
        stream.write_manifest(out / "split.json")
        log.info("run %s on %s: %d tasks", cfg.method, stream.name, len(stream.tasks))
        clf = build_baseline(cfg, progress=progress)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        evaluation, per_task, model_bytes = [], [], 0
        for k, task in enumerate(stream.tasks):
            t1 = time.perf_counter()
            stats = clf.fit_task(task, stream_tasks=len(stream.tasks))
            stats["seconds_train"] = time.perf_counter() - t1
            ev = evaluate_rows(clf, stream, k, cache)
            stats["seconds_task"] = time.perf_counter() - t1
            evaluation.append(ev)
            per_task.append(stats)
            model_bytes = save_model(clf, out)
            log.info("task %d: %s", k + 1, json.dumps({"stats": stats, "eval": ev}))
            if progress:
                row = [round(a, 1) for a in ev["row"]]
                print(f"task {k + 1}/{len(stream.tasks)}: accuracy per task {row}", flush=True)
        extra = {"tasks": per_task, "model_bytes": model_bytes, "learner": clf.name}
        res = build_results(cfg, stream, evaluation, time.perf_counter() - t0, extra)
        (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
        return res
    finally:
        logging.getLogger("proteus").removeHandler(handler)
