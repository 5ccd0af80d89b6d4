"""Every registered method end to end on a tiny quickstart (Sec. 5 and the Appendix ablations), the run
report (theory checks of Sec. 3.2, Figs. 2, 3, 8-10, latency) and ``proteus compare`` (Table 1, Fig. 3).

Tiny settings: a randomly initialised ViT-Ti/16 at 32 px (no download), 2 tasks of 5 digits, 15 training
images per class, one epoch. Torch runs single-threaded here: on a shared 2-core machine OpenMP's spinning
threads make small LAPACK calls hundreds of times slower.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from proteus.cli import main
from proteus.config import METHODS, RunConfig, apply_method
from proteus.kb import KnowledgeBase

TINY = [
    "--set", "backbone.name=vit_ti16",
    "--set", "backbone.pretrained=false",
    "--set", "backbone.img_size=32",
    "--set", "backbone.adapt_last=2",
    "--set", "train.epochs=1",
    "--set", "head.rp_dim=128",
    "--set", "signature.max_components=2",
    "--set", "signature.max_iter=20",
    "--set", "signature.rank=8",
    "--set", "benchmark.num_tasks=2",
    "--set", "benchmark.max_train_per_class=15",
    "--set", "report.latency_points=2",
    "--set", "report.latency_repeats=1",
    "--set", "report.latency_batch=8",
]  # fmt: skip

#: per-method extra settings (the budget schedule needs a rank that visibly shrinks within 2 tasks)
EXTRA: dict[str, list[str]] = {
    "proteus-budget": ["--set", "adapter.rank=20"],
    "ranpac-hide": ["--set", "baseline.tii_epochs=2", "--set", "baseline.ca_epochs=2"],
}
NO_RETRIEVAL = {n for n in METHODS.names() if apply_method(RunConfig(), n).retrieval.mode != "signature"}
#: RanPAC and its variants that train only the first task's adapter (the head uses it ever after)
RANPAC = {n for n in METHODS.names() if apply_method(RunConfig(), n).train.tasks == "first"}
#: methods whose task keys are heads in one space (LDA heads, HiDe's task-identity inference): no Gaussian
#: signature, no theory report, the keys in the head's object
LDA_METHODS = {
    n for n in METHODS.names()
    if n not in NO_RETRIEVAL
    and apply_method(RunConfig(), n).signature.keys in ("frozen-lda", "first-adapter-lda", "hide-tii")
}  # fmt: skip
WITH_FIGURES = "proteus-dpgmm"  # the Gaussian keys draw every figure (delta boxplot)


@pytest.fixture(scope="module")
def run_method(tmp_path_factory) -> Callable[[str], Path]:
    """Run a method once per module (cached) and return its run directory."""
    cache: dict[str, Path] = {}

    def go(method: str) -> Path:
        if method not in cache:
            out = tmp_path_factory.mktemp("runs") / method
            figs = "true" if method == WITH_FIGURES else "false"
            argv = ["run", "--benchmark", "quickstart", "--method", method, "--out", str(out), "-q"]
            assert main([*argv, *TINY, *EXTRA.get(method, []), "--set", f"report.figures={figs}"]) == 0
            cache[method] = out
        return cache[method]

    return go


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _learner(run_dir: Path) -> Any:
    from proteus import Proteus

    return Proteus.load(run_dir / "kb")


def _all_s(analysis: dict[str, Any]) -> list[float]:
    return [v for t in analysis["transfer"]["tasks"] for row in t["S"] for v in row]


@pytest.mark.parametrize("method", sorted(n for n in METHODS.names() if METHODS.get(n).learner == "proteus"))
def test_every_method_runs(method: str, run_method: Callable[[str], Path]) -> None:
    out = run_method(method)
    res = _json(out / "results.json")
    analysis = _json(out / "analysis.json")
    manifest = KnowledgeBase.open(out / "kb").manifest
    assert res["method"] == method and res["num_tasks"] == 2
    assert len(res["avg_acc"]) == 2 and all(0 <= a <= 100 for a in res["avg_acc"])
    assert math.isfinite(res["final_avg_acc"])
    has_adapter = [t["has_adapter"] for t in manifest["tasks"]]
    ranks = [(t.get("train") or {}).get("rank") for t in res["tasks"]]

    if method in NO_RETRIEVAL:
        assert res["retrieval_acc"] is None and res["oracle_avg_acc"] is None
        assert res["theory"] is None and res["retrieval_confusion"] is None
        assert all(t.get("signature") is None for t in manifest["tasks"])
    else:
        assert len(res["retrieval_acc"]) == 2 and res["retrieval_acc"][0] == 100.0
        assert len(res["oracle_avg_acc"]) == 2
        cm = res["retrieval_confusion"]
        assert len(cm) == 2 and all(len(row) == 2 for row in cm)
        assert 100.0 * (cm[0][0] + cm[1][1]) / sum(map(sum, cm)) == pytest.approx(res["retrieval_acc"][-1])
        th = res["theory"]
        if method in LDA_METHODS:  # LDA keys: no Gaussian signatures, no theory report
            assert th is None and all(t.get("signature") is None for t in manifest["tasks"])
            assert "task_head" in manifest["head"]["meta"]
        else:
            assert th["components"] and 0.0 <= th["summary"]["frac_delta_ok"] <= 1.0
            for t, row in enumerate(th["per_task"]):  # the measured error beside the bound, per task
                wrong = cm[t][1 - t] / sum(cm[t])
                assert row["retrieval_error"] == pytest.approx(wrong) and row["own_distance_per_dim"] > 0
            premise = th["summary"]["premise"]
            said = "holds" if premise["holds"] else "does not hold"
            assert premise["statement"].startswith(f"the premise {said}")
        assert all(has_adapter)

    if method == "frozen":
        assert not any(has_adapter) and res["orthogonality"] is None and analysis["transfer"] is None
    elif method in RANPAC:  # the first task trains the only adapter; the head uses it ever after
        assert has_adapter == [True, False] and ranks == [4, None]
        assert _learner(out).parts_.num_adapters == 1
    else:
        assert has_adapter == [True, True]
    if method in ("proteus-s0", "proteus-all-units"):
        assert set(_all_s(analysis)) == {0.0}  # S = 0 exactly
    if method == "proteus-si":
        assert set(_all_s(analysis)) == {1.0}  # S = I exactly
        S = _learner(out).model_.transfer_matrix(1)
        assert all(bool((v == 1.0).all()) for v in S.values())
    if method == "proteus-s0":  # no orthogonality constraint: the tasks' updates overlap
        assert res["orthogonality"]["max_abs_offdiag"] > 1e-4
    if method in ("proteus", "proteus-si", "proteus-lambda0", "proteus-budget", "last-lora"):
        assert res["orthogonality"]["max_abs_offdiag"] < 1e-5  # Eq. 15 holds to float precision
    if method == "proteus-lambda0":  # no penalty: the proximal step never zeroes S
        assert res["tasks"][1]["train"]["s_nonzero_frac"] == 1.0
    if method == "proteus-budget":
        assert ranks == [20, 19]  # r_m = round(r_0 exp(-0.05 (m - 1)))
    if method == "proteus-kmeans":
        assert {t["signature"]["method"] for t in manifest["tasks"]} == {"kmeans"}
    if method == "proteus-paper":
        sig = manifest["tasks"][0]["signature"]
        assert (sig["covariance"], sig["normalize"], sig["score"]) == ("full", "none", "nll")
    if method in ("proteus-top3", "proteus-top5"):
        assert manifest["config"]["retrieval"]["top_k"] == int(method[-1])
    if method == "proteus-all-units":
        assert manifest["config"]["retrieval"]["mode"] == "all-units"


def test_run_report(run_method: Callable[[str], Path]) -> None:
    out = run_method(WITH_FIGURES)
    res = _json(out / "results.json")
    md = (out / "report.md").read_text()
    for key in ("accuracy", "acc_matrix", "delta_boxplot", "retrieval_confusion", "s_heatmaps",
                "unit_cosines", "latency"):  # fmt: skip
        assert f"figures/{key}.png" in res["figures"], key
        png = out / "figures" / f"{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", key
    for link in re.findall(r"\]\(([^)]+)\)", md):
        assert (out / link).is_file(), link
    assert "Theorem 3.6" in md and "| 1 |" in md
    assert "report_errors" not in res
    # theory: one row per (task, component) with inputs; the summary counts them
    th = res["theory"]
    assert th["summary"]["n_components"] == len(th["components"]) > 0
    assert th["summary"]["n_untested"] == sum(1 for c in th["components"] if not c["tested"])
    for c in th["components"]:
        assert c["task"] in (0, 1) and c["n"] > 0
        if c["min_delta"] is not None:
            assert c["delta_ok"] == (c["delta"] >= c["min_delta"])
        # no bound where Theorem 3.5's condition fails, and then the reason (never a silent 1); a pair of one
        # test input is not tested: no bound, the reason says so, nothing failed or passed
        if not c["tested"]:
            assert c["n"] == 1 and c["bound"] is None and "not tested" in c["bound_reason"]
            assert c["failed"] == [] and c["delta_ok"] is None
            continue
        assert (c["bound"] is None) == (c["bound_reason"] is not None) == ("Thm 3.5 condition" in c["failed"])
        assert (c["bound"] is None or 0.0 <= c["bound"] <= 1.0) and 0.0 <= c["error"] <= 1.0
    assert [r["task"] for r in th["per_task"]] == [0, 1]
    # delta by hand (Def. 3.3): test inputs of task 1 nearest to own component t, under task 2's adapter
    from proteus.streams import build_benchmark

    learner = _learner(out)
    z, _ = learner.prefix_dataset(build_benchmark(learner.config.benchmark).tasks[0].test)
    H = learner.embed_prefix(z, [0, 1])
    own = learner.keys_.signatures[0].mahalanobis(H[0]).argmin(1).cpu()
    Z = learner.keys_.signatures[1].mahalanobis(H[1]).double().cpu()
    d = learner.keys_.signatures[1].d
    for c in (c for c in th["components"] if c["task"] == 0):
        sel = own == c["component"]
        assert c["n"] == int(sel.sum())
        assert c["delta"] == pytest.approx(float(Z[sel].mean(0).min()) / d - 1.0, rel=1e-4, abs=1e-6)
    # latency: predict with the first m tasks, m = 1..num_tasks
    lat = res["latency"]
    assert lat["m"] == [1, 2] and len(lat["seconds"]) == 2 and all(s > 0 for s in lat["seconds"])
    # results.json is strict JSON (no NaN / Infinity)
    json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


def test_predict_with_the_first_m_tasks(run_method: Callable[[str], Path]) -> None:
    from proteus.streams import build_benchmark

    out = run_method(WITH_FIGURES)
    learner = _learner(out)
    stream = build_benchmark(learner.config.benchmark)
    x = learner.transform_images([stream.tasks[1].test[i][0] for i in range(6)])
    assert set(learner.predict(x, num_tasks=1).task.tolist()) == {0}
    full = learner.predict(x)
    assert torch.equal(learner.predict(x, num_tasks=2).label, full.label)


def test_compare_two_methods(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    quick = ["--set", "report.figures=false", "--set", "report.latency=false"]
    argv = ["compare", "--benchmark", "quickstart", "--methods", "proteus,frozen", "--seeds", "0",
            "--out", str(out), "-q", *TINY, *quick]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| proteus |" in printed and "| frozen |" in printed
    rep = _json(out / "compare.json")
    assert rep["methods"] == ["proteus", "frozen"] and rep["seeds"] == [0] and rep["num_tasks"] == 2
    for m in ("proteus", "frozen"):
        res = _json(out / m / "seed0" / "results.json")
        s = rep["summary"][m]
        assert s["final_avg_acc"]["mean"] == pytest.approx(res["final_avg_acc"])
        assert s["final_avg_acc"]["n"] == 1 and s["final_avg_acc"]["std"] is None
        assert s["avg_acc_mean"] == pytest.approx(res["avg_acc"])
    assert rep["summary"]["frozen"]["retrieval_acc"]["mean"] is None
    assert (out / "compare_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "compare.md").read_text()
    assert "final avg acc" in md and "compare_accuracy.png" in md
    assert "seconds = each run's wall time under the machine's load" in md  # not comparable across loads
    # a rerun reuses the finished runs; a changed configuration in the same place is refused
    stamp = (out / "proteus" / "seed0" / "results.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert (out / "proteus" / "seed0" / "results.json").stat().st_mtime_ns == stamp
    capsys.readouterr()
    assert main([*argv, "--set", "train.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "different configuration: train.lr" in err and "0.5" in err  # the key that differs, both values
    # a run written before a config key existed reads that key as its default: still the same run
    cfg_file = out / "proteus" / "seed0" / "config.yaml"
    old = yaml.safe_load(cfg_file.read_text())
    del old["head"]["forgettable"]
    cfg_file.write_text(yaml.safe_dump(old))
    assert main(argv) == 0
    # ... and a key whose default moved reads as what the run did without it: not today's run
    del old["signature"]["prior"]
    cfg_file.write_text(yaml.safe_dump(old))
    assert main(argv) == 2
    assert "signature.prior ('ridge' there, 'oas' now)" in capsys.readouterr().err


def test_lda_keys_live_in_the_first_adapters_space(run_method: Callable[[str], Path]) -> None:
    """proteus-lda: one key space for every task (the first adapter's, fixed after task 1), so a task's
    score never depends on any other adapter's embedding, and no frozen forward is needed."""
    learner = _learner(run_method("proteus-lda"))  # loaded back from the KB
    assert learner.config.signature.keys == "first-adapter-lda" and not learner.parts_.needs_frozen
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, 32)
    H = learner.embed_prefix(
        learner.embedder_.prefix(x), list(range(learner.parts_.num_adapters)), shard=False
    )
    res = learner.retrieve(H)
    logits = learner.keys_.head.decision_function(torch.nn.functional.normalize(H[0], dim=1)).float()
    expect = torch.stack([logits[:, t.classes].max(1).values for t in learner.records_], 1).argmax(1).cpu()
    assert torch.equal(res.task, expect)
    H2 = H.clone()
    H2[1:] = torch.randn_like(H2[1:])  # other adapters' embeddings do not enter the keys
    assert torch.equal(learner.retrieve(H2).task, res.task)
    assert torch.equal(learner.predict(x).task, res.task)


def test_a_finished_run_is_the_same_run_whichever_way_its_data_path_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--data ../shared/data` and `--data /work/shared/data` name one folder: the run is reused; another
    folder is another run."""
    from proteus.config import RunConfig
    from proteus.errors import ConfigError
    from proteus.experiment.compare import _finished

    (tmp_path / "data").mkdir()
    (tmp_path / "cwd").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    stored = RunConfig.from_stored({"benchmark": {"name": "quickstart", "data": str(tmp_path / "data")}})
    (run / "config.yaml").write_text(yaml.safe_dump(stored.to_dict()))
    (run / "results.json").write_text('{"final_avg_acc": 1.0}')
    monkeypatch.chdir(tmp_path / "cwd")
    same = RunConfig.from_stored({"benchmark": {"name": "quickstart", "data": "../data"}})
    assert _finished(run, same) == {"final_avg_acc": 1.0}
    other = RunConfig.from_stored({"benchmark": {"name": "quickstart", "data": "../cwd"}})
    with pytest.raises(ConfigError, match="benchmark.data"):
        _finished(run, other)
