"""The ``proteus`` command line.

Subcommands: run, quickstart, learn, evaluate, predict, compare, bench, weights, data, list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EPILOG = """\
examples:
  proteus quickstart                                   # offline demo: digits, 5 tasks, MobileNetV2
  proteus run --benchmark cifar10 --data ../shared/data/cifar10-subset --config mobilenet_cpu
  proteus run --benchmark cifar100 --data ~/data --method ranpac --set adapter.rank=16
  proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 1      # one task per process
  proteus predict --kb kb/ img1.jpg img2.png --json
  proteus compare --benchmark quickstart --methods proteus,ranpac,frozen --seeds 0,1,2
  proteus list methods
"""


def _add_run_args(p: argparse.ArgumentParser, benchmark_required: bool = True) -> None:
    p.add_argument(
        "--benchmark",
        required=benchmark_required,
        help="benchmark name (see `proteus list benchmarks`) or a packaged preset such as cifar100-50 "
        "(docs/experiments.md)",
    )
    p.add_argument("--data", help="dataset root (for `folder`: an ImageFolder root with train/ and test/)")
    p.add_argument("--tasks", dest="tasks_file", help="task spec YAML for the `folder` benchmark")
    p.add_argument("--num-tasks", type=int, help="number of tasks (where the benchmark allows several)")
    p.add_argument("--backbone", help="backbone name (see `proteus list backbones`)")
    p.add_argument(
        "--weights", help="local backbone weights (.safetensors or .pth, loaded with weights_only)"
    )
    p.add_argument(
        "--config", action="append", default=[], help="YAML config file or packaged preset (repeatable)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--seed", type=int, help="seed (class order stays benchmark.class_order_seed)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: auto)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {"benchmark": {}, "backbone": {}}
    for key, dest in (("data", "data"), ("tasks_file", "tasks_file"), ("num_tasks", "num_tasks")):
        if getattr(args, key, None) is not None:
            o["benchmark"][dest] = getattr(args, key)
    if getattr(args, "backbone", None):
        o["backbone"]["name"] = args.backbone
    if getattr(args, "weights", None):
        o["backbone"]["weights"] = args.weights
    if getattr(args, "seed", None) is not None:
        o["seed"] = args.seed
    if getattr(args, "device", None):
        o["device"] = args.device
    return o


def _config(args: argparse.Namespace, method: str | None = None):
    from proteus.runner import resolve_config

    return resolve_config(
        benchmark=args.benchmark,
        method=method or getattr(args, "method", "proteus") or "proteus",
        config_files=args.config,
        sets=args.set,
        overrides=_overrides(args),
    )


def cmd_run(args: argparse.Namespace) -> int:
    from proteus.runner import format_table, run

    cfg = _config(args)
    out = Path(args.out or f"runs/{cfg.benchmark.name}-{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
    res = run(cfg, out, progress=not args.quiet)
    if _is_main():
        print(format_table(res))
        print(f"results: {out / 'results.json'}")
    return 0


def _is_main() -> bool:
    """False on the non-zero ranks of a torchrun launch (they print nothing)."""
    from proteus.distributed import is_main

    return is_main()


def cmd_quickstart(args: argparse.Namespace) -> int:
    args.benchmark = "quickstart"
    for k in ("data", "tasks_file", "num_tasks", "backbone", "weights", "seed", "device"):
        setattr(args, k, getattr(args, k, None))
    args.config, args.set = getattr(args, "config", []), getattr(args, "set", [])
    if args.out and Path(args.out, "kb", "manifest.json").exists():
        import shutil

        shutil.rmtree(args.out)  # the quickstart is a demo: rerunning it replaces its own output
    return cmd_run(args)


def _stream(cfg):
    from proteus.benchmarks import build_benchmark

    return build_benchmark(cfg.benchmark)


def cmd_learn(args: argparse.Namespace) -> int:
    from proteus.kb import KBError, KnowledgeBase
    from proteus.runner import (
        ContinualLearner,
        Evaluator,
        check_split,
        create_kb,
        kb_header,
        learn_and_commit,
        learner_from_kb,
    )

    kb_dir = Path(args.kb)
    k = args.task - 1
    if KnowledgeBase.exists(kb_dir):
        kb = KnowledgeBase.open(kb_dir)
        n = len(kb.manifest["tasks"])
        if k < n:
            print(
                f"{kb_dir}: task {args.task} is already learned ({n} tasks in the KB); nothing to do"
            )
            return 0
        if k > n:
            raise KBError(f"{kb_dir}: holds {n} tasks; learn task {n + 1} before task {args.task}")
        learner = learner_from_kb(kb, progress=not args.quiet, device=args.device)
        if args.method and args.method != learner.cfg.method:
            raise KBError(f"{kb_dir}: knowledge base uses method {learner.cfg.method!r}, not {args.method!r}")
        cfg = learner.cfg
        for key in ("data", "tasks_file"):
            if getattr(args, key, None):
                setattr(cfg.benchmark, key, getattr(args, key))
    else:
        if k != 0:
            raise KBError(f"{kb_dir}: no knowledge base here; learn task 1 first")
        cfg = _config(args)
        learner = ContinualLearner(cfg, progress=not args.quiet)
        stream = _stream(cfg)
        kb = create_kb(kb_dir, kb_header(learner, stream))
    stream = _stream(cfg)
    check_split(kb, stream)
    if k >= len(stream.tasks):
        raise KBError(f"benchmark {stream.name} has {len(stream.tasks)} tasks; there is no task {args.task}")
    evaluator = None if args.no_eval else Evaluator(learner, stream)
    learn_and_commit(learner, kb, stream, k, evaluator)
    ev = kb.manifest["evaluation"][-1] if kb.manifest["evaluation"] else None
    msg = f"learned task {args.task}/{len(stream.tasks)} into {kb_dir}"
    if ev:
        msg += f"; accuracy per task {[round(a, 2) for a in ev['row']]}"
        if ev["retrieval_acc"] is not None:
            msg += f", retrieval {ev['retrieval_acc']:.2f}%"
    if _is_main():
        print(msg)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from proteus.kb import KnowledgeBase
    from proteus.runner import Evaluator, build_results, check_split, format_table, learner_from_kb

    kb = KnowledgeBase.open(args.kb)
    learner = learner_from_kb(kb, progress=not args.quiet, device=args.device)
    cfg = learner.cfg
    if args.data:
        cfg.benchmark.data = args.data
    if args.tasks_file:
        cfg.benchmark.tasks_file = args.tasks_file
    stream = _stream(cfg)
    check_split(kb, stream)
    t0 = time.perf_counter()
    ev = Evaluator(learner, stream).evaluate(learner.num_tasks - 1)
    evaluation = list(kb.manifest.get("evaluation", []))[: learner.num_tasks - 1] + [ev]
    res = build_results(cfg, stream, evaluation, time.perf_counter() - t0)
    res["num_tasks_learned"] = learner.num_tasks
    print(format_table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"results: {args.out}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    import torch
    from PIL import Image, UnidentifiedImageError

    from proteus.kb import KnowledgeBase
    from proteus.runner import learner_from_kb

    learner = learner_from_kb(KnowledgeBase.open(args.kb), progress=False, device=args.device)
    names = learner.class_names()
    images = []
    for f in args.images:
        try:
            with Image.open(f) as im:
                images.append(im.convert("RGB"))
        except FileNotFoundError:
            raise SystemExit(f"error: {f}: no such file") from None
        except (UnidentifiedImageError, OSError) as e:
            raise SystemExit(f"error: {f}: not a readable image ({e})") from None
    rows = []
    bs = learner.cfg.eval.batch_size
    for i in range(0, len(images), bs):
        x = learner.transform_images(images[i : i + bs])
        p = learner.predict(x)
        probs = torch.softmax(p.logits, 1)
        for j in range(len(x)):
            c = int(p.label[j])
            rows.append(
                {
                    "file": str(args.images[i + j]),
                    "class": names[c],
                    "label": c,
                    "head_score": float(p.logits[j, c]),
                    "head_softmax": float(probs[j, c]),
                    "task": None if p.task is None else int(p.task[j]) + 1,
                    "component": None if p.component is None else int(p.component[j]),
                    "signature_score": None if p.score is None else float(p.score[j]),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            ret = (
                ""
                if r["task"] is None
                else f"  task {r['task']} component {r['component']} "
                f"(signature score {r['signature_score']:.2f})"
            )
            print(f"{r['file']}: {r['class']}{ret}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from proteus.report.compare import compare

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = [int(s) for s in str(args.seeds).split(",")]
    out = Path(args.out or f"runs/compare-{args.benchmark}-{time.strftime('%Y%m%d-%H%M%S')}")
    compare(
        lambda method, seed: _config(_with(args, method=method, seed=seed), method),
        methods,
        seeds,
        out,
        progress=not args.quiet,
    )
    return 0


def _with(args: argparse.Namespace, **kw: Any) -> argparse.Namespace:
    d = dict(vars(args))
    d.update(kw)
    return argparse.Namespace(**d)


def cmd_bench(args: argparse.Namespace) -> int:
    from proteus.bench import main as bench_main

    return bench_main(args)


def cmd_weights(args: argparse.Namespace) -> int:
    from proteus.backbones.weights import fetch

    path = fetch(args.name)
    print(f"{args.name}: {path}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from proteus.benchmarks.abrupt import build_abrupt_sequence

    out = build_abrupt_sequence(Path(args.cifar), Path(args.out), seed=args.seed)
    print(
        f"abrupt sequence written to {out}: use --benchmark folder --data {out} --tasks {out}/tasks.yaml"
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from proteus.backbones import BACKBONES
    from proteus.benchmarks import BENCHMARKS
    from proteus.methods import METHODS

    reg = {"backbones": BACKBONES, "benchmarks": BENCHMARKS, "methods": METHODS}
    for kind in [args.what] if args.what else list(reg):
        print(f"{kind}:")
        for name, doc in reg[kind].describe().items():
            print(f"  {name:<22} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="proteus",
        description="Continual fine-tuning of pre-trained vision backbones with provably accurate, "
        "parameter-free task retrieval (PROTEUS).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run a method over a whole task stream in one process")
    _add_run_args(r)
    r.add_argument("--method", default="proteus", help="method name (see `proteus list methods`)")
    r.add_argument("--out", help="run directory (default runs/<benchmark>-<method>-<time>)")
    r.set_defaults(func=cmd_run)

    q = sub.add_parser("quickstart", help="offline demo: digits in 5 tasks on MobileNetV2 (ImageNet weights)")
    q.add_argument("--out", default="runs/quickstart")
    q.add_argument("--method", default="proteus")
    q.add_argument("--config", action="append", default=[])
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    q.add_argument("-q", "--quiet", action="store_true")
    q.set_defaults(func=cmd_quickstart)

    lr = sub.add_parser("learn", help="learn task K into a knowledge base left by task K-1 (fresh process)")
    _add_run_args(lr)
    lr.add_argument("--kb", required=True, help="knowledge base directory")
    lr.add_argument("--task", type=int, required=True, help="task number, 1-based")
    lr.add_argument("--method", default=None, help="method (only when creating the knowledge base)")
    lr.add_argument("--no-eval", action="store_true", help="skip the evaluation after the task")
    lr.set_defaults(func=cmd_learn)

    ev = sub.add_parser("evaluate", help="evaluate a knowledge base on the test sets of its tasks")
    ev.add_argument("--kb", required=True)
    ev.add_argument("--benchmark", help="(checked against the knowledge base)")
    ev.add_argument("--data")
    ev.add_argument("--tasks", dest="tasks_file")
    ev.add_argument("--out", help="write results.json here")
    ev.add_argument("--device")
    ev.add_argument("-q", "--quiet", action="store_true")
    ev.set_defaults(func=cmd_evaluate)

    pr = sub.add_parser("predict", help="classify image files: class, retrieved task and component, scores")
    pr.add_argument("--kb", required=True)
    pr.add_argument("images", nargs="+", help="image files")
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.add_argument("--device")
    pr.set_defaults(func=cmd_predict)

    c = sub.add_parser(
        "compare", help="run several methods on one split and print a Table-1-style comparison"
    )
    _add_run_args(c)
    c.add_argument("--methods", required=True, help="comma-separated method names")
    c.add_argument("--seeds", default="0", help="comma-separated seeds (mean and std over them)")
    c.add_argument("--out", help="output directory")
    c.set_defaults(func=cmd_compare)

    b = sub.add_parser("bench", help="performance harness: ratios measured side by side in one process")
    b.add_argument("--out", help="write the JSON report here")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    b.add_argument("--device", default="auto")
    b.set_defaults(func=cmd_bench)

    w = sub.add_parser("weights", help="provision pretrained weights into the torch hub cache")
    wsub = w.add_subparsers(dest="action", required=True)
    wf = wsub.add_parser("fetch", help="download (or obtain offline) and verify weights")
    wf.add_argument("name", help="backbone name, e.g. mobilenet_v2")
    wf.set_defaults(func=cmd_weights)

    d = sub.add_parser("data", help="build datasets from local material")
    dsub = d.add_subparsers(dest="action", required=True)
    da = dsub.add_parser("abrupt", help="CIFAR-10 classes alternating with handwritten digits (5 tasks)")
    da.add_argument(
        "--cifar", required=True, help="CIFAR-10 ImageFolder root (e.g. ../shared/data/cifar10-subset)"
    )
    da.add_argument("--out", required=True)
    da.add_argument("--seed", type=int, default=0)
    da.set_defaults(func=cmd_data)

    ls = sub.add_parser("list", help="list backbones, benchmarks or methods")
    ls.add_argument("what", nargs="?", choices=["backbones", "benchmarks", "methods"])
    ls.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from proteus.config import ConfigError
    from proteus.kb import KBError

    if os.environ.get("WORLD_SIZE", "1") != "1":  # launched by torchrun: join the process group
        from proteus.distributed import init_from_env

        init_from_env()
    try:
        return int(args.func(args) or 0)
    except (ConfigError, KBError, KeyError, ValueError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:  # a corrupt image file in a dataset (CorruptImageError names the file)
        from proteus.benchmarks.errors import BenchmarkError

        if not isinstance(e, BenchmarkError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if "torch.distributed" in sys.modules:
            from proteus.distributed import shutdown

            shutdown()


if __name__ == "__main__":
    sys.exit(main())
