"""A small name -> entry registry (timm/Mammoth style): every strategy an option names (backbones, benchmarks,
methods, learners, keys, detectors, executors ...) is an entry, asked for by name and by its traits.

A registry may name *plugins*: the modules whose import registers its entries (the learners of
:mod:`proteus.core` and :mod:`proteus.baselines` declare their methods where they are defined). They are
imported the first time a name is missing or the whole registry is listed, together with the modules that
installed packages advertise under the ``proteus.plugins`` entry-point group, so that code which needs one
learner never imports the others (``import proteus.core`` loads no baseline).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from proteus.errors import ProteusError

T = TypeVar("T")


class UnknownNameError(ProteusError, KeyError):
    """A name that is not in a registry (the message lists the known ones); also a ``KeyError``."""

    def __str__(self) -> str:  # the message itself, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to factories. ``@REG.register("name")`` adds one; ``REG.get("name")`` looks it up.

    Every registry is also known by its ``kind`` (:meth:`named`): a configuration key whose allowed values
    are a registry's names declares it by that name when the registry lives above the key's section."""

    _by_kind: dict[str, Registry[object]] = {}

    def __init__(self, kind: str, plugins: tuple[str, ...] = ()) -> None:
        self.kind = kind
        Registry._by_kind.setdefault(kind, self)  # type: ignore[arg-type]
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}
        self._traits: dict[str, dict[str, object]] = {}
        #: modules whose import registers entries (imported once, at the first miss or listing)
        self.plugins = plugins
        self._discovered = not plugins

    @classmethod
    def named(cls, kind: str) -> Registry[object]:
        """The registry created with ``kind``; when its module is not loaded yet, the plugins of every
        registry are imported first (they import the learners, which import their strategies)."""
        if kind not in cls._by_kind:
            for reg in list(cls._by_kind.values()):
                reg.discover()
        try:
            return cls._by_kind[kind]
        except KeyError:
            raise UnknownNameError(f"no registry of {kind!r}") from None

    def discover(self) -> None:
        """Import the plugin modules (and the ``proteus.plugins`` entry points) once."""
        if self._discovered:
            return
        self._discovered = True
        for module in self.plugins:
            importlib.import_module(module)
        for ep in entry_points(group="proteus.plugins"):
            ep.load()

    def register(self, name: str, help: str = "", **traits: object) -> Callable[[T], T]:
        """Add ``name``; ``traits``: facts about the entry that code elsewhere asks by :meth:`trait` (which
        other options it reads, say) instead of comparing ``name`` with a string."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            self._traits[name] = traits
            doc = help or (getattr(obj, "__doc__", "") or "").strip().splitlines()
            self._help[name] = doc if isinstance(doc, str) else (doc[0] if doc else "")
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self:
            known = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; choose one of: {known}")
        return self._items[name]

    def unregister(self, name: str) -> T:
        """Remove an entry (a plugin's or a test's own); returns it."""
        self._help.pop(name, None)
        self._traits.pop(name, None)
        return self._items.pop(name)

    def trait(self, name: str, trait: str) -> object:
        """The trait ``trait`` entry ``name`` was registered with, else the entry's attribute of that name,
        else None (:meth:`register`)."""
        traits = self._traits.get(name, {})
        return traits[trait] if trait in traits else getattr(self.get(name), trait, None)

    def names(self) -> list[str]:
        """Every registered name (the plugins imported first)."""
        self.discover()
        return sorted(self._items)

    def loaded(self) -> list[str]:
        """The names registered so far, without importing the plugins."""
        return sorted(self._items)

    def describe(self) -> dict[str, str]:
        return {n: self._help[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        try:
            if name in self._items:
                return True
        except TypeError:  # an unhashable value (a list in a hand-edited file) is no registered name
            return False
        if self._discovered:
            return False
        self.discover()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
