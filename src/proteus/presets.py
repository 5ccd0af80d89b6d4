"""Configuration resolution and validation: defaults < the benchmark's packaged config < the method <
``--config`` files < ``--set`` < explicit flags, then every value checked before any work starts.

The allowed values of each variant key come from the registry that resolves it (one declaration:
adding a strategy to a registry makes it a valid value); numeric keys have declared ranges
(:data:`RANGES`). A violation names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import proteus.baselines  # noqa: F401 - the baselines' learners and the methods they declare
from proteus.adapters.lora import TRANSFER_INIT
from proteus.baselines.learner import OPTIMIZERS, SCHEDULES
from proteus.config import (
    CACHE_PREFIX,
    ConfigError,
    RunConfig,
    coerce_dotted,
    flatten,
    load_yaml,
    merge,
    nest,
    parse_set,
)
from proteus.devices import COMPILE_MODES, PRECISIONS
from proteus.engine.compositions import COMPOSITIONS, TRAIN_SCHEDULES
from proteus.engine.experts import COMBINATIONS, HEAD_SCOPES
from proteus.engine.keys import KEYS, TASK_SCORES
from proteus.engine.keys.space import SPACES
from proteus.engine.novelty import NOVELTY
from proteus.engine.trainer import S_UPDATES
from proteus.heads import GAMMA_SELECTIONS, PROTOTYPES
from proteus.methods import METHODS, apply_method
from proteus.signatures.signature import CHOICES as SIGNATURE_CHOICES
from proteus.streams.splits import SPLITS

__all__ = [
    "CHOICES", "METHODS", "RANGES", "Interval", "config_file_keys", "packaged_config", "resolve_config",
    "validate", "validate_keys",
]  # fmt: skip

#: key -> allowed values (a registry or a tuple)
CHOICES: dict[str, Collection[str]] = {
    "precision": tuple(PRECISIONS),
    "compile": COMPILE_MODES,
    "adapter.transfer": tuple(TRANSFER_INIT),
    "adapter.s_update": S_UPDATES,
    "train.tasks": TRAIN_SCHEDULES,
    "train.cache_prefix": tuple(CACHE_PREFIX),
    "retrieval.candidate_space": SPACES,
    "retrieval.combine": COMBINATIONS,
    "head.scope": HEAD_SCOPES,
    "retrieval.mode": COMPOSITIONS,
    "retrieval.novelty": NOVELTY,
    "benchmark.split": SPLITS,
    "signature.keys": KEYS,
    "signature.task_score": TASK_SCORES,
    "head.gamma_selection": GAMMA_SELECTIONS,
    "head.prototypes": PROTOTYPES,
    "baseline.optimizer": OPTIMIZERS,
    "baseline.schedule": SCHEDULES,
    **{f"signature.{k}": v for k, v in SIGNATURE_CHOICES.items()},
}


@dataclass(frozen=True)
class Interval:
    """An allowed range: ``low`` / ``high`` bounds (None: open), ``closed`` says which ends are included."""

    low: float | None = None
    high: float | None = None
    closed: str = "both"  # "both", "left", "right", "neither"

    def contains(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        lo_ok = self.low is None or (v >= self.low if self.closed in ("both", "left") else v > self.low)
        hi_ok = self.high is None or (v <= self.high if self.closed in ("both", "right") else v < self.high)
        return lo_ok and hi_ok

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        left = "[" if self.closed in ("both", "left") and self.low is not None else "("
        right = "]" if self.closed in ("both", "right") and self.high is not None else ")"
        return f"{left}{lo}, {hi}{right}"


POSITIVE = Interval(0, None, "neither")
AT_LEAST_1 = Interval(1, None)
NON_NEGATIVE = Interval(0, None)
UNIT = Interval(0, 1)

#: key -> allowed range (None values are allowed where the field's default is None)
RANGES: dict[str, Interval] = {
    "seed": NON_NEGATIVE,
    "adapter.rank": AT_LEAST_1,
    "adapter.scaling": Interval(None, None),
    "adapter.lam": NON_NEGATIVE,
    "adapter.lam_decay": Interval(0, 1, "right"),
    "adapter.alpha": UNIT,
    "adapter.s_lr": POSITIVE,
    "adapter.budget_decay": NON_NEGATIVE,
    "adapter.min_rank": AT_LEAST_1,
    "train.epochs": AT_LEAST_1,
    "baseline.lr": POSITIVE,
    "baseline.clip_grad": POSITIVE,
    "baseline.rank": AT_LEAST_1,
    "baseline.gpm_start": UNIT,
    "baseline.pool_size": AT_LEAST_1,
    "baseline.prompt_length": AT_LEAST_1,
    "baseline.top_k": AT_LEAST_1,
    "baseline.g_length": AT_LEAST_1,
    "baseline.match_weight": NON_NEGATIVE,
    "baseline.ortho_weight": NON_NEGATIVE,
    "baseline.max_tasks": AT_LEAST_1,
    "baseline.prompt_momentum": UNIT,
    "baseline.tii_epochs": NON_NEGATIVE,
    "baseline.tii_lr": POSITIVE,
    "baseline.tii_ca_lr": POSITIVE,
    "baseline.ca_lr": POSITIVE,
    "baseline.ca_epochs": NON_NEGATIVE,
    "baseline.n_centroids": AT_LEAST_1,
    "train.batch_size": AT_LEAST_1,
    "train.lr": POSITIVE,
    "train.weight_decay": NON_NEGATIVE,
    "train.num_workers": NON_NEGATIVE,
    "signature.max_components": AT_LEAST_1,
    "signature.rank": AT_LEAST_1,
    "signature.max_iter": AT_LEAST_1,
    "signature.tol": POSITIVE,
    "signature.reg_covar": NON_NEGATIVE,
    "signature.class_temperature": POSITIVE,
    "head.rp_dim": NON_NEGATIVE,
    "head.holdout": Interval(0, 1, "neither"),
    "retrieval.top_k": AT_LEAST_1,
    "retrieval.candidates": AT_LEAST_1,
    "retrieval.soft_top": AT_LEAST_1,
    "retrieval.key_temperature": POSITIVE,
    "retrieval.head_temperature": POSITIVE,
    "retrieval.calibration_holdout": Interval(0, 0.5, "neither"),
    "retrieval.reject_tpr": Interval(0, 1, "right"),
    "benchmark.num_tasks": AT_LEAST_1,
    "benchmark.max_train_per_class": AT_LEAST_1,
    "eval.batch_size": AT_LEAST_1,
    "eval.max_image_pixels": AT_LEAST_1,
    "eval.merge_budget_mb": NON_NEGATIVE,
    "backbone.img_size": Interval(8, None),
    "backbone.adapt_last": AT_LEAST_1,
    "report.latency_batch": AT_LEAST_1,
    "report.latency_points": AT_LEAST_1,
    "report.latency_repeats": AT_LEAST_1,
}


def _get(cfg: RunConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_value(key: str, val: Any) -> None:
    """One key's value (already of its declared type) against its registry (:data:`CHOICES`) and its range
    (:data:`RANGES`; None passes: the type allows it only where the field is optional)."""
    ok = CHOICES.get(key)
    if ok is not None and val not in ok:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, ok))}; got {val!r}")
    rng = RANGES.get(key)
    if rng is None or val is None:
        return
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not rng.contains(float(val)):
        raise ConfigError(f"{key} must be a number in {rng}; got {val!r}")


def validate_keys(dotted: dict[str, Any]) -> dict[str, Any]:
    """Flat dotted keys (what a command line sets) checked on their own, before anything uses them:
    unknown keys and sections refused by name, values converted to their declared types
    (:func:`proteus.config.coerce_dotted`), then each against its registry and range. Returns the typed
    keys."""
    typed = coerce_dotted(dotted)
    for key, val in typed.items():
        check_value(key, val)
    return typed


def validate(cfg: RunConfig) -> None:
    """Check every variant key against its registry and every numeric key against its range."""
    for key in (*CHOICES, *(k for k in RANGES if k not in CHOICES)):
        check_value(key, _get(cfg, key))
    if cfg.retrieval.mode != "signature" and (cfg.head.scope, cfg.retrieval.combine) != ("global", "hard"):
        raise ConfigError(
            f"head.scope={cfg.head.scope} and retrieval.combine={cfg.retrieval.combine} need task retrieval, "
            f"but retrieval.mode={cfg.retrieval.mode}; add --set head.scope=global "
            "--set retrieval.combine=hard"
        )
    if cfg.retrieval.combine == "soft" and not KEYS.get(cfg.signature.keys).one_space:
        one_space = [n for n in KEYS if KEYS.get(n).one_space]
        raise ConfigError(
            f"retrieval.combine=soft needs task keys in one space ({', '.join(one_space)}); got "
            f"signature.keys={cfg.signature.keys}; add --set retrieval.combine=hard (the paper's Gaussian "
            "keys: --method proteus-dpgmm)"
        )
    if cfg.head.gamma_max_exp <= cfg.head.gamma_min_exp:
        raise ConfigError(
            f"head.gamma_max_exp ({cfg.head.gamma_max_exp}) must be above head.gamma_min_exp "
            f"({cfg.head.gamma_min_exp})"
        )


#: the key of a config file that holds settings for named benchmarks only
PER_BENCHMARK = "benchmarks"


def config_path(name: str) -> Path:
    """A ``--config`` argument's file: the path if it is a file, else the packaged config of that name."""
    path = Path(name)
    if not path.is_file() and packaged_config(name) is not None:
        return packaged_config(name)  # type: ignore[return-value]
    return path


def _file_sections(data: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config file's settings and its ``benchmarks: {NAME: {...}}`` sections."""
    data = dict(data)
    per = data.pop(PER_BENCHMARK, None) or {}
    if not isinstance(per, dict) or not all(isinstance(v, dict) for v in per.values()):
        raise ConfigError(f"{where}: '{PER_BENCHMARK}' must map benchmark names to config sections")
    return data, per


def merge_config_file(cfg: RunConfig, data: dict[str, Any], where: str) -> None:
    """Merge a ``--config`` file; its ``benchmarks: {NAME: {...}}`` section applies only to benchmark NAME
    (``mobilenet_cpu`` caps the training images of the multi-domain streams, not of CIFAR-10). An error
    names the file."""
    data, per = _file_sections(data, where)
    try:
        merge(cfg, data)
        if cfg.benchmark.name in per:
            merge(cfg, per[cfg.benchmark.name], where="config")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def config_file_keys(name: str, benchmark: str | None) -> dict[str, Any]:
    """The flat dotted keys that the ``--config`` file ``name`` sets for ``benchmark`` (its per-benchmark
    section included), checked by :func:`validate_keys` (an error names the file)."""
    path = config_path(name)
    data, per = _file_sections(load_yaml(path), str(path))
    sections = {k for k, v in vars(RunConfig()).items() if dataclasses.is_dataclass(v)}
    data = {k: ({} if v is None and k in sections else v) for k, v in data.items()}  # an empty section
    flat = flatten(data)
    bench = flat.get("benchmark.name", benchmark)
    if bench in per:
        flat.update(flatten(per[bench]))
    try:
        return validate_keys(flat)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


#: the folders of the packaged configs, by kind: a benchmark's preset (loaded by ``--benchmark NAME``), a
#: method's released setting on a benchmark (``--config inflora-cifar100``), a machine's (``--config
#: mobilenet_cpu``)
CONFIG_KINDS = ("benchmarks", "methods", "hardware")


def packaged_configs(kind: str | None = None) -> dict[str, Path]:
    """Every packaged config (of one :data:`CONFIG_KINDS` kind), by name."""
    out: dict[str, Path] = {}
    for k in CONFIG_KINDS if kind is None else (kind,):
        folder = resources.files("proteus") / "configs" / k
        for p in sorted(folder.iterdir(), key=lambda p: p.name):
            if p.name.endswith(".yaml"):
                out[p.name[: -len(".yaml")]] = Path(str(p))
    return out


def packaged_config(name: str, kind: str | None = None) -> Path | None:
    """The packaged config ``name`` (of one :data:`CONFIG_KINDS` kind), or None."""
    for k in CONFIG_KINDS if kind is None else (kind,):
        p = resources.files("proteus") / "configs" / k / f"{name}.yaml"
        if p.is_file():
            return Path(str(p))
    return None


def resolve_config(
    benchmark: str | None = None,
    method: str = "proteus",
    config_files: list[str] | None = None,
    sets: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    dotted: dict[str, Any] | None = None,
) -> RunConfig:
    """defaults < the benchmark's packaged config < method < --config files < --set < explicit flags
    (``overrides`` nested, ``dotted`` with dotted keys), validated."""
    cfg = RunConfig()
    if benchmark:
        cfg.benchmark.name = benchmark
        bench_file = packaged_config(benchmark, "benchmarks")
        if bench_file:
            merge_config_file(cfg, load_yaml(bench_file), str(bench_file))
    apply_method(cfg, method)
    for f in config_files or []:
        path = config_path(f)
        merge_config_file(cfg, load_yaml(path), str(path))
    if sets:
        merge(cfg, parse_set(sets))
    if overrides:
        merge(cfg, overrides)
    if dotted:
        merge(cfg, nest(dotted))
    validate(cfg)
    return cfg
