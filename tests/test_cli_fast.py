"""Fast to say no: the command line's help and argument errors answer without importing torch or loading a
model (the configuration, the parser and the commands' modules are torch-free; :mod:`proteus.lazy`)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import argparse, contextlib, io, sys
from proteus.cli import build_parser, main
subs = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)][0].choices
for name in [None, *subs]:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(([name] if name else []) + ["--help"])
        except SystemExit:
            pass
print(len(subs), "torch" in sys.modules)
"""


def test_every_help_imports_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) >= 10 and out[1] == "False", out


def test_the_configuration_imports_no_torch() -> None:
    """The schema, its declarations and the coercion of ``--set`` values need no torch."""
    code = "import sys, proteus.config as c; c.parse_set(['train.epochs=2']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_missing_image_is_named_before_any_model_loads(tmp_path) -> None:  # noqa: ANN001
    """``proteus predict --kb KB nothere.jpg`` names the file at once: no torch, no knowledge base read (its
    manifest alone is checked first)."""
    (tmp_path / "kb").mkdir()
    (tmp_path / "kb" / "manifest.json").write_text('{"format": "proteus-kb", "format_version": 5}')
    code = (
        "import sys\nfrom proteus.cli import main\n"
        f"rc = main(['predict', '--kb', {str(tmp_path / 'kb')!r}, 'nothere.jpg'])\n"
        "print(rc, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.split() == ["2", "False"], p.stdout + p.stderr
    assert "nothere.jpg: no such file" in p.stderr


def test_a_failed_command_leaves_no_empty_folder(tmp_path, capsys) -> None:  # noqa: ANN001
    """A run or a first ``learn`` that fails before its first commit leaves nothing behind."""
    from proteus.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        main(["run", "--benchmark", "cifar10", "--data", str(empty), "--out", str(tmp_path / "r"), "-q"]) == 2
    )
    assert not (tmp_path / "r").exists()
    kb = tmp_path / "new-kb"
    assert main(["learn", "--kb", str(kb), "--benchmark", "cifar-10", "--task", "1", "-q"]) == 2
    assert "unknown benchmark 'cifar-10'" in capsys.readouterr().err and not kb.exists()


def test_every_command_has_a_description_and_examples() -> None:
    import argparse

    from proteus.cli import build_parser

    missing = []

    def walk(name: str, p: argparse.ArgumentParser) -> None:
        if not p.description or "examples:" not in (p.epilog or ""):
            missing.append(name)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(f"{name} {sub}", sp)

    walk("proteus", build_parser())
    assert not missing, missing
