"""Configuration resolution and validation: defaults < the benchmark's packaged config < the method <
``--config`` files < ``--set`` < explicit flags, then every value checked before any work starts.

Validation gathers the declarations (:mod:`proteus.options`): the run's own settings are checked here, and
the learner that runs the method checks the sections it reads (``check_config``, the PROTEUS learner its
backbone, adapter, train, signature, head and retrieval sections; a baseline its ``baseline.*`` options,
declared in its own module). A violation names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

from proteus.config.coercion import flatten, load_yaml, merge, typed_options
from proteus.config.methods import LEARNERS, METHODS, apply_method
from proteus.config.schema import RUN_SECTIONS, RunConfig, coerce_dotted, declaration, nest, parse_set
from proteus.errors import ConfigError
from proteus.options import check_section, check_value, options_of

__all__ = [
    "CONFIG_KINDS", "check_sections", "config_file_keys", "effective", "learner_of", "packaged_config",
    "packaged_configs", "resolve_config", "validate", "validate_keys",
]  # fmt: skip


def validate_keys(dotted: dict[str, Any]) -> dict[str, Any]:
    """Flat dotted keys (what a command line sets) checked on their own, before anything uses them:
    unknown keys and sections refused by name, values converted to their declared types
    (:func:`proteus.config.coercion.coerce_dotted`), then each against its declared choices and range (a
    baseline's options are checked by its learner, with the whole config). Returns the typed keys."""
    typed = coerce_dotted(dotted)
    for key, val in typed.items():
        check_value(key, val, declaration(key))
    return typed


def learner_name(cfg: RunConfig) -> str:
    """The registered name of the learner that runs ``cfg.method`` (a method unknown to this release runs
    on PROTEUS's)."""
    return METHODS.get(cfg.method).learner if cfg.method in METHODS else "proteus"


def learner_of(cfg: RunConfig) -> type[Any]:
    """The learner class that runs ``cfg.method`` (:func:`learner_name`)."""
    return LEARNERS.get(learner_name(cfg))


def effective(cfg: RunConfig) -> dict[str, Any]:
    """What runs, as flat dotted keys: every setting of ``cfg`` with the ``baseline.*`` options of its
    learner typed and complete (their declared defaults filled in; none for a learner without them)."""
    flat = flatten({k: v for k, v in cfg.to_dict().items() if k != "baseline"})
    options = getattr(learner_of(cfg), "Options", None)
    if isinstance(options, type) and dataclasses.is_dataclass(options):
        typed = dataclasses.asdict(typed_options(options, cfg.baseline, "baseline"))
        flat.update({f"baseline.{k}": v for k, v in typed.items()})
    return flat


def check_sections(cfg: RunConfig, names: tuple[str, ...]) -> None:
    """Check the sections ``names`` of ``cfg`` by their declarations (a learner's ``check_config`` calls it
    with the sections it reads)."""
    for name in names:
        check_section(f"{name}.", getattr(cfg, name))


def validate(cfg: RunConfig) -> None:
    """Check the run's settings by their declarations, then let the method's learner check its own."""
    for f, opt in options_of(RunConfig):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value) and not isinstance(value, dict):
            check_value(f.name, value, opt)
    check_sections(cfg, RUN_SECTIONS)
    check = getattr(learner_of(cfg), "check_config", None)  # (a learner without options of its own has none)
    if check is not None:
        check(cfg)


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
