"""``make gpu-check``: what a user with a GPU runs first. One table, and ``runs/gpu-check.json``.

Steps (each timed; a failing step is reported with its message and the others still run):

1. ``numerics``: the device-independent parts computed on the GPU and on the CPU from the same inputs --
   the DP-GMM fit (Eq. 18), a signature's scores, the RanPAC head (Eq. 23) and the adapters' batched
   forward (Eq. 9) -- agree to float tolerance;
2. ``bench``: ``tools/perf/run.py --device cuda --quick`` (its figures go in the JSON);
3. ``run``: ``proteus run`` of 3 tasks with ViT-B/16 (random weights) at 224 px on a generated image folder
   of 2,000 training images per task: seconds per task for training, signature fit, head update and
   evaluation, and the peak GPU memory;
4. ``precision``: the run's knowledge base predicts its test images with bf16 autocast (the default on
   CUDA) and in float32: the share of identical classes and retrieved tasks;
5. ``learn/predict``: ``proteus learn`` task 1 and task 2 in separate processes, then ``proteus predict``;
6. ``nccl``: a one-process ``torchrun`` that joins an NCCL process group and runs proteus' collective
   helpers (all-reduce, row all-gather, broadcast) on CUDA tensors;
7. ``torchrun``: ``torchrun --nproc_per_node=1 -m proteus run`` (NCCL, every collective of the learner run
   through it) against the same ``proteus run`` without torchrun: identical results and knowledge base.

Without a CUDA GPU it says so and exits 0. ``--device cpu`` runs the same steps on the CPU with small
sizes (how the plumbing itself is tested here, where there is no GPU).

    python tools/gpu_check.py                 # make gpu-check
    python tools/gpu_check.py --device cpu    # a dry run of every step on the CPU
    python tools/gpu_check.py --per-class 200 # a smaller run step (the default is 1,000 images per class)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _proteus(
    *args: str, env: dict[str, str] | None = None, timeout: int = 1800, launcher: list[str] | None = None
) -> str:
    cmd = [*(launcher or [sys.executable]), "-m", "proteus", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"proteus {' '.join(args[:2])} exited {p.returncode}: {p.stderr.strip()[-600:]}")
    return p.stdout


def make_folder(
    root: Path, classes: int = 6, per_class: int = 12, size: int = 64, per_task: int = 2
) -> tuple[Path, Path]:
    """A generated ImageFolder (train/ and test/: ``per_class`` and ``per_class // 3`` JPEGs of each class,
    a colour per class plus noise) and a tasks file of its classes in tasks of ``per_task`` (``c0``, ``c1``,
    ...). Reused when complete."""
    rng = np.random.default_rng(0)
    bases = rng.integers(0, 255, (classes, 3))  # a class has one colour in train/ and test/
    for split, n in (("train", per_class), ("test", max(1, per_class // 3))):
        for c in range(classes):
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            base = bases[c]
            if len(list(d.glob("*.jpg"))) == n:
                continue
            for i in range(n):
                img = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(d / f"{i}.jpg", quality=90)
    spec = root / "tasks.yaml"
    rows = (
        "  - [" + ", ".join(f"c{per_task * t + i}" for i in range(per_task)) + "]\n"
        for t in range(classes // per_task)
    )
    spec.write_text("tasks:\n" + "".join(rows))
    return root, spec


def step_numerics(dev: str) -> dict[str, Any]:
    from proteus.adapters import AdaptedBackbone
    from proteus.backbones import build_backbone
    from proteus.config import SignatureConfig
    from proteus.heads import RanPACHead
    from proteus.signatures import DPGMM, fit_signature

    g = torch.Generator().manual_seed(0)
    X = torch.cat([torch.randn(300, 32, generator=g) + 4 * k for k in range(3)]).double()
    out: dict[str, Any] = {}
    fits = [DPGMM(n_components=5, max_iter=50, random_state=0, device=d).fit(X) for d in ("cpu", dev)]
    out["dpgmm_loglik_rel_diff"] = abs(fits[0].score(X) - fits[1].score(X)) / abs(fits[0].score(X))
    sigs = [fit_signature(X.float().to(d), SignatureConfig(max_components=5, max_iter=50), seed=0)
            for d in ("cpu", dev)]  # fmt: skip
    s0, s1 = (s.score(X.float().to(s.device)).cpu() for s in sigs)
    out["signature_score_max_rel_diff"] = float(((s0 - s1).abs() / s0.abs().clamp_min(1)).max())
    y = torch.arange(900) // 300
    heads = [RanPACHead(32, rp_dim=256, seed=0, device=d).update(X.to(d), y.to(d)) for d in ("cpu", dev)]
    p0, p1 = (h.decision_function(X.to(h.device or "cpu")).cpu() for h in heads)
    out["head_max_abs_diff"] = float((p0 - p1).abs().max())
    models = []
    for d in ("cpu", dev):
        m = AdaptedBackbone(build_backbone("vit_ti16", pretrained=False, img_size=32)).to(d)
        for k in range(2):
            m.begin_task(4, "learned", True, seed=k)
            with torch.no_grad():
                for u in m.units.values():
                    assert u.B_new is not None
                    u.B_new.copy_(
                        torch.randn(tuple(u.B_new.shape), generator=torch.Generator().manual_seed(k))
                    )
            m.end_task()
        models.append(m)
    x = torch.randn(4, 3, 32, 32, generator=g)
    h0, h1 = (m.embed(x.to(next(m.parameters()).device), [0, 1]).float().cpu() for m in models)
    out["adapters_max_rel_diff"] = float(((h0 - h1).abs() / h0.abs().clamp_min(1)).max())
    tol = {"dpgmm_loglik_rel_diff": 1e-6, "signature_score_max_rel_diff": 1e-3, "head_max_abs_diff": 1e-4,
           "adapters_max_rel_diff": 1e-3}  # fmt: skip
    bad = [f"{k}={out[k]:.3g} > {t:g}" for k, t in tol.items() if not out[k] <= t]
    if bad:
        raise RuntimeError("GPU and CPU disagree: " + ", ".join(bad))
    return out


def step_bench(dev: str, out_dir: Path) -> dict[str, Any]:
    path = out_dir / "gpu-check-bench.json"
    env = {**os.environ, **({"PROTEUS_BENCH_TINY": "1"} if dev == "cpu" else {})}
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "perf" / "run.py"),
        "--quick",
        "--device",
        dev,
        "--out",
        str(path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"bench exited {p.returncode}: {p.stderr.strip()[-600:]}")
    rep = json.loads(path.read_text())
    return {k: v.get("value") for k, v in rep.items() if isinstance(v, dict) and "target" in v}


def _run_args(dev: str, data: Path, spec: Path, report: bool = True) -> list[str]:
    size = "224" if dev != "cpu" else "32"
    workers = str(min(8, os.cpu_count() or 1)) if dev != "cpu" else "0"
    args = ["--benchmark", "folder", "--data", str(data), "--tasks", str(spec), "--backbone", "vit_b16",
            "--device", dev, "-q", "--set", "backbone.pretrained=false", "--set", f"backbone.img_size={size}",
            "--set", "train.epochs=1", "--set", "head.rp_dim=1000", "--set", f"train.num_workers={workers}",
            "--set", "signature.max_components=3"]  # fmt: skip
    return args + (["--set", "report.latency=false", "--set", "report.figures=false"] if report else [])


#: the per-task phases of a run's results.json, in the order they run
PHASES = ("prefix", "train", "signature", "head", "evaluate")


def step_run(dev: str, work: Path, data: Path, spec: Path) -> dict[str, Any]:
    out = work / "run"
    _proteus("run", "--out", str(out), *_run_args(dev, data, spec))
    res = json.loads((out / "results.json").read_text())
    per_task = [{p: t.get(f"seconds_{p}") for p in PHASES} | {"peak_gpu_mb": t.get("peak_gpu_mb")}
                for t in res["tasks"]]  # fmt: skip
    return {
        "train_images_per_task": [
            len(list((data / "train" / f"c{2 * k}").glob("*.jpg"))) * 2 for k in range(3)
        ],
        "final_avg_acc": res["final_avg_acc"],
        "retrieval_acc": res["retrieval_acc"],
        "seconds": res["seconds"],
        "per_task": per_task,
    }


def step_precision(dev: str, work: Path, data: Path) -> dict[str, Any]:
    """The run's knowledge base predicts its test images in bf16 and in fp32 (same KB, same inputs)."""
    from proteus.core.estimator import Proteus
    from proteus.experiment.predictions import predict_images

    files = sorted(str(p) for p in (data / "test").rglob("*.jpg"))
    preds, emb = {}, {}
    for precision in ("bf16", "fp32"):
        clf = Proteus.load(work / "run" / "kb", device=dev, precision=precision)
        x = clf.transform_images([Image.open(f).convert("RGB") for f in files[:64]])
        emb[precision] = clf.embed(x)[0]
        batches = list(predict_images(clf, files, progress=False))
        label = torch.cat([b.prediction.label for b in batches if b.prediction is not None])
        task = torch.cat([b.prediction.task for b in batches if b.prediction is not None])  # type: ignore[misc]
        truth = torch.tensor([int(Path(f).parent.name[1:]) for f in files])
        preds[precision] = (label, task, float((label == truth).double().mean() * 100))
    (l16, t16, a16), (l32, t32, a32) = preds["bf16"], preds["fp32"]
    return {
        "images": len(files),
        "same_class_pct": float((l16 == l32).double().mean() * 100),
        "same_task_pct": float((t16 == t32).double().mean() * 100),
        "embedding_rel_diff": float((emb["bf16"] - emb["fp32"]).norm() / emb["fp32"].norm()),
        "accuracy_bf16": a16,
        "accuracy_fp32": a32,
    }


def step_learn_predict(dev: str, work: Path, data: Path, spec: Path) -> dict[str, Any]:
    kb = work / "kb"
    args = _run_args(dev, data, spec, report=False)
    for t in ("1", "2"):
        _proteus("learn", "--kb", str(kb), "--task", t, *args)
    imgs = sorted(str(p) for p in (data / "test").rglob("*.jpg"))[:8]
    rows = json.loads(_proteus("predict", "--kb", str(kb), *imgs, "--json", "--device", dev, "-q"))
    if len(rows) != len(imgs) or any(r["task"] not in (1, 2) for r in rows):
        raise RuntimeError(f"predict answered {rows[:2]}")
    return {"predicted": len(rows)}


def nccl_worker() -> int:
    """Run under torchrun: join the group and exercise proteus' collective helpers on CUDA tensors."""
    import torch.distributed as tdist

    from proteus import distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    tdist.init_process_group(backend=backend)
    dev = torch.device(f"cuda:{dist.local_rank()}" if backend == "nccl" else "cpu")
    t = torch.arange(6.0, device=dev).reshape(3, 2)
    dist.all_reduce_sum_(t)
    rows = dist.all_gather_rows(t)
    dist.broadcast_([t])
    ok = rows is not None and rows.shape[0] == 3 * tdist.get_world_size()
    tdist.destroy_process_group()
    print(json.dumps({"backend": backend, "ok": bool(ok)}))
    return 0 if ok else 1


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ: ``path: a != b`` for each differing leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:60]} != {str(b)[:60]}"]


def step_torchrun(dev: str, work: Path, data: Path, spec: Path) -> dict[str, Any]:
    """The same run with and without ``torchrun --nproc_per_node=1`` (NCCL on CUDA): identical results
    (:func:`proteus.experiment.results.computed`: times, memory and provenance apart)."""
    from proteus.experiment.results import computed
    from proteus.kb import KnowledgeBase

    args = _run_args(dev, data, spec)
    _proteus("run", "--out", str(work / "plain"), *args)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                "--master_addr=127.0.0.1", "--master_port=29533"]  # fmt: skip
    _proteus("run", "--out", str(work / "torchrun"), *args, launcher=launcher)
    log = (work / "torchrun" / "log.txt").read_text()
    backend = "nccl" if dev != "cpu" else "gloo"
    if f"torch.distributed: {backend}, 1 process" not in log:
        raise RuntimeError(f"the torchrun launch did not join a {backend} process group: {log[:300]}")
    a, b = (json.loads((work / d / "results.json").read_text()) for d in ("plain", "torchrun"))
    diff = _differences(computed(a), computed(b))
    same = not diff
    hashes = [
        [t["sha256"] for t in KnowledgeBase.open(work / d / "kb").manifest["tasks"]]
        for d in ("plain", "torchrun")
    ]
    if not same or hashes[0] != hashes[1]:
        raise RuntimeError(
            f"torchrun differs from the plain run: task objects same={hashes[0] == hashes[1]}; "
            f"{len(diff)} results differ: {'; '.join(diff[:6])}"
        )
    return {"backend": backend, "same_results": same, "same_kb_objects": True,
            "final_avg_acc": a["final_avg_acc"]}  # fmt: skip


def step_nccl() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(Path(__file__).resolve()),
           "--nccl-worker"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"torchrun exited {p.returncode}: {p.stderr.strip()[-600:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of the plumbing)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check.json"))
    ap.add_argument(
        "--per-class",
        type=int,
        help="training images per class of the run step (default: 1000 on a GPU; 12 on a CPU)",
    )
    ap.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.nccl_worker:
        return nccl_worker()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU is visible to torch {torch.__version__}; nothing to check (skipped).")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"skipped": "no CUDA GPU", "torch": torch.__version__}, indent=1))
        return 0
    work = args.out.parent / "gpu-check"
    work.mkdir(parents=True, exist_ok=True)
    import shutil

    for sub in ("run", "kb", "plain", "torchrun"):
        shutil.rmtree(work / sub, ignore_errors=True)
    cpu = args.device == "cpu"
    per_class = args.per_class or (12 if cpu else 1000)
    big, spec = make_folder(work / f"data-{per_class}", per_class=per_class, size=64 if cpu else 128)
    small, _ = make_folder(work / "data-12", per_class=12, size=64)
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("numerics", lambda: step_numerics(args.device)),
        ("bench", lambda: step_bench(args.device, work)),
        ("run", lambda: step_run(args.device, work, big, spec)),
        ("precision", lambda: step_precision(args.device, work, big)),
        ("learn/predict", lambda: step_learn_predict(args.device, work, small, spec)),
        ("nccl", step_nccl),
        ("torchrun", lambda: step_torchrun(args.device, work, small, spec)),
    ]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "steps": {},
    }
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            report["steps"][name] = {"ok": True, "details": fn()}
        except Exception as e:  # noqa: BLE001 - report every step
            report["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        report["steps"][name]["seconds"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(report, indent=1, default=str))  # kept if a later step hangs
        r = report["steps"][name]
        print(f"{name}: {'ok' if r['ok'] else 'FAIL'} ({r['seconds']:.1f} s)", flush=True)
    print(f"gpu-check on {report['device']} (torch {report['torch']})")
    print(f"{'step':<14} {'result':<6} {'seconds':>8}  details")
    for name, r in report["steps"].items():
        detail = json.dumps(r.get("details", r.get("error")), default=str)[:150]
        print(f"{name:<14} {'ok' if r['ok'] else 'FAIL':<6} {r['seconds']:>8.1f}  {detail}")
    print(f"report: {args.out}")
    return 0 if all(r["ok"] for r in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
