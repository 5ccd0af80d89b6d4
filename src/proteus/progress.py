"""Every progress bar of the package, made by :func:`bar`: on a terminal a tqdm bar as before; when the
bars' stream is not a terminal (``make demo | tee log``, a batch job's log file) a :class:`PlainBar`
instead, which writes a plain line now and then (``task 2: train: 40/120 (33%) loss=0.530 [31 s]``) and
never carriage-return updates, so a log holds a few lines per long pass and none for a short one. In a
notebook (tqdm's widget bars) the bars stay. ``enabled=False`` (``-q``) shows nothing anywhere.

When a plain line is written: at each quarter of the total (:data:`PLAIN_EVERY`) once the bar is at least
:data:`PLAIN_MIN_GAP` seconds past its start or its last line, and every :data:`PLAIN_INTERVAL` seconds
in any case; a bar that wrote a line writes a last one when it ends. A pass shorter than
:data:`PLAIN_MIN_GAP` seconds writes nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _auto_tqdm
from tqdm.std import tqdm as std_tqdm

__all__ = ["PLAIN_EVERY", "PLAIN_INTERVAL", "PLAIN_MIN_GAP", "PlainBar", "bar", "is_tty"]

#: off a terminal: a line at each of these fractions of a bar's total ...
PLAIN_EVERY = 0.25
#: ... when at least this many seconds have passed since the bar's start or its last line
PLAIN_MIN_GAP = 5.0
#: and a line at least this often (seconds) while a bar runs
PLAIN_INTERVAL = 10.0


def is_tty(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an interactive terminal (False for None, files, pipes and closed streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class PlainBar:
    """The progress of a pass off a terminal, as a few plain lines on ``file`` (see the module docstring).
    It takes what the package calls on a tqdm bar: iteration, ``update``, ``set_postfix``,
    ``set_postfix_str``, ``set_description``, ``close`` and ``with``; ``disable`` is True (no tqdm bar)."""

    disable = True

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        desc: str | None = None,
        total: float | None = None,
        file: IO[str] | None = None,
        unit: str = "it",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self.iterable, self.desc, self.total, self.file, self.unit = iterable, desc, total, file, unit
        self.n: float = 0
        self.postfix = ""
        self._clock = clock
        self._t0 = self._last = clock()
        self._next = PLAIN_EVERY
        self._lines = 0
        self._shown: float = 0
        self._closed = False

    # --------------------------------------------------------------------------------------- tqdm's face
    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this bar has no iterable (use update)")
        try:
            for obj in self.iterable:
                yield obj
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> PlainBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self._clock()
        due = now - self._last >= PLAIN_INTERVAL
        if self.total:
            frac = self.n / self.total
            if frac >= self._next:  # a quarter passed: say so unless the last line was just now
                due = due or now - self._last >= PLAIN_MIN_GAP
                self._next = (int(frac / PLAIN_EVERY) + 1) * PLAIN_EVERY
        if due:
            self._write(now)

    def set_postfix(
        self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kw: Any
    ) -> None:
        items = {**(ordered_dict or {}), **kw}
        self.postfix = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items.items()
        )

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc

    def refresh(self) -> None:
        """Nothing to redraw off a terminal."""

    def close(self) -> None:
        """End the bar: a last line when it wrote any and has moved since."""
        if self._closed:
            return
        self._closed = True
        if self._lines and self._shown != self.n:
            self._write(self._clock())

    # ---------------------------------------------------------------------------------------- the line
    def line(self, now: float | None = None) -> str:
        """The plain line for the bar's state now: ``desc: n/total (pct%) postfix [elapsed]``."""
        elapsed = (self._clock() if now is None else now) - self._t0
        if self.total:
            count = f"{self.n:g}/{self.total:g} ({100 * self.n / self.total:.0f}%)"
        else:
            count = f"{self.n:g} {self.unit}"
        parts = [f"{self.desc}:" if self.desc else "", count, self.postfix, f"[{_duration(elapsed)}]"]
        return " ".join(p for p in parts if p)

    def _write(self, now: float) -> None:
        stream = sys.stderr if self.file is None else self.file
        try:
            print(self.line(now), file=stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stream: progress is never worth an error
            pass
        self._last, self._shown = now, self.n
        self._lines += 1


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"


def bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str | None = None,
    total: int | None = None,
    enabled: bool = True,
    file: IO[str] | None = None,
    **kwargs: Any,
) -> tqdm | PlainBar:
    """A progress bar over ``iterable`` (or a manual one with ``total``): when ``enabled`` and the bar's
    stream (``file``, default ``sys.stderr``) is a terminal, a tqdm bar (``kwargs`` go to tqdm: ``unit``,
    ...; ``leave=False`` and ``dynamic_ncols=True`` unless given); when enabled off a terminal, a
    :class:`PlainBar` writing a plain line now and then; when not enabled, a disabled tqdm bar. Every kind
    iterates and takes ``update`` / ``set_postfix`` / ``close``."""
    stream = sys.stderr if file is None else file
    notebook = _auto_tqdm is not std_tqdm  # tqdm.auto chose the notebook widget: the stream is no terminal
    if enabled and not notebook and not is_tty(stream):
        return PlainBar(iterable, desc=desc, total=total, file=file, unit=kwargs.get("unit", "it"))
    show = enabled and (notebook or is_tty(stream))
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, desc=desc, total=total, disable=not show, file=file, **kwargs)
