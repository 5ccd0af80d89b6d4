"""``proteus reproduce``: the catalogue names every table and figure of the paper's experiments, its
published numbers are the paper's, the plan resolves each cell on the recipe the table ablates, and a run
writes the table with the paper's numbers beside ours (the last one end to end, on a tiny quickstart)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from proteus.cli import main
from proteus.experiment import paper_tables as pt
from proteus.experiment import reproduce as rep

SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec" / "000_b8a2b9b06c209d3d.txt"
needs_spec = pytest.mark.skipif(not SPEC.is_file(), reason=f"the paper's source is not at {SPEC}")

#: tiny settings of the end-to-end run (as tests/test_methods.py): a random ViT-Ti/16 at 32 px, 2 tasks
TINY = [
    "backbone.name=vit_ti16", "backbone.pretrained=false", "backbone.img_size=32", "backbone.adapt_last=2",
    "head.rp_dim=128", "signature.max_components=2", "signature.max_iter=20", "benchmark.num_tasks=2",
    "benchmark.max_train_per_class=15", "report.figures=false", "report.latency=false",
]  # fmt: skip


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["reproduce", *argv, "--plan", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _experiment_labels(text: str) -> set[str]:
    """The labels of every table and figure from the experiments section on (subfigures left out)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("\\section{Empirical Studies}"))
    labels, envs = set(), []
    for ln in lines[start:]:
        for m in re.finditer(r"\\(begin|end)\{(table\*?|figure\*?|subfigure)\}|\\label\{([^}]*)\}", ln):
            if m.group(1) == "begin":
                envs.append(m.group(2))
            elif m.group(1) == "end":
                envs.pop()
            elif envs and envs[-1] in ("table", "table*", "figure", "figure*"):
                labels.add(re.sub(r"^(tab|table|fig)\s*:\s*", "", m.group(3)).strip())
    return labels


def _names() -> set[str]:
    return {n for e in pt.ENTRIES for n in (e.name, *e.aliases)}


@needs_spec
def test_list_shows_every_table_and_figure_of_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    labels = _experiment_labels(SPEC.read_text())
    assert {
        "main-table",
        "ablationS",
        "topkG",
        "kmeans",
        "lora_position",
        "delta_50T",
        "complexity",
    } <= labels
    assert len(labels) >= 25
    missing = sorted(labels - _names())
    assert not missing, f"tables or figures of the paper without a catalogue entry: {missing}"
    assert main(["reproduce", "--list"]) == 0
    listed = {ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert {e.name for e in pt.ENTRIES} == listed


def test_every_metric_of_the_tables_has_a_reader() -> None:
    """The metrics the tables name (paper_tables.yaml) are those a run can be read for, each read by its own
    reader (``table_metrics``), a final one as ``{None: value}`` and a per-task one by task."""
    from proteus.experiment.table_metrics import READERS

    assert set(pt.METRICS) == set(READERS.names())
    res = {"final_avg_acc": [80.0, 75.5], "avg_acc": [80.0, 75.5],
           "latency": {"m": [1, 10], "seconds": [0.1, 1]},
           "tasks": [{"trainable_params": 10}, {"trainable_params": 12, "peak_gpu_mb": 300.0}]}  # fmt: skip
    split = {"splits": {"train": {"count": 500}}, "num_classes": 10}
    assert rep.metric_values("acc", res, split) == {None: 75.5}
    assert rep.metric_values("acc@", res, split) == {1: 80.0, 2: 75.5}
    assert rep.metric_values("latency@", res, split) == {1: 0.1, 10: 1.0}
    assert rep.metric_values("params", res, split) == {None: 12.0}
    assert rep.metric_values("gpu_memory", res, split) == {None: 300.0}
    assert (
        rep.metric_values("n_train", res, split) == {None: 500.0}
        and rep.metric_values("n_test", res, split) == {}
    )
    assert rep.metric_values("classes", res, None) == {} and rep.metric_values("forgetting", res, split) == {}
    assert (rep._fmt("params", 12345.0), rep._fmt("orthogonality", 0.00012), rep._fmt("acc", 75.456)) == (
        "12,345", "1.2e-04", "75.46"
    )  # fmt: skip


@needs_spec
def test_published_numbers_are_the_papers() -> None:
    """Every transcribed number is printed in its entry's line range, and on the line of the paper's source
    that its row of the packaged data names (the data's lines are read back)."""
    lines = SPEC.read_text().splitlines()

    def printed(v: float) -> list[str]:
        forms = {f"{v:g}", f"{v:.2f}", f"{v:.1f}", f"{v:,.0f}"}
        return [f for f in forms if f != "nan"]

    checked = 0
    for e in pt.ENTRIES:
        lo, _, hi = e.lines.partition("-")
        text = "\n".join(lines[int(lo) - 1 : int(hi or lo)])
        for (label, _b, _m, _t), p in e.paper.items():
            if isinstance(p, str):
                assert p in text or p in "\n".join(lines), (e.name, label, p)
                continue
            mean, std = p
            # the PROTEUS count of `params` and the long-sequence retrieval come from the text around
            where = text if any(f in text for f in printed(mean)) else "\n".join(lines)
            assert any(f in where for f in printed(mean)), (e.name, label, mean)
            if std is not None:
                assert any(f in where for f in printed(std)), (e.name, label, std)
            checked += 1
    assert checked > 200
    # every published row of the packaged data names the line (or lines) of the paper's source that prints
    # it, and each of its numbers (a mean, or the string the paper prints) is printed there
    checked = 0
    for spec in pt.load_data()["entries"]:
        for row in spec.get("paper", []):
            lo, _, hi = str(row["line"]).partition("-")
            on = "\n".join(lines[int(lo) - 1 : int(hi or lo)])
            for v in row.get("values") or row.get("per_task") or [row["value"]]:
                if isinstance(v, str):
                    assert v in on, (spec["name"], row["variant"], v, row["line"])
                else:
                    mean = float(v[0] if isinstance(v, list) else v)
                    assert any(f in on for f in printed(mean)), (
                        spec["name"],
                        row["variant"],
                        mean,
                        row["line"],
                    )
            checked += 1
    assert checked >= 90


@needs_spec
def test_titles_number_tables_and_figures_as_the_paper() -> None:
    """An entry's title that names its table or figure ("Table 10", "Fig. 5", "Figs. 6-7") names the
    number LaTeX gives it: tables and figures counted by caption, in the order of the source."""
    number: dict[str, tuple[str, int]] = {}
    count = {"table": 0, "figure": 0}
    envs: list[str] = []
    last: tuple[str, int] | None = None
    pattern = r"\\(begin|end)\{(table|figure|subfigure|minipage)\*?\}|\\caption(?:of)?\{|\\label\{([^}]*)\}"
    for ln in SPEC.read_text().splitlines():
        for m in re.finditer(pattern, ln):
            if m.group(1) == "begin":
                envs.append(m.group(2))
            elif m.group(1) == "end":
                envs.pop()
            elif m.group(0).startswith("\\caption") and envs and envs[-1] != "subfigure":
                kind = next(e for e in reversed(envs) if e in count)
                count[kind] += 1
                last = (kind, count[kind])
            elif m.group(3) and last and envs and envs[-1] != "subfigure":
                number[re.sub(r"^(tab|table|fig)\s*:\s*", "", m.group(3)).strip()] = last
    named = 0
    for e in pt.ENTRIES:
        m = re.match(r"(Table|Figs?\.) (\d+)", e.title)
        if m:
            kind = "table" if m.group(1) == "Table" else "figure"
            assert number[e.name] == (kind, int(m.group(2))), (e.name, e.title, number[e.name])
            named += 1
    assert named >= 8


def test_plan_of_ablationS_is_proteus_papers_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_json(capsys, "ablationS")
    cells = plan["cells"]
    assert {c["method"] for c in cells} == {"proteus-s0", "proteus-si", "proteus-lambda0", "proteus-paper"}
    assert {c["seed"] for c in cells} == {0, 1, 2} and all(c["runnable"] for c in cells)
    for c in cells:
        cfg = c["config"]
        sig, head, ret, ad = cfg["signature"], cfg["head"], cfg["retrieval"], cfg["adapter"]
        # the paper's keys and signatures (Eq. 18): DP-GMM NLL under each task's own adapter, raw, full
        assert (sig["keys"], sig["method"], sig["covariance"], sig["normalize"], sig["score"]) == (
            "adapter", "dpgmm", "full", "none", "nll",
        )  # fmt: skip
        assert (sig["prior"], sig["prior_scale"], sig["calibrate"]) == ("ridge", "sklearn", "none")
        assert (ret["combine"], ret["top_k"], head["scope"]) == ("hard", 1, "global")
        assert (head["gamma_selection"], head["prototypes"]) == ("task", "task-mean")
        assert cfg["benchmark"]["name"] == "imagenet-r" and cfg["backbone"]["name"] == "vit_b16"
        assert cfg["signature"]["max_components"] == 100  # T = 100 on the 10-task ImageNet-R
        changed = {
            "proteus-s0": ("zero", False, 0.006),
            "proteus-si": ("identity", True, 0.006),
            "proteus-lambda0": ("learned", True, 0.0),
            "proteus-paper": ("learned", True, 0.006),
        }[c["method"]]
        assert (ad["transfer"], ad["orthogonal"], ad["lam"]) == changed, c["method"]


def test_plan_of_main_table(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_json(capsys, "main-table")
    by = {(c["variant"], c["benchmark"]): c for c in plan["cells"] if c["seed"] == 0}
    ranpac = [c for c in plan["cells"] if c["method"] == "ranpac"]
    assert len(ranpac) == 6 * 3
    assert all(c["config"]["head"]["gamma_selection"] == "task" for c in ranpac)  # RanPAC's own gamma rule
    assert by[("PROTEUS", "vtab5t")]["method"] == "proteus-paper"
    # a baseline on a paper benchmark runs with its released settings (its packaged config)
    assert by[("InfLoRA", "cifar100")]["config"]["train"]["epochs"] == 20
    assert by[("InfLoRA", "imagenet-r")]["config"]["baseline"]["gpm_start"] == 0.98


def test_plan_on_a_local_stream(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_json(capsys, "main-table", "--benchmark", "domains5", "--config", "mobilenet_cpu")
    assert [c["benchmark"] for c in plan["columns"]] == ["domains5"]
    assert plan["columns"][0]["paper_benchmark"] == "vtab5t"  # domains5 stands in for VTAB5T-small
    cells = {c["method"]: c for c in plan["cells"] if c["seed"] == 0}
    assert not cells["l2p"]["runnable"] and "needs a ViT" in cells["l2p"]["skip"]
    assert (
        cells["inflora"]["runnable"] and cells["inflora"]["config"]["train"]["epochs"] == 5
    )  # no release cfg
    diff = " ".join(plan["differences"])
    assert "`backbone.name=mobilenet_v2` (the paper: vit_b16;" in diff
    assert "#27 a local stream in place of the paper's benchmark: `benchmark.name=domains5`" in diff
    # a baseline on a local stream: its released settings are not applied (they are for the paper's data)
    assert "InfLoRA (`inflora`), domains5:" in plan["differences"]
    infl = {d["row"] for d in cells["inflora"]["departures"]}
    assert {15, 27, 28} <= infl
    # another paper column by name; a column the table does not have is refused, with the list
    plan = _plan_json(capsys, "kmeans", "--benchmark", "domains5:imagenet-a", "--seeds", "0")
    assert plan["columns"][0]["paper_benchmark"] == "imagenet-a" and plan["seeds"] == [0]
    assert main(["reproduce", "kmeans", "--benchmark", "domains5:vtab5t", "--plan"]) == 2
    assert "its benchmarks: imagenet-r, imagenet-a" in capsys.readouterr().err
    assert main(["reproduce", "no-such-table", "--plan"]) == 2
    assert "main-table" in capsys.readouterr().err


def test_unbuildable_and_unmeasured_cells_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_json(capsys, "long_tasks")
    vtab19 = [c for c in plan["cells"] if c["benchmark"] == "vtab19"]
    assert vtab19 and all(not c["runnable"] and "19-task VTAB" in c["skip"] for c in vtab19)
    # retrieval_overhead is measured now (inference time per method); its prompt baselines need a ViT
    plan = _plan_json(capsys, "retrieval_overhead", "--benchmark", "domains5", "--config", "mobilenet_cpu")
    runs = {c["method"]: c["runnable"] for c in plan["cells"]}
    assert runs == {"dualprompt": False, "s-prompt": False, "hide-prompt": False, "proteus-paper": True}
    assert all("needs a ViT" in c["skip"] for c in plan["cells"] if not c["runnable"])


def _fake_run(d: Path, avg_acc: list[float], retrieval: list[float] | None = None) -> None:
    d.mkdir(parents=True)
    res = {
        "avg_acc": avg_acc, "final_avg_acc": avg_acc[-1], "forgetting": 1.5, "retrieval_acc": retrieval,
        "oracle_avg_acc": None, "seconds": 1.0, "tasks": [{"train": {}} for _ in avg_acc],
    }  # fmt: skip
    (d / "results.json").write_text(json.dumps(res))
    (d / "config.yaml").write_text("{}\n")


def test_tables_in_the_papers_layout(tmp_path: Path) -> None:
    """Per-task and per-(variant, metric) layouts from results.json files, ours beside the paper's."""
    plan = rep.make_plan("budget_cifar100", benchmark="quickstart", seeds=[0, 1])
    for c in plan.cells:
        base = 90.0 if c.variant.label == "Unconstrained" else 80.0
        _fake_run(c.run_dir(tmp_path), [100.0, base + c.seed, base - 10 + c.seed])
    rows = rep.table_rows(plan, tmp_path)
    md = rep.markdown(plan, rows, "proteus reproduce budget_cifar100 ...")
    # our tasks 1-3 on the local stream; the paper's task 2 beside ours
    assert "| variant | task 1: ours | task 1: paper | task 2: ours | task 2: paper | task 3: ours |" in md
    assert "| Budget-Constrained | 100.00 ± 0.00 | - | 80.50 ± 0.71 | 99.10 | 70.50 ± 0.71 | - |" in md
    assert "| Unconstrained | 100.00 ± 0.00 | - | 90.50 ± 0.71 | 99.10 | 80.50 ± 0.71 | - |" in md
    assert "stands in for the paper's CIFAR-100 (20 tasks)" in md and "Made by:" in md
    # a (variant, metric) column layout, and a variant not run yet
    plan = rep.make_plan("kmeans", benchmark="quickstart", seeds=[0])
    cell = next(c for c in plan.cells if c.variant.label == "DP-GMM")
    _fake_run(cell.run_dir(tmp_path / "k"), [100.0, 91.0], [100.0, 93.0])
    md = rep.markdown(plan, rep.table_rows(plan, tmp_path / "k"))
    head = (
        "| benchmark | DP-GMM, final avg acc: ours | DP-GMM, final avg acc: paper | DP-GMM, retrieval: ours |"
    )
    assert head in md
    assert "| quickstart | 91.00 | 82.69 | 93.00 | 96.89 | - | 81.15 | - | 92.75 |" in md
    assert "Not (yet) run for every seed: K-Means" in md


def test_an_interrupted_cell_starts_again(tmp_path: Path) -> None:
    plan = rep.make_plan("topkG", benchmark="quickstart", seeds=[0])
    cell = plan.cells[0]
    d = cell.run_dir(tmp_path)
    (d / "kb").mkdir(parents=True)
    (d / "kb" / "manifest.json").write_text("{}")
    rep._restart_interrupted(plan, tmp_path, progress=False)
    assert not d.exists()
    kept = list(d.parent.glob("seed0.interrupted-*"))
    assert len(kept) == 1 and (kept[0] / "kb" / "manifest.json").is_file()


@pytest.mark.slow
def test_reproduce_ablationS_on_the_quickstart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "abl"
    argv = ["reproduce", "ablationS", "--benchmark", "quickstart", "--seeds", "0", "--set", "train.epochs=1",
            *_sets(*TINY), "--out", str(out), "-q"]  # fmt: skip
    assert main(argv) == 0
    md = (out / "ablationS-quickstart.md").read_text()
    for paper in ("78.98", "87.05", "30.38", "41.45", "30.49", "41.97", "82.17", "96.03"):
        assert paper in md
    with open(out / "ablationS-quickstart.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["metric"] for r in rows} == {"acc", "retrieval"}
    for r in rows:
        assert r["seeds"] == "1" and 0.0 <= float(r["ours_mean"]) <= 100.0 and r["paper_mean"]
        res = json.loads((out / "quickstart" / r["method"] / "seed0" / "results.json").read_text())
        ours = res["final_avg_acc"] if r["metric"] == "acc" else res["retrieval_acc"][-1]
        assert float(r["ours_mean"]) == pytest.approx(ours)
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {r['variant']} |"))
        assert f"{ours:.2f}" in line
    assert "`train.epochs=1` (the paper: not stated)" in md and "`backbone.name=vit_ti16`" in md
    # the table's provenance (the runs' commit, versions, device, threads; the command), each seed's value
    report = json.loads((out / "ablationS-quickstart.json").read_text())
    prov = report["provenance"]
    assert prov["runs"] == 4 and prov["device"] == "cpu" and isinstance(prov["threads"], int)
    assert prov["versions"]["torch"] and prov["command"] and prov["commit"]
    assert all(set(r["ours_by_seed"]) == {"0"} for r in report["rows"])
    # a second call reuses every finished cell
    capsys.readouterr()
    assert main([a for a in argv if a != "-q"]) == 0
    assert capsys.readouterr().out.count("reusing the finished run") == 4


def test_overhead_50T_times_the_papers_m(capsys: pytest.CaptureFixture[str]) -> None:
    """The 50-task latency table times m = 2, 5, 10, ..., 50, the paper's columns (not 1, 6, 11, ...)."""
    from proteus.report.analysis import latency_points

    plan = _plan_json(capsys, "overhead_50T")
    ms = plan["cells"][0]["config"]["report"]["latency_m"]
    assert ms == [2, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50] == list(pt.entry("overhead_50T").tasks)
    assert latency_points(50, 11, ms) == ms and latency_points(5, 11, ms) == [2, 5]
    assert latency_points(50, 11) == [1, 6, 11, 16, 21, 26, 30, 35, 40, 45, 50]  # evenly spaced otherwise


def test_retrieval_gain_is_computed_from_retrieval_and_inference_time() -> None:
    """retrieval_overhead: the paper's gain in %/s, (PROTEUS's retrieval - the baseline's) / (PROTEUS's
    inference time - the baseline's), from our runs' means."""
    e = pt.entry("retrieval_overhead")
    assert "retrieval_gain" in e.metrics and e.reference == "PROTEUS" and not e.unsupported
    assert all(m == "retrieval_gain" for _, _, m, _ in e.paper)

    def row(variant: str, metric: str, mean: float | None) -> dict[str, Any]:
        return {"benchmark": "b", "variant": variant, "metric": metric, "ours_mean": mean, "seeds": 3}

    rows = [row("PROTEUS", "retrieval", 96.0), row("PROTEUS", "inference", 2.8),
            row("HiDE", "retrieval", 47.0), row("HiDE", "inference", 0.3),
            row("HiDE", "retrieval_gain", None), row("SPrompt", "retrieval", None),
            row("SPrompt", "inference", 0.2), row("SPrompt", "retrieval_gain", None)]  # fmt: skip
    rep._gains(e, rows)
    assert rows[4]["ours_mean"] == pytest.approx((96.0 - 47.0) / (2.8 - 0.3))
    assert rows[7]["ours_mean"] is None  # no retrieval of its own: no gain
