"""Named crash points for the crash-safety tests.

A test sets ``PROTEUS_TEST_KILL_AT=<point>`` in the environment of a ``proteus`` process; when that process
reaches :func:`crash_point` with the same name it sends itself SIGKILL: no ``finally`` block, no atexit
handler and no buffered write runs, exactly as if the machine had lost power at that line (minus the page
cache). Without the variable a crash point is one dictionary lookup. The points, in the order a task passes
them (``proteus learn --task K``):

=====================  ===================================================================================
``learn:prefix``        frozen-prefix outputs of the task's training set computed (learner)
``learn:train``         adapter trained, not yet frozen into the KB (learner)
``learn:signature``     signature fitted (learner)
``learn:head``          head statistics G, e(c) updated in memory (learner)
``evaluate``            evaluation after the task done (runner)
``commit:tmp``          first object written to its temporary name, not yet renamed (kb)
``commit:objects``      every object of the new state written, manifest not yet (kb)
``commit:manifest-tmp`` new manifest written and fsynced to its temporary name, not yet renamed (kb)
``commit:manifest``     new manifest renamed into place, unreferenced files not yet swept (kb)
=====================  ===================================================================================

Every point before ``commit:manifest`` must leave the knowledge base in its old state; ``commit:manifest``
leaves the new one (tested in ``tests/test_crash_safety.py``). ``<point>@N`` kills at the N-th time the
process reaches the point (``learn:prefix@3``: while task 3 starts, tasks 1 and 2 committed).
"""

from __future__ import annotations

import os
import signal

#: environment variable naming the crash point at which the process kills itself
ENV = "PROTEUS_TEST_KILL_AT"

POINTS = (
    "learn:prefix",
    "learn:train",
    "learn:signature",
    "learn:head",
    "evaluate",
    "commit:tmp",
    "commit:objects",
    "commit:manifest-tmp",
    "commit:manifest",
)


#: how many times each point was reached in this process (for ``<point>@N``)
_reached: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if ``$PROTEUS_TEST_KILL_AT`` is ``name`` (or ``name@N`` and this is the N-th
    time; tests only; a no-op otherwise)."""
    want = os.environ.get(ENV)
    if want is None or want.partition("@")[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    at = want.partition("@")[2]
    if not at or _reached[name] == int(at):
        os.kill(os.getpid(), signal.SIGKILL)
