"""The package from its wheel: ``pip wheel .`` then that wheel installed into a new environment outside the
checkout gives a working ``proteus`` (the packaged configs, the splits, the paper's tables, the quickstart,
``serve``'s app).
The new environment borrows the test environment's third-party packages (torch, timm, ...) through a path
file, so nothing is downloaded; proteus itself comes from the wheel only."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT.parent / "shared" / "weights" / "mobilenet_v2-b0353104.pth"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding proteus from its wheel; returns its bin/ directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(ROOT)], check=True)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("proteus_cl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("proteus/configs/benchmarks/") for n in names)
    assert any(n.startswith("proteus/streams/splits/") for n in names)
    assert "proteus/experiment/paper_tables.yaml" in names  # the paper's tables, read by `reproduce`
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    py = env / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)]
    subprocess.run(pip, check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # the third-party packages of this environment (a plain path line: its editable proteus is not loaded)
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env / "bin"


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


#: what the installed package answers, in one interpreter (each process pays torch's import): where it is
#: imported from, its commands (the packaged method and paper tables), a packaged preset, serve's app
_CHECKS = """
import contextlib, io, sys
import proteus
from proteus.cli import main
from proteus.config import resolve_config
from proteus.serve.app import create_app
print("file", proteus.__file__)
for argv in (["run", "--benchmark", "cifar100", "--method", "ranpac", "--help"], ["reproduce", "--list"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    print(argv[0], rc, "main-table" in out.getvalue())
print("preset", resolve_config("cifar100").backbone.name, create_app.__name__)
"""


@pytest.mark.slow
def test_the_wheel_gives_a_working_proteus(installed: Path, tmp_path: Path) -> None:
    # the three processes are independent (each pays torch's import): started together, checked in turn
    sets = [f"backbone.weights={WEIGHTS}", "train.epochs=1", "benchmark.max_train_per_class=20",
            "benchmark.num_tasks=2"]  # fmt: skip
    quickstart = [str(installed / "proteus"), "quickstart", "--out", str(tmp_path / "q"),
                  *(a for s in sets for a in ("--set", s)), "-q"]  # fmt: skip
    procs = [
        _start([str(installed / "proteus"), "list", "methods"], tmp_path),  # the console script
        _start([str(installed / "python"), "-c", _CHECKS], tmp_path),
        *([_start(quickstart, tmp_path)] if WEIGHTS.is_file() else []),
    ]
    try:
        p = _done(procs[0])
        assert p.returncode == 0 and "proteus-paper" in p.stdout and "inflora" in p.stdout, p.stderr
        out = _done(procs[1])
        assert out.returncode == 0, out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        assert str(ROOT) not in lines["file"] and "site-packages" in lines["file"], lines["file"]
        assert lines["run"].startswith("0 ") and lines["reproduce"] == "0 True", lines
        assert lines["preset"] == "vit_b16 create_app"  # a packaged preset, read from the installed package
        if not WEIGHTS.is_file():
            pytest.skip(f"the quickstart needs MobileNetV2's weights ({WEIGHTS} not present)")
        p = _done(procs[2])
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "q" / "results.json").is_file() and (
            tmp_path / "q" / "kb" / "manifest.json"
        ).is_file()
    finally:  # (none left running after a failed check)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
