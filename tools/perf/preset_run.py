"""A paper preset end to end on generated images of its shape: seconds per task and phase, peak GPU memory.

The preset's own settings (``--config PRESET``: backbone, rank, lambda and its decay, learning rate, batch
size, random projection, DP-GMM components) run on a generated image folder with the preset's classes per
task at its image size (224 px for ViT-B/16), the backbone's weights random (no download: the timings do
not depend on the weights). The first ``--tasks`` tasks of the preset run, so that a GPU session can fit it
in its time; each task's seconds per phase (prefix, training, signature, head, evaluation) and its peak GPU
memory come from the run's results.json, in ``OUT/preset.json`` and a table::

    python tools/perf/preset_run.py --preset imagenet-r --tasks 3 --per-class 60 --device cuda \\
        --out runs/preset
    python tools/perf/preset_run.py --preset imagenet-r --tasks 2 --per-class 3 --img 32 --device cpu \\
        --out /tmp/preset   # a dry run of the plumbing on a CPU (about 3 minutes)

The peak GPU memory is per task (learning and evaluating it, ``peak_gpu_mb``), not per phase; off CUDA it is
null.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from gpu_check import PHASES, make_folder  # noqa: E402

#: the preset's classes per task where its benchmark does not say (ImageNet-R and ImageNet-A: 200 classes in
#: 10 tasks)
CLASSES_PER_TASK = 20


def preset(name: str) -> dict[str, Any]:
    """The preset's YAML (``proteus/configs/benchmarks/NAME.yaml``); a SystemExit naming the presets when
    there is none."""
    folder = resources.files("proteus") / "configs" / "benchmarks"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise SystemExit(f"no preset {name!r}; one of: {', '.join(names)}")
    return yaml.safe_load(path.read_text())


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each task's seconds per phase, in all, and its peak GPU memory, from a run's results.json."""
    return [
        {"task": k + 1, **{p: t.get(f"seconds_{p}") for p in PHASES}, "task_s": t.get("seconds_task"),
         "peak_gpu_mb": t.get("peak_gpu_mb")}
        for k, t in enumerate(res["tasks"])
    ]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["task", *PHASES, "task_s", "peak_gpu_mb"]
    cell = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + " ---: |" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="imagenet-r", help="a benchmark preset (default: imagenet-r)")
    ap.add_argument("--tasks", type=int, default=None, help="the first N tasks (default: all)")
    ap.add_argument("--classes-per-task", type=int, default=CLASSES_PER_TASK)
    ap.add_argument("--per-class", type=int, default=60, help="training images per class")
    ap.add_argument("--img", type=int, default=None, help="image size (default: the preset's backbone's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds the run may take")
    ap.add_argument("--out", type=Path, default=Path("runs/preset"))
    args = ap.parse_args(argv)
    cfg = preset(args.preset)
    tasks = args.tasks or int(cfg["benchmark"]["num_tasks"])
    size = args.img or 224
    t0 = time.perf_counter()
    data, spec = make_folder(args.out / "data", tasks * args.classes_per_task, args.per_class, size,
                             per_task=args.classes_per_task)  # fmt: skip
    made = time.perf_counter() - t0
    cmd = [sys.executable, "-m", "proteus", "run", "--benchmark", "folder", "--config", args.preset,
           "--set", "benchmark.name=folder", "--set", f"benchmark.num_tasks={tasks}", "--data", str(data),
           "--tasks", str(spec), "--set", "backbone.pretrained=false", "--device", args.device,
           "--out", str(args.out / "run"), "-q"]  # fmt: skip
    if args.img is not None:
        cmd += ["--set", f"backbone.img_size={args.img}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        log = args.out / "run" / "log.txt"
        tail = log.read_text()[-1500:] if log.is_file() else ""
        print(
            f"the run did not end in {args.timeout} s (--timeout); its log so far:\n{tail}", file=sys.stderr
        )
        return 124
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        return p.returncode
    res = json.loads((args.out / "run" / "results.json").read_text())
    rows = summary(res)
    report = {"preset": args.preset, "tasks": tasks, "classes_per_task": args.classes_per_task,
              "train_images_per_class": args.per_class, "img": args.img, "device": args.device,
              "generate_s": made, "run_s": res["seconds"], "final_avg_acc": res["final_avg_acc"],
              "provenance": res.get("provenance"), "command": cmd[1:], "per_task": rows}  # fmt: skip
    (args.out / "preset.json").write_text(json.dumps(report, indent=1))
    print(
        f"{args.preset}: {tasks} tasks of {args.classes_per_task} classes, {args.per_class} training images "
        f"per class at {size} px on {args.device}: {res['seconds']:.1f} s (images made in {made:.1f} s)"
    )
    print(table(rows))
    print(f"report: {args.out / 'preset.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
