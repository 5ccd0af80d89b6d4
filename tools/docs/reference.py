"""The docs site's generated references, written from the code's own declarations before every build
(``make docs``; ``mkdocs.yml`` runs :func:`on_pre_build` as a hook):

* ``docs/reference/configuration.md``: every config key from its field's declaration (type, default,
  allowed values or range, per-task, one line of meaning) and which learners read it;
* ``docs/reference/cli.md``: every command and flag from the parser, with its examples.

    python tools/docs/reference.py          # write both pages
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if args and origin is not None and type(None) in args:
        return " or ".join(_type_name(a) for a in args)
    return getattr(hint, "__name__", str(hint))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value}"


def _rows(prefix: str, section: type) -> list[str]:
    from proteus.options import NO_LEGACY, options_of

    hints = typing.get_type_hints(section)
    rows = []
    for f, opt in options_of(section):
        if dataclasses.is_dataclass(hints[f.name]) or typing.get_origin(hints[f.name]) is dict:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        allowed = opt.describe() or "any " + _type_name(hints[f.name])
        notes = []
        if opt.per_task:
            notes.append("per task")
        if opt.legacy is not NO_LEGACY:
            notes.append(f"older configs: `{_show(opt.legacy)}`")
        help_ = opt.help.replace("|", "\\|")
        rows.append(
            f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{_show(default)}` | {allowed} | "
            f"{help_}{' (' + '; '.join(notes) + ')' if notes else ''} |"
        )
    return rows


def configuration_reference() -> str:
    """Every configuration key, section by section, from the declarations (:mod:`proteus.options`)."""
    from proteus.config import LEARNERS, RUN_SECTIONS, RunConfig, sections

    learners = {n: LEARNERS.get(n) for n in LEARNERS.names()}
    readers: dict[str, list[str]] = {}
    for name, cls in learners.items():
        for s in getattr(cls, "option_sections", ()):
            readers.setdefault(s, []).append(name)
    head = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    out = [
        "# Configuration reference",
        "",
        "Generated from the declarations in the code (`proteus/options.py`): every key of `--set`,",
        "of a `--config` file and of the Python API's dotted keys. A key marked *per task* may change",
        "between the tasks of one knowledge base; every other key defines the learned model. *Older",
        "configs* is the value a stored config that lacks the key takes (what the release that wrote",
        "it did).",
        "",
        "## The run's settings",
        "",
        *head,
        *_rows("", RunConfig),
    ]
    for name, section in sections().items():
        who = (
            "every run"
            if name in RUN_SECTIONS
            else ", ".join(f"`{r}`" for r in sorted(readers.get(name, [])))
        )
        out += [
            "",
            f"## `{name}.*`",
            "",
            f"Read by: {who}.",
            "",
            (section.__doc__ or "").strip().splitlines()[0],
        ]
        out += ["", *head, *_rows(f"{name}.", section)]
    out += ["", "## `baseline.*`: each baseline's own options", ""]
    for name, cls in sorted(learners.items()):
        options = getattr(cls, "Options", None)
        if isinstance(options, type) and dataclasses.is_dataclass(options) and dataclasses.fields(options):
            out += [f"### `{name}`", "", *head, *_rows("baseline.", options), ""]
    return "\n".join(out) + "\n"


def _text(s: str) -> str:
    """Help text as Markdown table text: one line, ``|`` escaped, and ``<`` / ``>`` as entities (a renderer
    takes ``runs/<benchmark>-<method>`` for HTML tags and drops them)."""
    return s.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _actions(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | meaning | default |", "| --- | --- | --- |"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
        default = "" if a.default in (None, argparse.SUPPRESS, False) else f"`{a.default}`"
        help_ = _text(a.help or "")
        if a.choices is not None:
            help_ += f" (one of {', '.join(map(str, a.choices))})"
        rows.append(f"| {flags} | {help_} | {default} |")
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def cli_reference() -> str:
    """Every command and flag of ``proteus``, from the parser (:func:`proteus.cli.build_parser`)."""
    from proteus.cli import build_parser

    root = build_parser()
    out = [
        "# Command-line reference",
        "",
        "Generated from the parser (`proteus --help`).",
        "",
        "```",
        root.format_usage().strip(),
        "```",
        "",
    ]

    def emit(name: str, p: argparse.ArgumentParser, depth: int) -> None:
        nonlocal out
        out += [
            f"{'#' * depth} `{name}`",
            "",
            _text((p.description or "").strip()),
            "",
            "```",
            p.format_usage().strip(),
            "```",
            "",
        ]
        out += [*_actions(p), ""]
        if p.epilog:
            out += ["```", p.epilog.strip(), "```", ""]
        for sub, sp in _subparsers(p).items():
            emit(f"{name} {sub}", sp, depth + 1)

    for name, p in _subparsers(root).items():
        emit(f"proteus {name}", p, 2)
    return "\n".join(out) + "\n"


def write(docs: Path = DOCS) -> list[Path]:
    ref = docs / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    pages = {"configuration.md": configuration_reference(), "cli.md": cli_reference()}
    for name, text in pages.items():
        (ref / name).write_text(text)
    return [ref / n for n in pages]


def on_pre_build(config: Any) -> None:  # mkdocs hook
    write(Path(config["docs_dir"]))


if __name__ == "__main__":
    for p in write():
        print(p)
    sys.exit(0)
