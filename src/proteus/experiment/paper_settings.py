"""What the PROTEUS paper states about each setting, and every choice of ours where we differ or the paper
is silent: the data behind ``proteus reproduce NAME --plan`` and the differences table of
docs/experiments.md (both computed from here, never written by hand).

* :data:`STATED` -- per config key, the paper's value (per paper benchmark where it varies) and its words,
  with the line of the paper's source (``shared/spec/000_b8a2b9b06c209d3d.txt``).
* :data:`CHOICES` -- the rows of the differences table: the config keys the paper leaves open (or that we
  set otherwise), and the choices of the code that no key controls (the adapter's initialisation, the
  training head, ...), each with what the paper says, why we chose it and its measured effect.
* :data:`BOOKKEEPING` -- the keys that change no number of a run (where the data lie, what a run reports).

:func:`departures` compares a resolved configuration with the paper's statement for its cell: every stated
key whose value differs (named by the row that explains it, or as *unlisted*), every open key in force and
every choice of the code in force. ``tests/test_paper_settings.py`` fails when a method's resolved config
gains a departure that no row explains, and when docs/experiments.md's table is not the one
:func:`differences_tables` generates.
"""

# ruff: noqa: E501 -- one row's prose per string
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proteus.adapters.options import TRANSFER_INIT
from proteus.registry import Registry

__all__ = [
    "BOOKKEEPING",
    "CHOICES",
    "OPEN",
    "STATED",
    "Choice",
    "Departure",
    "Stated",
    "active",
    "choice",
    "departures",
    "differences_tables",
    "paper_family",
    "stated_value",
]


class _Open:
    """The value of a setting the paper does not state."""

    def __repr__(self) -> str:
        return "not stated"


#: a setting the paper leaves open
OPEN: Any = _Open()


@dataclass(frozen=True)
class Stated:
    """What the paper states of one config key: ``value`` (or a map paper benchmark -> value, ``"*"`` for
    every other, or a function of the paper benchmark) and its words, with the line."""

    value: Any
    says: str


def _per(default: Any, **by: Any) -> dict[str, Any]:
    return {"*": default, **{k.replace("_", "-"): v for k, v in by.items()}}


#: the stream that builds a paper benchmark, where its preset names another (``benchmark.name``)
_BUILDS = {
    "vtab5t-large": "vtab5t", "cifar100-50": "cifar100", "imagenet-r-100": "imagenet-r",
    "cifar100-budget": "cifar100", "imagenet-r-budget": "imagenet-r",
}  # fmt: skip

#: the paper's benchmarks by the values the Appendix gives them (l. 696-698): uniformly mild (CIFAR-100,
#: ImageNet-R) and varying (VTAB-Sim50) at r = 4, uniformly abrupt (ImageNet-A, the VTAB5Ts) at r = 16
STATED: dict[str, Stated] = {
    "backbone.name": Stated(
        "vit_b16", "ViT-B/16 pre-trained on ImageNet-21k, fine-tuned on ImageNet-1k (l. 696)"
    ),
    "backbone.pretrained": Stated(True, "a pre-trained backbone (l. 696)"),
    "backbone.img_size": Stated(None, "ViT-B/16's own 224 px (l. 696)"),
    "backbone.adapt_last": Stated(None, "LoRA on q and v of all 12 blocks (l. 1032)"),
    "adapter.enabled": Stated(True, "a LoRA update per task (Eq. 9)"),
    "adapter.blocks": Stated(
        "all",
        "LoRA on q and v of all 12 blocks (l. 1032); the first 8 or 4 blocks in the lighter variants (l. 1034)",
    ),
    "adapter.rank": Stated(
        _per(4, imagenet_a=16, vtab5t=16, vtab5t_large=16, cifar100_budget=10, imagenet_r_budget=10),
        "r = 4 (mild, varying), r = 16 (abrupt) (l. 696); r₀ = 10 in the budget runs (l. 885, 903)",
    ),
    "adapter.scaling": Stated(1.0, "no scaling factor in Eq. 9"),
    "adapter.transfer": Stated("learned", "S learned (Eq. 15)"),
    "adapter.orthogonal": Stated(True, "⟨ΔW_new, ΔW_τ⟩ = 0 for each old task τ (Eq. 15)"),
    "adapter.lam": Stated(0.006, "λ = 0.006 (l. 696)"),
    "adapter.lam_decay": Stated(0.8, "λ reduced by 20% after each task (l. 696)"),
    "adapter.alpha": Stated(0.8, "α = 0.8 (l. 698)"),
    "adapter.budget_decay": Stated(None, "a fixed rank (the budget schedule is an extension, l. 874)"),
    "train.lr": Stated(
        _per(1e-3, imagenet_a=5e-4, vtab5t=5e-4, vtab5t_large=1e-4, vtab_sim50=1e-4),
        "1e-3 (CIFAR-100, ImageNet-R), 5e-4 (ImageNet-A, VTAB5T-small), 1e-4 (VTAB5T-large, VTAB-Sim50) (l. 698)",
    ),
    "train.batch_size": Stated(
        _per(32, imagenet_a=16, vtab5t=16, vtab5t_large=24, vtab_sim50=24),
        "32 (CIFAR-100, ImageNet-R), 16 (ImageNet-A, VTAB5T-small), 24 (VTAB5T-large, VTAB-Sim50) (l. 698)",
    ),
    "train.tasks": Stated("all", "an adapter per task (Alg. 1)"),
    "signature.method": Stated("dpgmm", "a DP-GMM per task (Eq. 18, l. 159)"),
    "signature.max_components": Stated(
        _per(20, imagenet_r=100, imagenet_r_100=100, imagenet_r_budget=50),
        "T ≤ 20 clusters (l. 872); T = 100 on ImageNet-R (l. 606); τ = 20 and 50 in the budget runs (l. 885, 903)",
    ),
    "signature.covariance": Stated("full", "a 768 × 768 covariance per cluster (l. 872)"),
    "signature.score": Stated("nll", "the negative log Gaussian likelihood (l. 142)"),
    "signature.calibrate": Stated("none", "the raw score, argmin over tasks (l. 159)"),
    "signature.normalize": Stated("none", "h_k(x) as it is (l. 139)"),
    "signature.keys": Stated("adapter", "each task's signature under its own adapter (Eq. 18)"),
    "signature.rank": Stated(None, "full covariances (l. 872)"),
    "signature.storage_dtype": Stated("auto", "4-byte floats (l. 872)"),
    "retrieval.mode": Stated("signature", "the task of the nearest signature (Alg. 2)"),
    "retrieval.top_k": Stated(1, "the best component (l. 159)"),
    "retrieval.candidates": Stated(None, "every task scored (Alg. 2)"),
    "retrieval.combine": Stated("hard", "the retrieved task's adapter, then Eq. 23 (Alg. 2)"),
    "head.rp_dim": Stated(0, "Eq. 23 on h(x) itself (l. 273)"),
    "head.scope": Stated("global", "one head over every class learned so far (Eq. 23)"),
    "head.gamma_selection": Stated("task", "γ by RanPAC's strategy (l. 698)"),
    "head.gamma_min_exp": Stated(-8, "RanPAC's γ grid, 10⁻⁸ … 10¹³ (l. 698)"),
    "head.gamma_max_exp": Stated(14, "RanPAC's γ grid, 10⁻⁸ … 10¹³ (l. 698)"),
    "head.holdout": Stated(0.2, "RanPAC's 80 / 20 split for γ (l. 698)"),
    "head.prototypes": Stated("task-mean", "e_S(z) += m⁻¹ |D_k|⁻¹ h_S(x) (Alg. 1, line 11)"),
    "benchmark.num_tasks": Stated(
        _per(
            10,
            vtab5t=5,
            vtab5t_large=5,
            vtab_sim50=None,
            cifar100_50=50,
            imagenet_r_100=100,
            cifar100_budget=20,
            imagenet_r_budget=20,
        ),
        "10 tasks (l. 285-289), 5 VTAB datasets, VTAB-Sim50's own count; 50, 100 and 20 tasks in the long and budget runs (l. 622, 706, 885, 903)",
    ),
    "benchmark.name": Stated(
        lambda b: _BUILDS.get(b, b),
        "the paper's benchmarks (l. 283-289; the long and budget runs, l. 622, 706, 885, 903)",
    ),
    "benchmark.max_train_per_class": Stated(None, "every training image (l. 676-693)"),
}


def stated_value(key: str, paper_benchmark: str) -> Any:
    """The paper's value of ``key`` on ``paper_benchmark`` (:data:`OPEN` when it states none)."""
    s = STATED.get(key)
    if s is None:
        return OPEN
    if isinstance(s.value, dict):
        return s.value.get(paper_benchmark, s.value["*"])
    return s.value(paper_benchmark) if callable(s.value) else s.value


#: keys that change no number of a run: where the data and weights lie, what a run reports, how fast it
#: runs (the thread count moves only the last bits of the ridge solutions), prediction-time options off in
#: every experiment (rejection), a baseline's own options (compared with its released settings instead)
BOOKKEEPING = (
    "method", "seed", "device", "threads", "compile", "backbone.weights", "benchmark.data", "benchmark.tasks_file",
    "benchmark.download", "eval.", "report.", "train.cache_prefix", "train.num_workers", "retrieval.oracle",
    "retrieval.reject", "retrieval.novelty", "retrieval.shortlist", "retrieval.calibration_holdout",
    "retrieval.reject_tpr", "head.forgettable", "baseline.",
)  # fmt: skip


def bookkeeping(key: str) -> bool:
    return any(key == b or (b.endswith(".") and key.startswith(b)) for b in BOOKKEEPING)


# ------------------------------------------------------------------------------------- in force
def _adapter(f: Mapping[str, Any]) -> bool:
    return bool(f.get("adapter.enabled")) and _entry("train.tasks", f, "trains")


def _entry(kind: str, f: Mapping[str, Any], trait: str) -> bool:
    """``trait`` of the entry the setting ``kind`` names in its registry (:meth:`Registry.trait`; False for
    a name it lacks)."""
    reg = Registry.named(kind)
    name = f.get(kind)
    return isinstance(name, str) and name in reg and bool(reg.trait(name, trait))


def _retrieves(f: Mapping[str, Any]) -> bool:
    return _entry("retrieval.mode", f, "retrieves")


def _weighs_tasks(f: Mapping[str, Any]) -> bool:
    return _retrieves(f) and _entry("retrieval.combine", f, "weighs_tasks")


def _gaussian(f: Mapping[str, Any]) -> bool:
    return _retrieves(f) and _entry("signature.keys", f, "signatures")


def _lda_keys(f: Mapping[str, Any]) -> bool:
    return _retrieves(f) and _entry("signature.keys", f, "lda")


def _learned_s(f: Mapping[str, Any]) -> bool:
    transfer = f.get("adapter.transfer")
    return _adapter(f) and transfer in TRANSFER_INIT and TRANSFER_INIT[transfer] is None  # S learned


#: key (or section prefix) -> when it is in force (a key out of force departs from nothing)
_IN_FORCE: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "adapter.": _adapter,
    "adapter.enabled": lambda f: True,
    "adapter.lam": _learned_s,
    "adapter.lam_decay": _learned_s,
    "adapter.alpha": _learned_s,
    "adapter.s_update": _learned_s,
    "adapter.s_lr": lambda f: _learned_s(f) and _entry("adapter.s_update", f, "reads_s_lr"),
    "adapter.min_rank": lambda f: _adapter(f) and f.get("adapter.budget_decay") is not None,
    "train.": _adapter,
    "train.tasks": lambda f: True,
    "signature.": _gaussian,
    "signature.keys": _retrieves,
    "signature.normalize": lambda f: _gaussian(f) or _lda_keys(f),
    "signature.task_score": _lda_keys,
    "signature.class_temperature": lambda f: _lda_keys(f) and _entry("signature.task_score", f, "tempered"),
    "signature.rank": lambda f: _gaussian(f) and _entry("signature.covariance", f, "ranked"),
    "signature.prior_dof": lambda f: _gaussian(f) and _entry("signature.method", f, "dirichlet_prior"),
    "signature.prior_scale": lambda f: _gaussian(f) and _entry("signature.method", f, "dirichlet_prior"),
    "signature.max_components": lambda f: _gaussian(f) and _entry("signature.method", f, "components"),
    "retrieval.top_k": _gaussian,
    "retrieval.candidates": _gaussian,
    "retrieval.candidate_space": lambda f: _gaussian(f) and f.get("retrieval.candidates") is not None,
    "retrieval.combine": _retrieves,
    "retrieval.soft_top": _weighs_tasks,
    "retrieval.key_temperature": _weighs_tasks,
    "retrieval.head_temperature": _weighs_tasks,
}


def active(key: str, flat: Mapping[str, Any]) -> bool:
    """Whether ``key`` changes anything under the settings ``flat`` (the most specific rule of
    :data:`_IN_FORCE` decides; a key without one is always in force)."""
    if key in _IN_FORCE:
        return _IN_FORCE[key](flat)
    section = key.partition(".")[0] + "."
    return _IN_FORCE[section](flat) if section in _IN_FORCE else True


# ------------------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class Choice:
    """A row of the differences table: a choice where we differ from the paper or the paper is silent.

    ``keys``: the config keys that express it (a stated key departs when its value is not the paper's,
    an open one whenever it is in force; ``values`` limits the row to those values of its keys).
    ``code``: a choice of the code that no key controls, in force where ``when`` holds. ``common``: it
    concerns every method (the baselines too), not PROTEUS's recipe only. ``beyond``: a row of the
    default ``proteus``'s own retrieval and head (the second table)."""

    number: int
    name: str
    paper: str
    ours: str
    why: str
    effect: str
    keys: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()
    code: str = ""
    when: Callable[[Mapping[str, Any]], bool] | None = None
    common: bool = False
    beyond: bool = False

    def covers(self, key: str, value: Any) -> bool:
        return key in self.keys and (not self.values or value in self.values)

    def in_force(self, flat: Mapping[str, Any]) -> bool:
        """For a choice of the code: whether it is in force under ``flat``."""
        return bool(self.code) and (self.when is None or self.when(flat))


_MEASURED_2_4 = "`tools/studies/covariance_study.py` on the same adapters, head and test embeddings (MobileNetV2, `--config mobilenet_cpu`, seed 0)"

CHOICES: tuple[Choice, ...] = (
    Choice(
        1,
        "signature covariances Λ",
        "full, one d × d per component (l. 872: 768 × 768 per cluster)",
        "`shared`: the task's prior matrix once plus every component's own data rows, all of them kept (`signature.rank` unset): the DP-GMM's posterior covariances exactly, at any N; float16 rows (`storage_dtype=auto`)",
        "the same scores in fewer bytes (N d + d² instead of T d² floats)",
        "scale check (d = 768, 5,000 per task, 10 tasks): agreement with full covariances 100.00% for both recipes, 17.9 MB per task instead of 47.3, scoring 2.4× faster; the previous default (`rank` 128, approximate) agreed on only 91.3% (`proteus`) and 32.0% (paper recipe) of the inputs",
        keys=("signature.covariance", "signature.rank", "signature.storage_dtype"),
    ),
    Choice(
        2,
        "embedding scale",
        "raw h_k(x) (l. 139)",
        "L2-normalised before fitting and scoring (`signature.normalize=l2`)",
        "each adapter changes the embedding's scale (reference-findings #2); raw NLLs then compare scales across adapters, not fits",
        f"with the prior of row 3: abrupt 51.6 → 69.9 retrieval, CIFAR-10 64.8 → 70.8; on the quickstart (290 images per task in d = 1,280) it costs 92.2 → 87.2, which row 4's OAS mostly wins back ({_MEASURED_2_4})",
        keys=("signature.normalize",),
    ),
    Choice(
        3,
        "DP-GMM Wishart prior",
        "not stated",
        "`proteus-paper`: scikit-learn's default, `covariance_prior` = the task covariance C, ν₀ = d, so that the prior expects C / d (`prior_scale=sklearn`); `proteus-dpgmm`: `covariance_prior` = ν₀ C, the prior expects C (`expected`)",
        "with C / d, a component of a few hundred points in d = 1,280 gets (C + N_k S_k) / (d + N_k), far smaller than its data: the own-task Mahalanobis term per dimension was 1,000-78,000 instead of ≈ 1, and NLLs rank tasks by how badly they are calibrated",
        "`expected` over `sklearn`, raw embeddings: abrupt 45.6 / 30.3 → 51.6 / 33.4, CIFAR-10 56.9 / 55.6 → 64.8 / 62.4, quickstart 90.9 → 92.2 (retrieval / final)",
        keys=("signature.prior_scale", "signature.prior_dof"),
    ),
    Choice(
        4,
        "the task covariance C (the prior's centre), shrinkage",
        "not stated",
        "OAS shrinkage towards tr(C)/d I (`signature.prior=oas`; `ledoit-wolf` also offered)",
        "with N close to or below d (290-2,000 points in 1,280 dimensions) the sample covariance's small eigenvalues are far too small, and a fixed ridge does not know how far",
        "over the ridge of row 17, with L2 and row 3: abrupt 69.9 / 59.7 → 77.8 / 78.8, CIFAR-10 70.8 / 68.2 → 71.0 / 67.9, quickstart 87.2 → 90.0 (Ledoit-Wolf: 78.0, 70.8 and 86.5)",
        keys=("signature.prior",),
        values=("oas", "ledoit-wolf"),
    ),
    Choice(
        5,
        "ridge γ of Eq. 23",
        '"the same optimization strategy as in RanPAC" (l. 698)',
        "chosen on all statistics so far, scored on the task's held-out part (`head.gamma_selection=accumulated`)",
        "RanPAC's rule picks γ for one task's classes, but γ then regularises the head over all classes so far",
        "CIFAR-10 and abrupt: both rules chose the same γ for every task (10⁵-10⁶), identical results. Quickstart (2 classes, 290 images per task, M = 2,000), `proteus-paper`, seed 0 (torch 2.14.1): RanPAC's rule picks γ = 10⁻⁸ on tasks 3 and 5 and the head collapses, final 35.58 (retrieval 91.85, oracle 37.62) against 91.66 (oracle 99.82) with `accumulated` (`proteus compare --benchmark quickstart --methods proteus-paper --seeds 0 [--set head.gamma_selection=accumulated]`)",
        keys=("head.gamma_selection",),
    ),
    Choice(
        6,
        "class prototypes e(c)",
        "e_S(z) += m⁻¹ |D_k|⁻¹ h_S(x) (Alg. 1, line 11)",
        "class sums, as RanPAC's code (`head.prototypes=sum`)",
        "identical for tasks of equal size; the abrupt sequence's digit tasks (4 × 128 images) are 8× smaller than its CIFAR tasks (4 × 1,000)",
        "abrupt: oracle 94.77 → 92.50, final 78.90 → 77.98 with per-task means (the small digit tasks' prototypes weigh 8× more); CIFAR-10: identical (equal tasks)",
        keys=("head.prototypes",),
    ),
    Choice(
        7,
        "orthogonality (Eq. 15)",
        "⟨ΔW_new, ΔW_τ⟩ = 0 for each old task τ",
        "the constraint on A only: A_new kept in the orthogonal complement of the span of every old A (a projection at every step)",
        "implies the paper's constraints for any B and holds exactly at every step without a penalty; once the old span fills a map's input dimension the new rank is cut, with a warning naming the maps (ViT-B/16 q, v: input 768, so at r = 16 after 48 tasks, at r = 4 after 192)",
        "cosine between tasks' updates below 10⁻⁵ (asserted in tests/test_adapters.py); no cut in any preset",
        code="A_new projected onto the complement of the old A's span at every step",
        when=lambda f: _adapter(f) and bool(f.get("adapter.orthogonal")),
    ),
    Choice(
        8,
        "optimisers",
        "an ℓ1 / ℓ2 (elastic-net) penalty on S in Eq. 15; no optimiser named",
        "a proximal step on S (`adapter.s_update=prox`, step `adapter.s_lr`), Adam on A and B without weight decay (`train.weight_decay`)",
        "Adam with an ℓ1 subgradient leaves S jittering around zero, never sparse (reference-findings #6); `s_update=adam` runs that variant",
        "not measured: `--set adapter.s_update=adam` runs the other optimiser; S's sparsity under each is what `analysis.json` reports",
        keys=("adapter.s_update", "adapter.s_lr", "train.weight_decay"),
    ),
    Choice(
        9,
        "epochs, augmentation",
        "not stated",
        "3 epochs (`train.epochs`), augmentation on in the ViT-B/16 presets",
        "the defaults of RanPAC-style runs; with `--config mobilenet_cpu` augmentation is off so the frozen prefix can be cached",
        "not measured: the ViT presets' 3 epochs need a GPU",
        keys=("train.epochs", "train.augment"),
    ),
    Choice(
        10,
        "DP-GMM iterations and pruning",
        "not stated (T is: l. 606, 872)",
        "100 EM iterations, tolerance 10⁻³, 10⁻⁶ on every covariance's diagonal (scikit-learn's defaults); a component is kept when its weight is ≥ 10⁻³ and it owns ≥ 2 training points",
        "scikit-learn's defaults for the fit; the pruning rule drops components no training point chose",
        "not measured: T = 100 matters on ImageNet-R, which is not on this machine; the local runs use T = 10",
        keys=("signature.max_iter", "signature.tol", "signature.reg_covar"),
        code="components of weight < 10⁻³ or fewer than 2 training points dropped",
        when=lambda f: _gaussian(f) and _entry("signature.method", f, "dirichlet_prior"),
    ),
    Choice(
        11,
        "task keys",
        "a DP-GMM over each task's embeddings under its own adapter (Eq. 18)",
        "an LDA head over all classes on the L2-normalised embeddings under the first task's adapter (fixed after task 1), accumulated like G (`signature.keys=first-adapter-lda`)",
        "one space for every task: scores compare across tasks, and a covariance tied across classes is estimated from all their data; the DP-GMM fits a task's training points far more tightly than new inputs when a task has about as many images as dimensions",
        "LDA keys (best class score, hard, Eq. 23's head: `proteus-lda`) over the DP-GMM keys (`proteus-dpgmm`): +0.75 / +7.19 / +4.02 / +7.15 / +6.63 (ablation: `proteus-dpgmm`)",
        keys=("signature.keys",),
        beyond=True,
    ),
    Choice(
        12,
        "a task's score from the LDA keys",
        "-",
        "minus the log of the task's mean class probability, softmax over all classes at temperature 0.1 (`signature.task_score=mean`, `signature.class_temperature`)",
        "the posterior over tasks with a uniform prior on tasks; the best class alone ignores how the rest of the task's classes score, and the sum favours tasks with more classes",
        "over the best class score (`max`, key temperature 0.1): +0.62 / +0.27 / +0.45 / -0.10 / -0.07, retrieval 97.5 → 98.2; over the sum: +0.28 / +1.03 / -0.12 / 0.00 / 0.00, retrieval 96.6 → 98.2 (ablation: `proteus-max-key`)",
        keys=("signature.task_score", "signature.class_temperature"),
        beyond=True,
    ),
    Choice(
        13,
        "the head that classifies under a retrieved adapter",
        "Eq. 23: one ridge head over every class learned so far",
        "each task's own ridge head over its own classes, fitted on its adapter's embeddings when the task is learned and never changed (`head.scope=task`); the global head is kept",
        "once the task is known, the classes of other tasks are only confusions; a task's own head sees only its adapter's embeddings",
        "over Eq. 23's head (same soft combination): +0.93 / +0.22 / +0.26 / +0.18 / +0.44 (ablation: `proteus-global-head`)",
        keys=("head.scope",),
        beyond=True,
    ),
    Choice(
        14,
        "how retrieval and the head combine",
        "Alg. 2: the best task, then the head",
        "the two likeliest tasks, each input embedded under both adapters; the class maximising log p(t|x) + log p(c|x, t) (`retrieval.combine=soft`, `soft_top` 2, key temperature 1, head temperature 1)",
        "where two tasks' keys are close, the head that is surer of a class settles it",
        "over hard retrieval (same keys and heads): +0.32 / +0.73 / +0.86 / +0.26 / +0.35, retrieval 98.5 → 98.2; one more forward per input (ablation: `proteus-hard`)",
        keys=(
            "retrieval.combine",
            "retrieval.soft_top",
            "retrieval.key_temperature",
            "retrieval.head_temperature",
        ),
        beyond=True,
    ),
    Choice(
        15,
        "`--config mobilenet_cpu` (a CPU's backbone)",
        "ViT-B/16 at 224 px, LoRA on every block, the learning rates and batch sizes of l. 698",
        "MobileNetV2 at 96 px, adapters on the last 6 blocks (the frozen prefix cached), rank 8, 5 epochs, batch 64, learning rate 1e-3, T = 10, a 2,000-wide projection (row 16), 150 training images per class on the multi-domain streams; any other `--backbone` or `--set` of these keys alike",
        "the only real pre-trained backbone on these machines; a ViT-B/16 run needs a GPU. Rank 8 and 5 epochs (was 4 and 3): the oracle column is the ceiling of the whole method, and each task's adapter adds 1-10 points over RanPAC's first-task adapter",
        "`proteus` over `ranpac` (both at the same settings), rank 4 / 3 epochs → rank 8 / 5 epochs: +3.15 → +3.63 on domains5, +1.60 → +1.91, +2.53 → +3.03, +0.52 → +0.98, +1.88 → +1.76; oracle on domains5 85.9 → 86.5; 15% more time",
        keys=(
            "backbone.name",
            "backbone.pretrained",
            "backbone.img_size",
            "backbone.adapt_last",
            "adapter.rank",
            "train.epochs",
            "train.batch_size",
            "train.lr",
            "train.augment",
            "signature.max_components",
            "head.rp_dim",
            "benchmark.max_train_per_class",
        ),
        common=True,
    ),
    Choice(
        16,
        "the random projection in front of Eq. 23's head",
        'Eq. 23 written on h(x) (l. 273); γ chosen "with the same optimization strategy as in RanPAC"',
        "RanPAC's head as a whole: ReLU(h W_rand) with M = 10,000 (`head.rp_dim`; 2,000 with `--config mobilenet_cpu`), Eq. 23 on it; `head.rp_dim=0` is Eq. 23 on h as written",
        "the paper builds its head on RanPAC's and names no dimension; RanPAC's head is the projected one, and Eq. 23 on h is one setting away",
        "domains5 (46 classes), `proteus-paper`, seed 0, one thread: final 70.87 with M = 0, 69.99 with M = 2,000, 72.39 with M = 10,000 (retrieval 75.02 in all three: the head does not touch it); M = 10,000 took 668 s against 442 (G is 10,000² float64)",
        keys=("head.rp_dim",),
    ),
    Choice(
        17,
        "the ridge on the task covariance (the DP-GMM prior's centre)",
        "not stated",
        "`cov(H) + 10⁻³ tr(cov)/d I` (`signature.prior=ridge`); `sample` is scikit-learn's empirical covariance",
        "scikit-learn's empirical covariance is near singular when a task has about as many embeddings as dimensions",
        "domains5, `proteus-paper`, seed 0, one thread: without the ridge (`sample`) retrieval 75.02 → 67.60 and final 69.99 → 66.56",
        keys=("signature.prior",),
        values=("ridge", "sample"),
    ),
    Choice(
        18,
        "precision of the backbone's forward passes",
        "not stated",
        "bf16 autocast on CUDA (`precision=auto`), float32 on the CPU; `--precision fp32` reproduces exactly",
        "bf16 halves the activations' memory and runs on the tensor cores",
        'domains5, `proteus-paper`, seed 0, one thread, bf16 autocast on the CPU (`--precision bf16`) against float32: final 69.99 → 69.19, retrieval 75.02 → 73.80; on a GPU the share of identical predictions is in docs/performance.md ("bf16 against fp32")',
        keys=("precision",),
        common=True,
    ),
    Choice(
        19,
        "the per-task heads' features",
        "Eq. 23 (on h(x), l. 273)",
        "each task's own head (row 13) classifies h itself, without the random projection; `head.rp_dim` shapes the global head only",
        "a task's head is fitted on its own few classes, where a 10,000-wide projection adds cost and no capacity that the measured rows needed",
        "not measured as a separate choice",
        code="the per-task ridge heads on h, no random projection",
        when=lambda f: _entry("head.scope", f, "per_task"),
        beyond=True,
    ),
    Choice(
        20,
        "the adapter's initialisation",
        "not stated",
        "A kaiming-uniform (PEFT's bound 1/√q) in the complement of the old span, B = 0, S = 0: each task starts from the previous tasks' model",
        "PEFT's LoRA initialisation: ΔW = 0 at the start of each task",
        "not measured",
        code="A kaiming-uniform, B = 0, S = 0",
        when=_adapter,
    ),
    Choice(
        21,
        "the training loss's head",
        "a task's loss L(D_k, ·), e.g. cross-entropy (l. 109); no head named",
        "cross-entropy through a fresh linear head over the task's own classes, trained with the adapter and dropped after the task",
        "the adapter learns to separate the task's classes; prediction uses Eq. 23's parameter-free head, never this one",
        "not measured",
        code="cross-entropy through a fresh per-task linear head",
        when=_adapter,
    ),
    Choice(
        22,
        "the elastic net's ℓ2 term",
        "λ(α‖S‖₁ + (1 - α)‖S‖₂) with S = blkdiag(S_1, …, S_k) (Eq. 15)",
        "‖s‖₂ of each adapted map's coefficients, summed over the maps (a group norm per map), not the norm of all of S",
        "each map's S is its own parameter; the proximal step shrinks each group by its own norm",
        "not measured",
        code="the ℓ2 term summed per adapted map",
        when=lambda f: (
            _learned_s(f) and float(f.get("adapter.lam") or 0) > 0 and float(f.get("adapter.alpha") or 0) < 1
        ),
    ),
    Choice(
        23,
        "class order",
        "not stated (no seeds and no class order)",
        "one class order for every seed: a `RandomState(benchmark.class_order_seed)` permutation, 1993 by default (the class order of the CIL codes the baselines come from); the seed moves everything else",
        'the same tasks for every seed and method, so that methods compare on the same stream; "± std over seeds" leaves out the class order\'s variance',
        "not measured: `--set benchmark.class_order_seed=N` gives another order",
        keys=("benchmark.class_order_seed",),
        common=True,
    ),
    Choice(
        24,
        "K-means clusters' covariance (the `kmeans` ablation)",
        "K-means with K = 20 in place of the DP-GMM (l. 834); no covariance rule",
        "each cluster's scatter shrunk towards the pooled within-cluster covariance (plus the prior's ridge): (n_k S_k + d S_pool) / (n_k + d)",
        "a cluster of fewer points than dimensions has a singular scatter; d pseudo-points of the pooled covariance make every cluster's covariance invertible",
        "not measured separately; it is inside the `kmeans` comparison (domains5: K-means +5.2 retrieval over the DP-GMM)",
        code="(n_k S_k + d S_pool) / (n_k + d)",
        when=lambda f: _gaussian(f) and _entry("signature.method", f, "pooled_scatter"),
    ),
    Choice(
        25,
        "the data's split",
        "not stated (RevisitingCIL's benchmarks, l. 289)",
        "each dataset's own train / test folders (`benchmark.split=folders`, the convention of RanPAC and LAMDA-PILOT); ImageNet-R also as CODA-Prompt's fixed 24,000 / 6,000 split (`coda`)",
        "the folders the paper's data sources ship",
        "not measured: numbers of the two conventions are not comparable",
        keys=("benchmark.split",),
        common=True,
    ),
    Choice(
        26,
        "RanPAC's first-session training",
        "LoRA trained on the first task's data (l. 79)",
        "PROTEUS's trainer on task 1: LoRA on the same maps, Adam, the preset's epochs, learning rate and batch",
        "RanPAC's released code trains its first session with its own schedule; the paper gives RanPAC no settings of its own",
        "not measured",
        code="the first task's adapter trained with PROTEUS's trainer and settings",
        when=lambda f: _entry("train.tasks", f, "first_session") and bool(f.get("adapter.enabled")),
    ),
    Choice(
        27,
        "a local stream in place of the paper's benchmark",
        "the benchmark of the paper's table",
        "`--benchmark LOCAL` runs the table on another stream (domains5, the CIFAR-10 subset, ...), compared with the paper's column it stands in for",
        "the paper's datasets are not on this machine",
        "the paper's numbers are a reference, not a target",
        keys=("benchmark.name", "benchmark.num_tasks"),
        common=True,
    ),
    Choice(
        28,
        "a baseline's released settings on a local stream",
        'each baseline with "the optimal configuration provided in their released code" (l. 1011)',
        "on a local stream a baseline runs with its declared defaults (its own optimiser and learning rate) and the `--config`'s epochs, not its released config (that config is for the paper's benchmarks)",
        "the released configs are tuned for the paper's datasets and ViT-B/16",
        "not measured",
        code="its released config not applied",
        when=lambda f: False,  # added by the plan, which knows whether a released config applies
        common=True,
    ),
    Choice(
        29,
        "the budget schedule's rounding and floor",
        "r_m = r₀ exp(-α(m - 1)) (l. 874)",
        "r_m rounded to the nearest integer, at least `adapter.min_rank` (1)",
        "a rank is a whole number of directions, and a task with none would learn nothing",
        "not measured",
        keys=("adapter.min_rank",),
    ),
    Choice(
        30,
        "a shortlist of tasks for the Gaussian keys",
        "every task scored (Alg. 2)",
        "off in every packaged method; `retrieval.candidates=c` scores only the c tasks that cheap LDA keys in one space (`retrieval.candidate_space`) rank highest",
        "c + 1 forwards per input instead of one per task",
        "docs/performance.md (candidates: time and agreement with every task scored)",
        keys=("retrieval.candidates", "retrieval.candidate_space"),
    ),
)


def choice(number: int) -> Choice:
    """The row ``number`` of :data:`CHOICES`."""
    return next(c for c in CHOICES if c.number == number)


def _check(choices: Sequence[Choice]) -> None:
    numbers = [c.number for c in choices]
    if len(set(numbers)) != len(numbers):
        raise ValueError("paper_settings: a row number twice")
    for c in choices:
        if not c.keys and not c.code:
            raise ValueError(f"paper_settings: row {c.number} names no key and no choice of the code")


_check(CHOICES)


# ------------------------------------------------------------------------------------- departures
@dataclass(frozen=True)
class Departure:
    """One way a cell departs from the paper: a config ``key`` (None for a choice of the code) with our
    value and the paper's (:data:`OPEN` when it states none), and the ``row`` of :data:`CHOICES` that
    explains it (None: unlisted)."""

    row: int | None
    key: str | None
    ours: Any
    paper: Any
    #: what the reference is: "paper" (the paper's statement) or "own" (the method's own settings on the
    #: paper's benchmark and preset, for a method the paper gives no recipe of its own)
    basis: str = "paper"
    #: the paper's words for its value, with the line
    says: str = ""

    def text(self) -> str:
        name = (
            f"#{self.row} {choice(self.row).name}"
            if self.row is not None
            else "unlisted (no row explains it)"
        )
        if self.key is None:
            return f"{name}: {self.ours}"
        if self.paper is OPEN:
            paper = "the paper: not stated"
        elif self.basis == "own":
            paper = f"on the paper's benchmark: {_fmt(self.paper)}"
        else:
            paper = f"the paper: {_fmt(self.paper)}" + (f"; {self.says}" if self.says else "")
        return f"{name}: `{self.key}={_fmt(self.ours)}` ({paper})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "choice": choice(self.row).name if self.row is not None else None,
            "key": self.key,
            "ours": self.ours,
            "paper": None if self.paper is OPEN else self.paper,
            "paper_states": self.paper is not OPEN,
            "basis": self.basis,
        }


def paper_family(method: str) -> str:
    """How the paper's statement of ``method`` is read: ``"paper"`` (``proteus-paper`` and the ablations
    built on it: the paper's PROTEUS with the ablation's own change), ``"default"`` (``proteus`` and what
    derives from it: the paper's PROTEUS, every change ours) or ``"own"`` (RanPAC, the frozen backbone,
    the baselines: the method's own declaration and released settings)."""
    from proteus.config import METHODS

    return METHODS.get(method).paper_reading()[0]


def _ablation(method: str) -> dict[str, Any]:
    """The settings an ablation of ``proteus-paper`` changes (the paper's own change): what its chain
    declares below the method that reads as the paper."""
    from proteus.config import METHODS

    chain = METHODS.get(method).chain()
    _, paper = METHODS.get(method).paper_reading()
    below = chain[chain.index(paper) + 1 :] if paper is not None else []
    return {k: v for m in below for k, v in m.overrides.items()}


def departures(
    flat: Mapping[str, Any],
    paper_benchmark: str,
    method: str,
    cell_settings: Mapping[str, Any] | None = None,
    own: Mapping[str, Any] | None = None,
    released_skipped: str | None = None,
) -> list[Departure]:
    """Every departure from the paper of the resolved settings ``flat`` (dotted keys) of a cell on
    ``paper_benchmark`` (the paper's, or the one a local stream stands in for).

    ``cell_settings``: what the paper states for this cell beyond the method (a variant's and a table's
    settings, e.g. ``adapter.alpha=0.1``). ``own``: for a method read as its own declaration
    (:func:`paper_family` ``"own"``), its settings on the paper's benchmark and preset; its departures
    are the keys that differ from those, plus the rows that concern every method. ``released_skipped``:
    the released config a baseline has on the paper's benchmark, not applied to this cell (row 28)."""
    family = paper_family(method)
    stated: dict[str, Any] = {k: stated_value(k, paper_benchmark) for k in STATED}
    if family == "paper":
        stated.update(_ablation(method))
    stated.update(cell_settings or {})
    out: list[Departure] = []

    def add(key: str, value: Any, paper: Any) -> None:
        rows = [c for c in CHOICES if c.covers(key, value) and (family != "own" or c.common)]
        if family == "own" and not rows and paper is OPEN:
            return  # an open key of the method's own recipe: its declaration is the paper's statement
        rows.sort(key=lambda c: c.common)  # the row of the choice itself before the rows of a setup
        basis = "own" if family == "own" and paper is not OPEN and paper != stated.get(key, OPEN) else "paper"
        if paper is OPEN or key not in STATED:
            says = ""
        elif paper == stated_value(key, paper_benchmark):
            says = STATED[key].says
        else:
            says = "the setting of this table, method or variant"
        out.append(Departure(rows[0].number if rows else None, key, value, paper, basis, says))

    common_keys = {k for c in CHOICES if c.common for k in c.keys}
    if family == "own":  # its own settings on the paper's preset, the paper's for what concerns every method
        reference: dict[str, Any] = dict(own or {})
        reference.update({k: stated[k] for k in STATED if k.startswith(("backbone.", "benchmark."))})
        reference.update({k: OPEN for k in common_keys if k not in STATED and not k.startswith("train.")})
    else:
        reference = stated
    for key in sorted(flat):
        if bookkeeping(key) or not active(key, flat):
            continue
        value, paper = flat[key], reference.get(key, OPEN)
        if paper is OPEN or value != paper:
            add(key, value, paper)
    for c in CHOICES:
        if c.in_force(flat) and (family != "own" or c.common or c.number == 26):
            out.append(Departure(c.number, None, c.code, OPEN))
    if released_skipped:
        out.append(Departure(28, None, f"its released config `{released_skipped}` not applied", OPEN))
    return sorted(out, key=lambda d: (d.row is not None, d.row or 0, d.key or ""))


# ------------------------------------------------------------------------------------- the docs' tables
def _fmt(v: Any) -> str:
    return "null" if v is None else str(v)


def _cell(c: Choice, per_bench: dict[str, list[Departure]], flats: dict[str, Mapping[str, Any]]) -> str:
    """A method's cell of row ``c``: its values where the row applies on the paper's presets, "as the
    paper" where its keys are the paper's, "—" where the row is not in force."""
    values: dict[str, list[str]] = {}
    for bench, deps in per_bench.items():
        shown = [
            f"`{d.key}={_fmt(d.ours)}`" if d.key is not None else str(d.ours)
            for d in deps
            if d.row == c.number
        ]
        if shown:
            values.setdefault(", ".join(shown), []).append(bench)
    if values:
        if len(values) == 1:
            return next(iter(values))
        return "; ".join(f"{v} ({', '.join(b)})" for v, b in values.items())
    in_force = [k for k in c.keys if any(active(k, f) for f in flats.values())]
    return "as the paper" if in_force and all(k in STATED for k in in_force) else "—"


def differences_tables(
    methods: Sequence[str] = ("proteus-paper", "proteus-dpgmm", "proteus"),
) -> dict[str, str]:
    """The differences tables of docs/experiments.md in Markdown, by the name of their block on the page:
    ``differences`` (the paper's recipe and the setup) and ``differences-beyond`` (the default's own
    retrieval and head), each method's values resolved on every paper benchmark a packaged preset builds."""
    from proteus.config import flatten, resolve_config
    from proteus.experiment.paper_tables import PAPER_BENCHMARKS

    per: dict[str, dict[str, list[Departure]]] = {}
    flats: dict[str, dict[str, Mapping[str, Any]]] = {}
    for m in methods:
        per[m], flats[m] = {}, {}
        for b, pb in PAPER_BENCHMARKS.items():
            if pb.preset is None:
                continue
            flat = flatten(resolve_config(benchmark=pb.preset, method=m).to_dict())
            flats[m][b], per[m][b] = flat, departures(flat, b, m)
    head = [
        "#",
        "choice",
        "the paper says",
        *(f"`{m}`" for m in methods),
        "what we do",
        "why",
        "measured effect",
    ]
    out: dict[str, str] = {}
    for name, beyond in (("differences", False), ("differences-beyond", True)):
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for c in CHOICES:
            if c.beyond != beyond:
                continue
            cells = [str(c.number), c.name, c.paper, *(_cell(c, per[m], flats[m]) for m in methods)]
            cells += [c.ours, c.why, c.effect]
            lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
        out[name] = "\n".join(lines) + "\n"
    return out
