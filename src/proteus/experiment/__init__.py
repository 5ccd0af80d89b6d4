"""Experiments around the learners: the shared continual loop, evaluation, prediction over image files, the
knowledge-base glue, results.json, ``proteus compare`` and ``proteus reproduce``.

    from proteus.experiment import resolve_config, run
    cfg = resolve_config("quickstart", method="proteus", sets=["train.epochs=1"])
    results = run(cfg, "runs/mine")
"""

from proteus.config import resolve_config, validate
from proteus.lazy import exports

__all__ = [
    "Evaluation", "Evaluator", "build_results", "check_split", "format_table", "kb_header",
    "learn_and_commit", "resolve_config", "run", "validate",
]  # fmt: skip

__getattr__, __dir__ = exports(
    __name__,
    {
        "Evaluation": "evaluate",
        "Evaluator": "evaluate",
        "learn_and_commit": "loop",
        "run": "loop",
        "build_results": "results",
        "format_table": "results",
        "check_split": "store",
        "kb_header": "store",
    },
)
