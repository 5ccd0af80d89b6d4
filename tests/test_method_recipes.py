"""Every method's resolved recipe is held in ``method_recipes.json``: a change to a default, a base or a
declaration that moves what a method runs fails here until the recording is renewed on purpose
(``python tests/test_method_recipes.py --write``), so an ablation never silently stops ablating what it
names (an ablation of the paper derives from ``proteus-paper``, not from whatever ``proteus`` is today)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from proteus.config import METHODS, RunConfig, apply_method, effective, flatten

RECORDING = Path(__file__).with_name("method_recipes.json")


def recipe(name: str) -> dict[str, Any]:
    """What method ``name`` runs: its declaration (base, own overrides) and every key of the resolved
    config that differs from the defaults."""
    m = METHODS.get(name)
    cfg = apply_method(RunConfig(), name)
    default = effective(RunConfig(method=name))
    resolved = {k: v for k, v in effective(cfg).items() if default.get(k) != v and k != "method"}
    return {"base": m.base, "learner": m.learner, "overrides": m.overrides, "resolved": resolved}


def recipes() -> dict[str, dict[str, Any]]:
    return {n: json.loads(json.dumps(recipe(n))) for n in METHODS.names()}


@pytest.mark.parametrize("name", METHODS.names())
def test_a_methods_recipe_changes_only_with_its_declaration(name: str) -> None:
    held = json.loads(RECORDING.read_text())
    assert name in held, f"{name}: a new method; record it: python tests/test_method_recipes.py --write"
    now = recipe(name)
    now = json.loads(json.dumps(now))
    was = held[name]
    if now == was:
        return
    own = {k: now[k] for k in ("base", "learner", "overrides")} == {
        k: was[k] for k in ("base", "learner", "overrides")
    }
    moved = sorted(
        k
        for k in set(now["resolved"]) | set(was["resolved"])
        if now["resolved"].get(k) != was["resolved"].get(k)
    )
    why = (
        "its declaration did not change, so a default or a base it derives from did"
        if own
        else "its declaration changed"
    )
    pytest.fail(
        f"method {name}: what it runs changed ({', '.join(moved) or 'declaration'}): {why}. If meant, "
        "renew the recording: python tests/test_method_recipes.py --write"
    )


#: the ablations of the paper's tables (S, lambda, the signature, top-K, the LoRA position, the rank budget)
PAPER_ABLATIONS = (
    "proteus-s0", "proteus-si", "proteus-lambda0", "proteus-kmeans", "proteus-top3", "proteus-top5",
    "proteus-all-units", "last-lora", "proteus-budget",
)  # fmt: skip


@pytest.mark.parametrize("name", PAPER_ABLATIONS)
def test_the_papers_ablations_ablate_the_paper(name: str) -> None:
    """Each ablation changes the paper's recipe (it derives from ``proteus-paper``, directly or not) and
    keeps every key of it that it does not name itself."""
    m = METHODS.get(name)
    assert "proteus-paper" in [b.name for b in m.chain()]
    paper = flatten(apply_method(RunConfig(), "proteus-paper").to_dict())
    mine = flatten(apply_method(RunConfig(), name).to_dict())
    assert {k for k in paper if paper[k] != mine[k]} <= set(m.overrides) | {"method"}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    RECORDING.write_text(json.dumps(recipes(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(recipes())} recipes to {RECORDING}")
