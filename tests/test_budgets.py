"""The budgets (:mod:`proteus.budgets`) and the parsers that keep to them (:mod:`proteus.untrusted`): the
table of docs/reliability.md is the declarations', each parser refuses what the adversarial review found,
by name and with exit code 2 on the command line."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from proteus.budgets import BUDGETS, BudgetError, limit
from proteus.cli import main
from proteus.untrusted import (
    InputError,
    SpecialFileError,
    load_json,
    load_yaml,
    printable,
    read_regular,
    yaml_has_tag,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
ROW = re.compile(
    r"^\| `(?P<name>[a-z_]+)` \| (?P<default>[\d,]+) (?P<unit>\w+) \| (?P<protects>.+) \| (?P<raise>.+) \|$"
)


def test_the_documented_table_is_the_declared_one() -> None:
    rows = {m["name"]: m for m in map(ROW.match, DOC.read_text().splitlines()) if m}
    assert set(rows) == set(BUDGETS), "docs/reliability.md's budget table and proteus.budgets differ"
    for name, b in BUDGETS.items():
        row = rows[name]
        assert int(row["default"].replace(",", "")) == b.default, name
        assert row["unit"] == b.unit, name
        assert (f"`${b.env}`" in row["raise"]) == b.from_env, name
        for flag in re.findall(r"--[a-z-]+", b.option):
            assert flag in row["raise"], (name, flag)


def test_a_budget_is_raised_through_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert limit("nesting_depth") == 100
    monkeypatch.setenv("PROTEUS_LIMIT_NESTING_DEPTH", "300")
    assert limit("nesting_depth") == 300
    load_json(b"[" * 250 + b"]" * 250, "x.json")
    monkeypatch.setenv("PROTEUS_LIMIT_NESTING_DEPTH", "lots")
    with pytest.raises(BudgetError, match=r"\$PROTEUS_LIMIT_NESTING_DEPTH must be a number of levels"):
        limit("nesting_depth")
    monkeypatch.setenv("PROTEUS_LIMIT_IMAGE_PIXELS", "1")  # not an environment budget: its own setting
    assert limit("image_pixels") == 64_000_000


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        (b"[" * 200_000 + b"]" * 200_000, BudgetError, "nested too deeply.*nesting_depth.*PROTEUS_LIMIT"),
        (b"[" * 101 + b"]" * 101, BudgetError, "nested too deeply"),
        (b'{"a": ' + b"9" * 5000 + b"}", BudgetError, "an integer of 5000 digits.*int_digits"),
        (b'{"tasks": [], "tasks": [1]}', InputError, "the key 'tasks' appears twice"),
        (b'{"a": {"b": 1, "b": 1}}', InputError, "the key 'b' appears twice"),
        (b'["\\ud800"]', InputError, "lone surrogate"),
        (b"[1,", InputError, "not valid JSON"),
        (b"\xff", InputError, "not UTF-8"),
    ],
)
def test_json_from_someone_else(data: bytes, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        load_json(data, "m.json")


def test_json_within_the_budgets_is_read() -> None:
    assert load_json(b'{"a": [1, 2.5, "\\u00e9", null], "b": ' + b"9" * 64 + b"}", "m.json")["b"] == int(
        "9" * 64
    )


LAUGHS = ["meta:", '  a0: &a0 ["c","c","c","c","c","c","c","c","c","c"]'] + [
    f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)
]


@pytest.mark.parametrize(
    ("text", "error", "words"),
    [
        (
            "\n".join([*LAUGHS, "tasks: [[c0, c1]]"]),
            InputError,
            r"YAML aliases \(\*a0, line 3\) are not allowed",
        ),
        ("x: " + "[" * 50_000, BudgetError, "brackets nested too deeply"),
        ("x: " + "9" * 5000, BudgetError, "an integer of 5000 digits"),
        ("x: [" + ", ".join(["a"] * 200_001) + "]", BudgetError, "more than 200000 nodes"),
        ("tasks: [[a]]\ntasks: [[b]]", InputError, "the key 'tasks' appears twice in one mapping"),
    ],
)
def test_yaml_from_someone_else(text: str, error: type, words: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(error, match=words):
        load_yaml(text, "t.yaml")
    assert time.perf_counter() - t0 < 30  # a bound on a hang, not a timing claim


def test_yaml_tags_are_found_after_the_nesting_check() -> None:
    assert yaml_has_tag("!!python/object:os.system x") and not yaml_has_tag("[1, 2]")
    with pytest.raises(BudgetError):
        yaml_has_tag("[" * 1000)


def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SpecialFileError, match=r"not a regular file \(a FIFO"):
        read_regular(fifo, "yaml_bytes")
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")
    with pytest.raises(SpecialFileError, match="character device"):
        read_regular(link, "yaml_bytes")
    with pytest.raises(SpecialFileError, match="symbolic link"):
        read_regular(link, "yaml_bytes", follow=False)
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # sparse: no disk space, refused by its size before any read
    with pytest.raises(
        BudgetError, match=r"3221225472 bytes, over the limit of 16777216 bytes \(yaml_bytes\)"
    ):
        read_regular(big, "yaml_bytes")


def test_printable_escapes_what_a_terminal_would_act_on() -> None:
    assert printable("a\x1b[31mb\u202ec\u2066d\n\ud800 é 日") == "a\\x1b[31mb\\u202ec\\u2066d\\n\\ud800 é 日"


def test_the_cli_refuses_hostile_set_values_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from proteus.config import parse_set

    for value, error, words in (
        ("9" * 5000, BudgetError, "int_digits"),
        ("[" * 50_000, BudgetError, "nesting_depth"),
        ("*a", InputError, "aliases"),
    ):
        with pytest.raises(error, match=words):
            parse_set([f"train.epochs={value}"])
    argv = ["learn", "--kb", "/nonexistent/kb", "--benchmark", "quickstart", "--task", "1"]
    assert main([*argv, "--set", "train.epochs=" + "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set train.epochs: an integer of 5000 digits"), err
