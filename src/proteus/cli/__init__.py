"""The ``proteus`` command line.

Subcommands: run, quickstart, learn, evaluate, predict, kb, compare, bench, weights, data, list
(:mod:`.parser` builds the parser, :mod:`.commands` holds the commands; this module maps errors to exit
codes).
"""

from __future__ import annotations

import argparse
import sys

from proteus.cli.parser import build_parser
from proteus.errors import ProteusError

__all__ = ["build_parser", "main"]


def _kb_tasks(args: argparse.Namespace) -> str:
    """How many tasks the KB of this command holds now (for the Ctrl-C message)."""
    kb = getattr(args, "kb", None)
    if not kb:
        return ""
    try:
        import proteus.kb as kbmod

        n = len(kbmod.KnowledgeBase.open(kb, verify=False).manifest["tasks"])
    except Exception:  # noqa: BLE001 - a message on the way out must not fail
        return ""
    return f"; the knowledge base is unchanged at {n} task{'s' if n != 1 else ''}"


def _message(e: ProteusError) -> str:
    """The one-line message of a :class:`ProteusError` (an ``OSError``'s file name in front if missing)."""
    msg = str(e)
    filename = getattr(e, "filename", None)
    if isinstance(e, OSError) and filename and str(filename) not in msg:
        msg = f"{filename}: {msg}"
    return msg


def main(argv: list[str] | None = None) -> int:
    """Run the command line; exit codes: 0 success, 1 internal error (any exception that is not a
    :class:`~proteus.errors.ProteusError`: a bug, --debug shows its traceback), 2 bad input (a
    ``ProteusError``: one line naming the file, task, key or device at fault), 130 interrupted (Ctrl-C)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "wait", None) is not None and args.wait < 0:
        args.wait = None  # --wait without a value: as long as it takes
    from proteus.distributed import init_from_env, launched_by_torchrun

    if launched_by_torchrun():  # join the process group (also with one process: proteus.distributed)
        init_from_env(device=getattr(args, "device", None))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"interrupted{_kb_tasks(args)}", file=sys.stderr)
        return 130
    except ProteusError as e:  # the user's input, files or environment: one line, no traceback
        if args.debug:
            raise
        print(f"error: {_message(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # anything else is a bug in proteus
        if args.debug:
            raise
        msg = " ".join(str(e).split())  # one line
        print(
            f"internal error: {type(e).__name__}: {msg} -- this is a bug in proteus; please report it "
            "(run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        if "torch.distributed" in sys.modules:
            from proteus.distributed import shutdown

            shutdown()


if __name__ == "__main__":
    sys.exit(main())
