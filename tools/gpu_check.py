"""``make gpu-check``: what a user with a GPU runs first. One table, and ``runs/gpu-check.json``.

Steps (each timed; a failing step is reported with its message and the others still run):

1. ``numerics``: the device-independent parts computed on the GPU and on the CPU from the same inputs --
   the DP-GMM fit (Eq. 18), a signature's scores, the RanPAC head (Eq. 23) and the adapters' batched
   forward (Eq. 9) -- agree to float tolerance;
2. ``bench``: ``tools/perf/run.py --device cuda --quick`` (its figures go in the JSON);
3. ``run``: an end-to-end ``proteus run`` of 3 tasks with ViT-B/16 (random weights) on a generated image
   folder;
4. ``learn/predict``: ``proteus learn`` task 1 and task 2 in separate processes, then ``proteus predict``;
5. ``nccl``: a one-process ``torchrun`` that joins an NCCL process group and runs proteus' collective
   helpers (all-reduce, row all-gather, broadcast) on CUDA tensors.

Without a CUDA GPU it says so and exits 0. ``--device cpu`` runs the same steps on the CPU with small
sizes (how the plumbing itself is tested here, where there is no GPU).

    python tools/gpu_check.py                 # make gpu-check
    python tools/gpu_check.py --device cpu    # a dry run of every step on the CPU
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


def _proteus(*args: str, env: dict[str, str] | None = None, timeout: int = 1800) -> str:
    p = subprocess.run([sys.executable, "-m", "proteus", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(f"proteus {' '.join(args[:2])} exited {p.returncode}: {p.stderr.strip()[-600:]}")
    return p.stdout


def make_folder(root: Path, classes: int = 6, per_class: int = 12, size: int = 64) -> tuple[Path, Path]:
    """A generated ImageFolder (train/ and test/) and a tasks file of 3 tasks of 2 classes."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("test", per_class // 3)):
        for c in range(classes):
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            base = rng.integers(0, 255, 3)
            for i in range(n):
                img = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(d / f"{i}.png")
    spec = root / "tasks.yaml"
    spec.write_text("tasks:\n" + "".join(f"  - [c{2 * t}, c{2 * t + 1}]\n" for t in range(classes // 2)))
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
    args = ["--benchmark", "folder", "--data", str(data), "--tasks", str(spec), "--backbone", "vit_b16",
            "--device", dev, "-q", "--set", "backbone.pretrained=false", "--set", f"backbone.img_size={size}",
            "--set", "train.epochs=1", "--set", "head.rp_dim=1000",
            "--set", "signature.max_components=3"]  # fmt: skip
    return args + (["--set", "report.latency=false", "--set", "report.figures=false"] if report else [])


def step_run(dev: str, work: Path, data: Path, spec: Path) -> dict[str, Any]:
    out = work / "run"
    _proteus("run", "--out", str(out), *_run_args(dev, data, spec))
    res = json.loads((out / "results.json").read_text())
    return {
        "final_avg_acc": res["final_avg_acc"],
        "retrieval_acc": res["retrieval_acc"],
        "seconds": res["seconds"],
    }


def step_learn_predict(dev: str, work: Path, data: Path, spec: Path) -> dict[str, Any]:
    kb = work / "kb"
    args = _run_args(dev, data, spec, report=False)
    for t in ("1", "2"):
        _proteus("learn", "--kb", str(kb), "--task", t, *args)
    imgs = sorted(str(p) for p in (data / "test").rglob("*.png"))[:8]
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

    for sub in ("run", "kb"):
        shutil.rmtree(work / sub, ignore_errors=True)
    data, spec = make_folder(work / "data", size=64 if args.device == "cpu" else 224)
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("numerics", lambda: step_numerics(args.device)),
        ("bench", lambda: step_bench(args.device, work)),
        ("run", lambda: step_run(args.device, work, data, spec)),
        ("learn/predict", lambda: step_learn_predict(args.device, work, data, spec)),
        ("nccl", step_nccl),
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
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu-check on {report['device']} (torch {report['torch']})")
    print(f"{'step':<14} {'result':<6} {'seconds':>8}  details")
    for name, r in report["steps"].items():
        detail = json.dumps(r.get("details", r.get("error")), default=str)[:150]
        print(f"{name:<14} {'ok' if r['ok'] else 'FAIL':<6} {r['seconds']:>8.1f}  {detail}")
    print(f"report: {args.out}")
    return 0 if all(r["ok"] for r in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
