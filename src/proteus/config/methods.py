"""Registered methods (PROTEUS, its ablations and the baselines of Sec. 5 and the Appendix) and the
learners that run them.

A method is a declaration next to its learner's code: which learner runs it, what it derives from (its
``base``: another method, or None for the configuration's defaults) and the settings it overrides, as
dotted config keys. The strategies it names are resolved from their registries when the learner is built.
PROTEUS's methods are declared in :mod:`proteus.core.methods`, each baseline's in its own module;
``proteus run --method NAME``.

A method's *recipe* is its base's recipe with its own overrides on top: an ablation of the paper names
``base="proteus-paper"`` and so keeps ablating the paper's recipe whatever the default ``proteus`` becomes
(``tests/test_methods.py`` holds every resolved recipe and fails when one changes without its declaration).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from proteus.config.coercion import OPEN_SECTIONS, merge
from proteus.config.schema import RunConfig
from proteus.errors import ConfigError
from proteus.registry import Registry

__all__ = ["LEARNERS", "METHODS", "Method", "apply_method", "baseline_option_type", "declare"]


@dataclass(frozen=True)
class Method:
    """A method: its name, a one-line description, what it derives from and its config overrides."""

    name: str
    help: str
    #: the method whose recipe this one starts from (None: the configuration's defaults)
    base: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    #: the learner that runs it (:data:`proteus.learners.LEARNERS`): "proteus" or a baseline's name
    learner: str = "proteus"
    #: how the paper's statement of it and of what derives from it is read (``reproduce``): "paper" (the
    #: paper's PROTEUS, an ablation's own change on top), "default" (the paper's PROTEUS, every change
    #: ours); None: its base's, and a root without one is read by its own declaration ("own")
    reading: str | None = None

    def chain(self) -> list[Method]:
        """The declarations from the root of its bases down to this one."""
        out: list[Method] = [self]
        while out[-1].base is not None:
            base = METHODS.get(out[-1].base)
            if base in out:
                raise ValueError(f"method {self.name}: its bases loop ({' <- '.join(m.name for m in out)})")
            out.append(base)
        return out[::-1]

    def paper_reading(self) -> tuple[str, Method | None]:
        """How the paper's statement of this method is read (:attr:`reading`, inherited from the nearest
        base that declares one, else ``"own"``), and the declaration that says so."""
        for m in reversed(self.chain()):
            if m.reading is not None:
                return m.reading, m
        return "own", None

    def recipe(self) -> dict[str, Any]:
        """Every dotted key this method sets, its bases' first (later declarations win)."""
        return {k: v for m in self.chain() for k, v in m.overrides.items()}

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.recipe().items():
            section, _, name = key.partition(".")
            if name:
                out.setdefault(section, {})[name] = value
            else:
                out[section] = value
        return out


#: the modules that hold learners and declare their methods (imported at the first miss: registry plugins)
PLUGINS = ("proteus.core", "proteus.baselines")
#: every method; a miss imports the learners' modules, which declare theirs
METHODS: Registry[Method] = Registry("method", plugins=PLUGINS)
#: learner name (``Method.learner``) -> the learner class (:mod:`proteus.learners` is their protocol); each
#: learner registers itself where it is defined
LEARNERS: Registry[type[Any]] = Registry("learner", plugins=PLUGINS)


def declare(
    name: str,
    help: str,
    *,
    base: str | None,
    learner: str | None = None,
    reading: str | None = None,
    **overrides: Any,
) -> Method:
    """Register a method derived from ``base`` (a declared method, or None for the defaults); keyword names
    are config keys with ``__`` for the dot (``train__tasks``). ``learner`` defaults to the base's (to
    ``"proteus"`` without a base); ``reading``: :attr:`Method.reading`."""
    if base is not None and base not in METHODS:
        raise ValueError(f"method {name}: its base {base!r} is not declared (declare it first)")
    if learner is None:
        learner = METHODS.get(base).learner if base is not None else "proteus"
    m = Method(name, help, base, {k.replace("__", "."): v for k, v in overrides.items()}, learner, reading)
    METHODS.register(name, help=help)(m)
    return m


def apply_method(cfg: RunConfig, name: str) -> RunConfig:
    """``cfg`` with method ``name``'s recipe merged in (in place) and ``cfg.method`` set."""
    merge(cfg, METHODS.get(name).nested())
    cfg.method = name
    return cfg


def baseline_option_type(name: str) -> Any:
    """The declared type of ``baseline.<name>``: the field of that name in any learner's options (each
    baseline declares its own, :attr:`proteus.baselines.ContinualClassifier.Options`); an unknown name is
    refused with the names that exist."""
    found: dict[str, Any] = {}
    for learner in (LEARNERS.get(n) for n in LEARNERS.names()):
        options = getattr(learner, "Options", None)
        if isinstance(options, type) and dataclasses.is_dataclass(options):
            found.update({k: v for k, v in typing.get_type_hints(options).items() if k not in found})
    if name not in found:
        raise ConfigError(
            f"unknown config key 'baseline.{name}'; the baselines' options: {', '.join(sorted(found))}"
        )
    return found[name]


OPEN_SECTIONS["baseline"] = baseline_option_type  # (the learners register their options in their modules)
