"""The PROTEUS paper's experiments as data: every table and figure of Sec. 5 and the Appendix, named by its
``\\label`` in the paper's source, with the benchmarks, methods, settings, seeds and metrics that make it
and the numbers the paper publishes (each transcribed with the line of the paper's LaTeX source it comes
from, ``shared/spec/000_b8a2b9b06c209d3d.txt``).

:mod:`proteus.experiment.reproduce` runs an entry (``proteus reproduce NAME``) and lays our numbers out
beside these. Nothing here runs anything: an entry is plain data.

A table is a grid of cells; each cell is one (variant, benchmark, metric[, task]) and holds our mean over
seeds beside the paper's number. ``rows`` and ``cols`` name the axes of the paper's layout (``variant``,
``benchmark``, ``metric``, ``task``). A *variant* is a method with dotted settings on top of it: one row
(or column) of the paper's table, run with ``proteus compare``.
"""

# ruff: noqa: E501 -- one published row per line, each with the line of the paper it comes from
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "ENTRIES",
    "LOCAL_STANDS_FOR",
    "METRICS",
    "PAPER_BENCHMARKS",
    "Entry",
    "PaperBenchmark",
    "Published",
    "Variant",
    "entry",
]


@dataclass(frozen=True)
class PaperBenchmark:
    """A benchmark of the paper: its title in the tables, the packaged preset that builds it (None: none
    does, ``why`` says why) and the folder under a data root that holds it."""

    title: str
    preset: str | None
    data: str | None = None
    why: str = ""


#: the paper's benchmarks (Sec. 5.1, Appendix "Datasets, Hyperparameters ..." and the long-sequence and
#: memory-budget sections) and the presets that build them (docs/experiments.md, "Configurations")
PAPER_BENCHMARKS: dict[str, PaperBenchmark] = {
    "cifar100": PaperBenchmark("CIFAR-100", "cifar100", "cifar100"),
    "imagenet-r": PaperBenchmark("ImageNet-R", "imagenet-r", "imagenet-r"),
    "imagenet-a": PaperBenchmark("ImageNet-A", "imagenet-a", "imagenet-a"),
    "vtab5t-large": PaperBenchmark("VTAB5T-large", "vtab5t-large", "vtab-large"),
    "vtab5t": PaperBenchmark("VTAB5T-small", "vtab5t", "vtab"),
    "vtab-sim50": PaperBenchmark("VTAB-Sim50", "vtab-sim50", "vtab-large"),
    "cifar100-50": PaperBenchmark("CIFAR-100 (50 tasks)", "cifar100-50", "cifar100"),
    "imagenet-r-100": PaperBenchmark("ImageNet-R (100 tasks)", "imagenet-r-100", "imagenet-r"),
    "cifar100-budget": PaperBenchmark("CIFAR-100 (20 tasks)", "cifar100-budget", "cifar100"),
    "imagenet-r-budget": PaperBenchmark("ImageNet-R (20 tasks)", "imagenet-r-budget", "imagenet-r"),
    "vtab19": PaperBenchmark(
        "VTAB (19 tasks)",
        None,
        why="no benchmark builds the paper's 19-task VTAB: the paper does not say which 19 datasets, classes "
        "and splits form its tasks",
    ),
}

#: the paper benchmark whose numbers a local stream is compared with by default (its shape: domains5 is
#: VTAB5T's uniformly abrupt sequence of five visual domains, domains-sim the vtab-sim50 recipe, the
#: CIFAR-10 subset CIFAR-100's uniformly mild one); ``--benchmark LOCAL:PAPER`` chooses another
LOCAL_STANDS_FOR: dict[str, str] = {
    "domains5": "vtab5t",
    "domains-sim": "vtab-sim50",
    "cifar10": "cifar100",
}

#: metric name -> (column title, unit); a ``@`` metric is per task (``acc@`` the average accuracy after
#: task k; ``latency@`` the seconds of ``predict`` on one batch of 32 with the first m tasks)
METRICS: dict[str, tuple[str, str]] = {
    "acc": ("final avg acc", "%"),
    "forgetting": ("forgetting", "%"),
    "retrieval": ("retrieval", "%"),
    "oracle": ("oracle", "%"),
    "acc@": ("avg acc after task", "%"),
    "retrieval@": ("retrieval after task", "%"),
    "latency@": ("seconds per batch of 32", "s"),
    "delta@": ("empirical δ", ""),
    "min_delta_a23@": ("minimum δ, σ² of A2-3 (as the paper)", ""),
    "min_delta@": ("minimum δ, σ² = V[Z]/d (the proof's)", ""),
    "s_nonzero@": ("share of non-zero S", ""),
    "orthogonality": ("max |cos| between tasks' updates", ""),
    "params": ("trainable parameters", ""),
    "inference": ("seconds per batch of 32, every task", "s"),
    "retrieval_gain": ("retrieval accuracy gain of PROTEUS", "%/s"),
    "n_train": ("# train samples", ""),
    "n_test": ("# test samples", ""),
    "classes": ("# classes", ""),
    "gpu_memory": ("peak GPU memory", "MB"),
}


@dataclass(frozen=True)
class Variant:
    """One row (or column) of a table: a method and the dotted settings on top of it (``KEY=VALUE``, as
    ``--set`` writes them). ``configs`` maps a paper benchmark to the method's packaged config used on it
    when the paper's own benchmarks run (a baseline's released settings; not used on a local stream)."""

    label: str
    method: str
    settings: tuple[str, ...] = ()
    configs: dict[str, str] = field(default_factory=dict)
    #: beyond the paper: a row of ours the paper does not have (shown without a paper number)
    extra: bool = False


#: a published number: (mean, std) or (mean, None), or a string the paper prints instead ("OOM")
Published = tuple[float, float | None] | str


@dataclass(frozen=True)
class Entry:
    """A table or figure of the paper (see the module docstring).

    ``paper`` holds the published numbers by (variant label, benchmark, metric, task or None);
    ``settings`` apply to every cell (before the variant's own, after ``--config``); ``unsupported``
    says why the harness cannot measure it (the plan still lists its cells); ``notes`` go under the
    table."""

    name: str
    kind: str  # "table" or "figure"
    title: str
    lines: str  # where the paper's source defines it
    benchmarks: tuple[str, ...]
    variants: tuple[Variant, ...]
    metrics: tuple[str, ...]
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    paper: dict[tuple[str, str, str, int | None], Published] = field(default_factory=dict)
    settings: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0, 1, 2)
    #: the variant a ``retrieval_gain`` is measured against (PROTEUS): (its retrieval - the variant's) / (its
    #: inference time - the variant's), from the means over seeds
    reference: str = ""
    #: the paper's task indices of a per-task table (on a local stream: our own tasks)
    tasks: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()
    unsupported: str = ""
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        what = "table" if self.kind == "table" else "figure"
        bench = ", ".join(self.benchmarks)
        return f"{what}, {self.title} ({bench}; {len(self.variants)} variants; l. {self.lines})"


def _released(name: str, imagenet_r: bool = True) -> dict[str, str]:
    """A baseline's packaged configs: its ImageNet-R one there (if it has one), its CIFAR-100 one on every
    other paper benchmark (the released codes have no settings for ImageNet-A and the VTABs)."""
    out = {b: f"{name}-cifar100" for b in PAPER_BENCHMARKS}
    if imagenet_r:
        for b in ("imagenet-r", "imagenet-r-100", "imagenet-r-budget"):
            out[b] = f"{name}-imagenet-r"
    return out


# ----------------------------------------------------------------------------- the methods of Table 1
L2P = Variant("L2P", "l2p", configs=_released("l2p", imagenet_r=False))
DUALPROMPT = Variant("DualPrompt", "dualprompt", configs=_released("dualprompt"))
CODA = Variant("CODAPrompt", "coda-prompt", configs=_released("coda-prompt"))
SPROMPT = Variant("SPrompt", "s-prompt", configs=_released("s-prompt"))
ADAPROMPT = Variant("AdaPromptCL", "adapromptcl", configs=_released("adapromptcl"))
HIDE = Variant("HiDE-Prompt", "hide-prompt", configs=_released("hide-prompt"))
INFLORA = Variant("InfLoRA", "inflora", configs=_released("inflora"))
SDLORA = Variant("SD-LoRA", "sd-lora", configs=_released("sd-lora"))
RANPAC = Variant("RanPAC", "ranpac")
PROTEUS = Variant("PROTEUS", "proteus-paper")
#: the lighter variants of l. 1034: LoRA on the first 8 or 4 of ViT-B/16's 12 blocks, as shares of the
#: adaptable blocks (so that a backbone with another number of them keeps the proportion: the first 4 and 2 of
#: the 6 that ``--config mobilenet_cpu`` adapts)
FIRST8 = Variant("PROTEUS, first 8 blocks", "proteus-paper", ("adapter.blocks=first:2/3",))
FIRST4 = Variant("PROTEUS, first 4 blocks", "proteus-paper", ("adapter.blocks=first:1/3",))
#: our default, beyond the paper (docs/experiments.md rows 11-14 and 19)
OURS = Variant("proteus (default, beyond the paper)", "proteus", extra=True)

MAIN_BENCHMARKS = ("cifar100", "imagenet-r", "imagenet-a", "vtab5t-large", "vtab5t", "vtab-sim50")


def _grid(
    table: dict[str, tuple[Published, ...]], benchmarks: tuple[str, ...], metric: str
) -> dict[tuple[str, str, str, int | None], Published]:
    """Published numbers of a (row label -> one value per benchmark) table."""
    out: dict[tuple[str, str, str, int | None], Published] = {}
    for label, values in table.items():
        if len(values) != len(benchmarks):
            raise ValueError(f"{label}: {len(values)} values for {len(benchmarks)} benchmarks")
        for b, v in zip(benchmarks, values):
            out[(label, b, metric, None)] = v
    return out


def _per_task(
    label: str, benchmark: str, metric: str, tasks: tuple[int, ...], values: tuple[float, ...]
) -> dict[tuple[str, str, str, int | None], Published]:
    if len(tasks) != len(values):
        raise ValueError(f"{label}: {len(values)} values for {len(tasks)} tasks")
    return {(label, benchmark, metric, t): (v, None) for t, v in zip(tasks, values)}


ENTRIES: list[Entry] = [
    Entry(
        "main-table",
        "table",
        "Table 1: final average accuracy across the three semantic-gap scenarios",
        "298-329",
        MAIN_BENCHMARKS,
        (L2P, DUALPROMPT, CODA, SPROMPT, ADAPROMPT, HIDE, INFLORA, SDLORA, RANPAC, PROTEUS, OURS),
        ("acc",),
        rows=("variant",),
        cols=("benchmark",),
        paper=_grid(
            {
                "L2P": (
                    (84.59, 0.44),
                    (61.48, 0.21),
                    (45.36, 1.66),
                    (60.46, 1.24),
                    (65.32, 5.14),
                    (80.24, 1.46),
                ),  # l. 312
                "DualPrompt": (
                    (85.26, 0.26),
                    (69.38, 0.26),
                    (49.37, 0.79),
                    (71.84, 0.37),
                    (75.30, 1.57),
                    (87.74, 0.33),
                ),  # l. 313
                "CODAPrompt": (
                    (84.24, 3.11),
                    (75.39, 0.48),
                    (52.86, 0.41),
                    (25.57, 1.14),
                    (73.52, 0.27),
                    (86.01, 1.91),
                ),  # l. 314
                "SPrompt": (
                    (87.04, 0.34),
                    (67.71, 0.73),
                    (40.49, 0.26),
                    (77.37, 0.67),
                    (85.64, 0.28),
                    (90.69, 0.22),
                ),  # l. 315
                "AdaPromptCL": (
                    (79.87, 2.10),
                    (65.63, 0.78),
                    (48.67, 0.80),
                    (65.48, 1.83),
                    (71.86, 2.86),
                    (77.86, 1.62),
                ),  # l. 316
                "HiDE-Prompt": (
                    (92.79, 0.94),
                    (73.00, 0.48),
                    (40.81, 0.74),
                    "OOM",
                    (68.44, 1.14),
                    "OOM",
                ),  # l. 317
                "InfLoRA": (
                    (86.45, 0.21),
                    (74.55, 0.50),
                    (47.88, 0.71),
                    (32.58, 1.81),
                    (90.55, 0.88),
                    (91.25, 0.25),
                ),  # l. 319
                "SD-LoRA": (
                    (87.08, 0.44),
                    (75.81, 0.67),
                    (52.03, 0.64),
                    (26.13, 5.59),
                    (91.02, 0.76),
                    (84.91, 1.95),
                ),  # l. 320
                "RanPAC": (
                    (92.01, 0.19),
                    (78.08, 0.30),
                    (62.76, 1.09),
                    (85.84, 0.24),
                    (92.34, 0.13),
                    (90.22, 0.24),
                ),  # l. 321
                "PROTEUS": (
                    (94.10, 0.64),
                    (82.17, 0.54),
                    (63.19, 0.82),
                    (89.37, 1.94),
                    (94.24, 1.73),
                    (95.89, 0.80),
                ),  # l. 323
            },
            MAIN_BENCHMARKS,
            "acc",
        ),  # fmt: skip
        notes=(
            "PROTEUS is `proteus-paper` (every choice the paper states); `proteus`, our default, is a row "
            "beyond the paper. RanPAC is `ranpac` with RanPAC's own γ rule (`head.gamma_selection=task`).",
        ),
    ),
    Entry(
        "accuracy-tasks",
        "figure",
        "Fig. 3: average accuracy after each task (CIFAR-100, VTAB5T-small, VTAB-Sim50)",
        "346-351",
        ("cifar100", "vtab5t", "vtab-sim50"),
        (L2P, DUALPROMPT, CODA, SPROMPT, ADAPROMPT, HIDE, INFLORA, SDLORA, RANPAC, PROTEUS, OURS),
        ("acc@",),
        rows=("benchmark", "variant"),
        cols=("task",),
        aliases=("accuracy-per-task",),
        notes=("A figure: the paper prints no numbers. The same runs as `main-table` (reused).",),
    ),
    Entry(
        "boxplots",
        "figure",
        "Fig. 2: empirical separation factor δ against Theorem 3.6's minimum (Split CIFAR-100)",
        "338-344",
        ("cifar100",),
        (PROTEUS,),
        ("delta@", "min_delta_a23@", "min_delta@"),
        rows=("metric",),
        cols=("task",),
        seeds=(0,),
        notes=(
            "A figure: the paper prints no numbers. Each run's `figures/delta_boxplot.png` draws the "
            "distribution; this table gives the per-task means (`results.json` → `theory.per_task`).",
        ),
    ),
    Entry(
        "wo_matching",
        "table",
        "Table 2: PROTEUS with and without retrieval (the last task's adapter for every input)",
        "358-382",
        MAIN_BENCHMARKS,
        (Variant("w/ Retrieval", "proteus-paper"), Variant("w/o Retrieval", "last-lora")),
        ("acc",),
        rows=("benchmark",),
        cols=("variant",),
        paper={
            **_grid(
                {
                    "w/ Retrieval": (
                        (94.10, None),
                        (82.17, None),
                        (63.19, None),
                        (89.37, None),
                        (94.24, None),
                        (95.89, None),
                    )
                },
                MAIN_BENCHMARKS,
                "acc",
            ),  # l. 370-377
            **_grid(
                {
                    "w/o Retrieval": (
                        (76.96, None),
                        (57.07, None),
                        (35.03, None),
                        (70.07, None),
                        (61.65, None),
                        (78.90, None),
                    )
                },
                MAIN_BENCHMARKS,
                "acc",
            ),  # l. 370-377
        },  # fmt: skip
    ),
    Entry(
        "matching_comparison",
        "table",
        "Table 3: task retrieval accuracy of the retrieval-based methods",
        "384-401",
        ("imagenet-r", "vtab5t", "vtab-sim50"),
        (
            Variant("D-Prompt", "dualprompt", configs=DUALPROMPT.configs),
            Variant("SPrompt", "s-prompt", configs=SPROMPT.configs),
            Variant("HiDE", "hide-prompt", configs=HIDE.configs),
            PROTEUS,
            OURS,
        ),
        ("retrieval",),
        rows=("variant",),
        cols=("benchmark",),
        paper=_grid(
            {
                "D-Prompt": ((38.59, None), (61.35, None), (82.40, None)),  # l. 392
                "SPrompt": ((42.52, None), (77.26, None), (90.43, None)),  # l. 393
                "HiDE": ((47.23, None), (69.87, None), "OOM"),  # l. 394
                "PROTEUS": ((96.02, None), (97.97, None), (97.16, None)),  # l. 396
            },
            ("imagenet-r", "vtab5t", "vtab-sim50"),
            "retrieval",
        ),
        aliases=("retrieval",),
        notes=(
            "DualPrompt's retrieval is its e-prompt key match; ours reports a retrieval only for the methods "
            "that pick a task (S-Prompt's K-Means keys, HiDe-Prompt's stage-1 TII, PROTEUS's signatures).",
        ),
    ),
    Entry(
        "ablationS",
        "table",
        "Table 10: classification and retrieval with S = 0, S = I, λ = 0 (ImageNet-R)",
        "755-773",
        ("imagenet-r",),
        (
            Variant("S = 0", "proteus-s0"),
            Variant("S = I", "proteus-si"),
            Variant("S*, λ = 0", "proteus-lambda0"),
            Variant("S*, λ > 0", "proteus-paper"),
        ),
        ("acc", "retrieval"),
        rows=("variant",),
        cols=("metric",),
        paper={
            ("S = 0", "imagenet-r", "acc", None): (78.98, None),  # l. 765
            ("S = 0", "imagenet-r", "retrieval", None): (87.05, None),  # l. 765
            ("S = I", "imagenet-r", "acc", None): (30.38, None),  # l. 766
            ("S = I", "imagenet-r", "retrieval", None): (41.45, None),  # l. 766
            ("S*, λ = 0", "imagenet-r", "acc", None): (30.49, None),  # l. 767
            ("S*, λ = 0", "imagenet-r", "retrieval", None): (41.97, None),  # l. 767
            ("S*, λ > 0", "imagenet-r", "acc", None): (82.17, None),  # l. 768
            ("S*, λ > 0", "imagenet-r", "retrieval", None): (96.03, None),  # l. 768
        },
        notes=(
            "Every row is `proteus-paper` with one change: S = 0 also drops the orthogonality constraint "
            "(the paper's 'no knowledge transfer', l. 413), S = I reuses every old direction in full, λ = 0 "
            "drops the elastic net on S.",
        ),
    ),
    Entry(
        "topkG",
        "table",
        "Top-K Gaussians retrieval, K = 1, 3, 5 (VTAB5T-small, VTAB5T-large)",
        "775-788",
        ("vtab5t", "vtab5t-large"),
        (
            Variant("K = 1", "proteus-paper"),
            Variant("K = 3", "proteus-top3"),
            Variant("K = 5", "proteus-top5"),
        ),
        ("acc",),
        rows=("variant",),
        cols=("benchmark",),
        paper=_grid(
            {
                "K = 1": ((94.76, None), (89.32, None)),  # l. 782
                "K = 3": ((93.72, None), (76.50, None)),  # l. 783
                "K = 5": ((92.34, None), (76.25, None)),  # l. 784
            },
            ("vtab5t", "vtab5t-large"),
            "acc",
        ),
        notes=(
            "K = 1 here (94.76, 89.32) differs from Table 1's PROTEUS (94.24, 89.37): the paper's own runs.",
        ),
    ),
    Entry(
        "synergy-pooling-matching",
        "figure",
        "Retrieval with and without adaptive fine-tuning (S = 0, no orthogonality)",
        "723-728",
        MAIN_BENCHMARKS,
        (PROTEUS, Variant("w/o adaptive FT", "proteus-s0")),
        ("retrieval",),
        rows=("benchmark",),
        cols=("variant",),
        notes=("A figure: the paper prints no numbers (its benchmarks are not named; Table 1's are used).",),
    ),
    Entry(
        "delta_50T",
        "table",
        "Empirical δ against Theorem 3.6's minimum, Split CIFAR-100 in 50 tasks",
        "732-746",
        ("cifar100-50",),
        (PROTEUS,),
        ("delta@", "min_delta_a23@", "min_delta@"),
        rows=("metric",),
        cols=("task",),
        seeds=(0,),
        tasks=(5, 10, 15, 20, 25, 30, 35, 40, 45, 50),
        paper={
            **_per_task(
                "PROTEUS",
                "cifar100-50",
                "delta@",
                (5, 10, 15, 20, 25, 30, 35, 40, 45, 50),
                (163.01, 105.02, 163.31, 159.36, 140.94, 98.93, 128.74, 88.84, 145.01, 143.41),
            ),  # l. 740
            **_per_task(
                "PROTEUS",
                "cifar100-50",
                "min_delta_a23@",
                (5, 10, 15, 20, 25, 30, 35, 40, 45, 50),
                (5.17, 6.60, 5.67, 5.88, 5.71, 6.24, 4.68, 6.31, 5.40, 6.59),
            ),  # l. 742
        },  # fmt: skip
        notes=(
            "The paper's 'theoretical δ' matches Theorem 3.6 with σ² of assumption A2-3 (V[h] ≤ dσ²); the "
            "proof's Bernstein step needs V[Z] ≤ dσ² instead, the last row (docs/experiments.md, theory).",
        ),
    ),
    Entry(
        "heatmap",
        "figure",
        "Fig. 5: S heatmaps on ImageNet-R with λ > 0 and λ = 0 (sparsity of S per task)",
        "796-816",
        ("imagenet-r",),
        (PROTEUS, Variant("λ = 0", "proteus-lambda0")),
        ("s_nonzero@",),
        rows=("variant",),
        cols=("task",),
        seeds=(0,),
        notes=(
            "A figure: each run draws `figures/s_heatmaps.png`; the table gives the share of non-zero S.",
        ),
    ),
    Entry(
        "sim_vtab_large_qv",
        "figure",
        "Fig. 6: pairwise cosine of the tasks' LoRA directions, VTAB5T-large",
        "819-824",
        ("vtab5t-large",),
        (PROTEUS,),
        ("orthogonality",),
        rows=("variant",),
        cols=("metric",),
        seeds=(0,),
        notes=("A figure: each run draws `figures/unit_cosines.png`; the paper says 'vanishingly small'.",),
    ),
    Entry(
        "similarity_INA_QV_Lora",
        "figure",
        "Fig. 7: pairwise cosine of the tasks' LoRA directions, ImageNet-A",
        "826-831",
        ("imagenet-a",),
        (PROTEUS,),
        ("orthogonality",),
        rows=("variant",),
        cols=("metric",),
        seeds=(0,),
        notes=("A figure: each run draws `figures/unit_cosines.png`.",),
    ),
    Entry(
        "kmeans",
        "table",
        "DP-GMM against K-means (K = 20) signatures (ImageNet-R, ImageNet-A)",
        "836-858",
        ("imagenet-r", "imagenet-a"),
        (Variant("DP-GMM", "proteus-paper"), Variant("K-Means", "proteus-kmeans")),
        ("acc", "retrieval"),
        rows=("benchmark",),
        cols=("variant", "metric"),
        paper={
            ("DP-GMM", "imagenet-r", "acc", None): (82.69, None),  # l. 854
            ("DP-GMM", "imagenet-r", "retrieval", None): (96.89, None),  # l. 854
            ("K-Means", "imagenet-r", "acc", None): (81.15, None),  # l. 854
            ("K-Means", "imagenet-r", "retrieval", None): (92.75, None),  # l. 854
            ("DP-GMM", "imagenet-a", "acc", None): (63.77, None),  # l. 855
            ("DP-GMM", "imagenet-a", "retrieval", None): (77.55, None),  # l. 855
            ("K-Means", "imagenet-a", "acc", None): (55.34, None),  # l. 855
            ("K-Means", "imagenet-a", "retrieval", None): (63.63, None),  # l. 855
        },
        notes=(
            "`proteus-kmeans` sets K = 20 (`signature.max_components=20`), as the paper does. A `--config` "
            "comes after the method, so one that sets `signature.max_components` sets K too "
            "(mobilenet_cpu: K = T = 10); `--plan` lists it as a departure.",
        ),
    ),
    Entry(
        "complexity",
        "figure",
        "Peak GPU memory during training (ImageNet-A)",
        "860-868",
        ("imagenet-a",),
        (L2P, DUALPROMPT, CODA, SPROMPT, ADAPROMPT, HIDE, INFLORA, SDLORA, RANPAC, PROTEUS),
        ("gpu_memory",),
        rows=("variant",),
        cols=("metric",),
        seeds=(0,),
        aliases=("memory",),
        notes=(
            "A figure: the paper prints no numbers; it says PROTEUS uses the least memory. Ours is the "
            "largest `peak_gpu_mb` over a run's tasks (`results.json` → `tasks`), recorded on CUDA only: "
            "'-' on a CPU.",
        ),
    ),
    Entry(
        "budget_cifar100",
        "table",
        "Budget-constrained rank r_m = r_0 exp(-0.05 (m - 1)) against fixed r = 10, CIFAR-100 in 20 tasks",
        "887-901",
        ("cifar100-budget",),
        (Variant("Budget-Constrained", "proteus-budget"), Variant("Unconstrained", "proteus-paper")),
        ("acc@",),
        rows=("variant",),
        cols=("task",),
        seeds=(0,),
        tasks=(2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
        paper={
            **_per_task(
                "Budget-Constrained",
                "cifar100-budget",
                "acc@",
                (2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
                (99.1, 98.6, 97.9, 97.57, 96.82, 96.46, 96.22, 96.1, 96.21, 95.43),
            ),  # l. 895
            **_per_task(
                "Unconstrained",
                "cifar100-budget",
                "acc@",
                (2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
                (99.1, 98.4, 97.7, 97.17, 96.74, 96.50, 96.54, 96.51, 96.60, 95.65),
            ),  # l. 897
        },  # fmt: skip
        notes=("r_0 = 10 and τ = 20 components come from the `cifar100-budget` preset (l. 885).",),
    ),
    Entry(
        "budget_imgnr",
        "table",
        "Budget-constrained rank r_m = r_0 exp(-0.1 (m - 1)) against fixed r = 10, ImageNet-R in 20 tasks",
        "904-918",
        ("imagenet-r-budget",),
        (
            Variant("Budget-Constrained", "proteus-budget", ("adapter.budget_decay=0.1",)),
            Variant("Unconstrained", "proteus-paper"),
        ),
        ("acc@",),
        rows=("variant",),
        cols=("task",),
        seeds=(0,),
        tasks=(2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
        paper={
            **_per_task(
                "Budget-Constrained",
                "imagenet-r-budget",
                "acc@",
                (2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
                (87.55, 86.27, 82.43, 82.57, 82.85, 82.86, 81.31, 79.53, 80.04, 79.13),
            ),  # l. 912
            **_per_task(
                "Unconstrained",
                "imagenet-r-budget",
                "acc@",
                (2, 4, 6, 8, 10, 12, 14, 16, 18, 20),
                (90.28, 90.03, 89.36, 88.39, 87.53, 86.92, 87.20, 86.46, 86.74, 86.65),
            ),  # l. 914
        },  # fmt: skip
        notes=("r_0 = 10, α = 0.1 and τ = 50 components (l. 903) come from the preset and the variant.",),
    ),
    Entry(
        "retrieve_significant",
        "table",
        "RanPAC with HiDe's parametric retrieval against RanPAC and PROTEUS (ImageNet-R)",
        "936-953",
        ("imagenet-r",),
        (
            Variant("RanPAC (w/ Retrieval)", "ranpac-hide"),
            Variant("RanPAC (wo/ Retrieval)", "ranpac"),
            PROTEUS,
        ),
        ("acc", "retrieval"),
        rows=("variant",),
        cols=("metric",),
        paper={
            ("RanPAC (w/ Retrieval)", "imagenet-r", "acc", None): (71.79, None),  # l. 945
            ("RanPAC (w/ Retrieval)", "imagenet-r", "retrieval", None): (75.18, None),  # l. 945
            ("RanPAC (wo/ Retrieval)", "imagenet-r", "acc", None): (78.08, None),  # l. 946
            ("RanPAC (wo/ Retrieval)", "imagenet-r", "retrieval", None): "N/A",  # l. 946
            ("PROTEUS", "imagenet-r", "acc", None): (82.17, None),  # l. 948
            ("PROTEUS", "imagenet-r", "retrieval", None): (96.02, None),  # l. 948
        },
        notes=(
            "`ranpac-hide`: a LoRA unit per task (S = 0, no orthogonality), retrieved by HiDe-Prompt's "
            "task-identity inference on the frozen features (its MLP and heads, trained per task and "
            "re-aligned on pseudo-features), then Eq. 23's head with RanPAC's γ rule.",
        ),
    ),
    Entry(
        "lora_position",
        "table",
        "PROTEUS against its O-LoRA and MELO variants, and LoRA on the first 8 or 4 blocks only",
        "958-978",
        ("cifar100", "imagenet-r", "imagenet-a", "vtab5t", "vtab-sim50"),
        (
            Variant("PROTEUS", "proteus-paper"),
            FIRST8,
            FIRST4,
            Variant("O-LoRA", "proteus-all-units"),
            Variant("MELO", "proteus-s0"),
        ),
        ("acc",),
        rows=("benchmark",),
        cols=("variant",),
        paper={
            ("PROTEUS, first 8 blocks", "vtab-sim50", "acc", None): (95.44, None),  # l. 1034
            ("PROTEUS, first 4 blocks", "vtab-sim50", "acc", None): (88.63, None),  # l. 1034
            **_grid(
                {
                    "PROTEUS": (
                        (94.10, None),
                        (82.17, None),
                        (62.76, None),
                        (92.34, None),
                        (95.89, None),
                    ),  # l. 967-972
                    "O-LoRA": (
                        (54.55, None),
                        (53.93, None),
                        (32.11, None),
                        (87.69, None),
                        (90.64, None),
                    ),  # l. 967-972
                    "MELO": (
                        (92.98, None),
                        (78.98, None),
                        (38.47, None),
                        (87.67, None),
                        (91.07, None),
                    ),  # l. 967-972
                },
                ("cifar100", "imagenet-r", "imagenet-a", "vtab5t", "vtab-sim50"),
                "acc",
            ),
        },  # fmt: skip
        notes=(
            "O-LoRA (l. 956): S = 0, no retrieval, every task's unit summed at inference, orthogonal units "
            "(`proteus-all-units`: the constraint held exactly, where O-LoRA penalises ‖A_iᵀA_t‖² softly). "
            "MELO: PROTEUS's retrieval, S = 0 and no orthogonality (`proteus-s0`, the same variant as "
            "`ablationS`'s S = 0).",
            "The paper's PROTEUS column prints RanPAC's Table 1 numbers on ImageNet-A (62.76) and "
            "VTAB5T-small (92.34), not PROTEUS's (63.19, 94.24); transcribed as printed.",
            "LoRA position (l. 1034): the first 8 or 4 of ViT-B/16's 12 blocks (`adapter.blocks=first:2/3`, "
            "`first:1/3`: shares of the adaptable blocks, the first 4 and 2 of the 6 that `--config "
            "mobilenet_cpu` adapts); the paper reports them on VTAB-Sim50 only.",
        ),
    ),
    Entry(
        "retrieval_overhead",
        "table",
        "Retrieval accuracy gain per second of inference over the retrieval-based baselines (ImageNet-R)",
        "992-1004",
        ("imagenet-r",),
        (
            Variant("Dual-Prompt", "dualprompt", configs=DUALPROMPT.configs),
            Variant("SPrompt", "s-prompt", configs=SPROMPT.configs),
            Variant("HiDE", "hide-prompt", configs=HIDE.configs),
            Variant("PROTEUS", "proteus-paper"),
        ),
        ("retrieval_gain", "retrieval", "inference"),
        rows=("metric",),
        cols=("variant",),
        reference="PROTEUS",
        paper={
            ("Dual-Prompt", "imagenet-r", "retrieval_gain", None): (22.29, None),  # l. 1000
            ("SPrompt", "imagenet-r", "retrieval_gain", None): (20.78, None),  # l. 1000
            ("HiDE", "imagenet-r", "retrieval_gain", None): (19.07, None),  # l. 1000
        },
        notes=(
            "The gain is (PROTEUS's retrieval - the baseline's) / (PROTEUS's inference time - the baseline's) "
            "(l. 988), from the means over seeds; inference time is seconds per `predict` on one batch of 32 "
            "test images with every task learned (`results.json` → `inference`, any method). A baseline "
            "without a retrieval of its own (DualPrompt's keys are not reported as one) has no gain ('-').",
        ),
    ),
    Entry(
        "params",
        "table",
        "Trainable parameters and accuracy on VTAB-Sim50",
        "1009-1031",
        ("vtab-sim50",),
        (L2P, DUALPROMPT, SPROMPT, CODA, ADAPROMPT, RANPAC, INFLORA, SDLORA, PROTEUS, FIRST8, FIRST4),
        ("params", "acc"),
        rows=("variant",),
        cols=("metric",),
        paper={
            ("L2P", "vtab-sim50", "params", None): (156868, None),  # l. 1018
            ("L2P", "vtab-sim50", "acc", None): (80.24, 1.46),  # l. 1018
            ("DualPrompt", "vtab-sim50", "params", None): (602308, None),  # l. 1019
            ("DualPrompt", "vtab-sim50", "acc", None): (87.71, 0.33),  # l. 1019 (Table 1 says 87.74)
            ("SPrompt", "vtab-sim50", "params", None): (1650628, None),  # l. 1020
            ("SPrompt", "vtab-sim50", "acc", None): (90.69, 0.22),  # l. 1020
            ("CODAPrompt", "vtab-sim50", "params", None): (3950786, None),  # l. 1021
            ("CODAPrompt", "vtab-sim50", "acc", None): (86.01, 1.91),  # l. 1021
            ("AdaPromptCL", "vtab-sim50", "params", None): (18773186, None),  # l. 1022
            ("AdaPromptCL", "vtab-sim50", "acc", None): (77.86, 1.62),  # l. 1022
            ("RanPAC", "vtab-sim50", "params", None): (213505, None),  # l. 1024
            ("RanPAC", "vtab-sim50", "acc", None): (90.22, 0.24),  # l. 1024
            ("InfLoRA", "vtab-sim50", "params", None): (251992, None),  # l. 1025
            ("InfLoRA", "vtab-sim50", "acc", None): (91.25, 0.25),  # l. 1025
            ("SD-LoRA", "vtab-sim50", "params", None): (464786, None),  # l. 1026
            ("SD-LoRA", "vtab-sim50", "acc", None): (84.91, 1.95),  # l. 1026
            ("PROTEUS", "vtab-sim50", "params", None): (258192, None),  # l. 1034 (text)
            ("PROTEUS", "vtab-sim50", "acc", None): (95.89, 0.80),  # l. 323
            ("PROTEUS, first 8 blocks", "vtab-sim50", "params", None): (209092, None),  # l. 1034
            ("PROTEUS, first 8 blocks", "vtab-sim50", "acc", None): (95.44, None),  # l. 1034
            ("PROTEUS, first 4 blocks", "vtab-sim50", "params", None): (159940, None),  # l. 1034
            ("PROTEUS, first 4 blocks", "vtab-sim50", "acc", None): (88.63, None),  # l. 1034
        },
        notes=(
            "Ours counts the parameters the last task trains (`results.json` → `tasks[-1].trainable_params`): "
            "a baseline's optimised parameters; PROTEUS's new A and B on every adapted map, its learned S "
            "coefficients and its training head over the task's own classes. The paper's 258,192 for "
            "PROTEUS matches one task's A and B on q and v of 12 blocks at r = 4 (147,456) plus a linear head "
            "over all 144 classes (110,736).",
        ),
    ),
    Entry(
        "alpha",
        "figure",
        "Accuracy as the elastic net's α varies from 0.1 to 1.0 (VTAB5T-small)",
        "1035-1047",
        ("vtab5t",),
        tuple(
            Variant(f"α = {a}", "proteus-paper", (f"adapter.alpha={a}",))
            for a in ("0.1", "0.3", "0.5", "0.8", "1.0")
        ),
        ("acc",),
        rows=("variant",),
        cols=("benchmark",),
        paper={
            ("α = 0.8", "vtab5t", "acc", None): (94.76, None)
        },  # l. 1046 (the figure's peak; the rest unprinted)
        aliases=("alpha ablation VTAB",),
    ),
    Entry(
        "long_tasks",
        "table",
        "Longer task sequences: VTAB (19 tasks), CIFAR-100 (50 tasks), ImageNet-R (100 tasks)",
        "706-721",
        ("vtab19", "cifar100-50", "imagenet-r-100"),
        (INFLORA, SDLORA, RANPAC, PROTEUS),
        ("acc", "retrieval"),
        rows=("variant",),
        cols=("benchmark", "metric"),
        seeds=(0,),
        paper={
            **_grid(
                {
                    "InfLoRA": ((84.15, None), (61.93, None), (40.6, None)),  # l. 714
                    "SD-LoRA": ("Not ready", (68.19, None), (55.08, None)),  # l. 715
                    "RanPAC": ((93.77, None), (89.23, None), (72.10, None)),  # l. 716
                    "PROTEUS": ((94.60, None), (91.31, None), (75.69, None)),  # l. 718
                },
                ("vtab19", "cifar100-50", "imagenet-r-100"),
                "acc",
            ),
            **_grid(
                {"PROTEUS": ((91.35, None), (98.15, None), (80.82, None))},  # l. 703 (text)
                ("vtab19", "cifar100-50", "imagenet-r-100"),
                "retrieval",
            ),
        },  # fmt: skip
    ),
    Entry(
        "forgetting",
        "table",
        "Final average forgetting (Appendix)",
        "641-669",
        MAIN_BENCHMARKS,
        (L2P, DUALPROMPT, CODA, SPROMPT, RANPAC, PROTEUS, OURS),
        ("forgetting",),
        rows=("variant",),
        cols=("benchmark",),
        paper=_grid(
            {
                "L2P": (
                    (6.22, 0.16),
                    (7.93, 0.66),
                    (6.29, 0.33),
                    (27.90, 2.14),
                    (12.30, 3.01),
                    (17.73, 1.69),
                ),  # l. 657
                "DualPrompt": (
                    (6.14, 0.59),
                    (5.39, 0.19),
                    (9.98, 0.16),
                    (10.55, 2.27),
                    (9.17, 2.57),
                    (8.74, 0.80),
                ),  # l. 658
                "CODAPrompt": (
                    (2.01, 0.72),
                    (1.61, 0.08),
                    (4.73, 1.17),
                    (25.70, 1.58),
                    (6.55, 1.32),
                    (9.67, 2.09),
                ),  # l. 659
                "SPrompt": (
                    (5.33, 0.23),
                    (3.32, 0.08),
                    (3.45, 0.29),
                    (3.99, 1.19),
                    (6.24, 0.39),
                    (3.86, 0.76),
                ),  # l. 660
                "RanPAC": (
                    (2.87, 0.11),
                    (4.55, 0.55),
                    (7.02, 0.95),
                    (0.31, 0.02),
                    (1.85, 0.19),
                    (1.05, 0.10),
                ),  # l. 661
                "PROTEUS": (
                    (2.02, 0.27),
                    (1.45, 0.36),
                    (5.35, 1.40),
                    (6.54, 1.41),
                    (4.12, 2.39),
                    (1.41, 0.73),
                ),  # l. 663
            },
            MAIN_BENCHMARKS,
            "forgetting",
        ),  # fmt: skip
        notes=("The same runs as `main-table` (reused). The paper's ranks are not repeated here.",),
    ),
    Entry(
        "overhead_10T",
        "table",
        "Inference latency per batch of 32 against the number of tasks m, ImageNet-R with T = 100",
        "606-620",
        ("imagenet-r",),
        (PROTEUS,),
        ("latency@",),
        rows=("variant",),
        cols=("task",),
        settings=("signature.max_components=100", "report.latency_points=10"),
        seeds=(0,),
        tasks=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
        paper=_per_task(
            "PROTEUS",
            "imagenet-r",
            "latency@",
            (1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
            (0.41, 0.77, 1.03, 1.31, 1.66, 2.13, 2.42, 2.60, 2.97, 3.29),
        ),  # l. 616
        notes=("Timings belong on the paper's hardware (2 A40s); a CPU or another GPU gives other seconds.",),
    ),  # fmt: skip
    Entry(
        "overhead_50T",
        "table",
        "Inference latency per batch of 32 against the number of tasks m, CIFAR-100 in 50 tasks",
        "622-635",
        ("cifar100-50",),
        (PROTEUS,),
        ("latency@",),
        rows=("variant",),
        cols=("task",),
        settings=("report.latency_m=[2,5,10,15,20,25,30,35,40,45,50]",),
        seeds=(0,),
        tasks=(2, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50),
        paper=_per_task(
            "PROTEUS",
            "cifar100-50",
            "latency@",
            (2, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50),
            (0.27, 0.64, 1.33, 2.08, 2.93, 3.86, 4.89, 5.91, 7.18, 8.26, 9.59),
        ),  # l. 631
        notes=(
            "m is timed at the paper's columns (`report.latency_m`); on a shorter stream, those up to its length.",
        ),
    ),  # fmt: skip
    Entry(
        "dataset_stats",
        "table",
        "Dataset statistics",
        "676-693",
        MAIN_BENCHMARKS,
        (Variant("frozen", "frozen"),),
        ("n_train", "n_test", "classes"),
        rows=("benchmark",),
        cols=("metric",),
        seeds=(0,),
        paper={
            **_grid(
                {
                    "frozen": (
                        (50000, None),
                        (24000, None),
                        (5981, None),
                        (321406, None),
                        (1796, None),
                        (47328, None),
                    )
                },
                MAIN_BENCHMARKS,
                "n_train",
            ),  # l. 684-689
            **_grid(
                {
                    "frozen": (
                        (10000, None),
                        (6000, None),
                        (1519, None),
                        (47585, None),
                        (8619, None),
                        (11856, None),
                    )
                },
                MAIN_BENCHMARKS,
                "n_test",
            ),  # l. 684-689
            **_grid(
                {"frozen": ((100, None), (200, None), (200, None), (196, None), (50, None), (144, None))},
                MAIN_BENCHMARKS,
                "classes",
            ),  # l. 684-689
        },  # fmt: skip
        notes=(
            "Counted from each run's split.json (a `frozen` run: no training). VTAB-Sim50 has 185 "
            "classes by the paper's stated recipe (docs/experiments.md).",
        ),
    ),  # fmt: skip
]


def entry(name: str) -> Entry:
    """The entry named ``name`` (its label or an alias); a KeyError lists every name."""
    for e in ENTRIES:
        if name == e.name or name in e.aliases:
            return e
    raise KeyError(
        f"no table or figure {name!r} of the paper; one of: {', '.join(e.name for e in ENTRIES)} "
        "(`proteus reproduce --list`)"
    )


def _check(entries: list[Entry]) -> None:
    """Catalogue invariants: unique names, known benchmarks and metrics, published numbers on known
    variants (checked at import: a typo in the data fails at once)."""
    seen: set[str] = set()
    for e in entries:
        for n in (e.name, *e.aliases):
            if n in seen:
                raise ValueError(f"paper_tables: {n!r} named twice")
            seen.add(n)
        labels = {v.label for v in e.variants}
        for b in e.benchmarks:
            if b not in PAPER_BENCHMARKS:
                raise ValueError(f"paper_tables: {e.name}: unknown benchmark {b!r}")
        for m in e.metrics:
            if m not in METRICS:
                raise ValueError(f"paper_tables: {e.name}: unknown metric {m!r}")
        if e.reference and e.reference not in labels:
            raise ValueError(f"paper_tables: {e.name}: reference {e.reference!r} is not a variant")
        for label, b, m, _ in e.paper:
            if label not in labels or b not in e.benchmarks or m not in e.metrics:
                raise ValueError(f"paper_tables: {e.name}: a published number on ({label}, {b}, {m})")


_check(ENTRIES)
