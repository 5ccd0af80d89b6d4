"""The ``proteus`` subcommands: each turns its arguments into library calls and prints the outcome."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proteus.cli.inputs import UsageError, check_kb
from proteus.config import ConfigError
from proteus.untrusted import printable

if TYPE_CHECKING:
    from proteus.config import RunConfig


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
    if getattr(args, "precision", None):
        o["precision"] = args.precision
    return o


def _config(args: argparse.Namespace, method: str | None = None) -> RunConfig:
    from proteus.config import resolve_config

    cfg = resolve_config(
        benchmark=args.benchmark,
        method=method or getattr(args, "method", "proteus") or "proteus",
        config_files=args.config,
        sets=args.set,
        overrides=_overrides(args),
    )
    _use_threads(cfg.threads)
    return cfg


def _use_threads(n: int | None) -> None:
    """The config's ``threads`` (a --config file's, --set's, a resumed run's), once it is known."""
    if n is not None:
        from proteus.cli import threads

        threads.apply(n)


def _warn_full_backbone_on_cpu(cfg: RunConfig) -> None:
    """A warning when a run trains on a CPU with every block of the backbone adapted (the paper's ViT-B/16
    presets, and ``folder``'s MobileNetV2 at 224 px): settings made for a GPU, not the CPU recipe's."""
    from proteus.distributed import device_for_rank

    b = cfg.backbone
    if b.adapt_last is None and device_for_rank(cfg.device).type == "cpu":
        logging.getLogger("proteus").warning(
            "training %s with every block adapted on a CPU: settings made for a GPU, slow and memory-hungry "
            "here; --config mobilenet_cpu runs MobileNetV2 settings made for a CPU",
            b.name,
        )


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys this command line sets explicitly (flat, dotted, each checked and of its declared
    type: :func:`proteus.config.validate_keys`): what ``learn`` checks against an existing knowledge base.
    A packaged preset given as --benchmark only names the benchmark."""
    from proteus.config import config_file_keys, flatten, load_yaml, packaged_config, parse_set, validate_keys

    given: dict[str, Any] = {}
    if args.benchmark:
        preset = packaged_config(args.benchmark, "benchmarks")
        name = (load_yaml(preset).get("benchmark") or {}).get("name") if preset else None
        given["benchmark.name"] = name or args.benchmark
    for f in args.config:
        given.update(config_file_keys(f, given.get("benchmark.name")))
    given.update(flatten(parse_set(args.set)))
    given.update(flatten(_overrides(args)))
    if args.method:
        given["method"] = args.method
    return validate_keys(given)


#: the options ``run --resume`` takes beside the run directory (everything else is the run's own config)
_RESUME_OPTIONS = ("device", "precision", "threads", "quiet", "resume", "debug", "func", "command", "set")


def _resumed_config(args: argparse.Namespace) -> RunConfig:
    """The interrupted run's own config (its config.yaml), with ``--device`` / ``--precision`` for this
    process; any option that would change the run is refused by name."""
    from proteus.config import RunConfig, load_yaml

    given = [k for k, v in vars(args).items() if k not in _RESUME_OPTIONS and v not in (None, [], False)]
    if given or [s for s in args.set if not s.startswith("threads=")]:  # (--threads N is --set threads=N)
        names = ", ".join(f"--{k.replace('_', '-')}" for k in given) or "--set"
        raise UsageError(f"--resume continues a run with its own config.yaml; drop {names}")
    path = Path(args.resume) / "config.yaml"
    if not path.is_file():
        raise UsageError(
            f"--resume {args.resume}: no config.yaml there; give the --out of an interrupted run"
        )
    cfg = RunConfig.from_stored(load_yaml(path))
    return cfg.with_values({k: v for k, v in _overrides(args).items() if k in ("device", "precision")})


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        cfg, out = _resumed_config(args), Path(args.resume)
        _use_threads(args.threads or cfg.threads)
    else:
        if not args.benchmark:
            raise UsageError("run: --benchmark is required (or --resume DIR to continue an interrupted run)")
        cfg = _config(args)
        out = Path(args.out or f"runs/{cfg.benchmark.name}-{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        _check_out_dir(out, "--out", allow_existing_dir=True)
    from proteus.experiment import format_table, run  # (torch: after the config and --out are checked)

    _warn_full_backbone_on_cpu(cfg)
    args.run_dir = out  # an interrupted run says how to continue it (proteus.cli.main)
    res = run(cfg, out, progress=not args.quiet, resume=bool(args.resume))
    if _is_main():
        print(format_table(res))
        print(f"results: {out / 'results.json'}")
    return 0


def _check_out_dir(out: Path, flag: str, allow_existing_dir: bool = False) -> None:
    """Refuse an output path that is a file, or (unless allowed) an existing non-empty directory, before
    any work starts."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out}: is a file; give a directory")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{flag} {out}: {parent} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not allow_existing_dir:
        raise UsageError(f"{flag} {out}: exists and is not empty; choose a new directory")


def _is_main() -> bool:
    """False on the non-zero ranks of a torchrun launch (they print nothing)."""
    from proteus.distributed import is_main

    return is_main()


def cmd_quickstart(args: argparse.Namespace) -> int:
    args.benchmark = "quickstart"
    for k in (
        "data",
        "tasks_file",
        "num_tasks",
        "backbone",
        "weights",
        "seed",
        "device",
        "precision",
        "resume",
    ):
        setattr(args, k, getattr(args, k, None))
    args.config, args.set = getattr(args, "config", []), getattr(args, "set", [])
    out = Path(args.out) if args.out else None
    if out is not None and Path(out, "kb", "manifest.json").exists():
        if not (out / QUICKSTART_MARK).is_file():
            raise ConfigError(
                f"{out}: holds a knowledge base that no quickstart wrote (no {QUICKSTART_MARK} in it); it is "
                "left as it is: choose another --out for the quickstart"
            )
        import shutil

        shutil.rmtree(out)  # the quickstart is a demo: rerunning it replaces its own output
    code = cmd_run(args)
    if out is not None and code == 0 and out.is_dir():
        (out / QUICKSTART_MARK).write_text(
            "written by `proteus quickstart`: its next run replaces this folder\n"
        )
    return code


#: the file a quickstart leaves in its folder: the one folder holding a knowledge base that it replaces
QUICKSTART_MARK = ".quickstart"


def cmd_learn(args: argparse.Namespace) -> int:
    if args.task > 1 and Path(args.kb).exists():  # a wrong folder named before anything loads (a missing
        check_kb(args.kb)  # one: learn_task says to learn task 1 first)
    given = _given(args)  # every key checked before torch loads
    _use_threads(given.get("threads"))  # (a new knowledge base's config applies it too: _config)
    from proteus.experiment.learn import learn_task

    kb_dir = Path(args.kb)
    out = learn_task(
        kb_dir,
        args.task,
        lambda: _config(args),
        given,
        evaluate=not args.no_eval,
        progress=not args.quiet,
        wait=args.wait,
    )
    if not _is_main():
        return 0
    if out.already:
        print(
            f"{kb_dir}: task {args.task} is already learned ({out.kb_tasks} tasks in the KB); nothing to do"
        )
        return 0
    msg = f"learned task {args.task}/{out.num_tasks} into {kb_dir}"
    if out.evaluation is not None:
        msg += f"; accuracy per task {[round(a, 2) for a in out.evaluation.row]}"
        if out.evaluation.retrieval_acc is not None:
            msg += f", retrieval {out.evaluation.retrieval_acc:.2f}%"
    else:
        msg += " (not evaluated: --no-eval)"
    print(msg)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.experiment import format_table
    from proteus.experiment.learn import evaluate_kb

    if args.out:
        _check_out_dir(Path(args.out), "--out")
    res = evaluate_kb(
        args.kb, benchmark=args.benchmark, data=args.data, tasks_file=args.tasks_file, device=args.device,
        precision=args.precision, progress=not args.quiet,
    )  # fmt: skip
    print(format_table(res))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / "results.json"
        path.write_text(json.dumps(res, indent=1))
        print(f"results: {path}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """``proteus predict``: every input checked first (the knowledge base's folder and manifest, each image's
    header: :mod:`.inputs`, no torch), then the knowledge base loaded and the images predicted in batches,
    each batch's rows printed or written (``--out``) as it is done, and a summary."""
    from proteus.cli.inputs import check_kb, image_inputs, kb_eval_setting, output_format
    from proteus.images import DEFAULT_MAX_PIXELS, describe_skipped

    manifest = check_kb(args.kb)
    kind = output_format(args.out) if args.out else None
    max_pixels = args.max_pixels or kb_eval_setting(manifest, "max_image_pixels", DEFAULT_MAX_PIXELS)
    inputs = image_inputs(args.images, max_pixels=max_pixels, skip_unreadable=args.skip_unreadable)
    if not inputs.files and not inputs.skipped:
        given = " ".join(map(printable, args.images))
        raise UsageError(
            f"{given}: no image file found (folders are searched recursively, hidden files left out)"
        )
    if inputs.skipped:
        print(describe_skipped(inputs.skipped), file=sys.stderr)
    from proteus.experiment.predictions import (
        NOT_CALIBRATED,
        NOT_CHECKED,
        Summary,
        format_row,
        predict_images,
        prediction_rows,
    )
    from proteus.experiment.store import load_learner
    from proteus.kb import KBError, KnowledgeBase

    kb = KnowledgeBase.open(args.kb)
    clf = load_learner(kb, "proteus predict", device=args.device, precision=args.precision)
    if clf.num_tasks == 0:
        raise KBError(f"{args.kb}: the knowledge base holds no task yet; learn task 1 first (proteus learn)")
    summary = Summary(unreadable=len(inputs.skipped), ignored=inputs.ignored)
    many = len(inputs.files) + len(inputs.skipped) > 1 or kind is not None
    rows: list[dict[str, Any]] = []  # --json prints them together at the end
    unchecked, uncalibrated, seconds = True, False, 0.0
    with _RowSink(args.out, kind, args.top_k) as sink:
        for path, reason in inputs.skipped:
            sink.write([{"file": path, "error": reason}])
        batches = predict_images(
            clf,
            inputs.files,
            progress=not args.quiet and len(inputs.files) > clf.config.eval.batch_size,  # images, images/s
            max_pixels=max_pixels,
            skip_unreadable=args.skip_unreadable,
        )
        for batch in batches:
            seconds = batch.seconds
            if batch.skipped:  # found only when decoded (data corrupt past a complete-looking header)
                print(describe_skipped(batch.skipped), file=sys.stderr)
                summary.unreadable += len(batch.skipped)
                sink.write([{"file": p, "error": why} for p, why in batch.skipped])
            if batch.prediction is None:
                continue
            got = prediction_rows(clf, batch.prediction, batch.files, top_k=args.top_k)
            summary.add(got)
            unchecked &= all(r["known"] is None for r in got)
            uncalibrated |= any(r["known"] is not False and not r["calibrated"] for r in got)
            if sink.kind is not None:
                sink.write(got)
            elif args.json:
                rows += got
            else:
                for r in got:
                    print(printable(format_row(r, verbose=args.verbose)), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif sink.kind is None and summary.predicted and not args.quiet:
        if unchecked and "retrieval" in clf.supports:  # `kb calibrate` fits thresholds on task retrieval
            print(NOT_CHECKED, file=sys.stderr)
        if uncalibrated:
            print(NOT_CALIBRATED, file=sys.stderr)
    if many and not args.quiet:
        written = f"; rows written to {printable(str(args.out))}" if args.out else ""
        print(f"predicted {summary.line(seconds)}{written}", file=sys.stderr)
    return 0 if summary.predicted or not summary.unreadable else 2


class _RowSink:
    """Where ``predict --out FILE`` writes each batch's rows as it is done: JSON Lines or CSV
    (:func:`proteus.experiment.predictions.csv_row`); nothing without a file (``kind`` None)."""

    def __init__(self, path: str | None, kind: str | None, top_k: int) -> None:
        self.path, self.kind, self.top_k = path, kind, top_k
        self._file: Any = None
        self._csv: Any = None
        self._columns: list[str] = []

    def __enter__(self) -> _RowSink:
        if self.path is None:
            return self
        self._file = open(self.path, "w", encoding="utf-8", newline="")  # noqa: SIM115 - closed in __exit__
        if self.kind == "csv":
            import csv

            from proteus.experiment.predictions import csv_columns

            self._columns = csv_columns(self.top_k)
            self._csv = csv.writer(self._file)
            self._csv.writerow(self._columns)
        return self

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self._file is None:
            return
        if self._csv is not None:
            from proteus.experiment.predictions import csv_row

            self._csv.writerows(csv_row(r, self._columns) for r in rows)
        else:
            self._file.writelines(json.dumps(r) + "\n" for r in rows)
        self._file.flush()

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


def cmd_kb_forget(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.experiment.manage import forget

    names = forget(args.kb, args.task, wait=args.wait, key=_kb_key(args))
    print(f"{args.kb}: task {args.task} forgotten (classes {names}); `proteus kb undo` restores it")
    return 0


def _kb_key(args: argparse.Namespace, strict: bool = False) -> bytes | None:
    """The key of ``--key-file`` (else $PROTEUS_KB_KEY_FILE's, when ``--min-sequence``, ``--kb-id`` or
    ``strict`` need one) with ``--min-sequence`` and ``--kb-id``; ``strict``: a record of accepted sequences
    that cannot be read or written is a problem (``kb verify``). None: no key given (``KnowledgeBase.open``
    reads $PROTEUS_KB_KEY_FILE)."""
    from proteus.kb.signing import key_from_env, read_key_file

    floor, pinned = getattr(args, "min_sequence", None), getattr(args, "kb_id", None)
    key = read_key_file(args.key_file) if getattr(args, "key_file", None) else None
    if key is None and (floor is not None or pinned is not None or strict):
        key = key_from_env()
        if key is None and (floor is not None or pinned is not None):
            raise ConfigError(
                "--min-sequence and --kb-id check a signature: give --key-file (or $PROTEUS_KB_KEY_FILE)"
            )
    if key is not None:
        key.min_sequence, key.kb_id, key.strict = floor, pinned, strict
    return key


def _commit_words(s: dict[str, Any]) -> str:
    forgotten = f"; task(s) {s['forgotten']} forgotten" if s["forgotten"] else ""
    return f"the commit of {s['updated']} ({s['tasks']} task(s){forgotten})"


def cmd_kb_undo(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.experiment.manage import undo

    done = undo(args.kb, wait=args.wait, key=_kb_key(args))
    print(
        f"{args.kb}: restored {_commit_words(done['restored'])}; the state it replaced "
        f"({_commit_words(done['replaced'])}) is now the previous commit: `proteus kb undo` again goes back "
        "to it"
    )
    return 0


def cmd_kb_sign(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.kb import KnowledgeBase, write_lock
    from proteus.kb.signing import key_id

    key = _kb_key(args)
    assert key is not None
    with write_lock(args.kb, wait=args.wait):
        kb = KnowledgeBase.open(args.kb, key=key, require_signature=False)
        kb.sign(key)
    print(
        f"{args.kb}: signed (hmac-sha256, key id {key_id(key)}); check it with `proteus kb verify {args.kb} "
        "--key-file KEYFILE` or $PROTEUS_KB_KEY_FILE; commits made with the key sign again"
    )
    return 0


def cmd_kb_gc(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.kb import KnowledgeBase, write_lock

    with write_lock(args.kb, wait=args.wait):
        removed = KnowledgeBase.open(args.kb, verify=False, require_signature=False).gc()
    for path, size in removed:
        print(f"removed {path} ({size} bytes)")
    freed = sum(size for _, size in removed)
    print(f"{args.kb}: removed {len(removed)} file(s), {freed} bytes ({freed / 1e6:.2f} MB) freed")
    return 0


def cmd_kb_upgrade(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.kb import FORMAT_VERSION, KnowledgeBase, write_lock

    with write_lock(args.kb, wait=args.wait):
        kb = KnowledgeBase.open(args.kb, key=_kb_key(args))
        was = kb.upgrade()
    if was is None:
        print(f"{args.kb}: already in format {FORMAT_VERSION}; nothing to do")
        return 0
    print(
        f"{args.kb}: upgraded from format {was} to format {FORMAT_VERSION} ({len(kb.manifest['tasks'])} "
        f"task(s) in {len(kb.manifest['segments'])} record segment(s), commit {kb.manifest['sequence']}); "
        "`proteus kb undo` goes back to the same state"
    )
    return 0


def cmd_kb_calibrate(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.experiment.manage import calibrate_images, recalibrate

    if args.images is None and args.tpr is None:
        raise ConfigError("kb calibrate needs --images DIR (held-out images) or --tpr RATE, or both")
    if args.images is not None:
        found, temps = calibrate_images(args.kb, args.images, args.tpr, wait=args.wait, key=_kb_key(args))
        print(f"{args.kb}: thresholds fitted on the images of {args.images}: {[round(t, 3) for t in found]}")
        if temps:
            each = ", ".join(f"task {k + 1}: {c.temperature:.3g} ({c.rows} images)" for k, c in temps.items())
            print(f"{args.kb}: confidence temperatures fitted on the images in class folders: {each}")
        return 0
    thresholds = [round(t, 3) for t in recalibrate(args.kb, args.tpr, wait=args.wait, key=_kb_key(args))]
    print(f"{args.kb}: thresholds at a true-positive rate of {args.tpr:g}: {thresholds}")
    return 0


def cmd_kb_verify(args: argparse.Namespace) -> int:
    """``proteus kb verify KB``: every error (exit 1), then the warnings (files no commit needs: exit 0). A
    knowledge base whose files are sound is then loaded as every command loads it
    (:func:`proteus.learners.load_problems`): what verify accepts, ``predict`` and ``kb info`` load."""
    import proteus.kb as kbmod

    key = _kb_key(args, strict=True)
    report = kbmod.check(args.kb, key)
    if not report.errors:
        from proteus.learners import load_problems

        try:
            report.errors += load_problems(kbmod.KnowledgeBase.open(args.kb, key=key))
        except kbmod.KBError as e:  # changed since it was checked (a commit ran meanwhile)
            report.errors.append(str(e))
    for p in report.errors:
        print(printable(p))
    for w in report.warnings:
        print(printable(f"warning: {w}"))
    status = "OK" if not report.errors else f"{len(report.errors)} problem(s)"
    if report.verified:
        status += f", {report.verified}"
    if report.warnings:
        status += f", {len(report.warnings)} warning(s)"
        if report.leftover_bytes:
            status += f" ({report.leftover_bytes} bytes of leftovers: `proteus kb gc {args.kb}` removes them)"
    print(f"{args.kb}: {status}")
    return 0 if not report.errors else 1


def cmd_kb_show(args: argparse.Namespace) -> int:
    """``proteus kb info | list KB``."""
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    import proteus.kb as kbmod

    kb = kbmod.KnowledgeBase.open(args.kb, key=_kb_key(args))
    info = kbmod.info(kb)
    if args.action == "info":
        from proteus.adapters.model import ranks_from_shapes

        for t in info["tasks"]:  # each task's adapter rank per map, from its object's header
            ranks = ranks_from_shapes(kbmod.object_shapes(kb, t.get("object")) or {})
            if ranks:
                t["ranks"] = ranks
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    show = _printer()
    mb, disk, prev = (info[k] / 1e6 for k in ("total_bytes", "disk_bytes", "previous_bytes"))
    show(
        f"{info['root']}: {info['method']} on {info['benchmark']}, backbone {info['backbone_name']}, "
        f"{info['num_tasks']} task(s), {mb:.2f} MB ({disk:.2f} MB on disk, {prev:.2f} MB of it the previous "
        f"commit kept for `proteus kb undo`) (format {info['format_version']})"
    )
    for t in info["tasks"]:
        settings = ", ".join(f"{k}={v}" for k, v in (t.get("settings") or {}).items())
        line = (
            f"  task {t['index'] + 1}: {len(t['classes'])} classes {t['class_names']}, {t['n_train']} images"
        )
        line += f", learned {t['learned']}" if t.get("learned") else ""
        line += " [forgotten]" if t.get("forgotten") else ""
        if t.get("ranks") and args.action == "info":
            line += f", {_ranks_text(t['ranks'])}"
        show(line + (f"; {settings}" if settings and args.action == "info" else ""))
    if args.action == "info":
        show(f"  created {info['created']}, updated {info['updated']}, proteus {info['proteus_version']}")
        show(f"  backbone {json.dumps(info['backbone'])}")
        sig = info["signature"]
        if sig is None:
            show("  not signed (`proteus kb sign`)")
        else:
            checked = "checked" if sig["checked"] else "not checked: pass --key-file"
            show(f"  signed ({sig['alg']}, key id {sig['key_id']}; {checked})")
    return 0


def _ranks_text(ranks: dict[str, int]) -> str:
    """A task's adapter rank per map in words: ``rank 8 on 12 maps``, naming the maps that got fewer."""
    top = max(ranks.values())
    fewer = {m: r for m, r in ranks.items() if r < top}
    text = f"rank {top} on {len(ranks) - len(fewer)} of {len(ranks)} maps"
    if fewer:
        text += " (no orthogonal room left: " + ", ".join(f"{m} {r}" for m, r in fewer.items()) + ")"
    return text


def _printer() -> Any:
    """``print`` of one line of someone else's text: control and bidi characters escaped."""
    return lambda line: print(printable(str(line)))


def cmd_serve(args: argparse.Namespace) -> int:
    check_kb(args.kb)  # before anything loads: a wrong folder is named at once
    from proteus.serve import serve

    limits = ("read_timeout", "request_timeout", "max_concurrency", "max_queue", "max_batch", "max_body",
              "max_images", "max_request_pixels")  # fmt: skip
    given = {k: getattr(args, k) for k in limits if hasattr(args, k)}  # the rest: Limits' defaults
    serve(args.kb, host=args.host, port=args.port, device=args.device, precision=args.precision,
          poll_seconds=args.poll, **given)  # fmt: skip
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        seeds = [int(s) for s in str(args.seeds).split(",")]
    except ValueError:
        raise UsageError(f"--seeds expects comma-separated integers (0,1,2), got {args.seeds!r}") from None
    out = Path(args.out or f"runs/compare-{args.benchmark}-{time.strftime('%Y%m%d-%H%M%S')}")
    for method in methods:  # every method's config checked before torch loads (a typo named at once)
        _config(_with(args, method=method, seed=seeds[0]), method)
    executor = _executor(args)
    from proteus.experiment.compare import compare

    compare(
        lambda method, seed: _config(_with(args, method=method, seed=seed), method),
        methods,
        seeds,
        out,
        progress=not args.quiet,
        executor=executor,
    )
    return 0


#: the options that say where cells run, not what they compute (left out of the command a table records)
_EXECUTOR_FLAGS = {"--executor": 1, "--jobs": 1, "--partition": 1, "--gpus-per-task": 1, "--time": 1,
                   "--array-parallelism": 1, "--slurm-opt": 1, "--dry-run": 0}  # fmt: skip


def _without_executor(argv: list[str]) -> list[str]:
    """``argv`` without the executor's options: the same cells give the same table wherever they ran."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _EXECUTOR_FLAGS:
            skip = _EXECUTOR_FLAGS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


def _executor(args: argparse.Namespace) -> Any:
    """The executor the command line names, with its options (one it does not take is refused)."""
    from proteus.experiment.executors import ExecutorOptions, make_executor, time_minutes

    options = ExecutorOptions(
        jobs=args.jobs, partition=args.partition, gpus_per_task=args.gpus_per_task,
        time=time_minutes(args.time) if args.time else None, array_parallelism=args.array_parallelism,
        slurm_opts=dict(args.slurm_opt), dry_run=args.dry_run,
    )  # fmt: skip
    return make_executor(args.executor, options)


def _with(args: argparse.Namespace, **kw: Any) -> argparse.Namespace:
    d = dict(vars(args))
    d.update(kw)
    return argparse.Namespace(**d)


def cmd_bench(args: argparse.Namespace) -> int:
    """A thin entry into the performance harness, which lives outside the package: runs the checkout's
    ``tools/perf/run.py`` in a child process with the same flags (its output and exit code are this
    command's)."""
    import subprocess

    script = Path(__file__).resolve().parents[3] / "tools" / "perf" / "run.py"
    if not script.is_file():
        raise UsageError(
            f"proteus bench runs the performance harness of a source checkout ({script} is missing: this "
            "installation has no tools/perf/): clone the repository and run `python tools/perf/run.py`"
        )
    argv = [sys.executable, str(script), "--device", str(args.device)]
    if args.quick:
        argv.append("--quick")
    if args.out:
        argv += ["--out", str(args.out)]
    return subprocess.run(argv, check=False).returncode


def cmd_weights(args: argparse.Namespace) -> int:
    from proteus.backbones.weights import fetch

    path = fetch(args.name)
    print(f"{args.name}: {path}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from proteus.streams.abrupt import build_abrupt_sequence

    out = build_abrupt_sequence(Path(args.cifar), Path(args.out), seed=args.seed)
    print(f"abrupt sequence written to {out}: use --benchmark folder --data {out} --tasks {out}/tasks.yaml")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from proteus.backbones import BACKBONES
    from proteus.config import METHODS  # every method: PROTEUS's and the baselines' own declarations
    from proteus.streams import BENCHMARKS

    reg = {"backbones": BACKBONES, "benchmarks": BENCHMARKS, "methods": METHODS}
    for kind in [args.what] if args.what else list(reg):
        print(f"{kind}:")
        for name, doc in reg[kind].describe().items():
            print(f"  {name:<22} {doc}")
        if kind == "backbones":
            from proteus.backbones.base import FAMILIES

            for prefix in FAMILIES:
                print(f"  {prefix + '<name>':<22} any timm ViT by timm's name (weights as for the presets)")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """``proteus reproduce``: list the paper's tables, plan one, or run it (docs/experiments.md)."""
    from proteus.experiment import reproduce as rep

    if args.list:
        print("\n".join(rep.catalogue_lines()))
        return 0
    if not args.name:
        raise UsageError("proteus reproduce: name a table or figure (`proteus reproduce --list` lists them)")
    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
        except ValueError:
            raise UsageError(
                f"--seeds expects comma-separated integers (0,1,2), got {args.seeds!r}"
            ) from None
    try:
        plan = rep.make_plan(
            args.name, benchmark=args.benchmark, data=args.data, seeds=seeds, config_files=args.config,
            sets=args.set, overrides=_overrides(args),
        )  # fmt: skip
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    if args.plan:
        if args.json:
            print(json.dumps(plan.to_dict(), indent=1, default=str))
        else:
            print("\n".join(rep.plan_lines(plan)))
        return 0
    if not plan.runnable():
        reasons = sorted({c.skip for c in plan.cells if c.skip})
        raise UsageError(f"reproduce {plan.entry.name}: no cell can run here ({'; '.join(reasons)})")
    bench = f"-{args.benchmark.split(':')[0]}" if args.benchmark else ""
    out = Path(args.out or f"runs/reproduce{bench}")
    _check_out_dir(out, "--out", allow_existing_dir=True)
    if args.status:
        print("\n".join(rep.status_lines(plan, out)))
        return 0
    executor = _executor(args)
    command = (
        "proteus " + " ".join(_without_executor(sys.argv[1:]))
        if sys.argv and sys.argv[0].endswith(("proteus", "__main__.py"))
        else ""
    )
    rep.reproduce(plan, out, progress=not args.quiet, command=command, executor=executor)
    return 0
