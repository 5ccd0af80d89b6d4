"""Crash safety (issue 4): ``proteus learn --task 2`` killed with SIGKILL 22 times, all over its life.

Kill points: every named crash point of :mod:`proteus.faults` (prefix, training, signature fit, head
update, evaluation, and inside the commit: temporary object, objects written, temporary manifest, manifest
renamed), 12 kill times drawn from a seeded RNG over the part of an uninterrupted run that learns,
evaluates and commits (located by timing an uninterrupted run and a run killed after its prefix pass),
and a kill of a literal ``sys.executable -m proteus learn`` process at a seeded time over its expected
duration.

After every kill: the KB opens with full verification and is either exactly the old state (the tasks and
head it had before, and ``proteus predict`` on a few images prints exactly what it printed before) or,
only when the kill came after the manifest rename, exactly the reference's new state. Each chain of
kills ends with an uninterrupted rerun of the same command, whose KB must equal the reference
(object hashes, evaluation rows). Kills are chained (a rerun after a crash is itself killed again), so
reruns also have to cope with the debris (temporary files, orphan objects) of earlier crashes.

Speed: a ``proteus`` process spends most of its few seconds importing torch. The kills at named points
and the seeded random ones run in processes forked from a "zygote" (a ``sys.executable`` process that has
imported what ``proteus learn`` imports and then forks one child per command, each child running
``proteus.cli.main(argv)``, the code of ``python -m proteus``); one kill hits a literal
``python -m proteus learn`` process (and tests/test_determinism.py checks that a fresh process computes
bit for bit what an older one does). Tiny settings with a random-weight ViT-Ti/16 (d = 192) keep one
task around a second.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from proteus.cli import main
from proteus.faults import ENV, POINTS
from proteus.kb import KnowledgeBase
from tiny import sets

pytestmark = pytest.mark.slow

TINY = ["--benchmark", "quickstart", "--backbone", "vit_ti16", "-q"]
TINY += sets("benchmark.max_train_per_class=40")


N_RANDOM = 12  # seeded random kill times, in chains of 4
N_LITERAL = 1  # kills of a literal `python -m proteus learn`

ZYGOTE = r"""
import json, os, sys, traceback
import proteus.cli, proteus.experiment, proteus.streams, proteus.streams.builtin
# the slow imports, which proteus makes lazily (~3.5 s of a child's ~4 s if they were left to it): what
# `learn` imports (the backbones, the learner, the engine, the KB, the loop), done once before any fork
import sklearn.datasets, timm, torchvision  # noqa
import proteus.backbones.vit, proteus.core, proteus.engine, proteus.kb, proteus.learners  # noqa
import proteus.baselines, proteus.metrics, proteus.distributed, proteus.experiment.loop  # noqa
import proteus.experiment.learn  # noqa
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.environ.update(req["env"])
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = proteus.cli.main(req["argv"])
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status}), flush=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    # one thread per process: bit-identical results in every process (and MKL's eigh is slow when two
    # threads share two busy cores)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


class Zygote:
    """A ``sys.executable`` process that forks one child per ``proteus`` command (see module docstring)."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.n = 0
        self.startup: float | None = None  # seconds from launch to the first child: the imports
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
            cwd=cwd,
            bufsize=0,  # unbuffered: select() on the pipe sees every line not yet read
        )
        self.t_launch = t0

    def _line(self, timeout: float | None) -> dict | None:
        assert self.proc.stdout is not None
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, timeout))
            if not ready:
                return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote exited with {self.proc.poll()}")
        return json.loads(line)

    def run(
        self, argv: list[str], kill_at: str | None = None, kill_after: float | None = None
    ) -> tuple[str, float]:
        """Run ``proteus argv`` in a forked child. Returns (outcome, seconds): outcome is ``"ok"``,
        ``"killed"`` (SIGKILL, by a crash point or by the timer) or ``"exit N"``."""
        assert self.proc.stdin is not None
        self.n += 1
        log = self.cwd / f"child-{self.n}.log"
        env = {ENV: kill_at} if kill_at else {}
        self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._line(None)["pid"]  # type: ignore[index]
        t0 = time.perf_counter()
        if self.startup is None:
            self.startup = t0 - self.t_launch
        msg = self._line(kill_after)
        if msg is None:  # still running at the kill time
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            msg = self._line(None)
        seconds = time.perf_counter() - t0
        status = msg["status"]  # type: ignore[index]
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL, log.read_text()
            return "killed", seconds
        code = os.WEXITSTATUS(status)
        return ("ok" if code == 0 else f"exit {code}: {log.read_text()[-2000:]}"), seconds

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _learn(kb: Path, task: int) -> list[str]:
    return ["learn", "--kb", str(kb), "--task", str(task), *TINY]


def _state(kb: Path) -> dict:
    """The KB's committed state, opened with verification of every object."""
    m = KnowledgeBase.open(kb, verify=True).manifest
    return {
        "tasks": [t["sha256"] for t in m["tasks"]],
        "head": m["head"]["sha256"] if m["head"] else None,
        "evaluation": m["evaluation"],
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("crash")
    zyg = Zygote(root)
    base = root / "base"  # the state before the interrupted task: task 1 learned
    outcome, _ = zyg.run(_learn(base, 1))
    assert outcome == "ok", outcome
    ref = root / "ref"
    shutil.copytree(base, ref)
    outcome, seconds = zyg.run(_learn(ref, 2))
    assert outcome == "ok", outcome
    from sklearn.datasets import load_digits

    d = load_digits()
    images = []
    for i in range(3):
        p = root / f"digit{i}.png"
        Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).save(p)
        images.append(str(p))
    Image.new("RGBA", (20, 12), (10, 200, 30, 128)).save(root / "rgba.png")
    images.append(str(root / "rgba.png"))
    # when learning starts: a child killed at the first crash point (after the task's prefix pass)
    probe = root / "probe"
    shutil.copytree(base, probe)
    outcome, seconds_to_prefix = zyg.run(_learn(probe, 2), kill_at="learn:prefix")
    assert outcome == "killed"
    yield {
        "root": root,
        "zygote": zyg,
        "base": base,
        "old": _state(base),
        "new": _state(ref),
        "images": images,
        "seconds": seconds,  # uninterrupted `learn --task 2` in a zygote child
        "startup": zyg.startup,  # what a fresh process adds: the imports
        "seconds_to_prefix": seconds_to_prefix,  # start-up + data + the prefix pass of that run
    }
    zyg.close()


def _predict(kb: Path, images: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), *images, "--json"]) == 0
    return capsys.readouterr().out


def _check_after_kill(world: dict, kb: Path, before_predict: str, capsys, what: str) -> str:
    """The KB is the old state (and predicts as before) or, after the manifest rename, the new one."""
    state = _state(kb)  # raises if any object is missing or corrupt
    if state == world["old"]:
        assert _predict(kb, world["images"], capsys) == before_predict, what
        return "old"
    assert state == world["new"], f"{what}: the KB is neither the old state nor the new one"
    return "new"


def _fresh(world: dict, name: str) -> Path:
    kb = world["root"] / name
    shutil.copytree(world["base"], kb)
    return kb


def test_kill_at_every_named_phase(world: dict, capsys) -> None:
    zyg: Zygote = world["zygote"]
    before = _predict(world["base"], world["images"], capsys)
    kb = _fresh(world, "named")
    for point in POINTS[:-1]:  # one chain: each retry crashes at the next phase
        outcome, _ = zyg.run(_learn(kb, 2), kill_at=point)
        assert outcome == "killed", f"{point}: the crash point was not reached ({outcome})"
        assert _check_after_kill(world, kb, before, capsys, point) == "old", point
    outcome, _ = zyg.run(_learn(kb, 2))
    assert outcome == "ok", outcome
    assert _state(kb) == world["new"]
    assert not list((kb / "objects").glob(".*")), "temporary objects of the crashed commits were not swept"
    assert not list(kb.glob(".manifest.json.tmp-*")), "a crashed commit's temporary manifest was not swept"

    # after the manifest rename the task is committed: the KB is the new state, a rerun has nothing to do
    kb = _fresh(world, "renamed")
    outcome, _ = zyg.run(_learn(kb, 2), kill_at=POINTS[-1])
    assert outcome == "killed"
    assert _check_after_kill(world, kb, before, capsys, POINTS[-1]) == "new"
    outcome, _ = zyg.run(_learn(kb, 2))
    assert outcome == "ok" and _state(kb) == world["new"]


def test_kill_at_random_times(world: dict, capsys) -> None:
    zyg: Zygote = world["zygote"]
    before = _predict(world["base"], world["images"], capsys)
    rng = random.Random(20240404)
    total = world["seconds"]
    learning = world["seconds"] - 0.8 * world["seconds_to_prefix"]
    kills, attempts, chain = 0, 0, 0
    kb = _fresh(world, "random0")
    while kills < N_RANDOM:
        attempts += 1
        assert attempts <= 3 * N_RANDOM, f"only {kills} of {attempts} attempts were killed"
        # spread over the part of the run that learns, evaluates and commits (the rest is start-up)
        t = rng.uniform(max(0.0, total - learning), total)
        outcome, seconds = zyg.run(_learn(kb, 2), kill_after=t)
        assert outcome in ("killed", "ok"), outcome
        state = _check_after_kill(world, kb, before, capsys, f"kill {attempts} at {t:.2f}s ({outcome})")
        kills += outcome == "killed"
        if outcome == "ok":  # finished before the kill time (the machine got faster): re-estimate
            total = min(total, seconds)
        if state == "new" or (outcome == "killed" and kills % 4 == 0):
            # end of a chain: the same command, uninterrupted, completes the task exactly like the reference
            outcome, seconds = zyg.run(_learn(kb, 2))
            assert outcome == "ok", outcome
            assert _state(kb) == world["new"]
            chain += 1
            kb = _fresh(world, f"random{chain}")
    assert chain >= N_RANDOM // 4


def test_kill_literal_subprocess(world: dict, capsys) -> None:
    """The real command line, ``sys.executable -m proteus learn``, killed at a seeded time spread over the
    expected duration of a fresh process (its imports + the zygote child's time); then the same command
    completes the task (in a zygote child) exactly like the reference."""
    before = _predict(world["base"], world["images"], capsys)
    kb = _fresh(world, "literal")
    cmd = [sys.executable, "-m", "proteus", *_learn(kb, 2)]
    rng = random.Random(7)
    for i in range(N_LITERAL):
        t = world["startup"] + rng.uniform(0.2, 1.0) * world["seconds"]
        p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            p.wait(timeout=t)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
        assert p.returncode in (0, -signal.SIGKILL)
        _check_after_kill(world, kb, before, capsys, f"literal kill {i} at {t:.2f}s")
    outcome, _ = world["zygote"].run(_learn(kb, 2))
    assert outcome == "ok", outcome
    assert _state(kb) == world["new"]
