"""The house's architecture as tests: the layering (no module imports a layer above it; the PROTEUS learner
and the baselines never import each other), the class budget, and the import cost of the core."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import proteus

SRC = Path(proteus.__file__).resolve().parent

#: rank of each top-level module or package: a module may import only ranks below its own (or its own
#: package). The package face (``__init__``: ``from proteus import Proteus, __version__``) is the top: no
#: module of the package may import it; ``_version`` is the bottom, importable from anywhere.
#: cli -> experiment -> report -> core, baselines (the learners) -> learners (their protocol) -> engine ->
#: config (schema, resolution: it gathers the options the parts declare) -> the parts (kb gathers the
#: tensor rules they declare) -> options, tensor_rules (how an option, a stored tensor is declared) ->
#: registry, errors
LAYERS = {
    "__init__": 11,
    "cli": 9, "__main__": 10, "serve": 9,
    "experiment": 8,
    "report": 7,
    "core": 6, "baselines": 6,
    "learners": 5,
    "engine": 4,
    "config": 3,
    "adapters": 2, "signatures": 2, "heads": 2, "kb": 2, "backbones": 2, "streams": 2, "metrics": 2,
    "distributed": 2, "devices": 2, "faults": 2, "images": 2, "progress": 2, "heap": 2,
    "options": 1, "tensor_rules": 1, "lazy": 0, "budgets": 0, "untrusted": 1, "collector": 0,
    "registry": 0, "errors": 0,
    "_version": -1,
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    """Top-level proteus modules imported anywhere in a file (including inside functions)."""
    return _imports_of(path.read_text())


def _imports_of(code: str) -> set[str]:
    """Top-level proteus modules imported anywhere in ``code``; importing a name of the package face
    (``from proteus import Proteus``, ``import proteus``) counts as ``__init__``, while
    ``from proteus import distributed`` imports the submodule."""
    out = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "proteus":
            parts = node.module.split(".")
            if len(parts) > 1:
                out.add(parts[1])
            else:  # from proteus import X: a submodule, or a name of the face
                out.update(a.name if a.name in LAYERS else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "proteus":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
    return out


def test_layering_sees_the_package_face() -> None:
    """``from proteus import __version__`` is an import of the face (the top layer); the version's own
    module and a submodule imported by name are not."""
    assert _imports_of("from proteus import __version__") == {"__init__"}
    assert _imports_of("import proteus") == {"__init__"}
    assert _imports_of("from proteus import distributed as dist, Proteus") == {"distributed", "__init__"}
    assert _imports_of("from proteus._version import __version__") == {"_version"}
    assert LAYERS["__init__"] == max(LAYERS.values()) and LAYERS["_version"] == min(LAYERS.values())


def test_no_module_imports_a_layer_above_it() -> None:
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel == Path("__init__.py"):
            continue  # the package's front door re-exports the estimator (lazily)
        top = rel.parts[0].removesuffix(".py")
        assert top in LAYERS, f"{rel}: add its layer to LAYERS"
        for imp in _imports(path):
            if imp != top and imp in LAYERS and LAYERS[imp] > LAYERS[top]:
                bad.append(f"{rel} imports proteus.{imp}")
    assert not bad, bad


#: the size budget of one class, in what a reader reads: its statements (docstrings, bare annotations,
#: comments and blank lines are not counted) and the methods defined in it (a property or a
#: cached property reads as an attribute and is not counted)
CLASS_MAX_STATEMENTS = 180
CLASS_MAX_METHODS = 30
#: classes allowed over the budget, each with the reason (remove an entry once its class fits again)
CLASS_BUDGET_EXCEPTIONS = {
    "heads/ranpac.py::RanPACHead": "one scikit-learn-style estimator: statistics, gamma selection, "
    "decision function and downdate over the same Gram matrices",
    "baselines/learner.py::ContinualClassifier": "the base of every trained baseline: the shared training "
    "loop in its phases and every hook a method may replace, most of them a statement or two",
}


def _is_text(node: ast.AST) -> bool:
    """A docstring, or a bare annotation (``x: int`` with no value)."""
    if isinstance(node, ast.AnnAssign):
        return node.value is None
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_property(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
        or (isinstance(d, ast.Attribute) and d.attr in ("cached_property", "setter"))
        for d in node.decorator_list
    )


def class_size(node: ast.ClassDef) -> tuple[int, int]:
    """(statements, methods) of a class: every statement inside it but its docstrings and bare
    annotations (the ``class`` statement itself not counted), and the functions defined in its body that
    are not properties."""
    statements = sum(isinstance(n, ast.stmt) and not _is_text(n) for n in ast.walk(node)) - 1
    methods = sum(
        isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_property(b) for b in node.body
    )
    return statements, methods


def _class_sizes() -> dict[str, tuple[int, int]]:
    """``{"path::Class": (statements, methods)}`` for every class in src/ (nested ones included)."""
    out = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(SRC).as_posix()}::{node.name}"] = class_size(node)
    return out


def test_the_size_budget_counts_statements_not_text() -> None:
    """A docstring, a comment, a bare annotation or a blank line does not move the budget; a statement
    does, and a property's statements count though the property is no method."""
    plain = "class A:\n    def f(self):\n        y = 1\n        return y\n"
    texty = (
        'class A:\n    """Doc."""\n    x: int  # note\n\n    def f(self) -> int:\n'
        '        """Doc."""\n        y = 1\n        return y\n'
    )
    prop = plain + "\n    @property\n    def p(self):\n        return 1\n"
    size = [class_size(ast.parse(code).body[0]) for code in (plain, texty, prop)]  # type: ignore[arg-type]
    assert size == [(3, 1), (3, 1), (5, 1)]


def test_classes_stay_within_their_size_budget() -> None:
    """No class over its statement or method budget unless named in :data:`CLASS_BUDGET_EXCEPTIONS` with
    its reason: the budget counts classes, not files, so nobody splits a class into mixins to pass it."""
    sizes = _class_sizes()
    over = {n for n, (st, m) in sizes.items() if st > CLASS_MAX_STATEMENTS or m > CLASS_MAX_METHODS}
    new = {name: sizes[name] for name in over - set(CLASS_BUDGET_EXCEPTIONS)}
    assert not new, f"over {CLASS_MAX_STATEMENTS} statements or {CLASS_MAX_METHODS} methods: {new}"
    stale = sorted(set(CLASS_BUDGET_EXCEPTIONS) - over)
    assert not stale, f"these classes fit the budget now (or are gone): remove their exceptions {stale}"


@pytest.mark.parametrize(
    "module, absent",
    [
        ("proteus.core", "proteus.baselines"),
        ("proteus.baselines", "proteus.core"),
        ("proteus.config", "proteus.engine"),
    ],
)
def test_a_learner_never_loads_the_other_family(module: str, absent: str) -> None:
    """``import proteus.core`` loads no baseline (and the reverse): each learner family declares its
    options and methods where it is defined, and only a lookup of the other's names discovers it."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith({absent!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (functions and ``TYPE_CHECKING`` included),
    a package's face (its ``__init__``) left out: it re-exports its submodules."""
    names = {}
    for path in SRC.rglob("*.py"):
        if path.name != "__init__.py":
            names[".".join(("proteus", *path.relative_to(SRC).with_suffix("").parts))] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    """No circle of imports between modules (a package's face aside), not even one the type checker alone
    follows: each circle found is named."""
    graph, circles = _module_graph(), []
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    assert len(graph) > 100 and not circles, circles


def test_core_and_baselines_never_import_each_other() -> None:
    """The two learner families share a floor and never import each other, not even inside a function
    (what they share, task-identity inference say, lives in the engine below both)."""
    crossing = [
        f"{path.relative_to(SRC)} imports proteus.{other}"
        for family, other in (("core", "baselines"), ("baselines", "core"))
        for path in sorted((SRC / family).rglob("*.py"))
        if other in _imports(path)
    ]
    assert LAYERS["core"] == LAYERS["baselines"] and not crossing, crossing


def _string_calls(path: Path) -> tuple[set[str], list[str]]:
    """(the registries ``path`` creates, ``Registry("kind")``; the registries its options name,
    ``option(..., choices="kind")``)."""
    made, named = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.value if isinstance(node.func, ast.Subscript) else node.func
        if isinstance(func, ast.Name) and func.id == "Registry" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                made.add(first.value)
        for kw in node.keywords:
            if kw.arg == "choices" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                named.append(kw.value.value)
    return made, named


def test_no_code_compares_a_strategy_setting_with_a_name() -> None:
    """A setting whose values are a registry's names (``f.get("signature.method") == "dpgmm"``) is asked
    about by its entry's traits (:meth:`proteus.registry.Registry.trait`), never compared with a name:
    a new entry then declares what it reads where it is registered."""
    kinds: set[str] = set()
    for path in SRC.rglob("*.py"):
        kinds |= _string_calls(path)[0]
    assert {"signature.method", "train.tasks"} <= kinds, "the test reads the wrong registries"
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = [
                side.args[0].value
                for side in sides
                if isinstance(side, ast.Call) and isinstance(side.func, ast.Attribute)
                and side.func.attr == "get" and side.args and isinstance(side.args[0], ast.Constant)
                and side.args[0].value in kinds
            ]  # fmt: skip
            literal = any(isinstance(side, ast.Constant) and isinstance(side.value, str) for side in sides)
            if named and literal:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} ({named[0]})")
    assert not found, f"settings compared with a registered name (declare a trait instead): {found}"


def test_every_option_names_a_registry_at_or_below_its_floor() -> None:
    """An option's ``choices="kind"`` names a registry the package creates, on the option's floor or below
    (so the option's module could import it): a strategy registry whose entries live above the option (the
    engine's detectors, keys, compositions) is created beside the option, and the engine registers into it
    (the registry's ``plugins``: :func:`test_a_registry_below_its_entries_finds_them_all`)."""
    floor_of: dict[str, str] = {}
    options: list[tuple[str, str]] = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        made, named = _string_calls(path)
        floor_of.update(dict.fromkeys(made, rel.parts[0].removesuffix(".py")))
        options += [(rel.as_posix(), kind) for kind in named]
    assert options, "no option declares its choices by a registry's name: the test reads the wrong thing"
    unknown = [(o, k) for o, k in options if k not in floor_of]
    assert not unknown, f"choices naming no registry the package creates: {unknown}"
    above = sorted(
        (o, k) for o, k in options if LAYERS[floor_of[k]] > LAYERS[o.split("/")[0].removesuffix(".py")]
    )
    assert not above, f"options naming a registry above their floor (create it beside them): {above}"


def test_a_registry_below_its_entries_finds_them_all() -> None:
    """A registry that names *plugins* (the modules whose import registers its entries, above it: the
    engine's strategies beside their options, the learners beside the methods) lists the same entries in a
    process that imported only the configuration as in one that imported every module of the package: its
    plugins name every module that registers into it."""
    import importlib
    import pkgutil

    from proteus.registry import Registry

    for mod in pkgutil.walk_packages(proteus.__path__, "proteus."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    everything = {kind: reg.loaded() for kind, reg in Registry._by_kind.items() if reg.plugins}
    assert len(everything) >= 9 and all(everything.values()), everything
    # each registry asked in a fork of one process that imported the configuration only (a registry's
    # discovery imports modules that fill others)
    out = subprocess.run([sys.executable, "-c", _ASK_EACH, *everything], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == everything


_ASK_EACH = """
import json, os, sys
import timm, torch, torchvision  # third-party imports done once, before the forks
import proteus.config
from proteus.registry import Registry
pipes = {}
for kind in sys.argv[1:]:
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, json.dumps(Registry.named(kind).names()).encode())
        os._exit(0)
    os.close(w)
    pipes[kind] = r
found = {}
for kind, r in pipes.items():
    with os.fdopen(r) as f:
        found[kind] = json.loads(f.read())
print(json.dumps(found))
"""
