"""The paper's stated settings as data (``proteus.experiment.paper_settings``): every config key is
classified, no method's resolved configuration departs from the paper in a way no row of the differences
table explains, ``proteus reproduce NAME --plan`` names every departure of every entry, and
docs/experiments.md shows the tables the data generate."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from proteus.cli import main
from proteus.config import METHODS, RunConfig, flatten, packaged_config, resolve_config
from proteus.config.schema import field_type
from proteus.experiment import paper_settings as ps
from proteus.experiment import paper_tables as pt
from proteus.experiment import reproduce as rep

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {b: pb.preset for b, pb in pt.PAPER_BENCHMARKS.items() if pb.preset is not None}


def _flat(benchmark: str, method: str, configs: tuple[str, ...] = ()) -> dict:
    return flatten(resolve_config(benchmark=benchmark, method=method, config_files=list(configs)).to_dict())


def test_every_config_key_is_classified() -> None:
    """A key is stated by the paper, explained by a row or bookkeeping: a new option that is none of these
    fails here (it would be a departure nobody listed)."""
    keys = set(flatten({k: v for k, v in RunConfig().to_dict().items() if k != "baseline"}))
    rows = {k for c in ps.CHOICES for k in c.keys}
    missing = sorted(k for k in keys if k not in ps.STATED and k not in rows and not ps.bookkeeping(k))
    assert not missing, f"keys neither stated, in a row of paper_settings.CHOICES nor bookkeeping: {missing}"
    for k in [*ps.STATED, *rows]:
        field_type(k)  # a real config key (an unknown one raises)


def _unlisted(flat: dict, paper_benchmark: str, method: str, own: dict | None = None) -> list[str]:
    return [d.text() for d in ps.departures(flat, paper_benchmark, method, own=own) if d.row is None]


@pytest.mark.parametrize("benchmark", sorted(PRESETS))
def test_no_method_departs_without_a_row(benchmark: str) -> None:
    """Every declared method on every paper preset: each departure from the paper is a row of the table."""
    for m in METHODS.names():
        flat = _flat(PRESETS[benchmark], m)
        own = flat if ps.paper_family(m) == "own" else None
        assert not _unlisted(flat, benchmark, m, own), (m, benchmark, _unlisted(flat, benchmark, m, own))


def test_a_new_departure_is_unlisted() -> None:
    """The check can fail: a stated key set otherwise with no row for it, or an open key in force with no
    row, is a departure no row explains."""
    flat = _flat("imagenet-r", "proteus-paper")
    assert not _unlisted(flat, "imagenet-r", "proteus-paper")
    assert _unlisted({**flat, "signature.score": "mahalanobis"}, "imagenet-r", "proteus-paper")
    assert _unlisted({**flat, "adapter.scaling": 2.0}, "imagenet-r", "proteus-paper")
    # a stated key the paper sets per benchmark: r = 16 is the paper's on ImageNet-A, not on ImageNet-R
    assert not [d for d in ps.departures(_flat("imagenet-a", "proteus-paper"), "imagenet-a", "proteus-paper")
                if d.key == "adapter.rank"]  # fmt: skip
    deps = ps.departures({**flat, "adapter.rank": 16}, "imagenet-r", "proteus-paper")
    assert [d.row for d in deps if d.key == "adapter.rank"] == [15]


def test_proteus_papers_departures_are_the_open_choices_and_the_projection() -> None:
    """On the paper's ImageNet-R, `proteus-paper` departs from what the paper states only by the 10,000-wide
    projection; everything else it is told is a choice the paper leaves open (the prior's ridge, the
    proximal S step, the initialisation, the per-task training head, the per-map group norm, the class
    order, ...)."""
    deps = ps.departures(_flat("imagenet-r", "proteus-paper"), "imagenet-r", "proteus-paper")
    stated = [(d.key, d.ours) for d in deps if d.paper is not ps.OPEN]
    assert stated == [("head.rp_dim", 10000)]
    rows = {d.row for d in deps}
    assert {3, 7, 8, 9, 10, 16, 17, 18, 20, 21, 22, 23, 25} == rows
    keys = {d.key: d.ours for d in deps if d.key}
    assert keys["signature.prior"] == "ridge" and keys["adapter.s_update"] == "prox"
    assert keys["benchmark.class_order_seed"] == 1993


def test_proteus_rows() -> None:
    """The default fits LDA keys: the DP-GMM's rows (1, 3, 4, 10, 17) are not in force for it; its heads
    classify h without the projection (row 19); its own retrieval and head are rows 11-14."""
    deps = ps.departures(_flat("cifar100", "proteus"), "cifar100", "proteus")
    rows = {d.row for d in deps}
    assert not rows & {1, 3, 4, 10, 17}
    assert {2, 5, 6, 11, 12, 13, 14, 19} <= rows


def test_the_kmeans_variant_under_a_cpu_config() -> None:
    """`--config mobilenet_cpu` sets T = 10, which the K-means variant's K = 20 does not override (a method
    comes before `--config`): the plan says so, beside the K-means covariance rule."""
    plan = rep.make_plan("kmeans", benchmark="domains5", seeds=[0], config_files=["mobilenet_cpu"])
    km = next(c for c in plan.cells if c.variant.method == "proteus-kmeans")
    assert km.config is not None and km.config.signature.max_components == 10
    by_key = {d.key: d for d in km.departures}
    assert by_key["signature.max_components"].paper == 20 and by_key["signature.max_components"].row == 15
    assert 24 in {d.row for d in km.departures}


def test_every_entry_plans_with_every_departure_listed() -> None:
    """`proteus reproduce NAME --plan` for every entry, on the paper's benchmarks and on domains5 with the CPU
    config: every runnable cell has its departures and none is unlisted."""
    for e in pt.ENTRIES:
        for bench, configs in ((None, []), ("domains5", ["mobilenet_cpu"])):
            plan = rep.make_plan(e.name, benchmark=bench, seeds=[0], config_files=configs)
            for c in plan.runnable():
                assert c.departures, (e.name, bench, c.variant.label)
                bad = [d.text() for d in c.departures if d.row is None]
                assert not bad, (e.name, bench, c.variant.label, bad)


def test_plan_text_names_the_papers_departures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "ablationS", "--plan", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    for want in ("#16 the random projection", "`head.rp_dim=10000`", "`signature.prior=ridge`",
                 "`adapter.s_update=prox`", "#20 the adapter's initialisation",
                 "#21 the training loss's head", "#22 the elastic net's ℓ2 term",
                 "`benchmark.class_order_seed=1993`"):  # fmt: skip
        assert want in out, want
    # the ablation's own change is the paper's statement for its row, not a departure
    s0 = out[out.index("S = 0 (`proteus-s0`)") :].split("\n- ", 1)[0]
    assert "adapter.transfer" not in s0 and "adapter.orthogonal" not in s0


# ---------------------------------------------------------------------------------------- the page
sys.path.insert(0, str(ROOT / "tools" / "docs"))


def test_the_page_shows_the_generated_differences_tables() -> None:
    from differences_table import PAGE, rewrite

    text = PAGE.read_text()
    assert rewrite(text, ps.differences_tables()) == text, (
        "docs/experiments.md's differences tables are not the generated ones: run "
        "`python tools/docs/differences_table.py`"
    )


def test_the_cpu_config_is_described_as_it_is() -> None:
    """The page's one-line description of `--config mobilenet_cpu` gives the projection width, rank, epochs
    and T the packaged file sets."""
    cfg = yaml.safe_load(packaged_config("mobilenet_cpu").read_text())  # type: ignore[union-attr]
    page = (ROOT / "docs" / "experiments.md").read_text()
    line = " ".join(page[page.index("* **CPU only.**") :].split("\n* ")[0].split())
    assert f"{cfg['head']['rp_dim']:,}-wide projection" in line
    assert f"rank {cfg['adapter']['rank']}, {cfg['train']['epochs']} epochs" in line
    assert f"T = {cfg['signature']['max_components']}" in line
    assert f"last {cfg['backbone']['adapt_last']} blocks" in line
    assert f"{cfg['backbone']['img_size']} px" in line


def test_choices_are_well_formed() -> None:
    for c in ps.CHOICES:
        assert c.name and c.paper and c.ours and c.why and c.effect, c.number
        assert dataclasses.is_dataclass(c)
