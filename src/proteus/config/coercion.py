"""Typed coercion: every value that enters the configuration -- a ``--set``, a ``--config`` file, a method's
overrides, the API's dotted keys, a stored config -- is checked once against the schema: the key must exist
(:func:`field_of`) and the value is converted to the type its field declares (:func:`coerce`; the rules are
in its docstring), so ``1e-3`` is a float for a float key, ``2.5`` is refused for an integer one and ``1``
for a boolean one. Declared choices and ranges are checked after, by :func:`proteus.config.validate`.

The functions are generic over the schema's root dataclass (:class:`proteus.config.RunConfig`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import math
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from proteus.errors import ConfigError
from proteus.untrusted import load_yaml as untrusted_yaml
from proteus.untrusted import read_regular_text, yaml_has_tag

__all__ = [
    "coerce", "coerce_dotted", "field_of", "flatten", "load_yaml", "merge", "nest", "parse_set",
    "typed_options",
]  # fmt: skip


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------- the schema's types
#: how a boolean may be spelled as a string (YAML already reads unquoted true/false/yes/no/on/off as one);
#: 1 and 0 are numbers, not booleans, and are refused
_TRUE, _FALSE = frozenset({"true", "yes", "on"}), frozenset({"false", "no", "off"})
_NAMES = {
    bool: ("true or false", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's fields and their declared types (the string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


#: an open section's name -> the declared type of one of its keys (an unknown key raises a ConfigError)
OPEN_SECTIONS: dict[str, Callable[[str], Any]] = {}


def _is_open(hint: Any) -> bool:
    """An open section: a mapping whose keys a learner declares (``baseline``)."""
    return typing.get_origin(hint) is dict


def _section_error(path: str, cls: type) -> ConfigError:
    return ConfigError(
        f"{path} is a section, not a value: set {path}.<key>=...; keys: {', '.join(_hints(cls))}"
    )


def _unknown_key(path: str, cls: type) -> ConfigError:
    return ConfigError(f"unknown config key {path!r}; known keys here: {', '.join(_hints(cls))}")


def field_of(root: type, key: str) -> tuple[Any, dataclasses.Field[Any] | None]:
    """The declared type of the dotted config key ``key`` under the dataclass ``root`` (``"train.epochs"``
    -> ``int``) and its field (None inside an open mapping section such as ``baseline``, whose keys its
    learner types); an unknown key, or a section given as a key (``"train"``), is refused by name with the
    keys that exist there."""
    cls: type = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(key, cls)
        hint, here = hints[part], ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if _is_section(hint):
            if last:
                raise _section_error(here, hint)
            cls = hint
        elif _is_open(hint):
            if last:
                raise ConfigError(f"{here} is a section, not a value: set {here}.<key>=...")
            if i != len(parts) - 2:
                raise ConfigError(
                    f"unknown config key {key!r}: {here}.{parts[i + 1]} is a value, not a section"
                )
            typer = OPEN_SECTIONS.get(here)
            return (typer(parts[-1]) if typer is not None else Any), None
        elif not last:
            raise ConfigError(f"unknown config key {key!r}: {here} is a value, not a section")
    return hint, {f.name: f for f in dataclasses.fields(cls)}[parts[-1]]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_NAMES[args[0]][1]}"
    return _NAMES[hint][0]


def _scalar(value: Any, kind: type, raw: str | None) -> Any:
    """``value`` as ``kind`` (bool, int, float or str), or :data:`_BAD`."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        return _BAD
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, (bool, int, float, datetime.date)):  # a YAML scalar read as another type
            if raw is not None:  # what was written
                return raw
            return str(value).lower() if isinstance(value, bool) else str(value)
        return _BAD
    if isinstance(value, bool):  # a bool is an int to Python, never to a config
        return _BAD
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            try:
                value = float(text)  # "1e3" for an integer key
            except ValueError:
                return _BAD
    if isinstance(value, float) and not math.isfinite(value):
        return _BAD
    if kind is int:
        if isinstance(value, float):
            return int(value) if value.is_integer() else _BAD
        return value if isinstance(value, int) else _BAD
    try:  # an integer too large for a float is no number of a float key
        return float(value) if isinstance(value, (int, float)) else _BAD
    except OverflowError:
        return _BAD


_BAD = object()


def coerce(value: Any, hint: Any, key: str, raw: str | None = None) -> Any:
    """``value`` converted to the declared type ``hint`` of config key ``key``, or a :class:`ConfigError`
    naming the key, the type and the value. The rules:

    * ``bool``: true/false (YAML's spellings yes/no/on/off too, in any case); 1 and 0 are refused;
    * ``int``: an integer, a float with an integral value (2.0) or a string of one ("10", "1e3"); a
      non-integral value (2.5) is refused;
    * ``float``: any finite number, or a string of one ("1e-3", which YAML 1.1 reads as a string);
      nan and inf are refused;
    * ``str``: a string (a path too); a YAML scalar that YAML read as a number, a boolean or a date is
      taken as its text (``raw``, what was written, when known: ``--set train.cache_prefix=false`` is
      "false");
    * ``X | None``: null, or an ``X``; ``list[X]``: a list (or tuple) of ``X``s;
    * anything else (a mapping for a value, bytes, a date) is refused.
    """
    if hint is Any:  # a key of an open section: its learner converts it
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return coerce(value, inner[0], key, raw)
            except ConfigError:
                raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}") from None
    if value is None:
        raise ConfigError(f"{key} must be {_describe(hint)}; got null")
    if origin is list:
        if isinstance(value, (list, tuple)):
            out = [_scalar(v, args[0], None) for v in value]
            if not any(v is _BAD for v in out):
                return out
        raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}")
    out = _scalar(value, hint, raw)
    if out is _BAD:
        raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}")
    return out


def typed_options(options_type: type, raw: dict[str, Any], prefix: str) -> Any:
    """An options dataclass from a raw mapping (an open section such as ``baseline``): each value of one of
    its fields converted to the field's type and checked by its declaration (a :class:`ConfigError` names
    ``prefix.key``); keys that are not its fields are left out."""
    from proteus.options import check_value, options_of

    hints = typing.get_type_hints(options_type)
    values = {}
    for f, opt in options_of(options_type):
        if f.name in raw:
            key = f"{prefix}.{f.name}"
            values[f.name] = coerce(raw[f.name], hints[f.name], key)
            check_value(key, values[f.name], opt)
    return options_type(**values)


def coerce_dotted(root: type, dotted: dict[str, Any]) -> dict[str, Any]:
    """Flat dotted keys (``{"train.epochs": "2"}``) checked against the schema ``root`` (unknown keys and
    sections refused by name) and their values converted to each key's declared type (:func:`coerce`)."""
    return {key: coerce(value, field_of(root, key)[0], key) for key, value in dotted.items()}


def nest(root: type, dotted: dict[str, Any]) -> dict[str, Any]:
    """``{"train.epochs": 1}`` -> ``{"train": {"epochs": 1}}``, the keys checked and the values converted
    (:func:`coerce_dotted`)."""
    out: dict[str, Any] = {}
    for key, value in coerce_dotted(root, dotted).items():
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def merge(obj: Any, data: dict[str, Any], where: str = "config") -> None:
    """Merge a nested dict into a dataclass tree in place: unknown keys refused by name, every value
    converted to its field's declared type (:func:`coerce`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    cls: type = type(obj)
    hints = _hints(cls)
    for key, value in data.items():
        path = f"{where}.{key}" if where != "config" else str(key)
        if key not in hints:
            raise _unknown_key(path, type(obj))
        hint = hints[key]
        if _is_section(hint):
            if value is None:  # an empty section in a YAML file
                continue
            if not isinstance(value, dict):
                raise _section_error(path, hint)
            merge(getattr(obj, key), value, where=path)
        elif _is_open(hint):  # its learner checks the keys and converts the values
            if value is None:
                continue
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"{path}: expected a mapping of option names to values, got {_show(value)}")
            getattr(obj, key).update(copy.deepcopy(value))
        else:
            setattr(obj, key, coerce(value, hint, path))


def _has_tag(raw: str, key: str) -> bool:
    return yaml_has_tag(raw, f"--set {key}")


def parse_set(root: type, items: list[str]) -> dict[str, Any]:
    """Turn ``["adapter.rank=16", "train.epochs=1"]`` into a nested dict: each key checked against the
    schema ``root`` (:func:`field_of`), each value read as one YAML scalar (a flow list for a list key; YAML
    tags are refused) and converted to the key's declared type (:func:`coerce`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or not all(key.split(".")):
            raise ConfigError(f"--set expects key=value, got {item!r}")
        hint = field_of(root, key)[0]
        try:
            if _has_tag(raw, key):
                raise ConfigError(
                    f"--set {key}: YAML tags are not allowed in a value ({raw.strip()!r}); give a plain value"
                )
            value = untrusted_yaml(raw, f"--set {key}") if raw.strip() != "" else None
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ConfigError(f"--set {key}: not a valid YAML value: {raw!r} ({why})") from None
        except RecursionError:
            raise ConfigError(f"--set {key}: the value is nested too deeply: {raw[:40]!r}...") from None
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = coerce(value, hint, key, raw=raw.strip())
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = untrusted_yaml(read_regular_text(p), str(p)) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid YAML (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a text (UTF-8) YAML file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data
