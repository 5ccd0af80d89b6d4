"""Experiments around the estimator: configuration presets, the shared continual loop, evaluation, the
knowledge-base glue, results.json and ``proteus compare``.

    from proteus.experiment import resolve_config, run
    cfg = resolve_config("quickstart", method="proteus", sets=["train.epochs=1"])
    results = run(cfg, "runs/mine")
"""

from proteus.config import resolve_config, validate
from proteus.experiment.evaluate import Evaluation, Evaluator
from proteus.experiment.loop import learn_and_commit, run
from proteus.experiment.results import build_results, format_table
from proteus.experiment.store import check_split, kb_header

__all__ = [
    "Evaluation",
    "Evaluator",
    "build_results",
    "check_split",
    "format_table",
    "kb_header",
    "learn_and_commit",
    "resolve_config",
    "run",
    "validate",
]
