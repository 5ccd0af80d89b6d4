"""How an option is declared: once, on its field, by the part that reads it.

Every configuration key is a field of a section dataclass that lives with its owner (``backbone.*`` in
:mod:`proteus.backbones.options`, ``signature.*`` in :mod:`proteus.signatures.options`, a baseline's
``baseline.*`` in its own module ...). :func:`option` puts on the field everything the rest of the
project needs to know about it, so that nothing keeps a second list:

* ``help``: one line of meaning (the configuration reference is generated from it);
* ``range``: an :class:`Interval` the number must lie in;
* ``choices``: the allowed values -- a collection, a :class:`~proteus.registry.Registry` (adding a strategy
  to it makes it a valid value), or a registry's name when the registry lives above the section
  (``"signature.keys"``: :meth:`~proteus.registry.Registry.named`, resolved when the value is checked);
* ``per_task``: the key may change between tasks (a knowledge base records it per task);
* ``legacy``: the value that reproduces what a config written before the key existed did (a stored
  config that lacks the key takes it, not today's default).

The configuration's validation (:func:`proteus.config.validate`) gathers these declarations from the
sections a learner reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from proteus.errors import ConfigError
from proteus.registry import Registry

__all__ = [
    "AT_LEAST_1", "MAX_SQUARE_SIDE", "MISSING", "NO_LEGACY", "NON_NEGATIVE", "POSITIVE", "UNIT",
    "ConfigError", "Interval", "OptionInfo", "check_section", "check_value", "info", "option", "options_of",
]  # fmt: skip

MISSING: Any = dataclasses.MISSING


class _NoLegacy:
    def __repr__(self) -> str:
        return "NO_LEGACY"


#: ``legacy`` of a key that existed from the start (a stored config that lacks it takes today's default)
NO_LEGACY: Any = _NoLegacy()


@dataclass(frozen=True)
class Interval:
    """An allowed range: ``low`` / ``high`` bounds (None: open), ``closed`` says which ends are included."""

    low: float | None = None
    high: float | None = None
    closed: str = "both"  # "both", "left", "right", "neither"

    def contains(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        lo_ok = self.low is None or (v >= self.low if self.closed in ("both", "left") else v > self.low)
        hi_ok = self.high is None or (v <= self.high if self.closed in ("both", "right") else v < self.high)
        return lo_ok and hi_ok

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        left = "[" if self.closed in ("both", "left") and self.low is not None else "("
        right = "]" if self.closed in ("both", "right") and self.high is not None else ")"
        return f"{left}{lo}, {hi}{right}"


POSITIVE = Interval(0, None, "neither")
AT_LEAST_1 = Interval(1, None)
NON_NEGATIVE = Interval(0, None)
UNIT = Interval(0, 1)
#: the longest side of a square statistic a width option may ask for (RanPAC's G is M x M): 65,536 is 32 GiB
#: in float64, refused by name before anything is allocated
MAX_SQUARE_SIDE = 65_536


@dataclass(frozen=True)
class OptionInfo:
    """What :func:`option` declared about a field."""

    help: str
    range: Interval | None = None
    choices: Collection[Any] | Registry[Any] | str | None = None
    per_task: bool = False
    legacy: Any = NO_LEGACY

    def allowed(self) -> Collection[Any] | Registry[Any] | None:
        """The allowed values (a registry named by a string is looked up now)."""
        if isinstance(self.choices, str):
            return Registry.named(self.choices)
        return self.choices

    def describe(self) -> str:
        """The allowed values or range in words (for messages and the reference)."""
        ok = self.allowed()
        if ok is not None:
            return "one of " + ", ".join(map(str, ok))
        return f"a number in {self.range}" if self.range is not None else ""


def option(
    default: Any = MISSING,
    *,
    help: str,
    range: Interval | None = None,
    choices: Collection[Any] | Registry[Any] | str | None = None,
    per_task: bool = False,
    legacy: Any = NO_LEGACY,
    factory: Any = MISSING,
) -> Any:
    """A section field with its declaration (see the module docstring); ``factory`` for a mutable default."""
    meta = {"option": OptionInfo(help, range, choices, per_task, legacy)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def info(f: dataclasses.Field[Any]) -> OptionInfo:
    """The declaration of a section's field (a field without one has only a help line to add)."""
    found = f.metadata.get("option")
    return found if isinstance(found, OptionInfo) else OptionInfo(help="")


def options_of(section: type | Any) -> Iterator[tuple[dataclasses.Field[Any], OptionInfo]]:
    """The fields of a section (class or instance) that are values, with their declarations (nested
    sections are left out)."""
    for f in dataclasses.fields(section):
        yield f, info(f)


def check_value(key: str, value: Any, opt: OptionInfo) -> None:
    """One value (already of its declared type) against its declared choices and range (None passes: the
    type allows it only where the field is optional)."""
    ok = opt.allowed()
    if ok is not None and value not in ok:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, ok))}; got {value!r}")
    rng = opt.range
    if rng is None or value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not rng.contains(_as_float(value)):
        shown = (
            repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} digits)"
        )
        raise ConfigError(f"{key} must be a number in {rng}; got {shown}")


def _as_float(value: int | float) -> float:
    """``value`` as a float; an integer beyond a float's range is infinite (out of every finite range)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_section(prefix: str, section: Any) -> None:
    """Check every value of a section instance by its declaration; the first violation raises a
    :class:`ConfigError` naming ``prefix.key``."""
    for f, opt in options_of(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            continue
        check_value(f"{prefix}{f.name}", value, opt)
