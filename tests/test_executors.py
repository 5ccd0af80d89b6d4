"""Where the cells of ``compare`` and ``reproduce`` run (proteus.experiment.executors): each executor's
options, each cell's state read back from its folder (``--status``), SLURM's job script (``--dry-run``,
through submitit when it is installed), a pool of processes whose failed cells are named while the others
are kept, and, end to end, the pool's table equal to the local one with a re-run after an interrupted grid
running only the cells it lacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proteus.cli import main
from proteus.cli.commands import _without_executor
from proteus.config import ConfigError, resolve_config
from proteus.experiment import reproduce as rep
from proteus.experiment.cell import cell_state, write_job
from proteus.experiment.executors import (
    EXECUTORS,
    CellsFailed,
    ExecutorOptions,
    Job,
    make_executor,
    run_jobs,
    time_minutes,
)

#: tiny settings (as tests/test_reproduce.py's): a random ViT-Ti/16 at 32 px, 2 tasks, one epoch
TINY = [
    "backbone.name=vit_ti16", "backbone.pretrained=false", "backbone.img_size=32", "backbone.adapt_last=2",
    "head.rp_dim=128", "signature.max_components=2", "signature.max_iter=20", "benchmark.num_tasks=2",
    "benchmark.max_train_per_class=15", "report.figures=false", "report.latency=false", "train.epochs=1",
]  # fmt: skip
ABLATION = ["reproduce", "ablationS", "--benchmark", "quickstart", "--seeds", "0"]
ABLATION += [a for s in TINY for a in ("--set", s)]


def test_the_registry_names_every_executor() -> None:
    assert EXECUTORS.names() == ["local", "pool", "slurm"]
    assert make_executor("pool", ExecutorOptions(jobs=2)).options.jobs == 2


def test_an_option_of_another_executor_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        ConfigError, match=r"--executor local takes no --jobs \(an option of --executor pool\)"
    ):
        make_executor("local", ExecutorOptions(jobs=2))
    with pytest.raises(ConfigError, match="--executor pool takes no --partition"):
        make_executor("pool", ExecutorOptions(partition="gpu"))
    assert main([*ABLATION, "--out", str(tmp_path), "--partition", "gpu"]) == 2
    assert "--executor local takes no --partition (an option of --executor slurm)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_time_limits_in_slurms_forms() -> None:
    assert [time_minutes(t) for t in ("90", "2:00", "1:30:00", "1-00:00:00", "0:10:30")] == [
        90,
        120,
        90,
        1440,
        11,
    ]
    with pytest.raises(ConfigError, match="--time 'soon'"):
        time_minutes("soon")


def test_a_pool_gives_each_process_this_ones_threads_and_its_gpu() -> None:
    """The thread count decides a run's numbers: each process gets this one's (the local executor's)."""
    import torch

    pool = make_executor("pool", ExecutorOptions(jobs=2))
    env = [pool._env(slot, gpus=2) for slot in (0, 1)]  # type: ignore[attr-defined]
    assert [e["OMP_NUM_THREADS"] for e in env] == [str(torch.get_num_threads())] * 2
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in pool._env(0, gpus=1) or "CUDA_VISIBLE_DEVICES" in os.environ  # type: ignore[attr-defined]


def test_the_recorded_command_leaves_out_where_cells_ran() -> None:
    argv = ["reproduce", "x", "--executor", "pool", "--jobs", "2", "--seeds", "0", "--dry-run",
            "--slurm-opt", "mem=4G", "--time=90", "--out", "o"]  # fmt: skip
    assert _without_executor(argv) == ["reproduce", "x", "--seeds", "0", "--out", "o"]


def _results(run_dir: Path, acc: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    res = {"final_avg_acc": acc, "avg_acc": [acc], "retrieval_acc": [90.0], "provenance": {"device": "cpu"}}
    (run_dir / "results.json").write_text(json.dumps(res))


def test_each_cells_state_from_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """done, running (its process alive), failed (its error; or its process gone, with its log's last
    line), interrupted, missing: ``--status`` prints each, from the files alone."""
    plan = rep.make_plan("ablationS", benchmark="quickstart", seeds=[0], sets=TINY)
    done, running, failed, gone = (c.run_dir(tmp_path) for c in plan.runnable())
    _results(done, 80.0)
    (done / "state.json").write_text(json.dumps({"state": "done", "executor": "pool", "host": "n1"}))
    running.mkdir(parents=True)
    me = {"state": "running", "host": os.uname().nodename, "pid": os.getpid(), "job_id": "7_1"}
    (running / "state.json").write_text(json.dumps(me))
    failed.mkdir(parents=True)
    (failed / "state.json").write_text(json.dumps({"state": "failed", "error": "KBError: disk full"}))
    gone.mkdir(parents=True)
    (gone / "state.json").write_text(json.dumps({**me, "pid": 2**22 + 17}))  # no such process
    (gone / "job.log").write_text("task 1/2: accuracy 80\nKilled\n\n")
    assert cell_state(done).state == "done" and cell_state(done).where() == {
        "executor": "pool", "host": "n1", "device": "cpu"
    }  # fmt: skip
    assert (cell_state(running).state, cell_state(running).detail[:8]) == ("running", "job 7_1,")
    assert (cell_state(failed).state, cell_state(failed).detail) == ("failed", "KBError: disk full")
    assert cell_state(gone).state == "failed" and cell_state(gone).detail.endswith("is gone: Killed")
    (gone / "state.json").unlink()
    (gone / "kb").mkdir()
    assert cell_state(gone).state == "interrupted"
    (gone / "state.json").write_text(json.dumps({"state": "interrupted", "stopped": "signal SIGUSR2"}))
    st = cell_state(gone)  # a stop signal is not a failure: the cell continues from its committed tasks
    assert st.state == "interrupted" and st.detail.startswith("stopped (signal SIGUSR2)")
    assert cell_state(tmp_path / "nowhere").state == "missing"
    assert main([*ABLATION, "--out", str(tmp_path), "--status"]) == 0
    out = capsys.readouterr().out
    assert "seed 0  done (executor pool, host n1, device cpu)" in out
    assert "seed 0  failed: KBError: disk full" in out
    assert "1 done, 1 running, 1 failed, 1 interrupted of 4 cells" in out


def test_slurm_without_submitit_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "submitit", None)  # (an import of it fails)
    assert main([*ABLATION, "--out", str(tmp_path), "--executor", "slurm", "--dry-run"]) == 2
    assert "pip install submitit" in capsys.readouterr().err


def test_slurm_dry_run_prints_the_job_array(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("submitit", reason="submitit (the extra 'cluster') is not installed")
    argv = [*ABLATION, "--out", str(tmp_path / "o"), "--executor", "slurm", "--dry-run", "--partition", "gpu",
            "--gpus-per-task", "1", "--time", "2:00:00", "--array-parallelism", "2", "--slurm-opt",
            "account=lab", "-q"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    # (the last: the pre-emption notice docs/guides/cluster.md describes)
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-task=1", "#SBATCH --time=120",
                 "#SBATCH --array=0-3%2", "#SBATCH --account=lab", "#SBATCH --signal=USR2@90"):  # fmt: skip
        assert line in out
    tasks = [ln for ln in out.splitlines() if ln.startswith("# task ")]
    assert len(tasks) == 4 and all("-m proteus.experiment.cell" in t for t in tasks)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("job.json"))  # nothing submitted


def test_a_pool_names_its_failed_cells(tmp_path: Path) -> None:
    """Two cells in two processes, each failing at once (its data is missing): both are named with their
    log's last line, each folder says failed."""
    cfg = resolve_config(benchmark="folder", method="proteus", sets=TINY, overrides={"benchmark": {
        "data": str(tmp_path / "no-data"), "tasks_file": str(tmp_path / "no-tasks.yaml")}})  # fmt: skip
    jobs = [Job(f"cell {i}", tmp_path / f"c{i}", cfg) for i in range(2)]
    with pytest.raises(CellsFailed, match="2 of 2 cells failed") as err:
        run_jobs(make_executor("pool", ExecutorOptions(jobs=2)), jobs, tmp_path, progress=False)
    for i in range(2):
        assert f"cell {i} ({tmp_path / f'c{i}'}): " in str(err.value)
        st = cell_state(tmp_path / f"c{i}")
        assert st.state == "failed" and "no-" in st.detail and st.executor == "pool"
        assert json.loads((tmp_path / f"c{i}" / "job.json").read_text())["config"]["method"] == "proteus"


def test_a_job_file_holds_the_config_as_json(tmp_path: Path) -> None:
    cfg = resolve_config(benchmark="quickstart", method="proteus", sets=TINY)
    write_job(tmp_path, cfg, "slurm")
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["executor"] == "slurm" and job["config"] == json.loads(json.dumps(cfg.to_dict(), default=str))


@pytest.mark.parametrize("returncode", [-15, 1])
def test_a_requeue_whose_scontrol_the_requeue_itself_ends_is_a_requeue(returncode: int) -> None:
    """``scontrol requeue`` is a process of the job it re-queues, and the re-queue ends the job: on a loaded
    node the scheduler's signal reaches scontrol before it exits. The job then exits as after a re-queue
    (no result: submitit would report the cell failed while its job waits in the queue); scontrol failing
    on its own (an exit code) is still an error."""
    import signal
    import threading

    from proteus.experiment.executors import CellJob

    def requeue(signum: int, frame: object) -> None:  # submitit's handler, its scontrol killed or failing
        raise subprocess.CalledProcessError(returncode, ["scontrol", "requeue", "7"])

    before = signal.signal(signal.SIGUSR2, requeue)
    job = CellJob([sys.executable, "-c", "import time; time.sleep(60)"])  # a child that a SIGUSR1 ends
    notice = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR2))  # the scheduler's notice
    try:
        notice.start()
        if returncode < 0:
            with pytest.raises(SystemExit):
                job()
        else:
            with pytest.raises(subprocess.CalledProcessError):
                job()
    finally:
        notice.cancel()
        signal.signal(signal.SIGUSR2, before)


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The grid run by the local executor, once for the tests that compare another executor's with it (they
    only read it)."""
    local = tmp_path_factory.mktemp("grid") / "local"
    assert main([*ABLATION, "--out", str(local), "-q"]) == 0
    return local


@pytest.mark.slow
def test_the_pool_gathers_the_local_table_and_resumes_an_interrupted_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], local_grid: Path
) -> None:
    local, pool = local_grid, tmp_path / "pool"
    stem = "ablationS-quickstart"
    assert main([*ABLATION, "--out", str(pool), "-q", "--executor", "pool", "--jobs", "2"]) == 0
    for suffix in (".csv", ".md"):  # the same file, bit for bit
        assert (pool / f"{stem}{suffix}").read_bytes() == (local / f"{stem}{suffix}").read_bytes()
    for folder, name in ((local, "local"), (pool, "pool")):
        cells = json.loads((folder / f"{stem}.json").read_text())["cells"]
        assert {c["ran"]["executor"] for c in cells} == {name}
        assert {c["ran"]["device"] for c in cells} == {"cpu"} and all(c["ran"]["host"] for c in cells)
    # an interrupted grid: two cells lost, then killed in task 2 on the way back (task 1 committed)
    plan = rep.make_plan("ablationS", benchmark="quickstart", seeds=[0], sets=TINY)
    kept, lost = plan.runnable()[:2], plan.runnable()[2:]
    stamps = {c.cell_id: (c.run_dir(pool) / "results.json").stat().st_mtime_ns for c in kept}
    for c in lost:
        for p in sorted(c.run_dir(pool).rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    monkeypatch.setenv("PROTEUS_TEST_KILL_AT", "learn:prefix@2")
    capsys.readouterr()
    assert main([*ABLATION, "--out", str(pool), "-q", "--executor", "pool", "--jobs", "2"]) == 2
    err = capsys.readouterr().err
    assert "2 of 2 cells failed" in err and all(c.cell_id in err for c in lost)
    monkeypatch.delenv("PROTEUS_TEST_KILL_AT")
    assert main([*ABLATION, "--out", str(pool), "--status"]) == 0
    status = capsys.readouterr().out
    assert "2 done, 2 failed of 4 cells" in status and status.count("is gone") == 2
    # one killed job started again in its folder (as a re-queued SLURM job) continues from task 2
    again = lost[0].run_dir(pool)
    subprocess.run([sys.executable, "-m", "proteus.experiment.cell", str(again), "--quiet"], check=True)
    assert json.loads((again / "state.json").read_text())["resumed"] is True
    mine = json.loads((local / lost[0].run_dir(Path()) / "results.json").read_text())
    assert json.loads((again / "results.json").read_text())["avg_acc"] == mine["avg_acc"]
    # the re-run runs only the one left (continued from task 2), and the table is the local one again
    assert main([*ABLATION, "--out", str(pool), "--executor", "pool", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("reusing the finished run") == 3 and "running 1 cell (pool)" in out
    assert f"{lost[1].cell_id}, seed 0: failed: its process" in out.split("running 1 cell")[1]
    assert json.loads((lost[1].run_dir(pool) / "state.json").read_text())["resumed"] is True
    assert all(
        (c.run_dir(pool) / "results.json").stat().st_mtime_ns == t for c, t in zip(kept, stamps.values())
    )
    assert (pool / f"{stem}.csv").read_bytes() == (local / f"{stem}.csv").read_bytes()


@pytest.mark.slow
def test_a_grid_on_a_single_node_slurm_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], local_grid: Path
) -> None:
    """The grid as a SLURM job array (a cluster started for the test): the local table again; a job killed
    part-way is named, started again in its folder by the scheduler (it continues from its last committed
    task), and the next run submits nothing."""
    pytest.importorskip("submitit", reason="submitit (the extra 'cluster') is not installed")
    from contextlib import ExitStack

    from slurmcluster import Unavailable, single_node

    with ExitStack() as stack:
        try:
            env = stack.enter_context(single_node())
        except Unavailable as e:
            pytest.skip(f"no single-node SLURM cluster here: {e}")
        monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
        local, slurm = local_grid, tmp_path / "slurm"
        stem, on_slurm = (
            "ablationS-quickstart",
            ["--executor", "slurm", "--partition", "debug", "--time", "30"],
        )
        assert main([*ABLATION, "--out", str(slurm), "-q", *on_slurm]) == 0
        for suffix in (".csv", ".md"):
            assert (slurm / f"{stem}{suffix}").read_bytes() == (local / f"{stem}{suffix}").read_bytes()
        cells = json.loads((slurm / f"{stem}.json").read_text())["cells"]
        assert {c["ran"]["executor"] for c in cells} == {"slurm"}
        # one cell again, its job killed in task 2 (task 1 committed)
        cell = rep.make_plan("ablationS", benchmark="quickstart", seeds=[0], sets=TINY).runnable()[1]
        d = cell.run_dir(slurm)
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        monkeypatch.setenv("PROTEUS_TEST_KILL_AT", "learn:prefix@2")
        capsys.readouterr()
        assert main([*ABLATION, "--out", str(slurm), "-q", *on_slurm]) == 2
        assert "1 of 1 cells failed" in capsys.readouterr().err and cell_state(d).state == "failed"
        monkeypatch.delenv("PROTEUS_TEST_KILL_AT")
        # the scheduler starts it again in its folder: it continues from task 2
        wrap = f"{sys.executable} -m proteus.experiment.cell {d} --executor slurm --quiet"
        subprocess.run(
            [
                "sbatch",
                "--wait",
                "--partition",
                "debug",
                "--output",
                str(tmp_path / "again.out"),
                "--wrap",
                wrap,
            ],
            check=True,
            timeout=900,
        )
        state = json.loads((d / "state.json").read_text())
        assert state["state"] == "done" and state["resumed"] is True and state["job_id"]
        assert main([*ABLATION, "--out", str(slurm), *on_slurm]) == 0
        out = capsys.readouterr().out
        assert out.count("reusing the finished run") == 4 and "(slurm):" not in out  # nothing submitted
        assert (slurm / f"{stem}.csv").read_bytes() == (local / f"{stem}.csv").read_bytes()


def test_an_interrupted_run_of_the_same_config_is_continued_else_set_aside(tmp_path: Path) -> None:
    from proteus.experiment.compare import _finished, resumable

    plan = rep.make_plan("ablationS", benchmark="quickstart", seeds=[0], sets=TINY)
    same, other = plan.runnable()[:2]
    for c, cfg in ((same, same.config), (other, same.config)):  # `other` holds the first cell's config
        d = c.run_dir(tmp_path)
        (d / "kb").mkdir(parents=True)
        (d / "kb" / "manifest.json").write_text("{}")
        (d / "config.yaml").write_text(cfg.to_yaml())  # type: ignore[union-attr]
    assert resumable(same.run_dir(tmp_path), same.config)  # type: ignore[arg-type]
    assert _finished(same.run_dir(tmp_path), same.config) is None  # type: ignore[arg-type]
    assert not resumable(other.run_dir(tmp_path), other.config)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="holds an unfinished run"):
        _finished(other.run_dir(tmp_path), other.config)  # type: ignore[arg-type]
    rep._restart_interrupted(plan, tmp_path, progress=False)
    assert (same.run_dir(tmp_path) / "kb" / "manifest.json").is_file()  # left for its job to continue
    assert not other.run_dir(tmp_path).exists()
    assert len(list(other.run_dir(tmp_path).parent.glob("seed0.interrupted-*"))) == 1


@pytest.mark.slow
def test_a_preempted_slurm_job_is_requeued_and_continues_from_its_last_task(tmp_path: Path) -> None:
    """The scheduler's preemption notice (submitit's SIGUSR2, sent to the job as a scheduler sends it) to a
    cell's job after its first task: the cell stops at the task it is learning, submitit re-queues the
    job (its scontrol ended by the re-queue before it exits, as on a loaded node), and the job started again
    continues the cell from its last committed task, to the results of an uninterrupted local run."""
    pytest.importorskip("submitit", reason="submitit (the extra 'cluster') is not installed")
    import threading
    import time
    from contextlib import ExitStack

    from proteus.experiment.cell import run_cell
    from proteus.experiment.executors import SlurmExecutor
    from proteus.kb import KnowledgeBase
    from slurmcluster import Unavailable, single_node

    sets = [s if not s.startswith("benchmark.num_tasks") else "benchmark.num_tasks=5" for s in TINY]
    cell = rep.make_plan("ablationS", benchmark="quickstart", seeds=[0], sets=sets).runnable()[0]
    local = run_cell(cell.run_dir(tmp_path / "local"), "local", cell.config, progress=False)
    with ExitStack() as stack:
        try:
            env = stack.enter_context(single_node())
        except Unavailable as e:
            pytest.skip(f"no single-node SLURM cluster here: {e}")
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        stack.callback(os.environ.pop, "SLURM_CONF", None)
        # scontrol as on a loaded node, slow to exit after its request: the re-queue it asks for ends the
        # job, scontrol with it, before it exits (the job takes this PATH from the submitter)
        slow = tmp_path / "bin"
        slow.mkdir()
        real = shutil.which("scontrol")
        (slow / "scontrol").write_text(f'#!/bin/sh\n"{real}" "$@"; rc=$?\nsleep 2\nexit $rc\n')
        (slow / "scontrol").chmod(0o755)
        path = os.environ["PATH"]
        os.environ["PATH"] = f"{slow}{os.pathsep}{path}"
        stack.callback(os.environ.__setitem__, "PATH", path)
        job = Job("the cell", cell.run_dir(tmp_path / "slurm"), cell.config)  # type: ignore[arg-type]
        ex = SlurmExecutor(ExecutorOptions(partition="debug", time=30))
        failures: list[object] = []
        runner = threading.Thread(
            target=lambda: failures.extend(ex.run([job], tmp_path / "slurm", False)), daemon=True
        )
        runner.start()
        kb, end = job.run_dir / "kb", time.monotonic() + 600
        while time.monotonic() < end:  # its first task committed, the others not yet
            if KnowledgeBase.exists(kb) and len(KnowledgeBase.open(kb).manifest.get("tasks") or []) >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job committed no task within 600 s")
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
        job_id = queued.stdout.split()[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], env=env, check=True)
        runner.join(timeout=900)
        logs = [*sorted((tmp_path / "slurm" / ".slurm").rglob("*_log.*")), job.run_dir / "job.log"]
        said = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in logs if p.is_file())
        assert not runner.is_alive() and failures == [], said
    state = json.loads((job.run_dir / "state.json").read_text())
    assert state["state"] == "done" and state["resumed"] is True
    log = (job.run_dir / "job.log").read_text()
    assert "stopped (signal SIGUSR" in log and "Traceback" not in log  # it stopped, then continued
    got = json.loads((job.run_dir / "results.json").read_text())
    assert got["avg_acc"] == local["avg_acc"] and got["acc_matrix"] == local["acc_matrix"]
