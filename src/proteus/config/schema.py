"""The run configuration: one dataclass tree, resolved from defaults < the benchmark's preset < the method
< ``--config`` files < ``--set`` (:mod:`proteus.config.resolve`).

Its sections live with their owners and declare their keys there (:func:`proteus.options.option`: help,
range, choices, per-task, legacy value): ``backbone`` (:mod:`proteus.backbones.options`), ``adapter``
(:mod:`proteus.adapters.options`), ``signature`` and ``retrieval`` (:mod:`proteus.signatures.options`),
``head`` (:mod:`proteus.heads.options`), ``benchmark`` (:mod:`proteus.streams.options`). This module holds
the run's own settings -- method, seed, device, precision, compile, ``eval``, ``report`` -- and ``train``,
which every learner reads. ``baseline`` is an open section: each baseline declares its own options
(:attr:`proteus.baselines.ContinualClassifier.Options`), which type and check it.

Every hyper-parameter of the paper has the paper's default (Appendix "Datasets, Hyperparameters, and
Pre-Trained Models"): LoRA rank r, lambda = 0.006 decayed by 20% per task, alpha = 0.8, learning rate and
batch size per benchmark, the DP-GMM truncation T, RanPAC's head.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from proteus.adapters.options import AdapterConfig
from proteus.backbones.options import BackboneConfig
from proteus.config import coercion
from proteus.config.coercion import field_of, flatten, merge
from proteus.devices import COMPILE_MODES, PRECISIONS
from proteus.heads.options import HeadConfig
from proteus.options import AT_LEAST_1, NO_LEGACY, NON_NEGATIVE, POSITIVE, Interval, OptionInfo, info, option
from proteus.registry import Registry
from proteus.signatures.options import RetrievalConfig, SignatureConfig
from proteus.streams.options import BenchmarkConfig

__all__ = [
    "CACHE_PREFIX", "RUN_SECTIONS", "TRAIN_SCHEDULES", "EvalConfig", "ReportConfig", "RunConfig",
    "TrainConfig", "coerce_dotted", "declaration", "field_type", "nest", "parse_set", "per_task",
    "per_task_keys", "sections",
]  # fmt: skip

#: ``train.cache_prefix`` -> whether the prefix outputs are cached (only without augmentation); "auto" is
#: kept for configs written before it meant the same as "true"
CACHE_PREFIX = {"auto": True, "true": True, "false": False}

#: ``train.tasks``: which tasks train an adapter (:data:`proteus.engine.compositions.TRAIN_SCHEDULES`, which
#: registers them: created here, beside the option that names it)
TRAIN_SCHEDULES: Registry[Any] = Registry("train.tasks", plugins=("proteus.engine.compositions",))


@dataclass
class TrainConfig:
    """How each task trains (PROTEUS's adapter and every baseline's own parameters)."""

    epochs: int = option(3, help="epochs per task", range=AT_LEAST_1, per_task=True)
    batch_size: int = option(32, help="training batch size", range=AT_LEAST_1, per_task=True)
    lr: float = option(1e-3, help="the adapter's learning rate (Adam)", range=POSITIVE, per_task=True)
    weight_decay: float = option(0.0, help="the optimiser's weight decay", range=NON_NEGATIVE)
    tasks: str = option(
        "all",
        help="which tasks train an adapter: all, first (RanPAC) or none (the frozen backbone)",
        choices="train.tasks",
    )
    augment: bool = option(False, help="random crops and flips of the training images")
    cache_prefix: str = option(
        "auto",
        help="cache the frozen prefix's outputs once per image (only without augmentation): auto (= true), "
        "true, false",
        choices=CACHE_PREFIX,
    )
    num_workers: int = option(0, help="data-loading worker processes", range=NON_NEGATIVE, per_task=True)


@dataclass
class EvalConfig:
    """How evaluation and prediction run (they change no result)."""

    batch_size: int = option(64, help="inference batch size", range=AT_LEAST_1, per_task=True)
    max_image_pixels: int = option(
        64_000_000,
        help="images above this many pixels are refused before they are decoded (predict --max-pixels)",
        range=AT_LEAST_1,
        per_task=True,
    )
    merge_budget_mb: float | None = option(
        1024.0,
        help="MB of merged adapter weights kept for prediction (least recently used out first; the rest run "
        "factored, the same result to float round-off); null: no limit",
        range=Interval(0, 2**40),  # a finite number of bytes
        per_task=True,
    )


@dataclass
class ReportConfig:
    """What ``proteus run`` writes besides results.json: theory checks, figures, report.md, latency."""

    theory: bool = option(
        True,
        help="Sec. 3.2's checks (delta, kappa, sigma^2, Thm. 3.5's bound, Thm. 3.6's minimum delta)",
        per_task=True,
    )
    figures: bool = option(True, help="figures and report.md in the run directory", per_task=True)
    latency: bool = option(
        True, help="time predict with the first m adapters (App. 'Complexity of PROTEUS Inference')",
        per_task=True,
    )  # fmt: skip
    latency_batch: int = option(32, help="the latency's batch size", range=AT_LEAST_1, per_task=True)
    latency_points: int = option(
        10, help="m values timed (evenly spaced in 1..tasks, both ends included)", range=AT_LEAST_1,
        per_task=True,
    )  # fmt: skip
    latency_m: list[int] | None = option(
        None,
        help="the m values timed, as a list (those above the tasks learned are left out); null: "
        "latency_points evenly spaced",
        per_task=True,
    )
    latency_repeats: int = option(
        3, help="timed repetitions per m after a warm-up (the median is reported)", range=AT_LEAST_1,
        per_task=True,
    )  # fmt: skip
    tracking: str = option(
        "none",
        help="experiment tracking besides the CSVs: comma-separated sinks, tensorboard and wandb, or none "
        "(--track)",
        per_task=True,
    )


@dataclass
class RunConfig:
    method: str = option("proteus", help="the method (proteus list methods)")
    seed: int = option(
        0, help="the run's seed (class order aside: benchmark.class_order_seed)", range=NON_NEGATIVE
    )
    device: str = option("auto", help="auto, cpu, cuda or cuda:N", per_task=True)
    precision: str = option(
        "auto",
        help="the backbone's forward passes: auto (bfloat16 autocast on CUDA, float32 elsewhere), bf16, fp32",
        choices=tuple(PRECISIONS),
        per_task=True,
    )
    compile: str = option(
        "none",
        help="torch.compile of the backbone's inference forwards: none, default, reduce-overhead, "
        "max-autotune (the same results to float round-off)",
        choices=COMPILE_MODES,
        per_task=True,
    )
    threads: int | None = option(
        None,
        help="CPU threads of the command line's torch operations (--threads); null: as many as the cores "
        "the process may use (its CPU affinity, within a cgroup quota), unless OMP_NUM_THREADS is set",
        range=AT_LEAST_1,
        per_task=True,
    )
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    #: a baseline's own options (``baseline.lr``, ``baseline.rank`` ...), declared by its learner
    baseline: dict[str, Any] = field(default_factory=dict)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    # ------------------------------------------------------------------ conversion
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        cfg = cls()
        merge(cfg, data, where="config")
        return cfg

    def with_values(self, dotted: dict[str, Any]) -> RunConfig:
        """A copy with the dotted keys (``{"train.epochs": 5}``) set, each coerced to its field's type as
        ``--set`` does (unknown keys refused by name); this config is left as it is."""
        out = copy.deepcopy(self)
        merge(out, nest(dotted), where="config")
        return out

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> RunConfig:
        """A config written by a run or a knowledge base, possibly by an earlier release: a key it lacks
        takes its declared ``legacy`` value (what that release did), not today's default, so an old
        knowledge base keeps its recipe for the tasks it learns next."""
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for name, section in sections().items():
            if not isinstance(data.get(name), dict):
                continue
            for f in dataclasses.fields(section):
                legacy = info(f).legacy
                if legacy is not NO_LEGACY and f.name not in data[name]:
                    data[name][f.name] = legacy
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def task_settings(self) -> dict[str, Any]:
        """What a task's record keeps of how it was learned: the keys that may change per task but the
        device (the learner records the one it resolved), ``compile`` and ``threads`` (how fast, not what),
        the data's location and the report."""
        flat = flatten(self.to_dict())
        skip = ("device", "compile", "threads", "report.", "benchmark.")
        return {k: v for k, v in flat.items() if per_task(k) and not k.startswith(skip)}


#: the sections of the run's own settings (the rest are the learners': each reads those it declares)
RUN_SECTIONS = ("benchmark", "eval", "report")


def sections() -> dict[str, type]:
    """Every section of :class:`RunConfig` with a schema (the open ``baseline`` aside), by name."""
    hints = typing.get_type_hints(RunConfig)
    return {n: h for n, h in hints.items() if isinstance(h, type) and dataclasses.is_dataclass(h)}


def field_type(key: str) -> Any:
    """The declared type of a dotted config key (``"train.epochs"`` -> ``int``); unknown keys refused."""
    return field_of(RunConfig, key)[0]


def declaration(key: str) -> OptionInfo:
    """What the field of a dotted config key declares (help, range, choices, per-task, legacy)."""
    f = field_of(RunConfig, key)[1]
    return info(f) if f is not None else OptionInfo(help="a baseline's option (its learner declares it)")


def per_task(key: str) -> bool:
    """Whether a dotted config key may change between tasks (its field's ``per_task``); every other key
    defines the model and is fixed when a knowledge base is created."""
    try:
        return declaration(key).per_task
    except Exception:  # an unknown key is no per-task key (callers report it by name)
        return False


def per_task_keys() -> tuple[str, ...]:
    """Every per-task key, dotted."""
    return tuple(k for k in flatten(RunConfig().to_dict()) if per_task(k))


def coerce_dotted(dotted: dict[str, Any]) -> dict[str, Any]:
    """Flat dotted keys checked against :class:`RunConfig` and converted to their declared types."""
    return coercion.coerce_dotted(RunConfig, dotted)


def nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """``{"train.epochs": 1}`` -> ``{"train": {"epochs": 1}}``, checked and converted."""
    return coercion.nest(RunConfig, dotted)


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` arguments as a nested dict, checked against :class:`RunConfig` and converted."""
    return coercion.parse_set(RunConfig, items)
