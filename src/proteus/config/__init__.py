"""The configuration: its schema (:mod:`.schema`, gathering the sections their owners declare), typed
coercion (:mod:`.coerce`), the methods and learners (:mod:`.methods`) and resolution with validation
(:mod:`.resolve`). How a key is declared: :mod:`proteus.options`."""

from proteus.adapters.options import AdapterConfig
from proteus.backbones.options import BackboneConfig
from proteus.config.coercion import coerce, flatten, load_yaml, merge, typed_options
from proteus.config.methods import LEARNERS, METHODS, Method, apply_method, declare
from proteus.config.resolve import (
    CONFIG_KINDS,
    check_sections,
    config_file_keys,
    config_path,
    effective,
    learner_name,
    learner_of,
    packaged_config,
    packaged_configs,
    resolve_config,
    validate,
    validate_keys,
)
from proteus.config.schema import (
    CACHE_PREFIX,
    RUN_SECTIONS,
    EvalConfig,
    ReportConfig,
    RunConfig,
    TrainConfig,
    coerce_dotted,
    declaration,
    field_type,
    nest,
    parse_set,
    per_task,
    per_task_keys,
    sections,
)
from proteus.errors import ConfigError
from proteus.heads.options import HeadConfig
from proteus.signatures.options import RetrievalConfig, SignatureConfig
from proteus.streams.options import BenchmarkConfig

__all__ = [
    "CACHE_PREFIX", "CONFIG_KINDS", "LEARNERS", "METHODS", "RUN_SECTIONS", "AdapterConfig", "BackboneConfig",
    "BenchmarkConfig", "ConfigError", "EvalConfig", "HeadConfig", "Method", "ReportConfig", "RetrievalConfig",
    "RunConfig", "SignatureConfig", "TrainConfig", "apply_method", "check_sections", "coerce",
    "coerce_dotted", "config_file_keys", "config_path", "declaration", "declare", "field_type", "flatten",
    "learner_name", "learner_of",
    "load_yaml", "merge", "nest", "packaged_config", "packaged_configs", "parse_set", "per_task",
    "per_task_keys", "resolve_config", "sections", "typed_options", "validate", "validate_keys", "effective",
]  # fmt: skip
