"""One cell of a grid (a method, a seed, a benchmark) as a job with its own folder, and its state read back
from files only.

The submitter writes the cell's resolved configuration into ``RUN_DIR/job.json`` (JSON, no pickle); the job is
``python -m proteus.experiment.cell RUN_DIR [--log FILE]`` on whatever machine the executor picked
(:mod:`proteus.experiment.executors`): it runs :func:`proteus.experiment.loop.run` into ``RUN_DIR`` and
records its state in ``RUN_DIR/state.json`` (running, done, failed with the error, or interrupted by a stop
signal; the executor, host and job id). A job started again in a folder whose run stopped part-way (a
re-queued SLURM job) continues it from the knowledge base's last committed task (``run(..., resume=True)``:
the results of an uninterrupted run). SIGTERM, SIGUSR1 and SIGUSR2 (a scheduler's preemption or time-out
notice: submitit's is SIGUSR2, which every process of the job receives) stop the job as Ctrl-C does: the task
being learned is left out, every committed task kept; the first of them stops it, the others are ignored from
then on (SIGKILL still ends it at once).

:func:`cell_state` reads a folder back: ``done`` (a readable results.json), ``running``, ``failed`` (with the
last line of its log), ``interrupted`` (stopped by a signal, or a knowledge base but no results) or
``missing``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from proteus.config import RunConfig

__all__ = [
    "JOB_FILE", "LOG_FILE", "STATE_FILE", "STATES", "STOP_SIGNALS", "CellState", "cell_state", "last_line",
    "main", "read_state", "run_cell", "write_job",
]  # fmt: skip

#: the cell's configuration, written by the submitter
JOB_FILE = "job.json"
#: the job's state, written by the job
STATE_FILE = "state.json"
#: the job's standard output and error (executors that start a process)
LOG_FILE = "job.log"
#: what :func:`cell_state` says of a cell
STATES = ("done", "running", "failed", "interrupted", "missing")


def write_job(run_dir: Path, cfg: RunConfig, executor: str) -> None:
    """The job's input: ``cfg`` (as :meth:`RunConfig.to_dict`) and the executor that runs it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / JOB_FILE, {"executor": executor, "config": cfg.to_dict()})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_state(run_dir: Path) -> dict[str, Any]:
    """``state.json`` of a cell's folder ({} when there is none or it is unreadable)."""
    return _read_json(run_dir / STATE_FILE) or {}


def _mark(run_dir: Path, state: str, executor: str, **extra: Any) -> None:
    record = read_state(run_dir) if state != "running" else {}
    record.update(
        state=state,
        executor=executor,
        host=socket.gethostname(),
        pid=os.getpid(),
        job_id=os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID")),
        **{"started" if state == "running" else "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        **extra,
    )
    if record["job_id"] and os.environ.get("SLURM_ARRAY_TASK_ID"):
        record["job_id"] = f"{record['job_id']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / STATE_FILE, record)


def run_cell(
    run_dir: Path, executor: str, cfg: RunConfig | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run the cell in ``run_dir`` (``cfg``, else its job.json's) and record its state; an error is recorded
    as ``failed`` and raised again. A folder holding a run that stopped part-way is continued."""
    from proteus.experiment.loop import run
    from proteus.kb import KnowledgeBase

    if cfg is None:
        job = _read_json(run_dir / JOB_FILE)
        if job is None or not isinstance(job.get("config"), dict):
            raise FileNotFoundError(f"{run_dir / JOB_FILE}: no readable job file (the cell's configuration)")
        cfg = RunConfig.from_stored(job["config"])
        if cfg.threads is not None:  # the config's own count wins over the executor's share
            import torch

            torch.set_num_threads(cfg.threads)
    resume = KnowledgeBase.exists(run_dir / "kb") and not (run_dir / "results.json").is_file()
    _mark(run_dir, "running", executor, resumed=resume)
    try:
        res = run(cfg, run_dir, progress=progress, resume=resume)
    except KeyboardInterrupt as e:  # a stop (Ctrl-C, a scheduler's notice): not a failure of the cell
        _mark(run_dir, "interrupted", executor, stopped=str(e) or "KeyboardInterrupt")
        raise
    except BaseException as e:
        _mark(run_dir, "failed", executor, error=" ".join(f"{type(e).__name__}: {e}".split()))
        raise
    device = (res.get("provenance") or {}).get("device")
    _mark(run_dir, "done", executor, device=device)
    return res


def last_line(run_dir: Path) -> str:
    """The last non-empty line of the cell's job log (else of the run's log.txt); "" when there is none."""
    for name in (LOG_FILE, "log.txt"):
        try:
            with open(run_dir / name, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            continue
        if lines:
            return lines[-1].strip()
    return ""


@dataclass(frozen=True)
class CellState:
    """What a cell's folder says of it: ``state`` (one of :data:`STATES`), a ``detail`` for the user, and
    where it ran (``executor``, ``host``, ``device``: None where the folder does not say)."""

    state: str
    detail: str = ""
    executor: str | None = None
    host: str | None = None
    device: str | None = None

    def where(self) -> dict[str, str | None]:
        return {"executor": self.executor, "host": self.host, "device": self.device}


def _alive(record: dict[str, Any]) -> bool:
    """False for a job of this host whose process is gone; True otherwise (another host's is not known)."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return True
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cell_state(run_dir: Path) -> CellState:
    """The state of the cell in ``run_dir``, from its files only."""
    record = read_state(run_dir)
    res = _read_json(run_dir / "results.json")
    where: dict[str, Any] = {k: record.get(k) for k in ("executor", "host")}
    if res is not None:
        device = record.get("device") or (res.get("provenance") or {}).get("device")
        return CellState("done", "", device=device, **where)
    if (run_dir / "results.json").exists():
        return CellState("failed", "results.json is not readable JSON", **where)
    state = record.get("state")
    if state == "running":
        if _alive(record):
            job = f"job {record['job_id']}, " if record.get("job_id") else ""
            return CellState("running", f"{job}since {record.get('started')}", **where)
        return CellState(
            "failed", f"its process ({record.get('pid')}) is gone: {last_line(run_dir)}", **where
        )
    if state == "failed":
        return CellState("failed", record.get("error") or last_line(run_dir), **where)
    if state == "interrupted":
        why = f"stopped ({record.get('stopped')}) at {record.get('ended')}; its committed tasks are kept"
        return CellState("interrupted", why, **where)
    if (run_dir / "kb").exists():
        return CellState("interrupted", "a knowledge base but no results.json", **where)
    return CellState("missing", **where)


#: the signals that stop a job at the task being learned (module doc)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _stop(signum: int, frame: FrameType | None) -> None:
    for sig in STOP_SIGNALS:  # a notice often reaches the job twice (to it and through its parent): once
        signal.signal(sig, _stopping)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _stopping(signum: int, frame: FrameType | None) -> None:
    """A stop signal while the job is stopping already: nothing more to do (a handler, not SIG_IGN, so that
    a signal already on its way when the handler changed is not reported as a race)."""


def main(argv: list[str] | None = None) -> int:
    """The job: ``python -m proteus.experiment.cell RUN_DIR [--log FILE] [--quiet]``; exit 0 when the cell is
    done, 1 when it failed (the error in its state.json and log), 130 when stopped by a signal."""
    p = argparse.ArgumentParser(prog="python -m proteus.experiment.cell")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--executor", default="pool")
    p.add_argument("--log", type=Path, help="append standard output and error to this file")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            os.dup2(fd, stream.fileno())
        os.close(fd)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (proteus.cli.threads: before torch loads)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    try:
        run_cell(args.run_dir, args.executor, progress=not args.quiet)
    except KeyboardInterrupt as e:
        print(f"stopped ({e}); the committed tasks are kept: the next start continues from them", flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - recorded in state.json; one line here, the job fails
        print(f"failed: {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
