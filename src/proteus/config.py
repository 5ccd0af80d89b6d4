"""Run configuration: one dataclass tree, resolved from defaults < method < benchmark file < --config < --set.

Every hyper-parameter of the paper lives here with the paper's default (Appendix "Datasets,
Hyperparameters, and Pre-Trained Models"): LoRA rank r, lambda = 0.006 decayed by 20% per task,
alpha = 0.8, learning rate and batch size per benchmark, the DP-GMM truncation T, RanPAC's head.

Every value that enters the tree -- a ``--set``, a ``--config`` file, a method's overrides, the API's dotted
keys, a stored config -- is checked once against the schema here: the key must exist
(:func:`field_type`) and the value is converted to the type the field declares (:func:`coerce`; the rules
are in its docstring), so ``1e-3`` is a float for a float key, ``2.5`` is refused for an integer one and
``1`` for a boolean one. Registries and ranges are checked after, by :mod:`proteus.presets`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proteus.errors import ProteusError
from proteus.untrusted import load_yaml as untrusted_yaml
from proteus.untrusted import read_regular_text, yaml_has_tag


@dataclass
class BackboneConfig:
    name: str = "mobilenet_v2"
    #: local weights file (.safetensors, or .pth read with weights_only=True); None = the registry's source
    weights: str | None = None
    #: False builds random weights (timing and tests only)
    pretrained: bool = True
    #: input resolution override (None = the backbone's data config)
    img_size: int | None = None
    #: adapt only the last L blocks; the frozen prefix is computed once for all tasks (None = all blocks)
    adapt_last: int | None = None


@dataclass
class AdapterConfig:
    """Eq. 9 and Eq. 15: old frozen rank-1 directions mixed by S, plus r new orthogonal ones."""

    enabled: bool = True
    rank: int = 4
    scaling: float = 1.0
    #: how old directions enter a new task: "learned" (S*, Eq. 15), "zero" (S = 0), "identity" (S = I)
    transfer: str = "learned"
    #: keep new A in the orthogonal complement of the old A's span (guarantees Eq. 15's constraint)
    orthogonal: bool = True
    lam: float = 0.006
    lam_decay: float = 0.8
    alpha: float = 0.8
    #: "prox": proximal (soft-threshold) SGD step for S; "adam": S trained with the LoRA optimiser
    s_update: str = "prox"
    s_lr: float = 0.05
    #: budget-constrained schedule r_m = round(r_0 exp(-budget_decay (m - 1))) (None = fixed rank)
    budget_decay: float | None = None
    min_rank: int = 1


#: ``train.cache_prefix`` -> whether the prefix outputs are cached (only without augmentation); "auto" is
#: kept for configs written before it meant the same as "true"
CACHE_PREFIX = {"auto": True, "true": True, "false": False}


@dataclass
class TrainConfig:
    epochs: int = 3
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    #: "all": every task trains its adapter; "first": only task 1 (RanPAC); "none": frozen backbone
    tasks: str = "all"
    augment: bool = False
    #: cache the frozen prefix's outputs (only without augmentation): "auto" (= "true"), "true", "false"
    #: (:data:`CACHE_PREFIX`)
    cache_prefix: str = "auto"
    num_workers: int = 0


@dataclass
class SignatureConfig:
    """Eq. 18: the multi-key signature of a task, a DP-GMM over its embeddings under its own adapter."""

    #: "dpgmm" (Eq. 18), "kmeans" (ablation), "gaussian" (one component, Eq. 2)
    method: str = "dpgmm"
    max_components: int = 20
    #: component covariance kept for scoring: "full", "ppca" (low-rank + isotropic, Woodbury scoring) or
    #: "shared" (one full matrix per task, the fit's covariance prior, + per-component low rank; exact
    #: for the DP-GMM posterior while the rank budget holds its data terms, Woodbury scoring)
    covariance: str = "shared"
    #: q: the "ppca" rank (None: 128); for "shared" the mean factor rows per component, a budget of
    #: T * rank rows that approximates once the components' data terms exceed it (N + T rows for N
    #: training inputs and T components). None (default) keeps every row: exact at any N
    rank: int | None = None
    #: embedding normalisation before fitting and scoring: "none" (the paper) or "l2" (default: each
    #: adapter changes the embedding's scale, which raw likelihoods compare across tasks; docs/experiments.md)
    normalize: str = "l2"
    #: score per (input, component): "nll" (Gaussian NLL incl. log-det) or "mahalanobis" (Eq. 2)
    score: str = "nll"
    #: per-task score calibration: "none" or "standardize" (by the task's own training scores)
    calibrate: str = "none"
    #: how a task's covariance (the DP-GMM's covariance prior) is estimated: "ridge" (cov + 1e-3 tr/d I),
    #: "oas" (default) or "ledoit-wolf" (shrinkage towards tr/d I with the data's own intensity;
    #: signatures/fitting.py)
    prior: str = "oas"
    #: the DP-GMM's Wishart prior: "sklearn" (scikit-learn's default, covariance_prior = the task's
    #: covariance C, so the prior's expected covariance is C / prior_dof) or "expected" (covariance_prior =
    #: prior_dof * C: the prior's expected covariance is C; each component's covariance is then C
    #: shrunk towards its own scatter with the weight of prior_dof points; default)
    prior_scale: str = "expected"
    #: degrees of freedom of the DP-GMM's Wishart prior (the weight of the covariance prior, in points);
    #: None = d (scikit-learn's default)
    prior_dof: float | None = None
    #: where a task's keys live: "first-adapter-lda" (default, beyond the paper: an LDA head over all
    #: classes on the embeddings under the first task's adapter, which stays fixed after task 1,
    #: accumulated like G: docs/retrieval.md), "adapter" (the paper: h_k(x) under the task's own
    #: adapter), "frozen"
    #: (the frozen backbone's features, the same space for every task), or "adapter+frozen" (both
    #: signatures; a task's score is the sum of its two best negative log-likelihoods) or "frozen-lda"
    #: (the LDA head on the frozen features). ``normalize`` applies to the LDA keys' features too.
    keys: str = "first-adapter-lda"
    #: how the LDA keys (and the LDA shortlist of ``retrieval.candidates``) turn class scores f_c into a
    #: task's score (lower is better; Gaussian keys ignore it): "mean" (default:
    #: s_t = -log mean_{c in t} softmax_c(f / class_temperature), minus the log of the task's average
    #: class probability, so that a task with more classes is not favoured) or "max"
    #: (s_t = -max_{c in t} f_c, the best class)
    task_score: str = "mean"
    class_temperature: float = 0.1
    max_iter: int = 100
    tol: float = 1e-3
    reg_covar: float = 1e-6
    #: storage dtype of signature factors in the KB: "auto" (default: float16 for ``covariance = "shared"``,
    #: whose low-rank rows then take half the bytes and its eigenbasis is stored as float32 Householder
    #: vectors, scores within ~1e-5 of float32 and the same retrieval in the scale check; float32 for
    #: "full" and "ppca", whose float16 factors move scores by ~1e-3), "float32" (exact) or "float16"
    storage_dtype: str = "auto"


@dataclass
class HeadConfig:
    """Eq. 23 / Alg. 1 lines 8-12: RanPAC's ridge (LDA) head on accumulated G and e(c)."""

    #: random-projection width M with ReLU (RanPAC uses 10000); 0 disables the projection
    rp_dim: int = 10000
    gamma_min_exp: int = -8
    gamma_max_exp: int = 14
    holdout: float = 0.2
    #: "accumulated": ridge on all statistics so far, scored on the task's held-out part (default);
    #: "task": RanPAC's rule (this task's data alone)
    gamma_selection: str = "accumulated"
    #: the class prototypes e(c): "sum" (RanPAC's code: class sums) or "task-mean" (Algorithm 1 line 11:
    #: each task's sums divided by its size |D_k|; differs from "sum" only for tasks of unequal size)
    prototypes: str = "sum"
    #: keep each task's training embeddings (N x d float32) and labels in the knowledge base so that
    #: ``proteus kb forget`` can subtract the task from the head exactly; off by default: the knowledge
    #: base then holds no per-image data
    forgettable: bool = False
    #: which head classifies an input once its task is known: "global" (Eq. 23: one head over every
    #: class learned so far, its statistics accumulated from each task's own adapter) or "task" (beyond
    #: the paper: each task's own ridge head over its own classes, fitted on its adapter's embeddings
    #: when the task is learned and never changed; needs retrieval; the global head is kept too).
    #: Default "task", beyond the paper (docs/retrieval.md)
    scope: str = "task"


@dataclass
class RetrievalConfig:
    #: "signature" (Alg. 2), "first" (RanPAC), "last" (InfLoRA/SD-LoRA), "all-units" (O-LoRA-like), "none"
    mode: str = "signature"
    top_k: int = 1
    #: also report the accuracy with the true task's adapter (oracle)
    oracle: bool = True
    #: flag inputs from no learned task (beyond the paper, proteus.engine.novelty): each task's key is
    #: fitted without a held-out part of its training inputs, whose scores calibrate a threshold
    reject: bool = False
    #: the detector of inputs from no learned task (proteus.engine.novelty.NOVELTY): "auto" (the
    #: class-Gaussian one wherever the keys are LDA keys, as the default methods'), "class-gaussian" or
    #: "none". It holds nothing out of the keys (its calibration rows are subtracted from their statistics
    #: when scored), so accuracies do not change
    novelty: str = "auto"
    #: the share of each task's inputs that calibrates its threshold (either detector)
    calibration_holdout: float = 0.1
    #: the fraction of a task's held-out inputs that its threshold accepts
    reject_tpr: float = 0.95
    #: beyond the paper, for the per-adapter Gaussian keys (signature.keys = adapter): score only the c
    #: tasks shortlisted by cheap LDA keys in one space (fitted with each task, no old data: App.
    #: "Complexity of PROTEUS Inference" for the cost it avoids), c + 1 forwards per input instead of m
    #: (docs/performance.md). None: score every task (the paper)
    candidates: int | None = None
    #: the cheap keys' space: "first-adapter" (task 1's adapter, fixed after task 1) or "frozen"
    candidate_space: str = "first-adapter"
    #: how the task posterior and the head combine (beyond the paper; proteus.engine.experts): "hard"
    #: (Alg. 2: the best task's adapter, then its head) or "soft" (the class maximising
    #: log p(t|x) + log p(c|x, t) over the ``soft_top`` most likely tasks t, each input embedded under
    #: each of them; p(t|x) = softmax of minus the keys' task scores / ``key_temperature``, p(c|x, t) =
    #: softmax over task t's classes of the head's scores under adapter t / ``head_temperature``).
    #: Default "soft", beyond the paper (docs/retrieval.md)
    combine: str = "soft"
    soft_top: int = 2
    #: 1 for task scores already in nats (``signature.task_score = mean``); about 0.1 for "max"
    key_temperature: float = 1.0
    head_temperature: float = 1.0


@dataclass
class BaselineConfig:
    """The trained-classifier baselines of Table 1 (:mod:`proteus.baselines`; docs/experiments.md gives
    each method's official setting beside ours). ``train.epochs`` and ``train.batch_size`` apply to them;
    the optimiser and learning rate are the method's own."""

    #: "adam" (InfLoRA, L2P, DualPrompt, CODA-Prompt) or "sgd" (SD-LoRA: momentum 0.9)
    #: ``proteus.baselines.learner.OPTIMIZERS`` / ``SCHEDULES``
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    #: learning rate over a task's epochs: "constant" or "cosine" (CODA's / InfLoRA's CosineSchedule)
    schedule: str = "constant"
    #: clip the gradient norm of the trained tensors before each step (the L2P / DualPrompt ports: 1.0)
    clip_grad: float | None = None
    #: LoRA rank of InfLoRA and SD-LoRA (their code: 10)
    rank: int = 10
    #: InfLoRA's DualGPM threshold eps_t = gpm_start + (1 - gpm_start) t / T (CIFAR 0.95, ImageNet-R 0.98)
    gpm_start: float = 0.95
    #: SD-LoRA's magnitude initialisation (every task, as the released code does)
    magnitude_init: float = 0.8
    #: prompt pool size M (L2P 10, CODA-Prompt 100 components; DualPrompt: one e-prompt per task)
    pool_size: int = 10
    #: prompt length L (L2P 5, DualPrompt e-prompt 5 on CIFAR / 20 on ImageNet-R, CODA-Prompt 8)
    prompt_length: int = 5
    #: L2P: prompts chosen per input (N)
    top_k: int = 5
    #: the blocks that receive prompts (DualPrompt: e-prompt blocks; CODA-Prompt: prefix blocks)
    prompt_layers: list[int] = field(default_factory=lambda: [0])
    #: DualPrompt's g-prompt: length and blocks
    g_length: int = 5
    g_layers: list[int] = field(default_factory=lambda: [0, 1])
    #: weight of the key-query matching loss (L2P's surrogate, DualPrompt's pull constraint)
    match_weight: float = 0.1
    #: CODA-Prompt's orthogonality penalty weight (0 in the released scripts)
    ortho_weight: float = 0.0
    #: the number of tasks the prompt pool is divided over (CODA-Prompt: pool_size / max_tasks per task;
    #: DualPrompt: e-prompts); None = the stream's number of tasks
    max_tasks: int | None = None
    #: HiDe-Prompt (:mod:`proteus.baselines.hideprompt`; its contrastive weight ``reg`` is ``ortho_weight``):
    #: task t's e-prompt trains as (1 - m) P_t + m mean(P_0..P_t-1) and keeps it (m = ``prompt_momentum``);
    #: stage 1 (task-identity inference: an MLP head on the frozen class token) trains ``tii_epochs`` at
    #: ``tii_lr``; both stages re-align their heads on pseudo-features of ``n_centroids`` K-Means centroids
    #: per class for ``ca_epochs`` (SGD, cosine annealing) at ``tii_ca_lr`` / ``ca_lr``
    prompt_momentum: float = 0.01
    tii_epochs: int = 20
    tii_lr: float = 4.6875e-5
    tii_ca_lr: float = 4.6875e-4
    ca_lr: float = 5e-3
    ca_epochs: int = 30
    n_centroids: int = 10


@dataclass
class BenchmarkConfig:
    name: str = "quickstart"
    data: str | None = None
    num_tasks: int | None = None
    tasks_file: str | None = None
    class_order_seed: int = 1993
    #: cap per-class training images (None = all); test sets are never capped
    max_train_per_class: int | None = None
    #: when the data are not under benchmark.data and the machine is online, let torchvision download them
    #: there (CIFAR-10/100; other benchmarks say where to get their data)
    download: bool = False
    #: ImageNet-R/A's train/test convention (proteus.streams.splits.SPLITS): "folders" (the RevisitingCIL
    #: archives' train/ and test/) or "coda" (raw ImageNet-R, CODA-Prompt's shipped 6,000-file test list)
    split: str = "folders"


@dataclass
class EvalConfig:
    batch_size: int = 64
    #: images above this many pixels are refused before they are decoded (``predict --max-pixels``)
    max_image_pixels: int = 64_000_000
    #: MB of merged adapter weights kept for prediction (least recently used out first; the maps that do
    #: not fit run factored, same result to float round-off); None: no limit (proteus.adapters.model)
    merge_budget_mb: float | None = 1024.0


@dataclass
class ReportConfig:
    """What ``proteus run`` writes besides results.json: theory checks, figures, report.md, latency."""

    #: Sec. 3.2 checks (delta, kappa, sigma^2, Thm. 3.5 bound, Thm. 3.6 minimum delta) for retrieval methods
    theory: bool = True
    #: figures (Figs. 2, 3, 8-10, retrieval confusion, latency) and report.md in the run directory
    figures: bool = True
    #: time ``predict`` on one batch with the first m adapters (App. "Complexity of PROTEUS Inference")
    latency: bool = True
    latency_batch: int = 32
    #: number of m values timed (evenly spaced in 1..num_tasks, always including both ends)
    latency_points: int = 10
    #: timed repetitions per m (the median is reported; fewer once they add up to 2 s), after a warm-up call
    latency_repeats: int = 3
    #: experiment tracking besides train_log.csv and acc_matrix.csv (always written): comma-separated sinks
    #: of proteus.experiment.tracking.SINKS, "tensorboard" (<run>/tensorboard/) and "wandb" (needs
    #: `pip install wandb`); "none" for neither (``--track``)
    tracking: str = "none"


@dataclass
class RunConfig:
    method: str = "proteus"
    seed: int = 0
    device: str = "auto"
    #: the backbone's forward passes: "auto" (bfloat16 autocast on CUDA, float32 elsewhere), "bf16", "fp32"
    precision: str = "auto"
    #: torch.compile of the backbone's inference forwards: "none" (eager), "default", "reduce-overhead",
    #: "max-autotune" (same results to float round-off; eager with one warning where it cannot compile)
    compile: str = "none"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
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
        nested = nest(dotted)
        merge(out, nested, where="config")
        return out

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> RunConfig:
        """A config written by a run or a knowledge base, possibly by an earlier release: a key it lacks
        takes the value that reproduces what that release did (:data:`LEGACY_DEFAULTS`), not today's
        default, so an old knowledge base keeps its recipe for the tasks it learns next."""
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for key, value in LEGACY_DEFAULTS.items():
            section, _, name = key.partition(".")
            if isinstance(data.get(section), dict) and name not in data[section]:
                data[section][name] = value
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def task_settings(self) -> dict[str, Any]:
        """What a task's record keeps of how it was learned: the keys that may change per task
        (:data:`PER_TASK_KEYS`) but the device (the learner records the one it resolved), ``compile`` (how
        fast, not what), the data's location and the report."""
        flat = flatten(self.to_dict())
        skip = ("device", "compile", "report.", "benchmark.")
        return {k: v for k, v in flat.items() if per_task(k) and not k.startswith(skip)}

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


#: keys added after configs were first written, with the value that reproduces what happened before they
#: existed (their defaults may differ: ``proteus`` moved to an OAS prior with issue 13)
LEGACY_DEFAULTS: dict[str, Any] = {
    "signature.prior": "ridge",
    "signature.prior_scale": "sklearn",
    "signature.prior_dof": None,
    "head.prototypes": "sum",
    "head.forgettable": False,
    "retrieval.candidates": None,
    "head.scope": "global",
    "retrieval.combine": "hard",
    "retrieval.key_temperature": 0.1,
    "signature.task_score": "max",
    "signature.class_temperature": 0.1,
}

#: config keys that may differ from task to task (recorded in each task's record); every other key
#: defines the model and is fixed when a knowledge base is created (``report.`` covers a whole section)
PER_TASK_KEYS = (
    "device",
    "precision",
    "compile",
    "train.epochs",
    "train.lr",
    "train.batch_size",
    "train.num_workers",
    "eval.batch_size",
    "eval.max_image_pixels",
    "eval.merge_budget_mb",
    "benchmark.data",
    "benchmark.tasks_file",
    "benchmark.download",
    "report.",
)


def per_task(key: str) -> bool:
    """Whether a dotted config key may change between tasks (:data:`PER_TASK_KEYS`)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in PER_TASK_KEYS)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class ConfigError(ProteusError, ValueError):
    """A configuration key or value that does not fit the schema."""


# ---------------------------------------------------------------------------------- the schema's types
#: how a boolean may be spelled as a string (YAML already reads unquoted true/false/yes/no/on/off as one);
#: 1 and 0 are numbers, not booleans, and are refused
_TRUE, _FALSE = frozenset({"true", "yes", "on"}), frozenset({"false", "no", "off"})
_NAMES = {
    bool: ("true or false", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's fields and their declared types (the string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _section_error(path: str, cls: type) -> ConfigError:
    return ConfigError(
        f"{path} is a section, not a value: set {path}.<key>=...; keys: {', '.join(_hints(cls))}"
    )


def _unknown_key(path: str, cls: type) -> ConfigError:
    return ConfigError(f"unknown config key {path!r}; known keys here: {', '.join(_hints(cls))}")


def field_type(key: str) -> Any:
    """The declared type of the dotted config key ``key`` (``"train.epochs"`` -> ``int``); an unknown key,
    or a section given as a key (``"train"``), is refused by name with the keys that exist there."""
    cls: type = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(key, cls)
        hint, here = hints[part], ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if _is_section(hint):
            if last:
                raise _section_error(here, hint)
            cls = hint
        elif not last:
            raise ConfigError(f"unknown config key {key!r}: {here} is a value, not a section")
    return hint


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_NAMES[args[0]][1]}"
    return _NAMES[hint][0]


def _scalar(value: Any, kind: type, raw: str | None) -> Any:
    """``value`` as ``kind`` (bool, int, float or str), or :data:`_BAD`."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        return _BAD
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, (bool, int, float, datetime.date)):  # a YAML scalar read as another type
            if raw is not None:  # what was written
                return raw
            return str(value).lower() if isinstance(value, bool) else str(value)
        return _BAD
    if isinstance(value, bool):  # a bool is an int to Python, never to a config
        return _BAD
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            try:
                value = float(text)  # "1e3" for an integer key
            except ValueError:
                return _BAD
    if isinstance(value, (int, float)) and not math.isfinite(value):
        return _BAD
    if kind is int:
        if isinstance(value, float):
            return int(value) if value.is_integer() else _BAD
        return value if isinstance(value, int) else _BAD
    return float(value) if isinstance(value, (int, float)) else _BAD


_BAD = object()


def coerce(value: Any, hint: Any, key: str, raw: str | None = None) -> Any:
    """``value`` converted to the declared type ``hint`` of config key ``key``, or a :class:`ConfigError`
    naming the key, the type and the value. The rules:

    * ``bool``: true/false (YAML's spellings yes/no/on/off too, in any case); 1 and 0 are refused;
    * ``int``: an integer, a float with an integral value (2.0) or a string of one ("10", "1e3"); a
      non-integral value (2.5) is refused;
    * ``float``: any finite number, or a string of one ("1e-3", which YAML 1.1 reads as a string);
      nan and inf are refused;
    * ``str``: a string (a path too); a YAML scalar that YAML read as a number, a boolean or a date is
      taken as its text (``raw``, what was written, when known: ``--set train.cache_prefix=false`` is
      "false");
    * ``X | None``: null, or an ``X``; ``list[X]``: a list (or tuple) of ``X``s;
    * anything else (a mapping for a value, bytes, a date) is refused.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return coerce(value, inner[0], key, raw)
            except ConfigError:
                raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}") from None
    if value is None:
        raise ConfigError(f"{key} must be {_describe(hint)}; got null")
    if origin is list:
        if isinstance(value, (list, tuple)):
            out = [_scalar(v, args[0], None) for v in value]
            if not any(v is _BAD for v in out):
                return out
        raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}")
    out = _scalar(value, hint, raw)
    if out is _BAD:
        raise ConfigError(f"{key} must be {_describe(hint)}; got {_show(value)}")
    return out


def coerce_dotted(dotted: dict[str, Any]) -> dict[str, Any]:
    """Flat dotted keys (``{"train.epochs": "2"}``) checked against the schema (unknown keys and sections
    refused by name) and their values converted to each key's declared type (:func:`coerce`)."""
    return {key: coerce(value, field_type(key), key) for key, value in dotted.items()}


def nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """``{"train.epochs": 1}`` -> ``{"train": {"epochs": 1}}``, the keys checked and the values converted
    (:func:`coerce_dotted`)."""
    out: dict[str, Any] = {}
    for key, value in coerce_dotted(dotted).items():
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def merge(obj: Any, data: dict[str, Any], where: str = "config") -> None:
    """Merge a nested dict into a dataclass tree in place: unknown keys refused by name, every value
    converted to its field's declared type (:func:`coerce`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = _hints(type(obj))
    for key, value in data.items():
        path = f"{where}.{key}" if where != "config" else str(key)
        if key not in hints:
            raise _unknown_key(path, type(obj))
        hint = hints[key]
        if _is_section(hint):
            if value is None:  # an empty section in a YAML file
                continue
            if not isinstance(value, dict):
                raise _section_error(path, hint)
            merge(getattr(obj, key), value, where=path)
        else:
            setattr(obj, key, coerce(value, hint, path))


def _has_tag(raw: str) -> bool:
    return yaml_has_tag(raw, "--set")


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn ``["adapter.rank=16", "train.epochs=1"]`` into a nested dict: each key checked against the
    schema (:func:`field_type`), each value read as one YAML scalar (a flow list for a list key; YAML tags
    are refused) and converted to the key's declared type (:func:`coerce`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or not all(key.split(".")):
            raise ConfigError(f"--set expects key=value, got {item!r}")
        hint = field_type(key)
        try:
            if _has_tag(raw):
                raise ConfigError(
                    f"--set {key}: YAML tags are not allowed in a value ({raw.strip()!r}); give a plain value"
                )
            value = untrusted_yaml(raw, f"--set {key}") if raw.strip() != "" else None
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ConfigError(f"--set {key}: not a valid YAML value: {raw!r} ({why})") from None
        except RecursionError:
            raise ConfigError(f"--set {key}: the value is nested too deeply: {raw[:40]!r}...") from None
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = coerce(value, hint, key, raw=raw.strip())
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = untrusted_yaml(read_regular_text(p), str(p)) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid YAML (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a text (UTF-8) YAML file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data
