"""The long-stream section (issue 28): how the cost of task k grows with k on a 100-task stream.

The paper runs 50 and 100 tasks (CIFAR-100/50, ImageNet-R/100). This section learns a synthetic stream of
``tasks`` tasks (2 classes each, ``per_class`` small random-pattern images per class, one class pattern per
label) with the default ``proteus`` on a small randomly initialised backbone, committing every task to a
knowledge base on disk as ``proteus learn`` does, and records for every k:

* seconds to learn task k, split as the learner reports it (prefix, train, signature, head) plus the
  commit; and the seconds per optimisation step of the training (``train_step``);
* seconds per predict batch (``batch`` images of earlier tasks) along the default route, median of 3;
* the peak resident set size during learn and during predict (MiB above the process's size at start);
* the knowledge base's bytes on disk and the bytes of the two caches held within budgets (the merged
  weights, the detector's decoded Gaussians);
* at task 10 and at the last task, where the resident memory goes (:mod:`memory_account`: the learner's
  tensors by the attribute holding them, every tensor, and the native rest, malloc'd or not), and from
  the two the resident memory beyond those caches per task.

It writes ``long_stream.json`` (every row) and ``long_stream.png`` (each quantity against k) and reports
the ratios the issue sets: learn time of the last task over task 10 (<= 1.3), predict time per batch at
the last task over task 10 (<= 1.5), peak RSS at the last task within the merged-cache budget plus the
model. The time ratios are measured side by side at the end of the run (:func:`side_by_side`): the learner
as it was at task 10 (loaded from a copy of its knowledge base kept then) and the final one each learn one
more task and predict, in turns, so that a change of the machine's load during a long run cannot decide
them; the ratios of the rows (the median of a window of tasks k-2 .. k+2) are kept beside them
(``window_ratios``).

    python tools/perf/perf_long.py --tasks 100 --out runs/long_stream
    python tools/perf/perf_long.py --tasks 100 --device cuda --backbone vit_s16 --img 224 --out runs/long_gpu
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from proteus import Proteus
from proteus.engine.novelty import held_bytes
from proteus.engine.stored import TaskShares
from proteus.experiment.store import commit
from proteus.kb import KnowledgeBase
from proteus.streams.base import Task
from proteus.streams.datasets import ArrayImageDataset

sys.path.insert(0, str(Path(__file__).parent))
from memory_account import account, slopes  # noqa: E402
from perf_timing import PeakMemory, _rss_bytes, _time_call  # noqa: E402

#: the environment that turns oneDNN's primitive cache and PyTorch's mkldnn bridge cache off (read when
#: torch loads)
KERNEL_CACHES_OFF = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}


def _kernel_caches_off() -> bool:
    return all(os.environ.get(k) == v for k, v in KERNEL_CACHES_OFF.items())


def synthetic_task(k: int, per_class: int, img: int, seed: int) -> Task:
    """Task k: classes 2k and 2k+1, each a fixed random pattern plus noise (learnable, distinct per class)."""
    rng = np.random.RandomState(seed + k)
    images, labels = [], []
    for c in (2 * k, 2 * k + 1):
        pattern = np.random.RandomState(10_000 + c).randint(0, 256, (img, img, 3))
        for _ in range(per_class + 4):
            noise = rng.randint(-40, 41, (img, img, 3))
            images.append(np.clip(pattern + noise, 0, 255).astype(np.uint8))
            labels.append(c)
    arr, y = np.stack(images), np.array(labels)
    test = np.r_[np.arange(per_class, per_class + 4), per_class + 4 + np.arange(per_class, per_class + 4)]
    train = np.setdiff1d(np.arange(len(y)), test)
    return Task(
        k, [2 * k, 2 * k + 1], [f"c{2 * k}", f"c{2 * k + 1}"],
        ArrayImageDataset(arr, y[train], train), ArrayImageDataset(arr, y[test], test),
    )  # fmt: skip


def _detector_cache_bytes(clf: Proteus) -> int:
    """The bytes the detector's decoded Gaussians hold (the float64 bases a shortlist scored under, kept
    within their budget: :data:`proteus.engine.novelty.GAUSSIANS_BUDGET`, which counts each task at what it
    may come to hold); 0 without a detector."""
    novelty = getattr(getattr(clf, "keys_", None), "novelty", None)
    shares = getattr(novelty, "gaussians", None)
    return shares.holding(held_bytes) if isinstance(shares, TaskShares) else 0


def _caches_mb(row: dict[str, Any]) -> float:
    """MiB of a row's caches held within their budgets (the merged weights, the detector's Gaussians)."""
    return (row["merged_cache_bytes"] + row["detector_cache_bytes"]) / 2**20


def _gpu_slope(rows: list[dict[str, Any]], ref: int) -> float:
    """MiB of GPU memory held per task from task ``ref`` on (a least-squares line)."""
    ks = [r["task"] for r in rows if r["task"] >= ref]
    return float(np.polyfit(ks, [r["gpu_allocated_mb"] for r in rows if r["task"] >= ref], 1)[0])


def _window(rows: list[dict[str, Any]], key: str, k: int) -> float:
    vals = [r[key] for r in rows if abs(r["task"] - k) <= 2 and r[key] is not None]
    return statistics.median(vals)


def _warm(clf: Proteus) -> Proteus:
    """``clf`` (just loaded) with what a learner that kept running has built and a loaded one builds at its
    first task: each map's orthonormal basis of the old directions (``LoRAUnit._extend_basis``, O(k) after a
    load), so that the side-by-side turns time a task of a long run, not the first task of a new process."""
    for unit in getattr(getattr(clf, "model_", None), "units", {}).values():
        unit._extend_basis()
    return clf


def side_by_side(states: dict[str, tuple[Path, Any, int]], *, per_class: int, img: int, seed: int,
                 device: str, rounds: int = 3) -> dict[str, Any]:  # fmt: skip
    """For each named state (a knowledge base's folder, a predict batch, the next task's index), the learner
    loaded from it, then ``rounds`` turns, the states one after the other in each, of learning the next task
    on a copy of the learner and committing it to a copy of the knowledge base (copies made, the copy's
    store warmed by one commit, and the copy written to disk, outside the clock), then three predictions of
    the batch by the loaded learner, then opening the knowledge base anew and predicting one image; after
    the turns, ``rounds`` turns of the same in a process of its own; returns per state the medians over the
    turns (``learn_s`` fit plus commit, ``train_s`` the training part of the fit, ``signature_s``,
    ``commit_s``, ``train_step_s``, ``predict_s``: the median of its three, ``open_predict_s``,
    ``open_predict_new_s``) and, under ``turns``, each turn's seconds."""
    dev = torch.device(device)
    loaded = {name: _warm(Proteus.load(kb_dir, device=device)) for name, (kb_dir, _, _) in states.items()}
    same_x = next(iter(states.values()))[1]  # the first state's batch
    got: dict[str, dict[str, list[float]]] = {name: {} for name in states}
    for _ in range(rounds):
        for name, (kb_dir, x, k) in states.items():
            learner = copy.deepcopy(loaded[name])
            tmp = Path(tempfile.mkdtemp(prefix="proteus-side-"))
            try:
                shutil.copytree(kb_dir, tmp / "kb")
                kb = KnowledgeBase.open(tmp / "kb")
                commit(kb, learner)  # the store learns the copy's tensors (a long run's store knows them)
                os.sync()  # the copy's dirty pages written now, not by the timed commit's fsync
                t0 = time.perf_counter()
                stats = learner.fit_task(synthetic_task(k, per_class, img, seed))
                t1 = time.perf_counter()
                commit(kb, learner)
                t2 = time.perf_counter()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            steps = len(getattr(learner.trainer_, "train_log_", []) or []) or 1
            del learner
            predict, under, detector = _predict_split(loaded[name], x, dev)
            # the same batch for both learners (task 10's): what changes is only the tasks learned
            same, same_under, same_detector = _predict_split(loaded[name], same_x, dev)
            t3 = time.perf_counter()  # a new reader: open the knowledge base, predict one image
            Proteus.load(kb_dir, device=device).predict(x[:1])
            open_predict = time.perf_counter() - t3
            sec = stats.seconds
            for key, v in (("learn_s", t2 - t0), ("signature_s", sec.get("signature", 0.0)),
                           ("commit_s", t2 - t1), ("predict_s", predict), ("train_s", sec.get("train", 0.0)),
                           ("train_step_s", sec.get("train", 0.0) / steps),
                           ("open_predict_s", open_predict), ("predict_under_s", under),
                           ("predict_detector_s", detector), ("predict_same_s", same),
                           ("predict_same_under_s", same_under),
                           ("predict_same_detector_s", same_detector)):  # fmt: skip
                got[name].setdefault(key, []).append(v)
    # the readers in processes of their own after the turns above, in turns too (a process started between
    # those turns, with its gigabyte of imports, moved the timings that followed it)
    for _ in range(rounds):
        for name, (kb_dir, x, _) in states.items():
            got[name].setdefault("open_predict_new_s", []).append(
                _open_predict_new_process(kb_dir, x[:1], device)
            )
    medians = {name: {key: statistics.median(v) for key, v in d.items()} for name, d in got.items()}
    return {**medians, "turns": got}  # (each turn's seconds, for a second look)


#: a reader in a process of its own: the knowledge base (argv 1) opened and the image in the safetensors file
#: argv 2 predicted once before the clock (what a process pays once: its imports, the kernels' first use,
#: about 3 s here, the same for every knowledge base), then once more on the clock, under argv 3 threads on
#: device argv 4; prints the seconds
_NEW_READER = (
    "import sys, time, torch\n"
    "from safetensors.torch import load_file\n"
    "from proteus import Proteus\n"
    "torch.set_num_threads(int(sys.argv[3]))\n"
    "x = load_file(sys.argv[2])['x']\n"
    "Proteus.load(sys.argv[1], device=sys.argv[4]).predict(x)\n"
    "t = time.perf_counter()\n"
    "Proteus.load(sys.argv[1], device=sys.argv[4]).predict(x)\n"
    "print(time.perf_counter() - t)\n"
)


def _open_predict_new_process(kb_dir: Path, x: torch.Tensor, device: str) -> float:
    """Seconds a process of its own takes to open the knowledge base at ``kb_dir`` and predict ``x``, once it
    has done so once (:data:`_NEW_READER`): the opening measured apart from the harness's own process, which
    learned every task of the run and still holds them."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="proteus-reader-") as tmp:
        path = Path(tmp) / "x.safetensors"
        save_file({"x": x.detach().cpu().contiguous()}, str(path))
        threads = str(torch.get_num_threads())
        args = [sys.executable, "-c", _NEW_READER, str(kb_dir), str(path), threads, device]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a new reader of {kb_dir} failed: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def _predict_split(clf: Proteus, x: torch.Tensor, dev: torch.device) -> tuple[float, float, float]:
    """The median of three predictions of ``x`` and, in that call, the seconds spent in the adapters' forward
    of each input under its candidate tasks (``Embedder.embed_under``: Eq. 9's composition of every older
    direction, the method's own cost, which grows with the columns until each map's room is full) and in the
    detector of inputs from no learned task (``keys_.novelty_of``)."""
    parts = [(clf.embedder_, "embed_under"), (clf.keys_, "novelty_of")]
    spent: list[list[float]] = []
    for i, (obj, attr) in enumerate(parts):
        real = getattr(obj, attr)

        def timed(*a: Any, _real: Any = real, _i: int = i, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = _real(*a, **k)
            spent[-1][_i] += time.perf_counter() - t0
            return out

        setattr(obj, attr, timed)
    times = []
    try:
        for _ in range(3):
            spent.append([0.0, 0.0])
            times.append(_time_call(partial(clf.predict, x), dev))
    finally:
        for obj, attr in parts:
            delattr(obj, attr)
    mid = sorted(range(3), key=times.__getitem__)[1]
    return times[mid], spent[mid][0], spent[mid][1]


def held_out(refs: list[tuple[int, int]], per_class: int, img: int, seed: int) -> list[tuple[Any, int]]:
    """The held-out images ``refs`` ((task, index in its test set) each) with their classes, made again from
    their tasks (the harness keeps no image: what it holds would count as the learner's memory)."""
    tasks = {k: synthetic_task(k, per_class, img, seed) for k in sorted({k for k, _ in refs})}
    return [tasks[k].test[i] for k, i in refs]


def evaluate(
    clf: Proteus, refs: list[tuple[int, int]], batch: int, per_class: int, img: int, seed: int
) -> dict[str, float]:
    """Accuracy and task retrieval (%) on every held-out image (``refs``: :func:`held_out`) of the tasks
    learned so far."""
    hits = found = 0
    for i in range(0, len(refs), batch):
        part = refs[i : i + batch]
        images = held_out(part, per_class, img, seed)
        pred = clf.predict(clf.transform_images([x for x, _ in images]))
        y = torch.tensor([c for _, c in images])
        t = torch.tensor([k for k, _ in part])
        hits += int((pred.label.cpu() == y).sum())
        found += int((pred.task.cpu() == t).sum()) if pred.task is not None else 0
    return {"acc": 100.0 * hits / len(refs), "retrieval": 100.0 * found / len(refs)}


def run(tasks: int, out: Path, *, backbone: str = "mobilenet_v2", img: int = 32, per_class: int = 16,
        batch: int = 32, seed: int = 0, merge_budget_mb: float | None = 1024.0, method: str = "proteus",
        eval_every: int = 0, sets_extra: dict[str, Any] | None = None, device: str = "cpu",
        keep_kb: Path | None = None, log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Learn ``tasks`` synthetic tasks, measuring every k; returns the report (also written to ``out``);
    ``keep_kb``: copy the final knowledge base there, and task ``ref``'s beside it (``<keep_kb>-<ref>``: for
    profiling a long stream's learner)."""
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    sets = {
        "backbone.name": backbone, "backbone.pretrained": False, "backbone.img_size": img,
        "backbone.adapt_last": 6 if backbone == "mobilenet_v2" else 2, "adapter.rank": 2,
        "train.epochs": 1, "train.batch_size": 16, "head.rp_dim": 256, "device": device, "seed": seed,
        "eval.merge_budget_mb": merge_budget_mb,
    }  # fmt: skip
    sets.update(sets_extra or {})
    clf = Proteus.from_method(method, progress=False, **sets)
    kb_dir = Path(tempfile.mkdtemp(prefix="proteus-long-"))
    kb: KnowledgeBase | None = None
    rows: list[dict[str, Any]] = []
    held: list[tuple[int, int]] = []  # (task, index in its test set) of each held-out image (held_out)
    accounts: dict[int, dict[str, Any]] = {}
    ref = min(10, tasks)
    kept: tuple[Path, Any] | None = None  # a copy of the knowledge base at task ref, and its predict batch
    t_start = time.perf_counter()
    try:
        for k in range(tasks):
            task = synthetic_task(k, per_class, img, seed)
            with PeakMemory(dev) as pm_learn:
                t0 = time.perf_counter()
                stats = clf.fit_task(task)
                t1 = time.perf_counter()
                if kb is None:
                    kb = KnowledgeBase.create(kb_dir, clf.kb_header())
                commit(kb, clf)
                t2 = time.perf_counter()
            held += [(k, i) for i in range(len(task.test))]
            picked = [held[i % len(held)] for i in range(0, len(held), max(1, len(held) // batch))][:batch]
            x = clf.transform_images([x for x, _ in held_out(picked, per_class, img, seed)])
            with PeakMemory(dev) as pm_pred:
                predict_s = statistics.median(_time_call(partial(clf.predict, x), dev) for _ in range(3))
            sec = stats.seconds
            steps = len(getattr(clf.trainer_, "train_log_", []) or []) or None
            rows.append({
                "task": k + 1,
                "learn_s": t2 - t0, "fit_s": t1 - t0, "commit_s": t2 - t1,
                "prefix_s": sec.get("prefix"), "train_s": sec.get("train"),
                "signature_s": sec.get("signature"), "head_s": sec.get("head"),
                "train_step_s": None if not steps else sec.get("train", 0.0) / steps,
                "predict_s": predict_s,
                "learn_peak_mb": pm_learn.result.get("peak_mb"),
                "predict_peak_mb": pm_pred.result.get("peak_mb"),
                "kb_bytes": sum(f.stat().st_size for f in kb_dir.rglob("*") if f.is_file()),
                "merged_cache_bytes": clf.model_.merged_nbytes(),
                "detector_cache_bytes": _detector_cache_bytes(clf),
                "rss_mb": (_rss_bytes() or 0) / 2**20,
                # GPU memory the learner holds after task k (tensors, not the allocator's cache)
                "gpu_allocated_mb": torch.cuda.memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
            })  # fmt: skip
            r = rows[-1]
            r["ranks_min"] = stats.train.ranks_min if stats.train is not None else None
            if eval_every and ((k + 1) % eval_every == 0 or k + 1 == tasks):
                r.update(evaluate(clf, held, batch, per_class, img, seed))
            if k + 1 in (min(10, tasks), tasks):
                accounts[k + 1] = account(clf)
                r["rss_mb"] = accounts[k + 1]["rss_anon_mb"] + accounts[k + 1]["rss_file_mb"]
                r["rss_anon_mb"], r["rss_file_mb"] = (
                    accounts[k + 1]["rss_anon_mb"],
                    accounts[k + 1]["rss_file_mb"],
                )
            if k + 1 == ref and tasks > ref:  # kept on disk (not in memory) for the side-by-side measurement
                kept = (Path(tempfile.mkdtemp(prefix="proteus-long-ref-")) / "kb", x)
                shutil.copytree(kb_dir, kept[0])
            if (k + 1) % 10 == 0 or k == 0:
                log(f"task {k + 1:3d}: learn {r['learn_s']:.2f} s (train {r['train_s']:.2f}, signature "
                    f"{r['signature_s']:.2f}, head {r['head_s']:.2f}, commit {r['commit_s']:.2f}), predict "
                    f"{r['predict_s'] * 1e3:.0f} ms, KB {r['kb_bytes'] / 1e6:.1f} MB, merged cache "
                    f"{r['merged_cache_bytes'] / 1e6:.1f} MB, detector cache "
                    f"{r['detector_cache_bytes'] / 1e6:.1f} MB, peak RSS learn {r['learn_peak_mb']:.0f} "
                    f"MiB, rank {r['ranks_min']}" + (f", accuracy {r['acc']:.1f}%, retrieval "
                    f"{r['retrieval']:.1f}%" if "acc" in r else ""))  # fmt: skip
        side = None
        if kept is not None:
            log(f"side by side: the learner at task {ref} and at task {tasks}, in turns")
            side = side_by_side({"ref": (*kept, ref), "last": (kb_dir, x, tasks)},
                                per_class=per_class, img=img, seed=seed, device=device)  # fmt: skip
        if keep_kb is not None:
            shutil.copytree(kb_dir, keep_kb, dirs_exist_ok=True)
            if kept is not None:  # and task ``ref``'s beside it, for profiling the two side by side
                shutil.copytree(kept[0], keep_kb.with_name(f"{keep_kb.name}-{ref}"), dirs_exist_ok=True)
    finally:
        shutil.rmtree(kb_dir, ignore_errors=True)
        if kept is not None:
            shutil.rmtree(kept[0].parent, ignore_errors=True)
    last = rows[-1]["task"]
    budget_mb = (clf.model_.merge_budget_bytes or 0) / 2**20
    model_mb = sum(p.numel() * p.element_size() for p in clf.model_.parameters()) / 2**20
    window = {
        key: _window(rows, key, last) / _window(rows, key, ref)
        for key in ("learn_s", "train_step_s", "predict_s")
    }
    ratio = window if side is None else {key: side["last"][key] / side["ref"][key] for key in window}
    slope_keys = (
        "learn_s",
        "train_s",
        "signature_s",
        "head_s",
        "commit_s",
        "predict_s",
        "learn_peak_mb",
        "kb_bytes",
    )
    ks = [r["task"] for r in rows]
    # the process's own memory (anonymous) beyond the caches (the merged weights, the detector's decoded
    # Gaussians: each within its budget); the page cache apart (file-backed)
    beyond = {k: rows[k - 1]["rss_anon_mb"] - _caches_mb(rows[k - 1]) for k in accounts}
    span = max(last - ref, 1)
    report = {
        "settings": {"method": method, "tasks": tasks, "backbone": backbone, "img": img,
                     "kernel_caches": "off" if _kernel_caches_off() else "on",
                     "per_class": per_class,
                     "batch": batch, **{k: v for k, v in sets.items() if k != "device"}},
        "seconds_total": time.perf_counter() - t_start,
        "learn_ratio_last_vs_10": ratio["learn_s"],
        "train_step_ratio_last_vs_10": ratio["train_step_s"],
        "predict_ratio_last_vs_10": ratio["predict_s"],
        # side by side only: the commit, learning without what the training part grew (Eq. 9's O(k), shown
        # apart), and a new reader's open and first prediction
        "commit_ratio_last_vs_10": None if side is None
        else side["last"]["commit_s"] / side["ref"]["commit_s"],
        "learn_ratio_without_training_growth": None if side is None else (
            side["last"]["learn_s"] - (side["last"]["train_s"] - side["ref"]["train_s"])
        ) / side["ref"]["learn_s"],
        "open_predict_ratio_last_vs_10": None if side is None
        else side["last"]["open_predict_s"] / side["ref"]["open_predict_s"],
        # the same in a new process (a reader that did not learn the run: its imports before the clock)
        "open_predict_new_process_ratio_last_vs_10": None if side is None
        else side["last"]["open_predict_new_s"] / side["ref"]["open_predict_new_s"],
        # the adapters' forward under the candidates (Eq. 9 over every older column) as at task 10
        "predict_ratio_without_composition_growth": None if side is None else (
            side["last"]["predict_s"] - side["last"]["predict_under_s"] + side["ref"]["predict_under_s"]
        ) / side["ref"]["predict_s"],
        # task 10's batch predicted by both learners: only the tasks learned differ (not the batch's spread)
        "predict_same_batch_ratio_last_vs_10": None if side is None
        else side["last"]["predict_same_s"] / side["ref"]["predict_same_s"],
        "side_by_side": side,
        "window_ratios": window,
        "peak_rss_mb_last": max(rows[-1]["learn_peak_mb"], rows[-1]["predict_peak_mb"]),
        "rss_mb_start": rows[0]["rss_mb"] - _caches_mb(rows[0]),
        "detector_cache_mb_last": rows[-1]["detector_cache_bytes"] / 2**20,
        "rss_mb_last": rows[-1]["rss_mb"],
        "merged_budget_mb": budget_mb, "model_mb": model_mb,
        "kb_mb_per_task": rows[-1]["kb_bytes"] / last / 1e6,
        "gpu_allocated_mb_per_task": _gpu_slope(rows, ref) if dev.type == "cuda" and last > ref else None,
        "gpu_peak_mb_last": rows[-1]["learn_peak_mb"] if dev.type == "cuda" else None,
        "rss_beyond_cache_mb_per_task": (beyond[last] - beyond[ref]) / span,
        "rss_file_mb_per_task": (rows[last - 1]["rss_file_mb"] - rows[ref - 1]["rss_file_mb"]) / span,
        "memory_account": {"tasks": [ref, last], "first": accounts[ref], "last": accounts[last],
                           "per_task_mb": slopes(accounts[ref], accounts[last], span)},
        "slopes_per_task": {key: float(np.polyfit(ks, [r[key] for r in rows], 1)[0]) for key in slope_keys},
        "rows": rows,
    }  # fmt: skip
    (out / "long_stream.json").write_text(json.dumps(report, indent=1))
    _plot(rows, out / "long_stream.png")
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = [r["task"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(9, 6))
    for key in ("learn_s", "train_s", "signature_s", "head_s", "commit_s"):
        ax[0, 0].plot(k, [r[key] for r in rows], label=key.removesuffix("_s"))
    ax[0, 0].set(title="seconds to learn task k", xlabel="k")
    ax[0, 0].legend(fontsize=7)
    ax[0, 1].plot(k, [r["predict_s"] * 1e3 for r in rows])
    ax[0, 1].set(title="ms per predict batch (default route)", xlabel="tasks learned")
    ax[1, 0].plot(k, [r["learn_peak_mb"] for r in rows], label="learn")
    ax[1, 0].plot(k, [r["predict_peak_mb"] for r in rows], label="predict")
    ax[1, 0].set(title="peak RSS above start (MiB)", xlabel="k")
    ax[1, 0].legend(fontsize=7)
    ax[1, 1].plot(k, [r["kb_bytes"] / 1e6 for r in rows], label="KB on disk")
    ax[1, 1].plot(k, [r["merged_cache_bytes"] / 1e6 for r in rows], label="merged-weight cache")
    ax[1, 1].plot(k, [r["detector_cache_bytes"] / 1e6 for r in rows], label="detector's Gaussians")
    ax[1, 1].set(title="MB", xlabel="k")
    ax[1, 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--out", default="runs/long_stream")
    ap.add_argument("--backbone", default="mobilenet_v2")
    ap.add_argument("--img", type=int, default=32, help="image size of the synthetic tasks and the backbone")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...: where the learner runs")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--merge-budget-mb", type=float, default=1024.0, help="eval.merge_budget_mb")
    ap.add_argument("--method", default="proteus", help="the method (proteus-budget: the decaying rank)")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every N tasks (and after the last) accuracy and retrieval on all held-out images",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another setting")
    ap.add_argument("--keep-kb", metavar="DIR", help="copy the final knowledge base to DIR")
    ap.add_argument(
        "--no-kernel-caches",
        action="store_true",
        help="with oneDNN's and the mkldnn bridge's kernel caches off (the process starts again under "
        f"{' '.join(f'{k}={v}' for k, v in KERNEL_CACHES_OFF.items())}): every kernel compiled per call, so "
        "the native memory the caches hold is the difference from a run without this flag",
    )
    args = ap.parse_args()
    if args.no_kernel_caches and not _kernel_caches_off():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KERNEL_CACHES_OFF})
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    rep = run(args.tasks, Path(args.out), backbone=args.backbone, merge_budget_mb=args.merge_budget_mb,
              method=args.method, eval_every=args.eval_every, sets_extra=extra, device=args.device,
              img=args.img, keep_kb=Path(args.keep_kb) if args.keep_kb else None)  # fmt: skip
    keys = ("learn_ratio_last_vs_10", "train_step_ratio_last_vs_10", "predict_ratio_last_vs_10",
            "commit_ratio_last_vs_10", "learn_ratio_without_training_growth",
            "open_predict_ratio_last_vs_10", "open_predict_new_process_ratio_last_vs_10",
            "predict_ratio_without_composition_growth",
            "predict_same_batch_ratio_last_vs_10")  # fmt: skip
    for key in keys:
        if rep[key] is not None:
            print(f"{key}: {rep[key]:.3f}")
    if rep["side_by_side"] is not None:
        window = ", ".join(f"{k} {v:.3f}" for k, v in rep["window_ratios"].items())
        print(f"(measured side by side at the end; from the rows, medians of 5-task windows: {window})")
    slopes = {k: round(v, 5) for k, v in rep["slopes_per_task"].items()}
    print(f"resident {rep['rss_mb_start']:.0f} MiB after task 1, {rep['rss_mb_last']:.0f} MiB after the last")
    print(f"peak RSS at the last task {rep['peak_rss_mb_last']:.0f} MiB (merged-cache budget "
          f"{rep['merged_budget_mb']:.0f} MiB + model {rep['model_mb']:.0f} MiB); KB "
          f"{rep['kb_mb_per_task']:.2f} MB per task; slopes per task: {json.dumps(slopes)}")  # fmt: skip
    ref_k = rep["memory_account"]["tasks"][0]
    acc = rep["memory_account"]["per_task_mb"]
    owners = ", ".join(f"{k} {v:.3f}" for k, v in acc["learner_tensors_mb"].items() if abs(v) >= 0.0005)
    print(
        f"resident memory (anonymous) beyond the caches: {rep['rss_beyond_cache_mb_per_task']:.3f} MiB "
        f"per task (tasks {ref_k} to {rep['settings']['tasks']}; page cache "
        f"{rep['rss_file_mb_per_task']:.3f} MiB per task, mapped tensors {acc['learner_mapped_mb']:.3f}): "
        "the learner's tensors "
        f"{acc['learner_tensors_total_mb']:.3f} "
        f"({owners}); every tensor {acc['all_tensors_mb']:.3f}; native {acc['native_mb']:.3f}"
        + (
            f" (malloc'd {acc['native_malloc_mb']:.3f}, other {acc['native_other_mb']:.3f})"
            if acc.get("native_malloc_mb") is not None
            else ""
        )
    )
    if rep["gpu_allocated_mb_per_task"] is not None:
        print(f"GPU memory held: {rep['gpu_allocated_mb_per_task']:.3f} MiB per task from task {ref_k}; "
              f"learning the last task peaked {rep['gpu_peak_mb_last']:.0f} MiB above it")  # fmt: skip
    print(f"wrote {Path(args.out) / 'long_stream.json'} and long_stream.png")


if __name__ == "__main__":
    main()
