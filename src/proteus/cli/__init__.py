"""The ``proteus`` command line.

Subcommands: run, quickstart, learn, evaluate, predict, kb, compare, bench, weights, data, list
(:mod:`.parser` builds the parser, :mod:`.commands` holds the commands; this module maps errors to exit
codes).
"""

from __future__ import annotations

import argparse
import sys

from proteus.cli.parser import build_parser

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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; exit codes: 0 success, 1 internal error (a bug: --debug shows it), 2 bad
    input (one line naming the file, task, key or device at fault), 130 interrupted (Ctrl-C)."""
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
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        from proteus.kb import KBError

        bad_input = isinstance(e, (ValueError, KBError, OSError, KeyError))
        if args.debug or not bad_input:
            if args.debug:
                raise
            print(
                f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
                file=sys.stderr,
            )
            return 1
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    finally:
        if "torch.distributed" in sys.modules:
            from proteus.distributed import shutdown

            shutdown()


if __name__ == "__main__":
    sys.exit(main())
