"""``proteus learn``: one task into a knowledge base, in its own process (add a task today, another next
month).

The options given on the command line are checked against the knowledge base before any work starts:

* keys that define the model (backbone, method, adapter, signature, head, retrieval settings, seed,
  benchmark) must equal what the KB was built with; a conflict is refused with every conflicting key,
  the KB's value and the given one;
* keys that may change from task to task (declared ``per_task``: epochs, learning rate, batch sizes,
  workers, device) are applied to this task and recorded in its record (``settings``);
* the stream's already-learned tasks must have the same classes in the same order as the KB's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proteus import distributed as dist
from proteus.config import ConfigError, RunConfig, flatten, per_task, validate_keys
from proteus.experiment.evaluate import Evaluation, Evaluator
from proteus.experiment.loop import learn_and_commit
from proteus.experiment.results import build_results
from proteus.experiment.store import build_learner, kb_header, load_learner
from proteus.kb import KBError, KnowledgeBase, write_lock
from proteus.learners import ContinualLearner, check_supports
from proteus.streams import TaskStream, build_benchmark

__all__ = [
    "LearnOutcome", "check_learned_tasks", "config_conflicts", "evaluate_kb", "learn_task",
]  # fmt: skip


_LEARN = "proteus learn (tasks added one process at a time)"


def config_conflicts(kb_config: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """``"key: knowledge base has A, given B"`` for every model-defining key of ``given`` (flat, dotted,
    already validated and typed: :func:`proteus.config.validate_keys`) whose value differs from the
    knowledge base's config."""
    have = flatten(RunConfig.from_stored(kb_config).to_dict())
    return [
        f"{key}: knowledge base has {have.get(key)!r}, given {value!r}"
        for key, value in given.items()
        if not per_task(key) and have.get(key) != value
    ]


def check_learned_tasks(kb: KnowledgeBase, stream: TaskStream) -> None:
    """The stream must be the KB's benchmark, with the learned tasks' classes in the same order."""
    split = kb.manifest.get("split") or {}
    if split.get("benchmark") not in (None, stream.name):
        raise KBError(
            f"{kb.root}: knowledge base was built on benchmark {split.get('benchmark')!r}, "
            f"but the data given is {stream.name!r}"
        )
    for t in kb.manifest["tasks"]:
        k = t["index"]
        if k >= len(stream.tasks):
            raise KBError(
                f"{kb.root}: the data given has {len(stream.tasks)} tasks; the KB holds task {k + 1}"
            )
        s = stream.tasks[k]
        if list(s.classes) != t["classes"] or list(s.class_names) != t["class_names"]:
            raise KBError(
                f"{kb.root}: task {k + 1} was learned with classes {t['class_names']}, but the data given "
                f"makes task {k + 1} {list(s.class_names)} (the class order of learned tasks cannot change; "
                "restore the tasks file or start a new knowledge base)"
            )


@dataclass
class LearnOutcome:
    task: int  # 1-based
    num_tasks: int  # tasks in the stream
    kb_tasks: int  # tasks in the KB afterwards
    evaluation: Evaluation | None
    already: bool = False


def learn_task(
    kb_dir: str | Path,
    task: int,
    new_config: Callable[[], RunConfig],
    given: dict[str, Any],
    *,
    evaluate: bool = True,
    progress: bool = True,
    wait: float | None = 0.0,
) -> LearnOutcome:
    """Learn task ``task`` (1-based) into ``kb_dir`` under the KB's write lock (held from before the KB is
    read until after the commit; ``wait``: seconds to wait for another writer, None = as long as it takes).

    ``new_config`` resolves the config when the KB does not exist yet; ``given`` holds the flat dotted
    keys set explicitly on the command line, validated here before anything else (unknown keys, types,
    registries, ranges: :func:`proteus.config.validate_keys`), then checked against an existing KB
    (:func:`config_conflicts`) and the per-task keys applied."""
    kb_dir = Path(kb_dir)
    if task < 1:
        raise ConfigError(f"--task must be 1 or more (tasks are numbered from 1), got {task}")
    given = validate_keys(given)
    if kb_dir.exists() and not kb_dir.is_dir():
        raise KBError(f"{kb_dir}: is a file, not a knowledge-base directory; choose another --kb")
    if not KnowledgeBase.exists(kb_dir):  # refused before the lock leaves anything on disk
        check_supports(build_learner(new_config(), progress=False), "load", _LEARN)
    created = not kb_dir.exists()
    lock = write_lock(kb_dir, wait=wait) if dist.is_main() else contextlib.nullcontext()
    try:
        with lock:
            if dist.is_main():
                KnowledgeBase.check_writable(kb_dir)
            return _learn_locked(kb_dir, task, new_config, given, evaluate, progress)
    except BaseException:  # a first task that failed (or was stopped) leaves no empty knowledge-base folder
        if created and dist.is_main() and not KnowledgeBase.exists(kb_dir):
            shutil.rmtree(kb_dir, ignore_errors=True)
        raise


def _learn_locked(
    kb_dir: Path,
    task: int,
    new_config: Callable[[], RunConfig],
    given: dict[str, Any],
    evaluate: bool,
    progress: bool,
) -> LearnOutcome:
    k = task - 1
    kb = KnowledgeBase.open(kb_dir) if KnowledgeBase.exists(kb_dir) else None
    empty = kb is not None and not kb.manifest["tasks"]  # left by an earlier release's failed first task
    if kb is not None and not empty:
        n = len(kb.manifest["tasks"])
        if k < n:
            return LearnOutcome(task, -1, n, None, already=True)
        if k > n:
            raise KBError(f"{kb_dir}: holds {n} tasks; learn task {n + 1} before task {task}")
        conflicts = config_conflicts(kb.manifest["config"], given)
        if conflicts:
            raise KBError(
                f"{kb_dir}: the options given conflict with the knowledge base:\n  "
                + "\n  ".join(conflicts)
                + "\n(options that define the model cannot change between tasks: drop them or use a new --kb)"
            )
        loaded = load_learner(kb, "proteus learn", progress=progress, device=given.get("device"))
        loaded.set_params(**{key: value for key, value in given.items() if per_task(key)})
        clf: ContinualLearner = loaded
    else:
        if k != 0:
            raise KBError(f"{kb_dir}: no knowledge base here; learn task 1 first")
        clf = build_learner(new_config(), progress=progress)
        check_supports(clf, "load", _LEARN)
    stream = build_benchmark(clf.config.benchmark)
    if k >= len(stream.tasks):
        raise KBError(f"benchmark {stream.name} has {len(stream.tasks)} tasks; there is no task {task}")
    if kb is None:
        kb = KnowledgeBase.new(kb_dir, kb_header(clf, stream))
    elif empty:  # nothing was learned into it: this first commit replaces its header
        kb.manifest.update(kb_header(clf, stream))
    check_learned_tasks(kb, stream)
    evaluator = Evaluator(clf, stream, hint=" (skip with --no-eval)") if evaluate else None
    learn_and_commit(clf, kb, stream, k, evaluator)
    ev = None
    if evaluate and kb.manifest["evaluation"]:
        e = kb.manifest["evaluation"][-1]
        ev = Evaluation(e["row"], e["retrieval_acc"], e["oracle_row"])
    return LearnOutcome(task, len(stream.tasks), len(kb.manifest["tasks"]), ev)


def evaluate_kb(
    kb_dir: str | Path,
    *,
    benchmark: str | None = None,
    data: str | None = None,
    tasks_file: str | None = None,
    device: str | None = None,
    precision: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """``proteus evaluate``: the results (results.json's keys) of the learner a knowledge base holds, on
    the test sets of its benchmark (``data``/``tasks_file`` point at the data on this machine). The stored
    evaluation rows of the earlier tasks are kept when they are all there; the last row is measured now."""
    kb = KnowledgeBase.open(kb_dir)
    clf = load_learner(kb, "proteus evaluate", progress=progress, device=device, precision=precision)
    cfg = clf.config
    if benchmark and benchmark != cfg.benchmark.name:
        raise KBError(f"{kb_dir}: KB was built on benchmark {cfg.benchmark.name!r}, not {benchmark!r}")
    bench = dataclasses.replace(
        cfg.benchmark, data=data or cfg.benchmark.data, tasks_file=tasks_file or cfg.benchmark.tasks_file
    )
    stream = build_benchmark(bench)
    check_learned_tasks(kb, stream)
    t0 = time.perf_counter()
    n = clf.num_tasks
    ev = Evaluator(clf, stream).evaluate(n - 1).to_dict()
    stored = list(kb.manifest.get("evaluation", []))
    complete = len(stored) >= n - 1
    evaluation = (stored[: n - 1] if complete else []) + [ev]
    res = build_results(cfg, stream, evaluation, time.perf_counter() - t0)
    res["num_tasks_learned"] = n
    res["evaluated_after"] = list(range(1, n + 1)) if complete else [n]
    return res
