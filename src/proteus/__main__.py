"""``python -m proteus``: the command line. SIGTERM during start-up (imports, before :func:`proteus.cli.main`
installs its own handler) ends the process with exit code 143 and a message, as it does later."""

import signal
import sys


def _terminated_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write("terminated (SIGTERM) while starting; nothing was changed\n")
    raise SystemExit(128 + signal.SIGTERM)


try:
    signal.signal(signal.SIGTERM, _terminated_while_starting)
except (ValueError, OSError):  # not the main thread of the main interpreter
    pass

from proteus.cli import main  # noqa: E402

raise SystemExit(main())
