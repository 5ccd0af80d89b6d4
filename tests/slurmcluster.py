"""A single-node SLURM cluster for the tests, started in a folder of its own and stopped after: munge with
its own key and socket, slurmctld and slurmd on this host with one partition (``debug``), every state,
log and spool file under that folder (Debian's ``slurm-wlm`` and ``munge``: ``apt-get install slurmctld
slurmd slurm-client munge``). :func:`single_node` yields the environment in which ``sbatch`` reaches it
(``SLURM_CONF``), or raises :class:`Unavailable` with the reason it cannot start (the tests skip on it).

    python tests/slurmcluster.py     # start one, print sinfo, stop it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NEEDS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol")


#: a job step credential's lifetime, in seconds: also how long SLURM holds a re-queued job before it may
#: start again (``cred_expire``, 120 by default; a re-queued job started sooner is refused, "Job credential
#: revoked")
CRED_EXPIRE = 10


class Unavailable(RuntimeError):
    """Why no SLURM cluster can start here."""


def _conf(root: Path, host: str, cpus: int, socket_path: Path) -> str:
    return f"""ClusterName=proteus-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path},cred_expire={CRED_EXPIRE}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/d
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
KillWait=5
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pid(path: Path) -> int | None:
    """The process id a daemon wrote to ``path``; None until it has (the file can exist, still empty)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _started(path: Path, what: str) -> int:
    _wait(lambda: _pid(path) is not None, 15, what)
    return _pid(path)  # type: ignore[return-value]


def _jobs(env: dict[str, str]) -> list[str]:
    """The cluster's jobs still known to its controller (any state)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=15)
    return out.stdout.split()


def _wait(check: callable, seconds: float, what: str) -> None:  # type: ignore[valid-type]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.5)
    raise Unavailable(f"{what} did not come up within {seconds:g} s")


@contextlib.contextmanager
def single_node(cpus: int = 2) -> Iterator[dict[str, str]]:
    missing = [b for b in NEEDS if shutil.which(b) is None]
    if missing:
        raise Unavailable(f"no {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        raise Unavailable("slurmd runs jobs as root here: the tests must run as root")
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    os.chmod(root, 0o755)
    host = socket.gethostname()
    procs: list[int] = []
    env = dict(os.environ)
    try:
        for d in ("ctld", "d", "munge"):
            (root / d).mkdir(mode=0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = root / "munge" / "munge.socket"
        subprocess.run(
            ["munged", "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
             f"--seed-file={root}/munge/munged.seed"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        procs.append(_started(root / "munge" / "munged.pid", "munged"))
        conf = root / "slurm.conf"
        conf.write_text(_conf(root, host, cpus, sock))
        env["SLURM_CONF"] = str(conf)
        for daemon in ("slurmctld", "slurmd"):
            p = subprocess.run([daemon, "-f", str(conf)], env=env, capture_output=True, text=True, timeout=30)
            if p.returncode != 0:
                raise Unavailable(f"{daemon} did not start: {(p.stderr or p.stdout).strip()[-300:]}")
            procs.append(_started(root / f"{daemon}.pid", daemon))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.stdout.strip() in ("idle", "mix", "alloc")

        _wait(idle, 60, "the node")
        yield env
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from None
    finally:
        if len(procs) == 3:  # every job ended first: slurmd's job steps would outlive the daemons
            with contextlib.suppress(OSError, subprocess.SubprocessError, Unavailable):
                subprocess.run(["scancel", "--partition=debug"], env=env, capture_output=True, timeout=15)
                _wait(lambda: not _jobs(env), 15, "the jobs' end")
        for pid in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    with single_node() as e:
        print(subprocess.run(["sinfo"], env=e, capture_output=True, text=True).stdout)
