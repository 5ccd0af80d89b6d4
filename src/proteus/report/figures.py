"""The paper's figures, drawn from results.json and analysis.json with matplotlib's Agg backend.

* :func:`plot_accuracy` -- average accuracy ACC_kappa after each task, with retrieval and oracle accuracy
  (one run; Fig. 3 for one method);
* :func:`plot_compare` -- average accuracy after each task for several methods, mean +- std over seeds
  (Fig. 3);
* :func:`plot_acc_matrix` -- acc(tau, kappa) (Sec. 5.1 metrics; the forgetting metric's input);
* :func:`plot_delta_box` -- empirical separation factor delta against the minimum Theorem 3.6 requires,
  per task (Fig. 2; Appendix table of the 50-task delta);
* :func:`plot_transfer` -- |S| heatmaps per task, rows = adapted maps, columns = older directions
  (Fig. 5);
* :func:`plot_cosines` -- pairwise cosine of the tasks' own updates per adapted map, upper triangle
  (Figs. 6-7);
* :func:`plot_confusion` -- true task x retrieved task (Sec. 5.2 retrieval accuracy);
* :func:`plot_latency` -- seconds per batch against the number of tasks m (Appendix latency tables).

Figures are built with :class:`matplotlib.figure.Figure` on an Agg canvas, never through pyplot, so no
global backend is touched and nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import SymLogNorm
from matplotlib.figure import Figure

__all__ = [
    "plot_acc_matrix",
    "plot_accuracy",
    "plot_compare",
    "plot_confusion",
    "plot_cosines",
    "plot_delta_box",
    "plot_latency",
    "plot_transfer",
]

DPI = 110


def _figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _task_ticks(ax: Any, n: int, axis: str = "x") -> None:
    step = max(1, int(math.ceil(n / 12)))
    ticks = list(range(0, n, step))
    labels = [str(t + 1) for t in ticks]
    if axis == "x":
        ax.set_xticks(ticks, labels)
    else:
        ax.set_yticks(ticks, labels)


def _nan(v: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if x is None else float(x) for x in v], dtype=float)


def plot_accuracy(res: dict[str, Any], path: Path) -> Path:
    """ACC after each task (with retrieval and oracle accuracy where the method retrieves)."""
    fig = _figure(6.0, 3.8)
    ax = fig.add_subplot()
    x = np.arange(1, len(res["avg_acc"]) + 1)
    ax.plot(x, _nan(res["avg_acc"]), "o-", label="average accuracy")
    if res.get("retrieval_acc"):
        ax.plot(x, _nan(res["retrieval_acc"]), "s--", label="retrieval accuracy")
    if res.get("oracle_avg_acc"):
        ax.plot(x, _nan(res["oracle_avg_acc"]), "^:", label="oracle (true task's adapter)")
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("%")
    ax.set_title(f"{res['method']} on {res['benchmark']} ({res['backbone']}, seed {res['seed']})")
    ax.set_xticks(x if len(x) <= 20 else x[:: int(math.ceil(len(x) / 20))])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_compare(curves: dict[str, list[list[float]]], path: Path, title: str = "") -> Path:
    """Fig. 3: per method, ACC after each task; mean over seeds with a +-std band."""
    fig = _figure(6.5, 4.0)
    ax = fig.add_subplot()
    n = 0
    for method, runs in curves.items():
        if not runs:
            continue
        width = min(len(r) for r in runs)
        a = np.array([_nan(r[:width]) for r in runs], dtype=float)
        mean = np.nanmean(a, 0)
        x = np.arange(1, a.shape[1] + 1)
        n = max(n, len(x))
        ax.plot(x, mean, "o-", ms=3, label=method)
        if a.shape[0] > 1:
            std = np.nanstd(a, 0)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ticks = np.arange(1, n + 1)
    ax.set_xticks(ticks if n <= 20 else ticks[:: int(math.ceil(n / 20))])
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("average accuracy (%)")
    ax.set_title(title or "average accuracy after each task")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _task_heatmap(
    P: np.ndarray, cells: np.ndarray, cmap: str, dark: float, labels: tuple[str, str, str], cbar: str | None
) -> Figure:
    """A task x task percentage heatmap: cells where ``cells`` is true carry their value (white on
    values above ``dark``); labels = (x label, y label, title)."""
    n = P.shape[0]
    fig = _figure(max(4.8, min(3 + 0.35 * n, 12)), min(2.6 + 0.3 * n, 10))  # wide enough for the title
    ax = fig.add_subplot()
    im = ax.imshow(P, vmin=0, vmax=100, cmap=cmap)
    if n <= 12:
        for i, j in zip(*np.nonzero(cells)):
            ax.text(j, i, f"{P[i, j]:.0f}", ha="center", va="center", fontsize=7,
                    color="w" if P[i, j] > dark else "k")  # fmt: skip
    _task_ticks(ax, n, "x")
    _task_ticks(ax, n, "y")
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(labels[2])
    fig.colorbar(im, ax=ax, shrink=0.8, label=cbar)
    return fig


def plot_acc_matrix(res: dict[str, Any], path: Path) -> Path:
    """acc(tau, kappa): rows = after task kappa, columns = test set of task tau."""
    M = np.array([_nan(r) for r in res["acc_matrix"]], dtype=float)
    labels = ("test set of task", "after learning task", "accuracy matrix acc(task, after task) %")
    fig = _task_heatmap(M, np.tril(np.ones_like(M, dtype=bool)), "viridis", -1.0, labels, None)
    return _save(fig, path)


def plot_delta_box(theory: dict[str, Any], path: Path) -> Path:
    """Fig. 2: per task, the empirical delta of its components next to Theorem 3.6's minimum delta."""
    comps = theory["components"]
    tasks = sorted({c["task"] for c in comps})
    emp = [[c["delta"] for c in comps if c["task"] == k and c["delta"] is not None] for k in tasks]
    req = [[c["min_delta"] for c in comps if c["task"] == k and c["min_delta"] is not None] for k in tasks]
    n = len(tasks)
    fig = _figure(min(4 + 0.45 * n, 16), 4.0)
    ax = fig.add_subplot()
    pos = np.arange(n, dtype=float)
    width = 0.35
    for data, off, color, label in ((emp, -width / 2, "tab:blue", "empirical δ (Def. 3.3)"),
                                     (req, width / 2, "tab:orange", "minimum δ (Thm. 3.6)")):  # fmt: skip
        keep = [i for i, d in enumerate(data) if d]
        if not keep:
            continue
        bp = ax.boxplot(
            [data[i] for i in keep],
            positions=pos[keep] + off,
            widths=width * 0.9,
            patch_artist=True,
            manage_ticks=False,
            flierprops={"markersize": 3},
        )
        for b in bp["boxes"]:
            b.set_facecolor(color)
            b.set_alpha(0.6)
        ax.plot([], [], "s", color=color, alpha=0.6, label=label)
    vals = [v for d in emp + req for v in d]
    if vals and (min(vals) < 0 or max(vals) / max(min(abs(v) for v in vals), 1e-9) > 100):
        ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xticks(pos, [str(k + 1) for k in tasks])
    ax.set_xlabel("task")
    ax.set_ylabel("separation factor δ")
    s = theory.get("summary", {})
    frac = s.get("frac_delta_ok")
    ax.set_title(
        "cluster separation per (task, component): empirical vs. required"
        + (f"\n{100 * frac:.0f}% of the components have δ ≥ minimum" if frac is not None else ""),
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _pick(n: int, most: int) -> list[int]:
    if n <= most:
        return list(range(n))
    return sorted({int(round(v)) for v in np.linspace(0, n - 1, most)})


def plot_transfer(transfer: dict[str, Any], path: Path, most: int = 9) -> Path:
    """Fig. 5: |S| per task (rows = adapted maps, columns = older tasks' rank-1 directions)."""
    names = transfer["units"]
    tasks = transfer["tasks"]
    chosen = [tasks[i] for i in _pick(len(tasks), most)]
    ranks = transfer["ranks"][names[0]]
    vmax = max((abs(v) for t in chosen for row in t["S"] for v in row), default=0.0) or 1.0
    ncol = min(3, len(chosen))
    nrow = int(math.ceil(len(chosen) / ncol))
    fig = _figure(4.2 * ncol + 1, 0.18 * len(names) * nrow + 1.2 * nrow + 0.5)
    axes = fig.subplots(nrow, ncol, squeeze=False)
    im = None
    for ax, t in zip(axes.flat, chosen):
        S = np.abs(np.array(t["S"], dtype=float))
        im = ax.imshow(S, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest")
        edges = np.cumsum([0, *ranks[: t["task"]]])
        for e in edges[1:-1]:
            ax.axvline(e - 0.5, color="w", lw=0.5, alpha=0.6)
        centres = (edges[:-1] + edges[1:]) / 2 - 0.5
        step = max(1, int(math.ceil(len(centres) / 10)))
        ax.set_xticks(centres[::step], [str(i + 1) for i in range(0, len(centres), step)], fontsize=7)
        nz = float((S != 0).mean()) if S.size else 0.0
        ax.set_title(f"task {t['task'] + 1}: {100 * nz:.0f}% non-zero", fontsize=9)
        ax.set_xlabel("older task (its rank-1 directions)", fontsize=8)
        if len(names) <= 30:
            ax.set_yticks(range(len(names)), [_short(n) for n in names], fontsize=5)
        else:
            ax.set_yticks([])
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="|S|")
    fig.suptitle("knowledge-transfer coefficients S (Eq. 9)")
    return _save(fig, path)


def _short(name: str) -> str:
    return name.replace("backbone.", "").replace("vit.blocks.", "blk").replace(".attn.qkv", "")


def plot_cosines(cosines: dict[str, list[list[float]]], path: Path, most: int = 24) -> Path:
    """Figs. 6-7: per adapted map, |cosine| of the tasks' own updates (upper triangle)."""
    names = list(cosines)
    chosen = [names[i] for i in _pick(len(names), most)]
    ncol = min(6, len(chosen))
    nrow = int(math.ceil(len(chosen) / ncol))
    fig = _figure(2.3 * ncol + 1, 2.2 * nrow + 0.6)
    axes = fig.subplots(nrow, ncol, squeeze=False)
    norm = SymLogNorm(linthresh=1e-6, vmin=0.0, vmax=1.0)
    im = None
    for ax, name in zip(axes.flat, chosen):
        C = np.abs(np.array(cosines[name], dtype=float))
        C[np.tril_indices_from(C, -1)] = np.nan
        im = ax.imshow(C, cmap="viridis", norm=norm, interpolation="nearest")
        m = C.shape[0]
        off = C[np.triu_indices(m, 1)]
        top = float(np.nanmax(off)) if off.size else 0.0
        ax.set_title(f"{_short(name)}\nmax off-diag {top:.1e}", fontsize=7)
        _task_ticks(ax, m, "x")
        _task_ticks(ax, m, "y")
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="|cos(ΔW_i, ΔW_j)|")
    fig.suptitle("pairwise cosine similarity of the tasks' LoRA updates B_τ A_τᵀ")
    return _save(fig, path)


def plot_confusion(cm: list[list[int]], path: Path) -> Path:
    """Row-normalised true task x retrieved task (percent)."""
    C = np.array(cm, dtype=float)
    P = 100.0 * C / np.maximum(C.sum(1, keepdims=True), 1.0)
    acc = 100.0 * np.trace(C) / max(C.sum(), 1.0)
    labels = ("retrieved task", "true task", f"task retrieval after the last task ({acc:.1f}% correct)")
    fig = _task_heatmap(P, C != 0, "Blues", 50.0, labels, "% of the true task's test inputs")
    return _save(fig, path)


def plot_latency(latency: dict[str, Any], path: Path) -> Path:
    """Seconds per batch of ``predict`` against the number of tasks m."""
    fig = _figure(5.5, 3.6)
    ax = fig.add_subplot()
    ax.plot(latency["m"], latency["seconds"], "o-")
    ax.set_xlabel("number of tasks m")
    ax.set_ylabel(f"seconds per batch of {latency['batch_size']}")
    ax.set_title(f"inference latency ({latency['device']}, {latency['threads']} threads)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)
