"""A small name -> factory registry, used for backbones, benchmarks and methods (timm/Mammoth style)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from proteus.errors import ProteusError

T = TypeVar("T")


class UnknownNameError(ProteusError, KeyError):
    """A name that is not in a registry (the message lists the known ones); also a ``KeyError``."""

    def __str__(self) -> str:  # the message itself, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to factories. ``@REG.register("name")`` adds one; ``REG.get("name")`` looks it up."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            doc = help or (getattr(obj, "__doc__", "") or "").strip().splitlines()
            self._help[name] = doc if isinstance(doc, str) else (doc[0] if doc else "")
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):  # TypeError: an unhashable value (a list in a hand-edited file)
            known = ", ".join(sorted(self._items))
            raise UnknownNameError(f"unknown {self.kind} {name!r}; choose one of: {known}") from None

    def unregister(self, name: str) -> T:
        """Remove an entry (a plugin's or a test's own); returns it."""
        self._help.pop(name, None)
        return self._items.pop(name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def describe(self) -> dict[str, str]:
        return {n: self._help[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items
        except TypeError:  # an unhashable value is no registered name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
