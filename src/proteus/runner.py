"""Runs: the continual loop over a task stream, evaluation after each task, the KB, and results.json.

``proteus run`` and a sequence of ``proteus learn --task K`` share :func:`learn_and_commit`, so both
give the same knowledge base and the same results for the same seed. The evaluation after task k
(Sec. 5.1 metrics) embeds each seen test set under each adapter once per adapter: an adapter never
changes after its task, so an embedding computed at step j is reused at every later step.

Under ``torchrun --nproc_per_node=N -m proteus run ...`` every rank runs this same loop (the learner shards
its embedding passes and its training, :mod:`proteus.distributed`); only rank 0 writes config.yaml,
split.json, log.txt, the KB and results.json, and the other ranks wait for its commits at a barrier.
"""

from __future__ import annotations

import json
import logging
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from proteus import __version__
from proteus import distributed as dist
from proteus.benchmarks import TaskStream, build_benchmark
from proteus.config import ConfigError, RunConfig, load_yaml, merge, parse_set
from proteus.faults import crash_point
from proteus.kb import KBError, KnowledgeBase
from proteus.learner import ContinualLearner
from proteus.methods import apply_method
from proteus.metrics import average_accuracy, forgetting

log = logging.getLogger("proteus")


# ====================================================================== configuration
def packaged_config(name: str) -> Path | None:
    p = resources.files("proteus") / "configs" / f"{name}.yaml"
    return Path(str(p)) if p.is_file() else None


def resolve_config(
    benchmark: str | None = None,
    method: str = "proteus",
    config_files: list[str] | None = None,
    sets: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> RunConfig:
    """defaults < the benchmark's packaged config < method < --config files < --set < explicit flags."""
    cfg = RunConfig()
    if benchmark:
        cfg.benchmark.name = benchmark
        bench_file = packaged_config(benchmark)
        if bench_file:
            merge(cfg, load_yaml(bench_file))
    apply_method(cfg, method)
    for f in config_files or []:
        path = Path(f)
        if not path.is_file() and packaged_config(f) is not None:
            path = packaged_config(f)  # type: ignore[assignment]
        merge(cfg, load_yaml(path))
    if sets:
        merge(cfg, parse_set(sets))
    if overrides:
        merge(cfg, overrides)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    choices = {
        "adapter.transfer": (cfg.adapter.transfer, ("learned", "zero", "identity")),
        "adapter.s_update": (cfg.adapter.s_update, ("prox", "adam")),
        "train.tasks": (cfg.train.tasks, ("all", "first", "none")),
        "retrieval.mode": (cfg.retrieval.mode, ("signature", "first", "last", "all-units", "none")),
        "signature.method": (cfg.signature.method, ("dpgmm", "kmeans", "gaussian")),
        "signature.covariance": (cfg.signature.covariance, ("full", "ppca", "shared")),
        "signature.normalize": (cfg.signature.normalize, ("none", "l2")),
        "signature.score": (cfg.signature.score, ("nll", "mahalanobis")),
        "signature.calibrate": (cfg.signature.calibrate, ("none", "standardize")),
        "signature.keys": (
            cfg.signature.keys,
            ("adapter", "frozen", "adapter+frozen", "frozen-lda", "first-adapter-lda"),
        ),
    }
    for key, (val, ok) in choices.items():
        if val not in ok:
            raise ConfigError(f"{key} must be one of {', '.join(ok)}; got {val!r}")
    if cfg.adapter.rank < 1:
        raise ConfigError(f"adapter.rank must be >= 1, got {cfg.adapter.rank}")
    if cfg.retrieval.top_k < 1:
        raise ConfigError(f"retrieval.top_k must be >= 1, got {cfg.retrieval.top_k}")


# ====================================================================== evaluation
class Evaluator:
    """Accuracy matrix rows, retrieval and oracle accuracy, with per-adapter embedding caches."""

    def __init__(self, learner: ContinualLearner, stream: TaskStream, cache_bytes: int = 2 << 30) -> None:
        self.learner = learner
        self.stream = stream
        self.cache_bytes = cache_bytes
        self._z: dict[int, torch.Tensor] = {}
        self._y: dict[int, torch.Tensor] = {}
        self._emb: dict[tuple[int, str, int], torch.Tensor] = {}
        self._scores: dict[tuple[int, int], torch.Tensor] = {}
        self.last_retrieval: dict[int, Any] = {}

    def _prefix(self, tau: int) -> torch.Tensor:
        if tau not in self._z:
            z, y = self.learner.prefix_dataset(self.stream.tasks[tau].test, f"test {tau + 1}: prefix")
            self._y[tau] = y
            used = sum(v.numel() * v.element_size() for v in self._z.values())
            if used + z.numel() * z.element_size() > self.cache_bytes:
                return z
            self._z[tau] = z
        return self._z[tau]

    def embedding(self, tau: int, kind: str, j: int | None) -> torch.Tensor:
        key = (tau, kind, -1 if j is None else j)
        if key not in self._emb:
            tasks = None if j is None else [j]
            self._emb[key] = self.learner.embed_prefix(self._prefix(tau), tasks, kind)[0]
        return self._emb[key]

    def labels(self, tau: int) -> torch.Tensor:
        self._prefix(tau)
        return self._y[tau]

    def evaluate(self, k: int) -> dict[str, Any]:
        """Evaluate on the test sets of tasks 0..k after learning task k."""
        L = self.learner
        row, oracle_row = [], []
        n_correct_ret = n_total = 0
        retrieval_used = L.uses_retrieval
        for tau in range(k + 1):
            y = self.labels(tau)
            if retrieval_used:
                m = L.num_adapters
                H = torch.stack([self.embedding(tau, "task", j) for j in range(m)])
                F = self.embedding(tau, "task", None) if L.uses_frozen_keys else None
                res = L.retrieve_embeddings(H, F)
                self.last_retrieval[tau] = res
                h = H[res.task, torch.arange(H.shape[1])]
                n_correct_ret += int((res.task == tau).sum())
                n_total += len(y)
                oracle = L.classify(self.embedding(tau, "task", tau)).argmax(1)
                oracle_row.append(100.0 * float((oracle == y).float().mean()))
            else:
                tasks, kind = L.head_composition(k)
                h = self.embedding(tau, kind, None if tasks is None else tasks[0])
            pred = L.classify(h).argmax(1)
            row.append(100.0 * float((pred == y).float().mean()))
        return {
            "row": row,
            "retrieval_acc": 100.0 * n_correct_ret / n_total if retrieval_used else None,
            "oracle_row": oracle_row if retrieval_used else None,
        }


# ====================================================================== KB glue
def kb_header(learner: ContinualLearner, stream: TaskStream) -> dict[str, Any]:
    return {
        "proteus_version": __version__,
        "backbone": learner.backbone.identity(),
        "config": learner.cfg.to_dict(),
        "split": {
            "benchmark": stream.name,
            "sha256": stream.manifest.get("sha256"),
            "class_order": stream.manifest.get("class_order"),
        },
        "evaluation": [],
    }


def _without_timings(d: Any) -> Any:
    """``d`` without the keys that hold wall-clock seconds (recursively)."""
    if isinstance(d, dict):
        return {k: _without_timings(v) for k, v in d.items() if "seconds" not in k}
    if isinstance(d, list):
        return [_without_timings(v) for v in d]
    return d


def commit_learner(kb: KnowledgeBase, learner: ContinualLearner, evaluation: list[dict]) -> None:
    """Write the learner's state as the KB's new state (atomic)."""
    state = learner.state()
    manifest = dict(kb.manifest)
    tasks = []
    for t in state["tasks"]:
        rel, sha = kb.write_object(f"task{t['meta']['index']:03d}", t["tensors"])
        # wall-clock timings stay out of the KB (they are in results.json): same seed, same bytes
        tasks.append({**_without_timings(t["meta"]), "object": rel, "sha256": sha})
    manifest["tasks"] = tasks
    if state["head"] is not None:
        rel, sha = kb.write_object("head", state["head"]["tensors"])
        manifest["head"] = {"meta": state["head"]["meta"], "object": rel, "sha256": sha}
    manifest["evaluation"] = evaluation
    kb.commit(manifest)


def learner_from_kb(kb: KnowledgeBase, progress: bool = True, device: str | None = None) -> ContinualLearner:
    cfg = RunConfig.from_dict(kb.manifest["config"])
    if device:
        cfg.device = device
    learner = ContinualLearner(cfg, progress=progress)
    kb.check_backbone(learner.backbone.identity())
    for t in kb.manifest["tasks"]:
        learner.load_task(t, kb.read(t["object"], t["sha256"]))
    head = kb.manifest.get("head")
    if head:
        learner.load_head(head["meta"], kb.read(head["object"], head["sha256"]))
    return learner


def check_split(kb: KnowledgeBase, stream: TaskStream) -> None:
    split = kb.manifest.get("split", {})
    if split.get("sha256") != stream.manifest.get("sha256") or split.get("benchmark") != stream.name:
        raise KBError(
            f"{kb.root}: knowledge base was built on split {split.get('benchmark')!r} "
            f"(sha256 {str(split.get('sha256'))[:12]}…), but the data given is {stream.name!r} "
            f"(sha256 {str(stream.manifest.get('sha256'))[:12]}…)"
        )


def learn_and_commit(
    learner: ContinualLearner, kb: KnowledgeBase, stream: TaskStream, k: int, evaluator: Evaluator | None
) -> dict[str, Any]:
    """Learn task k, evaluate (if asked), commit the KB. The KB is never left half-written."""
    t0 = time.perf_counter()
    stats = learner.learn_task(stream.tasks[k])
    evaluation = list(kb.manifest.get("evaluation", []))
    if evaluator is not None:
        ev = evaluator.evaluate(k)
        evaluation = evaluation[:k] + [ev]
    crash_point("evaluate")
    stats["seconds_task"] = time.perf_counter() - t0
    if dist.is_main():  # under torchrun rank 0 writes; the others read its commit back
        commit_learner(kb, learner, evaluation)
    dist.barrier()
    if not dist.is_main():
        kb.manifest = KnowledgeBase.open(kb.root, verify=False).manifest
    return stats


def create_kb(root: str | Path, header: dict[str, Any]) -> KnowledgeBase:
    """Create a knowledge base. Under torchrun rank 0 creates it, after every rank has checked that none
    existed, and the other ranks open it."""
    dist.barrier()
    kb = KnowledgeBase.create(root, header) if dist.is_main() else None
    dist.barrier()
    return kb if kb is not None else KnowledgeBase.open(root, verify=False)


# ====================================================================== results
def build_results(
    cfg: RunConfig, stream: TaskStream, evaluation: list[dict], seconds: float, extra: dict | None = None
) -> dict[str, Any]:
    m = len(stream.tasks)
    matrix = [list(e["row"]) + [None] * (m - len(e["row"])) for e in evaluation]
    avg = average_accuracy([e["row"] for e in evaluation]) if evaluation else []
    forg = forgetting([e["row"] for e in evaluation]) if evaluation else []
    ret = [e["retrieval_acc"] for e in evaluation]
    oracle = [sum(e["oracle_row"]) / len(e["oracle_row"]) if e["oracle_row"] else None for e in evaluation]
    res = {
        "benchmark": stream.name,
        "method": cfg.method,
        "backbone": cfg.backbone.name,
        "seed": cfg.seed,
        "num_tasks": m,
        "acc_matrix": matrix,
        "avg_acc": avg,
        "final_avg_acc": avg[-1] if avg else None,
        "forgetting": forg[-1] if forg else None,
        "forgetting_per_step": forg,
        "retrieval_acc": ret if any(r is not None for r in ret) else None,
        "oracle_avg_acc": oracle if any(o is not None for o in oracle) else None,
        "oracle_acc_matrix": [e["oracle_row"] for e in evaluation]
        if evaluation and evaluation[0]["oracle_row"]
        else None,
        "seconds": seconds,
        "proteus_version": __version__,
    }
    res.update(extra or {})
    return res


def format_table(res: dict[str, Any]) -> str:
    lines = [f"{res['method']} on {res['benchmark']} ({res['backbone']}, seed {res['seed']})"]
    hdr = f"{'after task':>10} | {'avg acc':>8} | {'retrieval':>9} | {'oracle':>7}"
    lines += [hdr, "-" * len(hdr)]
    ret = res.get("retrieval_acc") or [None] * len(res["avg_acc"])
    orc = res.get("oracle_avg_acc") or [None] * len(res["avg_acc"])

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for i, a in enumerate(res["avg_acc"]):
        lines.append(f"{i + 1:>10} | {f(a):>8} | {f(ret[i]):>9} | {f(orc[i]):>7}")
    lines.append(
        f"final average accuracy {f(res['final_avg_acc'])}%, forgetting {f(res['forgetting'])}, "
        f"{res['seconds']:.1f} s"
    )
    return "\n".join(lines)


def _setup_log(out: Path) -> logging.Handler:
    out.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(out / "log.txt")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("proteus").addHandler(h)
    logging.getLogger("proteus").setLevel(logging.INFO)
    return h


def run(cfg: RunConfig, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """The whole continual loop in one process; writes config.yaml, split.json, log.txt, kb/, results.json,
    analysis.json and (``report.figures``) report.md with figures/ (:mod:`proteus.report`)."""
    out = Path(out)
    main = dist.is_main()  # under torchrun only rank 0 writes files (proteus.distributed)
    handler = _setup_log(out) if main else None
    try:
        t0 = time.perf_counter()
        if main:
            (out / "config.yaml").write_text(cfg.to_yaml())
        stream = build_benchmark(cfg.benchmark)
        if main:
            stream.write_manifest(out / "split.json")
        log.info("run %s on %s: %d tasks", cfg.method, stream.name, len(stream.tasks))
        learner = ContinualLearner(cfg, progress=progress)
        kb_dir = out / "kb"
        if KnowledgeBase.exists(kb_dir):
            raise KBError(
                f"{kb_dir}: exists already; choose a new --out (runs never overwrite a knowledge base)"
            )
        kb = create_kb(kb_dir, kb_header(learner, stream))
        evaluator = Evaluator(learner, stream)
        per_task = []
        for k in range(len(stream.tasks)):
            stats = learn_and_commit(learner, kb, stream, k, evaluator)
            ev = kb.manifest["evaluation"][-1] if kb.manifest["evaluation"] else None
            log.info("task %d: %s", k + 1, json.dumps({"stats": stats, "eval": ev}, default=str))
            per_task.append(stats)
            if progress and ev and main:
                ret = ev["retrieval_acc"]
                print(
                    f"task {k + 1}/{len(stream.tasks)}: accuracy per task {[round(a, 1) for a in ev['row']]}"
                    + (f", retrieval {ret:.1f}%" if ret is not None else ""),
                    flush=True,
                )
        evaluation = [e for e in kb.manifest["evaluation"] if e]
        extra = {"tasks": per_task, "kb_bytes": kb.nbytes()}
        seconds, t1 = time.perf_counter() - t0, time.perf_counter()
        # theory checks, S / cosine analyses, latency (proteus.report); every rank takes part in any
        # embedding pass the theory needs, rank 0 alone times and writes
        from proteus.report.analysis import analyse_run

        keys, bulky = analyse_run(learner, evaluator, stream, cfg.report, latency=main)
        extra.update(keys)
        res = build_results(cfg, stream, evaluation, seconds, extra)
        if main:
            (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
            (out / "analysis.json").write_text(json.dumps(bulky))
            if cfg.report.figures:
                from proteus.report import write_report

                res["figures"] = write_report(out, res, bulky)
            res["seconds_report"] = time.perf_counter() - t1
            (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
        return res
    finally:
        if handler is not None:
            logging.getLogger("proteus").removeHandler(handler)
