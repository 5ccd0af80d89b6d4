"""Where the cells of ``proteus compare`` and ``proteus reproduce`` run: one interface, a registry of
executors (timm style), each cell one job with its own folder (:mod:`proteus.experiment.cell`).

- ``local``: every cell in this process, one after the other (the default; an error stops the grid);
- ``pool``: ``jobs`` processes on this machine (``python -m proteus.experiment.cell``), each with the thread
  count this process has (a run's numbers depend on torch's thread count: the same count gives the local
  executor's numbers) and, where there are several GPUs, its own one (``CUDA_VISIBLE_DEVICES``);
- ``slurm``: one SLURM job array through submitit (the optional extra ``cluster``), a task per cell, with
  the options users set (partition, GPUs per task, time, array parallelism, any other sbatch option);
  ``dry_run`` prints the job script and each task's command instead of submitting. Each task is a
  :class:`CellJob`, which submitit re-queues after a preemption notice or when its time runs out (it is
  checkpointable: the cell's own files are its checkpoint), and the re-queued job continues the cell from
  its last committed task.

Every executor leaves the same files in each cell's folder (results.json, state.json), and the tables are
gathered from those files alone, so a grid gives the same table whichever executor ran it. A cell that
fails in a pool or on SLURM does not stop the others; :class:`CellsFailed` names every failed cell after
the rest finished.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from proteus.config import ConfigError, RunConfig
from proteus.errors import ProteusError
from proteus.experiment.cell import LOG_FILE, cell_state, last_line, run_cell, write_job
from proteus.registry import Registry

__all__ = [
    "EXECUTORS", "CellJob", "CellsFailed", "Executor", "ExecutorOptions", "Failure", "Job", "LocalExecutor",
    "PoolExecutor", "SlurmExecutor", "make_executor", "run_jobs", "time_minutes",
]  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One cell: ``config`` run into ``run_dir`` (its own folder); ``label`` names it to the user."""

    label: str
    run_dir: Path
    config: RunConfig


@dataclass(frozen=True)
class Failure:
    job: Job
    reason: str


class CellsFailed(ProteusError, RuntimeError):
    """Cells of a grid that failed (the others finished and are kept); the message names each one."""


@dataclass
class ExecutorOptions:
    """Every executor option (each executor declares the ones it takes: :attr:`Executor.takes`)."""

    #: pool: processes at once
    jobs: int | None = None
    #: slurm: ``--partition``
    partition: str | None = None
    #: slurm: ``--gpus-per-task``
    gpus_per_task: int | None = None
    #: slurm: the time limit of each task, in minutes
    time: int | None = None
    #: slurm: at most this many tasks of the array at once
    array_parallelism: int | None = None
    #: slurm: any other sbatch option (``key=value``, e.g. ``account=lab``, ``mem=16G``)
    slurm_opts: dict[str, str] = field(default_factory=dict)
    #: slurm: print the job script, submit nothing
    dry_run: bool = False

    def given(self) -> list[str]:
        default = ExecutorOptions()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


class Executor:
    """Runs jobs; returns those that failed. Subclasses register in :data:`EXECUTORS`."""

    name: ClassVar[str] = ""
    #: the :class:`ExecutorOptions` fields this executor takes
    takes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: ExecutorOptions | None = None) -> None:
        self.options = options or ExecutorOptions()

    def run(self, jobs: Sequence[Job], root: Path, progress: bool = True) -> list[Failure]:
        raise NotImplementedError

    @property
    def dry_run(self) -> bool:
        return False


EXECUTORS: Registry[type[Executor]] = Registry("executor")


def make_executor(name: str, options: ExecutorOptions | None = None) -> Executor:
    """The executor ``name`` with ``options``; an option it does not take is refused by name."""
    cls = EXECUTORS.get(name)
    options = options or ExecutorOptions()
    extra = [o for o in options.given() if o not in cls.takes]
    if extra:
        flags = ", ".join("--" + ("slurm-opt" if o == "slurm_opts" else o.replace("_", "-")) for o in extra)
        owners = sorted({n for n in EXECUTORS.names() if set(extra) <= set(EXECUTORS.get(n).takes)})
        hint = f" (an option of --executor {' / '.join(owners)})" if owners else ""
        raise ConfigError(f"--executor {name} takes no {flags}{hint}")
    return cls(options)


@EXECUTORS.register("local", help="every cell in this process, one after the other (the default)")
class LocalExecutor(Executor):
    name = "local"

    def run(self, jobs: Sequence[Job], root: Path, progress: bool = True) -> list[Failure]:
        from proteus import distributed as dist

        for job in jobs:
            if progress and dist.is_main():
                print(f"== {job.label} -> {job.run_dir}", flush=True)
            write_job(job.run_dir, job.config, self.name)
            run_cell(job.run_dir, self.name, job.config, progress=progress)
        return []


class CellJob:
    """A cell's job under submitit: its command (``python -m proteus.experiment.cell ...``) in a child
    process. Checkpointable in submitit's sense (:meth:`checkpoint`): on the scheduler's preemption or
    time-out notice (submitit's signal, SIGUSR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise) the child
    stops at the task it is learning (it receives the notice too, or is sent SIGUSR1: every committed task
    is kept), then submitit re-queues the job, which continues the cell from its knowledge base. Picklable:
    submitit stores it for the job to load (a list of strings, no user object)."""

    #: seconds the child is given to stop after a notice before it is killed (its knowledge base is always
    #: the old or the new state: a kill loses only the task being learned)
    grace: ClassVar[float] = 60.0

    def __init__(self, command: list[str]) -> None:
        self.command = list(command)

    def __call__(self) -> int:
        import signal

        child = subprocess.Popen(self.command)
        name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
        notice = getattr(signal, f"SIG{name}")
        requeue = signal.getsignal(notice)  # submitit's: checkpoint, re-queue, exit
        noticed: list[tuple[int, Any]] = []

        def note(signum: int, frame: Any) -> None:  # (no wait here: the main flow holds the child's lock)
            noticed.append((signum, frame))
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR1)  # (it may have had the notice itself: it stops once)

        signal.signal(notice, note)
        deadline = None
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if noticed and deadline is None:
                    deadline = time.monotonic() + self.grace
                if deadline is not None and time.monotonic() > deadline:
                    child.kill()
        if noticed and callable(requeue):
            try:
                requeue(*noticed[0])  # exits: the job is re-queued and starts the cell again
            except subprocess.CalledProcessError as e:
                if e.returncode >= 0:
                    raise
                # `scontrol requeue` is a process of this job, and the re-queue ends the job: the scheduler's
                # signal can reach scontrol before it exits (a loaded node), which is the re-queue taking
                # effect, not its failure. Exit as submitit does after a re-queue: no result, the job's
                # next start continues the cell (a result here would report the cell failed while its
                # job waits in the queue)
                sys.exit(-1)
        if code:
            raise RuntimeError(f"{shlex.join(self.command)} exited with code {code} (its log: --log)")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The same job again (submitit's re-queue): the cell's folder is its checkpoint."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


def _cell_command(job: Job, executor: str, quiet: bool = True) -> list[str]:
    argv = [sys.executable, "-m", "proteus.experiment.cell", str(job.run_dir), "--executor", executor]
    return [*argv, "--log", str(job.run_dir / LOG_FILE)] + (["--quiet"] if quiet else [])


def _gpus() -> int:
    if "torch" not in sys.modules:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@EXECUTORS.register("pool", help="--jobs N processes on this machine, each its share of cores or its GPU")
class PoolExecutor(Executor):
    name = "pool"
    takes = ("jobs",)

    def _env(self, slot: int, gpus: int) -> dict[str, str]:
        env = dict(os.environ)
        if "torch" in sys.modules:  # this process's thread count (the environment's, or --threads')
            import torch

            env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
        return env

    def run(self, jobs: Sequence[Job], root: Path, progress: bool = True) -> list[Failure]:
        n = max(1, self.options.jobs or 1)
        gpus = _gpus()
        queue, free, failures = list(jobs), list(range(n)), []
        running: dict[subprocess.Popen[bytes], tuple[Job, int]] = {}
        try:
            while queue or running:
                while queue and free:
                    job, slot = queue.pop(0), free.pop(0)
                    write_job(job.run_dir, job.config, self.name)
                    proc = subprocess.Popen(_cell_command(job, self.name), env=self._env(slot, gpus))
                    running[proc] = (job, slot)
                    if progress:
                        print(f"== {job.label} -> {job.run_dir} (process {proc.pid})", flush=True)
                time.sleep(0.2)
                for proc in [p for p in running if p.poll() is not None]:
                    job, slot = running.pop(proc)
                    free.append(slot)
                    state = cell_state(job.run_dir)
                    if proc.returncode == 0 and state.state == "done":
                        if progress:
                            print(f"== {job.label}: done", flush=True)
                        continue
                    reason = state.detail or last_line(job.run_dir) or f"exit code {proc.returncode}"
                    failures.append(Failure(job, reason))
                    if progress:
                        print(f"== {job.label}: failed: {reason}", flush=True)
        except BaseException:  # Ctrl-C or SIGTERM: the running cells are stopped (their commits are kept)
            for proc in running:
                proc.terminate()
            for proc in running:
                proc.wait()
            raise
        return failures


def time_minutes(text: str) -> int:
    """``--time``: minutes (``90``), ``H:MM`` or ``H:MM:SS``, or ``D-HH:MM:SS`` (SLURM's forms)."""
    days, _, rest = text.partition("-") if "-" in text else ("0", "", text)
    try:
        parts = [int(p) for p in rest.split(":")]
        d = int(days)
    except ValueError:
        raise ConfigError(f"--time {text!r}: give minutes (90), H:MM, H:MM:SS or D-HH:MM:SS") from None
    if len(parts) == 1 and d == 0:
        return parts[0]
    while len(parts) < 3:
        parts.append(0)
    h, m, s = parts[:3]
    return d * 1440 + h * 60 + m + (1 if s else 0)


@EXECUTORS.register("slurm", help="a SLURM job array through submitit, a task per cell (extra: cluster)")
class SlurmExecutor(Executor):
    name = "slurm"
    takes = ("partition", "gpus_per_task", "time", "array_parallelism", "slurm_opts", "dry_run")

    @property
    def dry_run(self) -> bool:
        return self.options.dry_run

    def parameters(self, n: int) -> dict[str, Any]:
        """submitit's SlurmExecutor parameters of an array of ``n`` tasks."""
        o = self.options
        params: dict[str, Any] = {"job_name": "proteus", "time": o.time or 60}
        if o.partition:
            params["partition"] = o.partition
        if o.gpus_per_task is not None:
            params["gpus_per_task"] = o.gpus_per_task
        if o.array_parallelism is not None:
            params["array_parallelism"] = o.array_parallelism
        if o.slurm_opts:
            params["additional_parameters"] = dict(o.slurm_opts)
        return params

    @staticmethod
    def _submitit() -> Any:
        try:
            import submitit
        except ImportError:
            raise ConfigError(
                "--executor slurm runs through submitit, which is not installed: "
                "pip install submitit (or, from a checkout, pip install '.[cluster]')"
            ) from None
        return submitit

    def script(self, jobs: Sequence[Job], root: Path) -> str:
        """The job script submitit submits for ``jobs`` (one array; its own text, made without a cluster),
        then each task's command."""
        from submitit.slurm.slurm import _make_sbatch_string  # (checked by _submitit)

        folder = root / ".slurm" / "%j"
        command = " ".join(
            [shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))]
        )
        text = _make_sbatch_string(
            command=command, folder=folder, map_count=len(jobs), **self.parameters(len(jobs))
        )
        tasks = [f"# task {i}: {shlex.join(_cell_command(j, self.name))}" for i, j in enumerate(jobs)]
        return (
            text.rstrip("\n")
            + "\n\n# each task runs one cell (submitit starts it in the job):\n"
            + ("\n".join(tasks) + "\n")
        )

    def run(self, jobs: Sequence[Job], root: Path, progress: bool = True) -> list[Failure]:
        if not jobs:
            return []
        submitit = self._submitit()
        if self.options.dry_run:
            print(self.script(jobs, root), end="")
            return []
        ex = submitit.SlurmExecutor(folder=root / ".slurm" / "%j", python=sys.executable)
        ex.update_parameters(**self.parameters(len(jobs)))
        for job in jobs:
            write_job(job.run_dir, job.config, self.name)
        with ex.batch():
            submitted = [ex.submit(CellJob(_cell_command(j, self.name))) for j in jobs]
        if progress:
            for job, sub in zip(jobs, submitted):
                print(f"== {job.label} -> {job.run_dir} (slurm job {sub.job_id})", flush=True)
        failures = []
        for job, sub in zip(jobs, submitted):
            try:
                sub.result()
            except Exception as e:  # noqa: BLE001 - the job's own error is in its folder
                state, error = cell_state(job.run_dir), " ".join(str(e).split())[-300:]
                detail = f"{state.state}: {state.detail}" if state.detail else state.state
                failures.append(Failure(job, f"{detail}; slurm job {sub.job_id}: {error}"))
        return failures


def run_jobs(executor: Executor, jobs: Sequence[Job], root: Path, progress: bool = True) -> None:
    """Run ``jobs`` with ``executor``, saying first which cells run and why (missing, failed or interrupted
    earlier); :class:`CellsFailed` names every failed cell once the others finished."""
    if not jobs:
        return
    if progress and not executor.dry_run:
        why = {}
        for job in jobs:
            st = cell_state(job.run_dir)
            why[job.label] = st.state + (f": {st.detail}" if st.state == "failed" and st.detail else "")
        print(f"running {len(jobs)} cell{'s' if len(jobs) != 1 else ''} ({executor.name}):", flush=True)
        for label, text in why.items():
            print(f"  {label}: {text}", flush=True)
    failures = executor.run(jobs, root, progress=progress)
    if failures:
        lines = [f"{f.job.label} ({f.job.run_dir}): {f.reason}" for f in failures]
        raise CellsFailed(
            f"{len(failures)} of {len(jobs)} cells failed; the others are kept, and the same command "
            "runs the failed ones again:\n" + "\n".join(lines)
        )
