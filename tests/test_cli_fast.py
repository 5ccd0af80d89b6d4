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
    """``proteus predict --kb KB nothere.jpg`` names the file at once: no torch, no knowledge base read."""
    code = (
        "import sys\nfrom proteus.cli import main\n"
        f"rc = main(['predict', '--kb', {str(tmp_path / 'kb')!r}, 'nothere.jpg'])\n"
        "print(rc, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.split() == ["2", "False"], p.stdout + p.stderr
    assert "no such image file: nothere.jpg" in p.stderr
