"""The shared continual loop: learn one task into a knowledge base, or run a whole stream (Mammoth's one
training loop; the method is the estimator's configuration).

``proteus run`` and a sequence of ``proteus learn --task K`` share :func:`learn_and_commit`, so both give
the same knowledge base and the same results for the same seed. Under ``torchrun`` every rank runs this
loop (the estimator shards its passes, :mod:`proteus.distributed`); only rank 0 writes files, and the
other ranks read its commits back after a barrier.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, cast

from proteus import devices
from proteus import distributed as dist
from proteus.config import RunConfig, learner_name
from proteus.engine.records import TaskStats
from proteus.experiment.evaluate import Evaluator
from proteus.experiment.provenance import provenance
from proteus.experiment.results import build_results
from proteus.experiment.store import (
    build_learner,
    check_split,
    commit,
    kb_header,
    load_learner,
    setup_run_log,
)
from proteus.experiment.tracking import Tracker
from proteus.faults import crash_point
from proteus.kb import KBError, KnowledgeBase
from proteus.learners import ContinualLearner, FittedLearner
from proteus.streams import TaskStream, build_benchmark

log = logging.getLogger("proteus")

__all__ = ["learn_and_commit", "run"]


def _orthogonal_room(k: int, stats: TaskStats) -> str | None:
    """A line for the user when task k's new directions did not fit some adapted maps (Eq. 15: each map's
    new directions are orthogonal to all old ones, and its input dimension bounds their number)."""
    train = stats.train
    if train is None or train.ranks_min >= train.rank:
        return None
    return (
        f"task {k + 1}: no orthogonal room left on some adapted maps: {train.ranks_min} of {train.rank} new "
        "directions on the fullest (Eq. 15); later tasks add none there. For long streams see "
        "docs/performance.md, 'Long streams' (adapter.budget_decay, a smaller adapter.rank)"
    )


def learn_and_commit(
    clf: ContinualLearner, kb: KnowledgeBase, stream: TaskStream, k: int, evaluator: Evaluator | None
) -> TaskStats:
    """Learn task k, evaluate (if asked), commit the KB. The KB is never left half-written."""
    t0 = time.perf_counter()
    stats = clf.fit_task(stream.tasks[k])
    fitted = cast(FittedLearner, clf)
    room = _orthogonal_room(k, stats)
    if room and dist.is_main():
        print(room, file=sys.stderr, flush=True)
    evaluation = list(kb.manifest.get("evaluation", []))
    if evaluator is not None:
        t1 = devices.clock(fitted.device_)
        evaluation = evaluation[:k] + [evaluator.evaluate(k).to_dict()]
        stats.seconds["evaluate"] = devices.clock(fitted.device_) - t1
        stats.peak_gpu_mb = devices.peak_memory_mb(fitted.device_)
    crash_point("evaluate")
    stats.seconds["task"] = devices.clock(fitted.device_) - t0
    if dist.is_main():  # under torchrun rank 0 writes; the others read its commit back
        commit(kb, clf, evaluation)
    dist.barrier()
    if not dist.is_main():
        kb.manifest = KnowledgeBase.open(kb.root, verify=False).manifest
    return stats


def _check_resumable(out: Path) -> None:
    if (out / "results.json").exists():
        raise KBError(f"{out}: the run finished (results.json); there is nothing to resume")
    if not (out / "config.yaml").is_file():
        raise KBError(f"{out}: no config.yaml: not a run directory; give the --out of an interrupted run")


def _resumed(
    cfg: RunConfig, kb_dir: Path, stream: TaskStream, progress: bool
) -> tuple[ContinualLearner | None, KnowledgeBase | None, list[dict[str, Any]]]:
    """An interrupted run's learner and knowledge base (None before its first commit) and the statistics
    of the tasks it committed (as its manifest keeps them: without wall-clock times)."""
    if not KnowledgeBase.exists(kb_dir):
        return None, None, []
    kb = KnowledgeBase.open(kb_dir)
    check_split(kb, stream)
    tasks = kb.manifest["tasks"]
    if not tasks:
        return None, kb, []
    clf = load_learner(
        kb, "proteus run --resume", device=cfg.device, precision=cfg.precision, progress=progress
    )
    log.info("resuming %s at task %d of %d", kb_dir.parent, len(tasks) + 1, len(stream.tasks))
    return clf, kb, [dict(t.get("stats") or {}) for t in tasks]


def run(cfg: RunConfig, out: str | Path, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """The whole continual loop in one process, for any method's learner; writes config.yaml, split.json,
    log.txt, kb/, train_log.csv (one row per optimisation step), results.json, acc_matrix.csv and, for
    PROTEUS methods, analysis.json and (``report.figures``) report.md with figures/
    (:mod:`proteus.report`). The training curves and accuracies go out as events
    (:mod:`proteus.experiment.tracking`): to the CSVs always, to TensorBoard / W&B with
    ``report.tracking``, task by task while the run goes on.

    ``resume``: continue an interrupted run in ``out`` from its knowledge base's last committed task (the
    learner read back from it, the earlier tasks' rows and statistics from its manifest); the results are
    those of an uninterrupted run."""
    out = Path(out)
    main = dist.is_main()  # under torchrun only rank 0 writes files (proteus.distributed)
    created = main and not out.exists()  # a run that fails before its first commit leaves no folder
    handler = setup_run_log(out) if main else None
    tracker: Tracker | None = None
    ok = False
    try:
        t0 = time.perf_counter()
        kb_dir = out / "kb"
        if resume:
            _check_resumable(out)
        elif KnowledgeBase.exists(kb_dir) or (out / "results.json").exists():
            raise KBError(
                f"{out}: holds a run already; choose a new --out (runs never overwrite a KB), or continue an "
                f"interrupted run with `proteus run --resume {out}`"
            )
        # the sinks are checked (names, packages) before any work; only rank 0 writes to them
        tracker = Tracker.for_run(out, cfg.report.tracking, enabled=main)
        if main and not resume:
            (out / "config.yaml").write_text(cfg.to_yaml())
        stream = build_benchmark(cfg.benchmark)
        if main and not resume:
            stream.write_manifest(out / "split.json")
        log.info("run %s on %s: %d tasks (%s)", cfg.method, stream.name, len(stream.tasks), dist.describe())
        tracker.start(out, cfg.to_dict(), cfg.method, stream.name, len(stream.tasks))
        clf, kb, per_task = _resumed(cfg, kb_dir, stream, progress) if resume else (None, None, [])
        if clf is None:
            clf = build_learner(cfg, progress=progress)
        if kb is None:
            # a new knowledge base, in memory until its first commit (nothing is written if task 1 fails);
            # under torchrun only rank 0 commits, and the others read its commits back
            kb = KnowledgeBase.new(kb_dir, kb_header(clf, stream))
        evaluator = Evaluator(clf, stream)
        if per_task:
            tracker.resume(kb.manifest["evaluation"][: len(per_task)])
        for k in range(len(per_task), len(stream.tasks)):
            stats = learn_and_commit(clf, kb, stream, k, evaluator)
            st = stats.to_dict()
            ev = kb.manifest["evaluation"][-1] if kb.manifest["evaluation"] else None
            log.info("task %d: %s", k + 1, json.dumps({"stats": st, "eval": ev}, default=str))
            per_task.append(st)
            # the task's training curve and accuracies: train_log.csv, acc_matrix.csv (docs/experiments.md)
            tracker.steps(k + 1, list(clf.train_log_))
            tracker.task_end(k + 1, len(stream.tasks), ev, st.get("seconds_task"))
            if progress and ev and main:
                ret = ev["retrieval_acc"]
                print(
                    f"task {k + 1}/{len(stream.tasks)}: accuracy per task {[round(a, 1) for a in ev['row']]}"
                    + (f", retrieval {ret:.1f}%" if ret is not None else ""),
                    flush=True,
                )
        evaluation = [e for e in kb.manifest["evaluation"] if e]
        extra: dict[str, Any] = {"tasks": per_task, "kb_bytes": kb.nbytes()}
        seconds, t1 = time.perf_counter() - t0, time.perf_counter()
        bulky: dict[str, Any] | None = None
        if "analysis" in clf.supports:
            # theory checks, S / cosine analyses, latency (proteus.report); every rank takes part in any
            # embedding pass the theory needs, rank 0 alone times and writes
            from proteus.report.analysis import analyse_run

            keys, bulky = analyse_run(clf, evaluator, stream, cfg.report, latency=main)
            extra.update(keys)
        else:  # a Table 1 baseline: its learned tensors are the head object of its knowledge base
            extra.update(
                {
                    "model_bytes": kb.nbytes().get("head", 0),
                    "learner": learner_name(cfg),
                }
            )
        if cfg.report.latency and main:  # seconds per batch with every task, any learner
            from proteus.report.analysis import measure_inference

            try:
                extra["inference"] = measure_inference(clf, stream, cfg.report)
            except Exception as e:  # noqa: BLE001 - a timing must not lose a finished run
                log.warning("inference time not measured: %s", e)
        extra["provenance"] = provenance(str(getattr(clf, "device_", cfg.device)))
        res = build_results(cfg, stream, evaluation, seconds, extra)
        if main:
            (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
            tracker.run_end(res)  # acc_matrix.csv: results.json's acc_matrix
            if bulky is not None:
                (out / "analysis.json").write_text(json.dumps(bulky))
                if cfg.report.figures:
                    from proteus.report import write_report

                    res["figures"] = write_report(out, res, bulky)
                res["seconds_report"] = time.perf_counter() - t1
                (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
        ok = True
        return res
    finally:
        if tracker is not None:
            tracker.close(ok)
        if handler is not None:
            logging.getLogger("proteus").removeHandler(handler)
            handler.close()
        if not ok and created and not KnowledgeBase.exists(out / "kb"):
            shutil.rmtree(out, ignore_errors=True)
