"""The house's architecture as tests: the layering (no module imports a layer above it; the PROTEUS learner
and the baselines never import each other), the class budget, and the import cost of the core."""

from __future__ import annotations

import ast
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


#: the size budget of one class: lines of its ``class`` statement (the AST span) and methods defined in it
CLASS_MAX_LINES = 250
CLASS_MAX_METHODS = 30
#: classes allowed over the budget, each with the reason (remove an entry once its class fits again)
CLASS_BUDGET_EXCEPTIONS = {
    "heads/ranpac.py::RanPACHead": "one scikit-learn-style estimator: statistics, gamma selection, "
    "decision function and downdate over the same Gram matrices",
    "core/estimator.py::Proteus": "the scikit-learn-style estimator; its fitted attributes (set from its "
    "parts by name) are declared in the class for the type checker",
}


def _class_sizes() -> dict[str, tuple[int, int]]:
    """``{"path::Class": (lines, methods)}`` for every class in src/ (nested ones included)."""
    out = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                name = f"{path.relative_to(SRC).as_posix()}::{node.name}"
                out[name] = (node.end_lineno - node.lineno + 1, methods)
    return out


def test_classes_stay_within_their_size_budget() -> None:
    """No class over ~250 lines or ~30 methods unless named in :data:`CLASS_BUDGET_EXCEPTIONS` with its
    reason: the budget counts classes, not files, so nobody splits a class into mixins to pass it."""
    sizes = _class_sizes()
    over = {name for name, (n, m) in sizes.items() if n > CLASS_MAX_LINES or m > CLASS_MAX_METHODS}
    new = {name: sizes[name] for name in over - set(CLASS_BUDGET_EXCEPTIONS)}
    assert not new, f"over {CLASS_MAX_LINES} lines or {CLASS_MAX_METHODS} methods (lines, methods): {new}"
    stale = sorted(set(CLASS_BUDGET_EXCEPTIONS) - over)
    assert not stale, f"these classes fit the budget now (or are gone): remove their exceptions {stale}"


def test_core_and_baselines_never_import_each_other() -> None:
    """The two learner families share one floor (:data:`LAYERS`), so the layering test cannot see an arrow
    between them: what both need (task-identity inference, the protocol) lives below them, in ``engine`` or
    ``learners``. Imports inside functions count."""
    bad = []
    for family, other in (("core", "baselines"), ("baselines", "core")):
        for path in (SRC / family).rglob("*.py"):
            if other in _imports(path):
                bad.append(f"{path.relative_to(SRC)} imports proteus.{other}")
    assert not bad, bad


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
