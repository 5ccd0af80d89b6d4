"""The docs' generated references: every configuration key is declared with a line of meaning, and the
configuration and command-line references are written from the declarations and the parser; the user
docs name no issue numbers (history goes to CHANGELOG.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import typing
from pathlib import Path

import pytest

from proteus.config import LEARNERS, RunConfig, sections
from proteus.options import options_of

ROOT = Path(__file__).resolve().parents[1]

# written by tools/docs/reference.py before every build, from the code's declarations
GENERATED = {"docs/reference/configuration.md", "docs/reference/cli.md"}
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+|\bissue-\d+", re.IGNORECASE)


def _reference():  # noqa: ANN202 - tools/docs/reference.py, outside the package
    spec = importlib.util.spec_from_file_location("reference", ROOT / "tools" / "docs" / "reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _keys() -> list[tuple[str, str]]:
    """(dotted key, its help) of every declared option: the run's, every section's, every baseline's."""
    out = []
    for f, opt in options_of(RunConfig):
        hint = typing.get_type_hints(RunConfig)[f.name]
        if not dataclasses.is_dataclass(hint) and typing.get_origin(hint) is not dict:
            out.append((f.name, opt.help))
    for name, section in sections().items():
        out += [(f"{name}.{f.name}", opt.help) for f, opt in options_of(section)]
    for n in LEARNERS.names():
        options = getattr(LEARNERS.get(n), "Options", None)
        if isinstance(options, type) and dataclasses.is_dataclass(options):
            out += [(f"baseline.{f.name} ({n})", opt.help) for f, opt in options_of(options)]
    return out


def test_every_config_key_has_a_description() -> None:
    missing = [k for k, h in _keys() if not h.strip()]
    assert not missing, f"declare a help line for: {missing}"
    assert len(_keys()) > 100


def test_the_references_name_every_key_and_command(tmp_path: Path) -> None:
    ref = _reference()
    conf, cli = (p.read_text() for p in ref.write(tmp_path))
    for key, _ in _keys():
        assert f"`{key.split(' (')[0]}`" in conf, key
    for command in ("proteus run", "proteus learn", "proteus predict", "proteus kb verify", "proteus serve"):
        assert f"`{command}`" in cli, command


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site built as ``make docs`` builds it (strict: a warning fails), into a folder named
    ``site`` as the README says."""
    pytest.importorskip("mkdocs")
    import subprocess

    out = tmp_path_factory.mktemp("docs") / "site"
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.mark.slow
def test_the_site_builds_offline_without_warnings(site: Path) -> None:
    assert (site / "index.html").is_file() and (site / "api.html").is_file()


def _nav_pages() -> list[tuple[str, str]]:
    """(title, page) of every entry of mkdocs.yml's navigation, in order."""
    import yaml

    out: list[tuple[str, str]] = []

    def walk(items: list) -> None:
        for item in items:
            for title, value in item.items():
                walk(value) if isinstance(value, list) else out.append((title, value))

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return out


@pytest.mark.slow
def test_every_navigation_link_opens_its_page_from_the_file_system(site: Path, tmp_path: Path) -> None:
    """The README's way to read the docs, ``site/index.html`` opened in a browser from the file system: in a
    headless Chromium, each link of the navigation, clicked on the home page, lands on its page (its title,
    its heading), not on a folder's listing."""
    from browser import Browser, find_chromium

    if find_chromium() is None:
        pytest.skip("no Chromium installed (apt-get install chromium; or set $PROTEUS_CHROMIUM)")
    pages = _nav_pages()
    home = (site / "index.html").as_uri()
    link = ".md-nav--primary a.md-nav__link[href]:not([href*='#'])"  # the navigation's links to pages
    with Browser.start(tmp_path) as b:
        b.open(home)
        assert b.evaluate(f"document.querySelectorAll({link!r}).length") == len(pages)
        for i, (title, page) in enumerate(pages):
            b.open(home)
            href = b.click(link, i)
            want = "proteus" if page == "index.md" else f"{title} - proteus"
            landed = b.evaluate("[location.href, document.title, !!document.querySelector('article h1')]")
            assert landed == [(site / page).with_suffix(".html").as_uri(), want, True], (href, landed)


@pytest.mark.slow
def test_the_api_page_shows_no_rest_role(site: Path) -> None:
    """The Python API page renders the docstrings' cross-references (``:meth:`fit_task```,
    ``:class:`~proteus.config.RunConfig```) as names, not as the raw roles (tools/docs/griffe_roles.py)."""
    import html

    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "api.html").read_text()))
    assert "fit_task" in text and "RunConfig" in text
    raw = re.findall(r".{0,30}:(?:meth|class|func|data|attr|mod|exc|obj):.{0,30}", text)
    assert not raw and "~proteus" not in text, raw


def test_rest_roles_become_inline_code() -> None:
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    from griffe_roles import plain

    assert plain("see :class:`~proteus.config.RunConfig` and :meth:`fit_task`") == (
        "see `RunConfig` and `fit_task()`"
    )
    assert plain(":func:`proteus.config.validate_keys`, :mod:`proteus.report`") == (
        "`proteus.config.validate_keys()`, `proteus.report`"
    )


def test_user_docs_name_no_issue_numbers() -> None:
    """User docs speak of the software; what changed when goes to CHANGELOG.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    hits = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in GENERATED or path.name == "CHANGELOG.md":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{rel}:{n}: {m.group(0)}" for m in ISSUE_NUMBER.finditer(line)]
    assert not hits, "user docs name issues (history goes to CHANGELOG.md):\n" + "\n".join(hits)


def test_the_cli_reference_keeps_angle_brackets_visible() -> None:
    """A flag's help such as ``runs/<benchmark>-<method>-<time>`` reaches the reference as entities, not as
    HTML tags a renderer would drop (it rendered as ``runs/--``)."""
    page = _reference().cli_reference()
    assert "runs/&lt;benchmark&gt;-&lt;method&gt;-&lt;time&gt;" in page
    assert "runs/<benchmark>" not in page


def test_the_api_page_covers_what_the_readme_example_uses() -> None:
    """Every ``proteus`` name the README's Python example imports has an entry on docs/api.md."""
    readme = (ROOT / "README.md").read_text()
    api = (ROOT / "docs" / "api.md").read_text()
    names = set()
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        for _mod, imported in re.findall(r"^from (proteus[\w.]*) import (.+)$", block, re.M):
            names |= {n.strip() for n in imported.split(",")}
    assert names, "the README has no Python example importing from proteus"
    missing = [n for n in sorted(names) if not re.search(rf"^::: proteus\.[\w.]*\b{n}$", api, re.M)]
    assert not missing, f"docs/api.md lacks {missing}"


def test_install_lines_name_what_can_be_installed() -> None:
    """No page tells a reader to ``pip install`` the unpublished distribution name ``proteus-cl`` (the README
    and docs install from a checkout or from the wheel built from it)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in pages
        if p.relative_to(ROOT).as_posix() not in GENERATED
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"pip install\s+['\"]?proteus-cl\b", line)
    ]
    assert not hits, f"install lines naming the unpublished package: {hits}"
