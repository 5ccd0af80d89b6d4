"""Reports of a run: the paper's figures and a ``report.md`` next to results.json (Sec. 5, Appendix).

``proteus run`` calls :func:`proteus.report.analysis.analyse_run` on the finished learner (theory checks
of Sec. 3.2, retrieval confusion, S and cosine analyses of Figs. 5-7, inference latency) and then
:func:`write_report`, which draws the figures of :mod:`proteus.report.figures` into ``<run>/figures/``
and writes ``<run>/report.md`` linking them with the results table. ``proteus compare``
(:mod:`proteus.report.compare`) builds the Table 1 / Fig. 3 comparison over methods and seeds.
Switch parts off with ``report.figures``, ``report.theory`` and ``report.latency`` (:class:`ReportConfig`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from proteus.report import figures as F

log = logging.getLogger("proteus")

__all__ = ["fmt", "pct", "results_markdown", "write_report"]


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def pct(frac: float | None, digits: int = 1) -> str:
    """A fraction as a percentage ("-" for None)."""
    return "-" if frac is None else f"{100 * frac:.{digits}f}%"


def results_markdown(res: dict[str, Any]) -> str:
    """Markdown table of one run: ACC, forgetting, retrieval and oracle accuracy after each task."""
    n = len(res["avg_acc"])
    ret = res.get("retrieval_acc") or [None] * n
    orc = res.get("oracle_avg_acc") or [None] * n
    forg = res.get("forgetting_per_step") or [None] * n
    lines = [
        "| after task | avg acc (%) | forgetting | retrieval (%) | oracle (%) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for i in range(n):
        cells = [fmt(res["avg_acc"][i]), fmt(forg[i]), fmt(ret[i]), fmt(orc[i])]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _theory_markdown(th: dict[str, Any]) -> list[str]:
    s = th["summary"]
    premise = s.get("premise") or {}
    no_bound = s.get("n_no_bound") or 0
    untested = s.get("n_untested") or 0
    apart = (
        f" ({untested} of them not tested: fewer than two test inputs give no V[Z]; they are counted "
        "neither as passing nor as failing)"
        if untested
        else ""
    )
    out = [
        *(
            [f"**Premise ({'holds' if premise['holds'] else 'does not hold'}).** {premise['statement']}.", ""]
            if premise
            else []
        ),
        f"{s['n_components']} (task, component) pairs{apart}, d = {s['d']}, with σ² = max V[Z]/d, the "
        f"variance bound the proof of Theorem 3.5 uses: **{pct(s.get('frac_delta_ok'))}** of the tested "
        "pairs have an empirical δ at "
        f"least the minimum Theorem 3.6 requires for their measured retrieval error (median δ "
        f"{fmt(s['delta_median'])}, median minimum {fmt(s.get('min_delta_median'))}); mean Theorem 3.5 "
        "bound "
        f"{fmt(s.get('bound_mean'), 3)} over the pairs that have one"
        + (f" (**{no_bound} pairs have none**: Theorem 3.5's condition fails)" if no_bound else "")
        + f", mean measured error {fmt(s['error_mean'], 3)}.",
        "",
        "With Assumption A2-3's σ² instead (max trace Var[h]/d, as the paper states it; the `*_a23` fields): "
        f"{pct(s.get('frac_delta_ok_a23'))} of the pairs have δ ≥ minimum (median minimum "
        f"{fmt(s.get('min_delta_median_a23'))}), mean bound {fmt(s.get('bound_mean_a23'), 3)}"
        + (f", {s['n_no_bound_a23']} pairs without a bound" if s.get("n_no_bound_a23") else "")
        + ". That σ² does not bound V[Z], so these are not proven bounds.",
        "",
        f"**Assumptions.** {s.get('assumptions', '-')}.",
        "",
        f"σ²: {s['sigma2']}; D_k^t: {s['components_of_inputs']}; ε: {s['eps']}.",
        "",
        "| task | components (not tested) | own distance / d | empirical δ (mean) | empirical δ (min) "
        "| minimum δ (mean) | minimum δ, A2-3's σ² (mean) | Thm 3.5 bound | no bound | retrieval error "
        "| δ ≥ minimum | fails |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in th["per_task"]:
        failed = ", ".join(f"{k} ({v})" for k, v in (r.get("failed") or {}).items()) or "-"
        out.append(
            f"| {r['task'] + 1} | {r['n_components']} ({r.get('n_untested', 0)}) | "
            f"{fmt(r.get('own_distance_per_dim'))} | "
            f"{fmt(r['delta_mean'])} | {fmt(r['delta_min'])} | {fmt(r.get('min_delta_mean'))} | "
            f"{fmt(r.get('min_delta_mean_a23'))} | {fmt(r.get('bound_mean'), 3)} | "
            f"{r.get('n_no_bound', 0)} | "
            f"{fmt(r.get('retrieval_error', r['error']), 3)} | {pct(r.get('frac_delta_ok'), 0)} | {failed} |"
        )
    return out


def write_report(out: Path, res: dict[str, Any], bulky: dict[str, Any] | None = None) -> list[str]:
    """Draw the figures into ``out/figures`` and write ``out/report.md``; returns the figure paths
    (relative to ``out``). A figure that fails is logged and left out."""
    out = Path(out)
    bulky = bulky or {}
    figdir = out / "figures"
    made: dict[str, str] = {}

    def draw(key: str, fn: Any, *args: Any) -> None:
        try:
            p = fn(*args, figdir / f"{key}.png")
            made[key] = str(p.relative_to(out))
        except Exception as e:  # noqa: BLE001 - a figure must not lose a finished run
            log.warning("report: figure %s failed: %s", key, e, exc_info=True)

    draw("accuracy", F.plot_accuracy, res)
    draw("acc_matrix", F.plot_acc_matrix, res)
    th = res.get("theory")
    if th and th.get("components"):
        draw("delta_boxplot", F.plot_delta_box, th)
    if res.get("retrieval_confusion"):
        draw("retrieval_confusion", F.plot_confusion, res["retrieval_confusion"])
    if bulky.get("transfer"):
        draw("s_heatmaps", F.plot_transfer, bulky["transfer"])
    cos = bulky.get("unit_cosines")
    if cos and len(next(iter(cos.values()))) > 1:  # at least two adapters to compare
        draw("unit_cosines", F.plot_cosines, bulky["unit_cosines"])
    if res.get("latency"):
        draw("latency", F.plot_latency, res["latency"])

    md = [
        f"# {res['method']} on {res['benchmark']}",
        "",
        f"Backbone `{res['backbone']}`, seed {res['seed']}, {res['num_tasks']} tasks, "
        f"{fmt(res.get('seconds'), 1)} s. Final average accuracy **{fmt(res['final_avg_acc'])}%**, "
        f"forgetting {fmt(res['forgetting'])}."
        + (
            f" Final retrieval accuracy {fmt(res['retrieval_acc'][-1])}%." if res.get("retrieval_acc") else ""
        ),
        "",
        "## Accuracy after each task (Sec. 5.1; Fig. 3)",
        "",
        results_markdown(res),
        "",
    ]
    for key, title in (("accuracy", "average accuracy"), ("acc_matrix", "accuracy matrix")):
        if key in made:
            md += [f"![{title}]({made[key]})", ""]
    if res.get("retrieval_confusion"):
        md += ["## Task retrieval (Sec. 5.2)", ""]
        if "retrieval_confusion" in made:
            md += [f"![retrieval confusion]({made['retrieval_confusion']})", ""]
    if th:
        md += ["## Separation factor vs. Theorems 3.5 and 3.6 (Sec. 3.2; Fig. 2)", ""]
        md += _theory_markdown(th) + [""]
        if "delta_boxplot" in made:
            md += [f"![delta box plot]({made['delta_boxplot']})", ""]
    if "s_heatmaps" in made:
        md += ["## Knowledge-transfer matrix S (Fig. 5)", "", f"![S heatmaps]({made['s_heatmaps']})", ""]
    orth = res.get("orthogonality")
    if "unit_cosines" in made:
        md += [
            "## Orthogonality of the LoRA updates (Eq. 15; Figs. 6-7)",
            "",
            f"Largest |cosine| between two tasks' own updates over all adapted maps: "
            f"{fmt((orth or {}).get('max_abs_offdiag'), 9) if orth else '-'}.",
            "",
            f"![pairwise cosines]({made['unit_cosines']})",
            "",
        ]
    lat = res.get("latency")
    if lat:
        md += [
            "## Inference latency (Appendix, latency tables)",
            "",
            f"`predict` on one batch of {lat['batch_size']} ({lat['device']}, {lat['threads']} threads), "
            "median seconds, with the first m tasks:",
            "",
            "| m | " + " | ".join(str(m) for m in lat["m"]) + " |",
            "| --- | " + " | ".join("---:" for _ in lat["m"]) + " |",
            "| seconds | " + " | ".join(f"{s:.3f}" for s in lat["seconds"]) + " |",
            "",
        ]
        if "latency" in made:
            md += [f"![latency]({made['latency']})", ""]
    if res.get("report_errors"):
        md += ["## Report errors", ""] + [f"- {e}" for e in res["report_errors"]] + [""]
    md += ["Raw numbers: `results.json` (this table, theory, latency) and `analysis.json` (S, cosines).", ""]
    (out / "report.md").write_text("\n".join(md))
    return list(made.values())
