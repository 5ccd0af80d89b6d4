"""The ``proteus`` command line.

Subcommands: run, quickstart, learn, evaluate, predict, kb, compare, bench, weights, data, list
(:mod:`.parser` builds the parser, :mod:`.commands` holds the commands; this module maps errors to exit
codes).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from proteus import heap
from proteus.cli import threads
from proteus.cli.parser import build_parser
from proteus.errors import ProteusError
from proteus.untrusted import printable

#: what a command's error says of a file-system error that is the machine's state, not a bug (every write
#: of a knowledge base is atomic: it is as it was, or as the command left it)
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "free some space and run the command again (a knowledge base is left as it was)",
    errno.EDQUOT: "the disk quota is used up: free some space and run the command again",
    errno.EROFS: "the file system is read-only: choose a writable place",
    errno.EACCES: "check the permissions, or choose another place",
    errno.EPERM: "check the permissions, or choose another place",
}

__all__ = ["Terminated", "build_parser", "main"]


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, kubernetes, slurm), raised in the main thread as Ctrl-C's KeyboardInterrupt is,
    so that the same clean-up runs: the knowledge base's write lock released, a commit not yet renamed
    into place left out (exit code 143)."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (which alone may set
    handlers; elsewhere nothing changes); a second SIGTERM during the clean-up ends the process at once, as
    SIGTERM does by default (the knowledge base is crash-safe). The previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:  # insisted: die now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        fired = True
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # no signals here (an embedded interpreter): nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _manifest_digest(args: argparse.Namespace) -> str | None:
    """The sha256 of the command's knowledge base's manifest.json now (None: no KB, or not readable; read
    like every file of a knowledge base: never a FIFO, a link or more than its budget)."""
    kb = getattr(args, "kb", None)
    if not kb:
        return None
    from proteus.kb.files import read_kb_file

    try:
        data = read_kb_file(Path(kb), "manifest.json")
    except (OSError, TypeError, ProteusError):
        return None
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _declared_tasks(args: argparse.Namespace) -> int | None:
    """How many tasks the command's knowledge base's manifest.json declares (``num_tasks``, or its list of
    ``tasks`` in a format before 4), parsed as plain JSON; None when it cannot be read."""
    import json

    from proteus.kb.files import read_kb_file

    try:
        data = read_kb_file(Path(args.kb), "manifest.json")
        manifest = json.loads(data) if data is not None else None
    except (OSError, ValueError, ProteusError):
        return None
    if not isinstance(manifest, dict):
        return None
    tasks = manifest.get("tasks")
    n = manifest.get("num_tasks", len(tasks) if isinstance(tasks, list) else None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _kb_tasks(args: argparse.Namespace, before: str | None = None) -> str:
    """What became of the command's knowledge base (for the Ctrl-C and SIGTERM message): "unchanged at N
    tasks", or, when its manifest changed during the command (the commit had completed), "now at N tasks"."""
    kb = getattr(args, "kb", None)
    if not kb:
        return ""
    n: int | None
    try:
        import proteus.kb as kbmod

        n = len(kbmod.KnowledgeBase.open(kb, verify=False).manifest["tasks"])
    except Exception:  # noqa: BLE001 - a message on the way out must not fail
        # the signal may have cut a module's import short (a lazy import of torch's), which opening needs:
        # the count the manifest itself declares, read without importing anything
        n = _declared_tasks(args)
    if n is None:
        return ""
    tasks = f"{n} task{'s' if n != 1 else ''}"
    if before is not None and _manifest_digest(args) != before:
        return f"; its commit had completed: the knowledge base is now at {tasks}"
    return f"; the knowledge base is unchanged at {tasks}"


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
    ``ProteusError``: one line naming the file, task, key or device at fault), 130 interrupted (Ctrl-C),
    143 terminated (SIGTERM: the same clean-up as Ctrl-C)."""
    args = build_parser().parse_args(argv)
    threads.prepare(getattr(args, "threads", None))  # before any command imports torch (OpenMP reads it then)
    if args.command == "serve":
        heap.bound_arenas()  # before torch's threads take arenas of their own (proteus.heap)
    if getattr(args, "wait", None) is not None and args.wait < 0:
        args.wait = None  # --wait without a value: as long as it takes
    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:  # torch only under torchrun
        from proteus.distributed import init_from_env, launched_by_torchrun

        if launched_by_torchrun():  # join the process group (also with one process: proteus.distributed)
            init_from_env(device=getattr(args, "device", None))
    before = _manifest_digest(args)
    try:
        with _sigterm_as_interrupt():
            return int(args.func(args) or 0)
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        term = isinstance(e, Terminated)
        what = "terminated (SIGTERM)" if term else "interrupted"
        run_dir = getattr(args, "run_dir", None)
        resume = f"; continue it with `proteus run --resume {printable(str(run_dir))}`" if run_dir else ""
        print(f"{what}{_kb_tasks(args, before)}{resume}", file=sys.stderr)
        return 128 + signal.SIGTERM if term else 130
    except BrokenPipeError:  # the reader went away (`proteus list methods | head -1`): a normal end
        with contextlib.suppress(OSError, ValueError):  # nothing more reaches it, not even at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ProteusError as e:  # the user's input, files or environment: one line, no traceback
        if args.debug:
            raise
        lines = [printable(line) for line in _message(e).split("\n")]  # each line escaped, then laid out
        print("error: " + "\n  ".join(line.strip() for line in lines if line.strip()), file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:  # the machine's state, not a bug
            where = f"{printable(str(e.filename))}: " if e.filename else ""
            print(f"error: {where}{e.strerror}; {ENVIRONMENT_ERRNOS[e.errno]}", file=sys.stderr)
            return 2
        msg = printable(" ".join(str(e).split()))  # anything else is a bug in proteus: one line
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
