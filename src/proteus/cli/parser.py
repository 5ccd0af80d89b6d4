"""The ``proteus`` argument parser: one ``add_<command>(sub)`` per command, its flags, description and
examples in one place (the work is ``cmd_<command>`` in :mod:`proteus.cli.commands`), beside the options
several commands share; :data:`COMMANDS` lists them in the order of ``proteus --help``."""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from collections.abc import Callable
from typing import Any

from proteus.cli.commands import (
    cmd_bench,
    cmd_compare,
    cmd_data,
    cmd_evaluate,
    cmd_kb_calibrate,
    cmd_kb_forget,
    cmd_kb_gc,
    cmd_kb_show,
    cmd_kb_sign,
    cmd_kb_undo,
    cmd_kb_upgrade,
    cmd_kb_verify,
    cmd_learn,
    cmd_list,
    cmd_predict,
    cmd_quickstart,
    cmd_reproduce,
    cmd_run,
    cmd_serve,
    cmd_weights,
)
from proteus.devices import COMPILE_MODES, PRECISIONS

EPILOG = """\
examples:
  proteus quickstart                                   # offline demo: digits, 5 tasks, MobileNetV2
  proteus run --benchmark cifar10 --data ../shared/data/cifar10-subset --config mobilenet_cpu
  proteus run --benchmark cifar100 --data ~/data --method ranpac --set adapter.rank=16
  proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 1      # one task per process
  proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 2 --wait   # wait for another writer
  proteus predict --kb kb/ img1.jpg img2.png --json
  proteus kb verify kb/ && proteus kb info kb/
  proteus compare --benchmark quickstart --methods proteus,ranpac,frozen --seeds 0,1,2
  proteus reproduce --list                             # the paper's tables and figures
  proteus list methods
"""


def _at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (and <= ``high``), refused at parse time otherwise (exit
    code 2, ``argument --top-k: must be an integer >= 1; got '0'``)."""
    what = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}")
        return value

    parse.__name__ = what
    return parse


def _positive(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}")
    return value


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
    _add_precision(p)
    p.add_argument(
        "--compile",
        action=_CompileAction,
        choices=COMPILE_MODES,
        help="torch.compile the backbone's inference forwards in this mode (default none: eager; same "
        "results to float round-off); the same as --set compile=MODE",
    )
    _threads_option(p, config=True)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


class _CompileAction(argparse.Action):
    """``--compile MODE`` is ``--set compile=MODE`` (in the order given among the --set options)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        namespace.set = [*(getattr(namespace, "set", None) or []), f"compile={values}"]


class _ThreadsAction(argparse.Action):
    """``--threads N`` of a command that resolves a config: the thread count from the start (``args.threads``:
    :func:`proteus.cli.threads.prepare`) and ``--set threads=N`` (recorded with the run)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        namespace.threads = values
        namespace.set = [*(getattr(namespace, "set", None) or []), f"threads={values}"]


def _threads_option(p: argparse.ArgumentParser, config: bool = False) -> None:
    """``--threads N``: torch's CPU threads (``config``: the command resolves a config, which records it)."""
    p.add_argument(
        "--threads",
        type=_at_least(1),
        action=_ThreadsAction if config else "store",
        metavar="N",
        help="CPU threads for torch (default: the cores this process may use, or OMP_NUM_THREADS; "
        + ("the same as --set threads=N)" if config else "threads waiting for work sleep, not spin)"),
    )


class _TrackAction(argparse.Action):
    """``--track tensorboard,wandb`` is ``--set report.tracking=tensorboard,wandb`` (in the order given
    among the --set options: the later one wins)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        namespace.set = [*(getattr(namespace, "set", None) or []), f"report.tracking={values}"]


def _track_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track",
        action=_TrackAction,
        metavar="SINKS",
        help="experiment tracking besides train_log.csv / acc_matrix.csv: tensorboard (<out>/tensorboard/), "
        "wandb (needs `pip install wandb`), comma-separated; the same as --set report.tracking=SINKS",
    )


def _add_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        help="the backbone's forward passes: auto (default: bf16 autocast on CUDA, fp32 elsewhere), bf16, "
        "fp32 (exact reproduction) or tf32 (float32 with TF32 matmuls on CUDA)",
    )


def _about(description: str = "", *examples: str) -> dict[str, Any]:
    """A command's ``add_parser`` keywords for its description (wrapped at 100 columns) and its examples (one
    command line each, under "examples:"), shown as written."""
    out: dict[str, Any] = {"formatter_class": argparse.RawDescriptionHelpFormatter}
    if description:
        out["description"] = textwrap.fill(description, 100)
    if examples:
        out["epilog"] = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``proteus`` parser: its global options, then each command of :data:`COMMANDS`."""
    p = argparse.ArgumentParser(
        prog="proteus",
        description="Continual fine-tuning of pre-trained vision backbones with provably accurate, "
        "parameter-free task retrieval (PROTEUS).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return p


def add_run(sub: argparse._SubParsersAction) -> None:
    """``proteus run``: a method over a whole task stream in one process."""
    r = sub.add_parser(
        "run",
        help="run a method over a whole task stream in one process",
        **_about(
            "Learn a task stream with one method in one process: each task learned, evaluated on every test "
            "set so far and committed to the run's knowledge base; results.json, train_log.csv and "
            "acc_matrix.csv in the run directory. An interrupted run goes on with --resume.",
            "proteus run --benchmark quickstart --out runs/q",
            "proteus run --benchmark cifar10 --data ~/data/cifar10 --config mobilenet_cpu --method ranpac",
            "proteus run --resume runs/q                 # after Ctrl-C, a crash or a killed job",
        ),
    )
    _add_run_args(r, benchmark_required=False)
    r.add_argument("--method", help="method name (default proteus; see `proteus list methods`)")
    r.add_argument("--out", help="run directory (default runs/<benchmark>-<method>-<time>)")
    r.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the interrupted run in DIR from its knowledge base's last committed task, with its "
        "own config.yaml (only --device, --precision and -q may be given); it ends with the results of an "
        "uninterrupted run",
    )
    _track_option(r)
    r.set_defaults(func=cmd_run)


def add_quickstart(sub: argparse._SubParsersAction) -> None:
    """``proteus quickstart``: the offline demo."""
    q = sub.add_parser(
        "quickstart",
        help="offline demo: digits in 5 tasks on MobileNetV2 (ImageNet weights)",
        **_about(
            "The offline demo: scikit-learn's digits in 5 tasks of 2 classes on MobileNetV2 with ImageNet "
            "weights; prints the accuracy after each task.",
            "proteus quickstart --out runs/quickstart",
        ),
    )
    q.add_argument("--out", default="runs/quickstart")
    q.add_argument("--method", default="proteus")
    q.add_argument("--config", action="append", default=[])
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _threads_option(q, config=True)
    q.add_argument("-q", "--quiet", action="store_true")
    q.set_defaults(func=cmd_quickstart)


def add_learn(sub: argparse._SubParsersAction) -> None:
    """``proteus learn``: one task into a knowledge base, in a fresh process."""
    lr = sub.add_parser(
        "learn",
        help="learn task K into a knowledge base left by task K-1 (fresh process)",
        **_about(
            "Learn task K of a stream into a knowledge base that holds tasks 1..K-1 (a new process per "
            "task: add a task today, the next one next month). Options that define the model must equal the "
            "knowledge base's; per-task ones (epochs, learning rate, batch sizes, device) may change and "
            "are recorded with the task. The result equals `proteus run` on the same stream.",
            "proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 1",
            "proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 2 --set train.epochs=5",
            "proteus learn --kb kb/ --benchmark cifar10 --data DATA --task 3 --no-eval --wait",
        ),
    )
    _add_run_args(lr)
    lr.add_argument("--kb", required=True, help="knowledge base directory")
    lr.add_argument("--task", type=int, required=True, help="task number, 1-based")
    lr.add_argument("--method", default=None, help="method (only when creating the knowledge base)")
    lr.add_argument("--no-eval", action="store_true", help="skip the evaluation after the task")
    _wait_option(lr)
    lr.set_defaults(func=cmd_learn)


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    """``proteus evaluate``: a knowledge base on the test sets of its tasks."""
    ev = sub.add_parser(
        "evaluate",
        help="evaluate a knowledge base on the test sets of its tasks",
        **_about(
            "Evaluate a knowledge base on the test sets of the tasks it holds (the stream it was learned "
            "on, or --benchmark / --data): the accuracy matrix's last row, retrieval and oracle accuracy.",
            "proteus evaluate --kb kb/ --data DATA",
            "proteus evaluate --kb kb/ --data DATA --out runs/eval",
        ),
    )
    ev.add_argument("--kb", required=True)
    ev.add_argument("--benchmark", help="(checked against the knowledge base)")
    ev.add_argument("--data")
    ev.add_argument("--tasks", dest="tasks_file")
    ev.add_argument("--out", help="write results.json here")
    ev.add_argument("--device")
    _add_precision(ev)
    _threads_option(ev)
    ev.add_argument("-q", "--quiet", action="store_true")
    ev.set_defaults(func=cmd_evaluate)


def add_predict(sub: argparse._SubParsersAction) -> None:
    """``proteus predict``: classify image files, folders or globs with a knowledge base."""
    pr = sub.add_parser(
        "predict",
        help="classify image files or folders: class, retrieved task and component, scores",
        description="Classify image files with a knowledge base (Algorithm 2). Each input gets a line: its "
        "class, p (the probability of that class among the learned classes, calibrated by a temperature "
        "fitted per task when the task was learned: of the answers given p = 0.9, about 9 in 10 are "
        "right) and the task it came from (1-based), or 'unknown' for an input from no learned task. "
        "--verbose adds the retrieval's raw numbers, --json every field, --out FILE writes every field as "
        "JSON Lines or CSV (docs/predict.md). Inputs are files, folders (every image inside, recursively, "
        "recognised by its content), globs, or - (paths read from standard input, one per line); every "
        "input's header is checked before the knowledge base loads, then the images are predicted in "
        "batches, with a progress line and a summary (counts per class, unknown, unreadable).",
        epilog="examples:\n  proteus predict --kb kb/ photo.jpg\n  proteus predict --kb kb/ photos/ --out "
        "predictions.csv\n  proteus predict --kb kb/ 'photos/**/*.png' --skip-unreadable --top-k 3 --json > "
        "predictions.json\n  find /data -name '*.jpg' | proteus predict --kb kb/ - --out predictions.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pr.add_argument("--kb", required=True)
    pr.add_argument(
        "images", nargs="+", metavar="IMAGE",
        help="image files, folders (searched recursively; files that are no images are ignored), globs "
        "(quoted: 'photos/**/*.jpg'), or - for paths on standard input",
    )  # fmt: skip
    written = pr.add_mutually_exclusive_group()
    written.add_argument("--json", action="store_true", help="print JSON (every row together, at the end)")
    written.add_argument(
        "--out",
        metavar="FILE",
        help="write every row to FILE as it is predicted: JSON Lines (FILE.jsonl) or CSV (FILE.csv); an "
        "unreadable file skipped gets a row with its error",
    )
    pr.add_argument(
        "-v", "--verbose", action="store_true",
        help="text output: add the retrieval's raw numbers (component, signature score, novelty, p_task)",
    )  # fmt: skip
    pr.add_argument("--device")
    _add_precision(pr)
    _threads_option(pr)
    pr.add_argument(
        "--skip-unreadable", action="store_true", help="report unreadable files and go on with the rest"
    )
    pr.add_argument(
        "--top-k",
        type=_at_least(1),
        default=1,
        metavar="K",
        help="also list the K best classes of the retrieved task (an integer >= 1)",
    )
    pr.add_argument("-q", "--quiet", action="store_true", help="no progress line and no summary")
    pr.add_argument(
        "--max-pixels",
        type=_at_least(1),
        help="refuse larger images before decoding (default eval.max_image_pixels)",
    )
    pr.set_defaults(func=cmd_predict)


def add_compare(sub: argparse._SubParsersAction) -> None:
    """``proteus compare``: several methods on one split, side by side."""
    c = sub.add_parser(
        "compare",
        help="run several methods on one split and print a Table-1-style comparison",
        **_about(
            "Run several methods over several seeds on one stream and print a Table-1-style summary (mean "
            "and spread); finished runs in --out are reused, so an interrupted compare resumes.",
            "proteus compare --benchmark quickstart --methods proteus,ranpac,frozen --seeds 0,1,2",
            "proteus compare --benchmark domains5 --config mobilenet_cpu --methods proteus,ranpac --out "
            "runs/d5",
        ),
    )
    _add_run_args(c)
    c.add_argument("--methods", required=True, help="comma-separated method names")
    c.add_argument("--seeds", default="0", help="comma-separated seeds (mean and std over them)")
    c.add_argument("--out", help="output directory")
    _track_option(c)
    _executor_options(c)
    c.set_defaults(func=cmd_compare)


def add_bench(sub: argparse._SubParsersAction) -> None:
    """``proteus bench``: the performance harness."""
    b = sub.add_parser(
        "bench",
        help="performance harness: ratios measured side by side in one process",
        **_about(
            "The performance harness (tools/perf, from a checkout): each ratio measured side by side in one "
            "process (docs/performance.md).",
            "proteus bench --out runs/bench.json",
        ),
    )
    b.add_argument("--out", help="write the JSON report here")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    b.add_argument("--device", default="auto")
    b.set_defaults(func=cmd_bench)


def add_weights(sub: argparse._SubParsersAction) -> None:
    """``proteus weights fetch``: provision pretrained weights."""
    w = sub.add_parser(
        "weights",
        help="provision pretrained weights into the torch hub cache",
        **_about(
            "Provision pretrained weights into the torch hub cache (offline fallbacks included).",
            "proteus weights fetch mobilenet_v2",
        ),
    )
    wsub = w.add_subparsers(dest="action", required=True)
    wf = wsub.add_parser(
        "fetch",
        help="download (or obtain offline) and verify weights",
        **_about(
            "Download (or obtain offline) a backbone's weights and verify their sha256.",
            "proteus weights fetch mobilenet_v2",
        ),
    )
    wf.add_argument("name", help="backbone name, e.g. mobilenet_v2")
    wf.set_defaults(func=cmd_weights)


def add_data(sub: argparse._SubParsersAction) -> None:
    """``proteus data abrupt``: build a dataset from local material."""
    d = sub.add_parser(
        "data",
        help="build datasets from local material",
        **_about(
            "Build datasets from local material.",
            "proteus data abrupt --cifar ../data/cifar10 --out data/abrupt",
        ),
    )
    dsub = d.add_subparsers(dest="action", required=True)
    da = dsub.add_parser(
        "abrupt",
        help="CIFAR-10 classes alternating with handwritten digits (5 tasks)",
        **_about(
            "Build the CIFAR-10 / digits sequence: CIFAR-10 classes alternating with handwritten digits.",
            "proteus data abrupt --cifar ../data/cifar10 --out data/abrupt",
        ),
    )
    da.add_argument(
        "--cifar", required=True, help="CIFAR-10 ImageFolder root (e.g. ../shared/data/cifar10-subset)"
    )
    da.add_argument("--out", required=True)
    da.add_argument("--seed", type=int, default=0)
    da.set_defaults(func=cmd_data)


def add_kb(sub: argparse._SubParsersAction) -> None:
    """``proteus kb ...``: inspect, sign, clean, upgrade, calibrate, forget and undo a knowledge base."""
    k = sub.add_parser(
        "kb",
        help="inspect a knowledge base: verify every checksum, show its tasks and settings",
        **_about(
            "Inspect and manage a knowledge base; every change is a commit (undo reverts it).",
            "proteus kb verify kb/",
            "proteus kb info kb/",
            "proteus kb list kb/ --json",
            "proteus kb sign kb/ --key-file kb.key && proteus kb verify kb/ --key-file kb.key",
            "proteus kb gc kb/",
        ),
    )
    ksub = k.add_subparsers(dest="action", required=True)
    for action, text, about, func in (
        ("verify", "check the manifest (fields, object paths, signature with --key-file), every object "
         "(checksum, dtypes, shapes, finite values) and the previous commit; list every problem (exit 1 if "
         "any) and, as warnings, files no commit needs (exit 0)",
         _about("Check every object's checksum and the manifest; list every problem found.",
                "proteus kb verify kb/"), cmd_kb_verify),
        ("info", "backbone, method, tasks, classes, sizes (also on disk) and per-task settings",
         _about("The knowledge base's backbone, method, tasks, classes, sizes and settings.",
                "proteus kb info kb/"), cmd_kb_show),
        ("list", "one line per learned task",
         _about("One line per learned task: its classes and how it was learned.", "proteus kb list kb/"),
         cmd_kb_show),
    ):  # fmt: skip
        kp = ksub.add_parser(action, help=text, **about)
        kp.add_argument("kb", help="knowledge base directory")
        kp.add_argument("--json", action="store_true", help="print JSON (info, list)")
        _key_option(kp)
        kp.set_defaults(func=func)
    add_kb_sign(ksub)
    add_kb_gc(ksub)
    add_kb_upgrade(ksub)
    add_kb_calibrate(ksub)
    add_kb_forget(ksub)
    add_kb_undo(ksub)


def add_kb_sign(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb sign``: sign a knowledge base with a secret key."""
    ks = ksub.add_parser(
        "sign",
        help="sign the knowledge base (its manifest, and the previous one kept for undo) with an HMAC-SHA256 "
        "under a secret key; readers check it with --key-file or $PROTEUS_KB_KEY_FILE (docs/reliability.md)",
        **_about(
            "Sign the knowledge base's manifest with a key (HMAC-SHA256).",
            "(umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > kb.key)",
            "proteus kb sign kb/ --key-file kb.key",
            "PROTEUS_KB_KEY_FILE=kb.key proteus predict --kb kb/ x.jpg",
        ),
    )
    ks.add_argument("kb", help="knowledge base directory")
    _key_option(ks, required=True)
    _wait_option(ks)
    ks.set_defaults(func=cmd_kb_sign)


def add_kb_gc(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb gc``: remove the files no commit needs."""
    kg = ksub.add_parser(
        "gc",
        help="remove the files neither the current nor the previous commit needs (orphan objects and "
        "temporary files of failed or interrupted commits) and say how many bytes it freed",
        **_about(
            "Remove files no commit refers to (left by an interrupted commit).",
            "proteus kb gc kb/",
        ),
    )
    kg.add_argument("kb", help="knowledge base directory")
    _wait_option(kg)
    kg.set_defaults(func=cmd_kb_gc)


def add_kb_upgrade(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb upgrade``: write an older knowledge base in this format."""
    kup = ksub.add_parser(
        "upgrade",
        help="write a knowledge base of an older format (1-3) again in this proteus's format (a commit: "
        "atomic; `proteus kb undo` goes back); a KB in an older format is read as it is, and upgraded at its "
        "next commit anyway",
        **_about(
            "Write a knowledge base of an older format again in this proteus's format, as a commit.",
            "proteus kb upgrade kb/",
        ),
    )
    kup.add_argument("kb", help="knowledge base directory")
    _key_option(kup)
    _wait_option(kup)
    kup.set_defaults(func=cmd_kb_upgrade)


def add_kb_calibrate(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb calibrate``: fit the thresholds that flag unknown inputs."""
    kc = ksub.add_parser(
        "calibrate",
        help="fit the thresholds that flag inputs from no learned task as unknown: from a folder of your "
        "own held-out images (--images; works on any KB with LDA keys, old ones included), or at another "
        "true-positive rate from what the tasks stored (--tpr)",
        description="examples:\n  proteus kb calibrate runs/kb --images held_out/   # sub-folders named "
        "after learned classes, or loose images\n  proteus kb calibrate runs/kb --tpr 0.9",
        **_about(
            "",
            "proteus kb calibrate kb/ --tpr 0.9",
            "proteus kb calibrate kb/ --images held_out/",
        ),
    )
    kc.add_argument("kb", help="knowledge base directory")
    _threads_option(kc)
    kc.add_argument(
        "--images",
        metavar="DIR",
        help="held-out images of the learned tasks (not used for learning): files in a sub-folder named "
        "after a learned class count for it (a name with '/' is nested folders: DIR/cifar10-subset/cat/ "
        "for cifar10-subset/cat), loose files for their nearest class",
    )
    kc.add_argument(
        "--tpr", type=float, help="fraction of a task's held-out inputs accepted (default with --images: "
        "the KB's, 0.95 unless changed)",
    )  # fmt: skip
    _key_option(kc)
    _wait_option(kc)
    kc.set_defaults(func=cmd_kb_calibrate)


def add_kb_forget(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb forget``: remove a task from what can be predicted."""
    kf = ksub.add_parser(
        "forget",
        help="remove a task from what can be predicted (its head statistics subtracted exactly, its key "
        "removed; needs head.forgettable=true when it was learned); undo with `proteus kb undo`",
        **_about(
            "Never predict a task again (its head statistics subtracted exactly).",
            "proteus learn --kb kb/ ... --set head.forgettable=true",
            "proteus kb forget kb/ --task 2",
            "proteus kb undo kb/",
        ),
    )
    kf.add_argument("kb", help="knowledge base directory")
    kf.add_argument(
        "--task", type=int, required=True, help="the task to forget (1-based, as `kb list` shows)"
    )
    _key_option(kf)
    _wait_option(kf)
    kf.set_defaults(func=cmd_kb_forget)


def add_kb_undo(ksub: argparse._SubParsersAction) -> None:
    """``proteus kb undo``: go back to the previous commit."""
    ku = ksub.add_parser(
        "undo",
        help="go back to the previous commit (undoes the last learn, forget or calibrate; undo "
        "again goes back to the state undone)",
        **_about(
            "Make the previous commit the current state again (itself a commit: undo twice redoes).",
            "proteus kb undo kb/",
        ),
    )
    ku.add_argument("kb", help="knowledge base directory")
    _key_option(ku)
    _wait_option(ku)
    ku.set_defaults(func=cmd_kb_undo)


def add_serve(sub: argparse._SubParsersAction) -> None:
    """``proteus serve``: a knowledge base over HTTP."""
    sv = sub.add_parser(
        "serve",
        help="serve a knowledge base over HTTP (POST /predict, GET /tasks), reloading new commits",
        description="Serve a knowledge base over HTTP (Starlette under uvicorn; the `serve` extra): POST "
        "/predict, POST /predict/batch, GET /tasks, GET /health, GET /openapi.json. Concurrent requests' "
        "images are predicted together in batches (docs/predict.md).",
        epilog="examples:\n  proteus serve --kb kb/ --port 8000\n"
        "  curl --data-binary @photo.jpg http://127.0.0.1:8000/predict\n"
        "  curl -F a=@1.jpg -F b=@2.png 'http://127.0.0.1:8000/predict?top_k=3'\n"
        "  curl -F a=@1.jpg -F b=@2.png http://127.0.0.1:8000/predict/batch   # a row or an error per file\n"
        "  curl http://127.0.0.1:8000/openapi.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sv.add_argument("--kb", required=True)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_at_least(0, 65535), default=8000, help="TCP port (0: any free port)")
    sv.add_argument("--device")
    _add_precision(sv)
    _threads_option(sv)
    sv.add_argument("--poll", type=_positive, default=1.0, help="seconds between checks for a new commit")
    sv.add_argument(
        "--read-timeout",
        type=_positive,
        default=argparse.SUPPRESS,  # proteus.serve.Limits holds the defaults
        metavar="SECONDS",
        help="close a connection that sends nothing for this long (e.g. a body shorter than its "
        "Content-Length: 408; default: 30)",
    )
    sv.add_argument(
        "--request-timeout",
        type=_positive,
        default=argparse.SUPPRESS,  # proteus.serve.Limits holds the defaults
        metavar="SECONDS",
        help="answer a prediction request within this long, or 504 (408 while its body is still arriving; "
        "default: 300)",
    )
    sv.add_argument(
        "--max-concurrency",
        type=_at_least(1),
        default=argparse.SUPPRESS,  # proteus.serve.Limits holds the defaults
        metavar="N",
        help="prediction requests served at once; their images are predicted together (default: 32)",
    )
    sv.add_argument(
        "--max-queue",
        type=_at_least(0),
        default=argparse.SUPPRESS,  # proteus.serve.Limits holds the defaults
        metavar="N",
        help="requests waiting for one of those slots; beyond them a request is refused with 503 "
        "(default: 128)",
    )
    sv.add_argument(
        "--max-batch",
        type=_at_least(1),
        default=argparse.SUPPRESS,  # proteus.serve.Limits holds the defaults
        metavar="N",
        help="the most images per forward of the model (default: 32)",
    )
    for flag, what in (
        ("--max-body", "bytes in one request body: 413 above it (default: 67108864, budget request_bytes)"),
        ("--max-images", "images (multipart parts, JSON items) in one request: 413 above it (default: 1024)"),
        ("--max-request-pixels", "width x height summed over one request's images, read from their headers "
         "before decoding: 413 above it (default: 256000000)"),
    ):  # fmt: skip
        sv.add_argument(flag, type=_at_least(1), default=argparse.SUPPRESS, metavar="N", help=what)
    sv.set_defaults(func=cmd_serve)


def add_list(sub: argparse._SubParsersAction) -> None:
    """``proteus list``: backbones, benchmarks or methods."""
    ls = sub.add_parser(
        "list",
        help="list backbones, benchmarks or methods",
        **_about(
            "List the registered backbones, benchmarks or methods.",
            "proteus list methods",
        ),
    )
    ls.add_argument("what", nargs="?", choices=["backbones", "benchmarks", "methods"])
    ls.set_defaults(func=cmd_list)


REPRODUCE_EPILOG = """\
examples:
  proteus reproduce --list
  proteus reproduce ablationS --plan --json            # every cell's resolved config; nothing runs
  proteus reproduce ablationS --benchmark quickstart --seeds 0 --set train.epochs=1 --out runs/abl
  proteus reproduce main-table --benchmark domains5 --data ../shared/data --config mobilenet_cpu \\
      --out runs/repro                                   # one column (VTAB5T-small's) on a local stream
  proteus reproduce main-table --benchmark cifar10:cifar100 --data ../shared/data/cifar10-subset \\
      --config mobilenet_cpu --out runs/repro
  proteus reproduce kmeans --data DATA --out runs/paper   # the paper's benchmarks, ViT-B/16 (a GPU job)
"""


def add_reproduce(sub: argparse._SubParsersAction) -> None:
    """``proteus reproduce``: the paper's tables by name (proteus.experiment.reproduce)."""
    p = sub.add_parser(
        "reproduce",
        help="run a table or figure of the paper by its name; write it with the paper's numbers beside ours",
        description="""\
Run one table or figure of the PROTEUS paper, named by its label in the paper's source
(main-table, ablationS, topkG, kmeans, ...; --list shows them all), through `proteus compare`,
then write it in the paper's layout as Markdown and CSV (OUT/NAME.md, .csv, .json): our mean
± std over seeds beside each published number, and a footnote with every setting that differs
from the paper's.

Runs go to OUT/BENCHMARK/CELL/seedK; finished ones are reused (tables sharing OUT share runs)
and an interrupted one continues from its last committed task. --executor pool|slurm runs the
cells side by side (docs: "Reproduce a table on a cluster"); --status shows each one's state.
Without --benchmark the paper's benchmarks run with their
ViT-B/16 presets (--data ROOT holds cifar100/, imagenet-r/, imagenet-a/, vtab/, vtab-large/);
--benchmark LOCAL[:PAPER] runs every cell on one local stream instead (domains5, cifar10,
quickstart, ...) beside the paper's column PAPER (default: the one the stream stands in for,
else the table's first). Cells that cannot run (a prompt method without a ViT, a benchmark no
preset builds) are shown as n/a with the reason.""",
        epilog=REPRODUCE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="the table or figure (`--list` shows every name)")
    p.add_argument("--list", action="store_true", help="list every table and figure, one line each")
    p.add_argument(
        "--plan", action="store_true", help="print every cell and its resolved config; run nothing"
    )
    p.add_argument("--json", action="store_true", help="with --plan: print JSON")
    p.add_argument(
        "--benchmark",
        metavar="LOCAL[:PAPER]",
        help="run on this benchmark instead of the paper's (e.g. domains5, cifar10, quickstart), compared "
        "with the paper's column PAPER",
    )
    p.add_argument("--data", help="dataset root (without --benchmark: the root of the paper's datasets)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the table's, usually 0,1,2)")
    p.add_argument(
        "--config", action="append", default=[], help="YAML config or packaged preset (repeatable)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--backbone", help="backbone name (replaces the presets')")
    p.add_argument("--weights", help="local backbone weights (.safetensors or .pth)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: auto)")
    _add_precision(p)
    _threads_option(p, config=True)
    p.add_argument("--out", help="output directory (default runs/reproduce[-BENCHMARK])")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--status",
        action="store_true",
        help="show each cell's state in --out (done, running, failed with its log's last line, missing); "
        "run nothing",
    )
    _executor_options(p)
    p.set_defaults(func=cmd_reproduce)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. account=lab), got {text!r}")
    return key.strip(), value


def _executor_options(p: argparse.ArgumentParser) -> None:
    """Where the cells run (proteus.experiment.executors): --executor and each executor's options."""
    from proteus.experiment.executors import EXECUTORS

    g = p.add_argument_group("where the cells run (each cell is one job with its own folder)")
    g.add_argument(
        "--executor",
        default="local",
        choices=EXECUTORS.names(),
        help="local: one after the other in this process (default); pool: --jobs processes on this machine; "
        "slurm: a SLURM job array through submitit (pip install submitit)",
    )
    g.add_argument("--jobs", type=_at_least(1), metavar="N", help="pool: processes at once")
    g.add_argument("--partition", help="slurm: the partition")
    g.add_argument("--gpus-per-task", type=_at_least(0), metavar="N", help="slurm: GPUs of each cell")
    g.add_argument("--time", metavar="TIME", help="slurm: each cell's time limit (minutes, H:MM:SS)")
    g.add_argument(
        "--array-parallelism", type=_at_least(1), metavar="N", help="slurm: at most N cells at once"
    )
    g.add_argument(
        "--slurm-opt",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="slurm: any other sbatch option (repeatable: --slurm-opt account=lab --slurm-opt mem=16G)",
    )
    g.add_argument("--dry-run", action="store_true", help="slurm: print the job script; submit nothing")


def _key_option(p: argparse.ArgumentParser, required: bool = False) -> None:
    """``--key-file FILE`` of the ``kb`` commands that check or make a signature."""
    p.add_argument(
        "--key-file",
        required=required,
        metavar="FILE",
        help="secret key (the file's bytes, at least 16) of the knowledge base's HMAC-SHA256 signature"
        + ("" if required else "; the KB must be signed with it (default: $PROTEUS_KB_KEY_FILE, if set)"),
    )
    if not required:
        p.add_argument(
            "--min-sequence",
            type=_at_least(0),
            metavar="N",
            help="refuse a signed manifest whose commit sequence number is below N (a rollback); the highest "
            "sequence a key accepted in each directory is also recorded beside it (KEYFILE.sequences) and "
            "enforced",
        )
        p.add_argument(
            "--kb-id",
            type=_kb_id,
            metavar="ID",
            help="refuse a signed manifest of another knowledge base than ID (its kb_id, or its first 8 or "
            "more hex digits, as `kb verify` prints it); without it, the one this key accepted in the "
            "directory before (recorded in KEYFILE.sequences)",
        )


def _kb_id(text: str) -> str:
    """``--kb-id``: 8 to 32 hex digits (a knowledge base's identity, or its start)."""
    if not re.fullmatch(r"[0-9a-fA-F]{8,32}", text):
        raise argparse.ArgumentTypeError(
            f"expected 8 to 32 hex digits (a knowledge base's kb_id), got {text!r}"
        )
    return text.lower()


def _wait_option(p: argparse.ArgumentParser) -> None:
    """``--wait [SECONDS]`` of every command that writes to a knowledge base."""
    p.add_argument(
        "--wait",
        nargs="?",
        type=float,
        const=-1.0,
        default=0.0,
        metavar="SECONDS",
        help="when another process is writing to the KB, wait for it (as long as it takes, or SECONDS) "
        "instead of failing at once",
    )


#: every command's parser, in the order of ``proteus --help``: a new command is a ``cmd_<name>`` in
#: :mod:`proteus.cli.commands` and an ``add_<name>(sub)`` here, named in this tuple
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_run,
    add_quickstart,
    add_learn,
    add_evaluate,
    add_predict,
    add_compare,
    add_reproduce,
    add_bench,
    add_weights,
    add_data,
    add_kb,
    add_serve,
    add_list,
)
