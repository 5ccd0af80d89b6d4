"""The ablation of ``proteus``'s retrieval (issue 23) on cached embeddings (``embed_cache.py``).

    python tools/studies/soft_rules.py runs/cache/sw-r8e5-domains5-s{0,1,2} \
        runs/cache/sw-r8e5-cifar10-s{0,1,2} [--pre-dir runs/cache/pre] [--grid]

Per cache it first computes, once (kept under ``--pre-dir``): the first-adapter LDA keys' class scores
(``signature.keys=first-adapter-lda``), each task's own ridge head under each adapter
(``head.scope=task``), Eq. 23's head over every class under each adapter (``head.scope=global``) and
RanPAC's predictions. It then scores the named rules below with the library's own
:func:`~proteus.engine.keys.lda.task_scores` and :func:`~proteus.engine.experts.combine_soft`, the
mean over the seeds of each stream (caches named ``NAME-sN``), as points over ``ranpac`` on the same
adapters, with the retrieval (the task of the predicted class) in brackets. ``--grid`` adds the
temperature and top-k grid that chose the defaults.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import torch
from domain_rules import Cache, _l2

from proteus.engine.experts import combine_soft
from proteus.engine.keys.lda import task_scores

#: name -> (task score, class temperature, key temperature, head temperature, soft top (0: hard), expert)
RULES: dict[str, tuple[str, float, float, float, int, str]] = {
    "proteus (default)": ("mean", 0.1, 1.0, 1.0, 2, "task"),
    "proteus-lda (max, hard, global head)": ("max", 0.1, 0.1, 1.0, 0, "global"),
    "proteus-hard (combine=hard)": ("mean", 0.1, 1.0, 1.0, 0, "task"),
    "proteus-max-key (task_score=max)": ("max", 0.1, 0.1, 1.0, 2, "task"),
    "proteus-global-head (scope=global)": ("mean", 0.1, 1.0, 1.0, 2, "global"),
    "max, hard, task head": ("max", 0.1, 0.1, 1.0, 0, "task"),
    "soft_top=3": ("mean", 0.1, 1.0, 1.0, 3, "task"),
    "head_temperature=0.5": ("mean", 0.1, 1.0, 0.5, 2, "task"),
    "class_temperature=0.05": ("mean", 0.05, 1.0, 1.0, 2, "task"),
    "class_temperature=0.2": ("mean", 0.2, 1.0, 1.0, 2, "task"),
    "sum, not mean (class-count prior)": ("sum", 0.1, 1.0, 1.0, 2, "task"),
}


def precompute(path: str, pre_dir: Path) -> dict:
    out = pre_dir / f"{Path(path).name}.pt"
    if out.is_file():
        return torch.load(out)
    c = Cache(path)
    task_heads = []
    for j in range(c.m):
        h = c.new_head(rp_dim=0)
        local = {int(x): i for i, x in enumerate(c.classes[j])}
        h.update(c.train(j, "own"), torch.tensor([local[int(v)] for v in c.train(j, "y")]))
        task_heads.append(h)
    keys = c.head("first", rp_dim=0, l2=True)
    glob = c.head("own")
    first = c.head("first")
    d = {
        "classes": c.classes, "ys": c.ys, "C": c.C,
        "E": [[task_heads[j].decision_function(c.test(t, j)).float() for j in range(c.m)]
              for t in range(c.m)],
        "G": [[glob.decision_function(c.test(t, j)).float() for j in range(c.m)] for t in range(c.m)],
        "klog": [keys.decision_function(_l2(c.test(t, 0), True)).float() for t in range(c.m)],
        "ranpac": [first.decision_function(c.test(t, 0)).argmax(1) for t in range(c.m)],
    }  # fmt: skip
    pre_dir.mkdir(parents=True, exist_ok=True)
    torch.save(d, out)
    return d


def _scores(klog: torch.Tensor, classes: list[list[int]], how: str, tc: float) -> torch.Tensor:
    if how == "sum":  # the mean without the division by the class count
        sizes = torch.tensor([float(len(c)) for c in classes])
        return task_scores(klog, classes, "mean", tc) + torch.log(sizes)
    return task_scores(klog, classes, how, tc)


def evaluate(d: dict, rule: tuple[str, float, float, float, int, str]) -> tuple[float, float]:
    how, tc, tk, te, top, expert = rule
    classes, C = d["classes"], d["C"]
    m = len(classes)
    task_of = torch.zeros(C, dtype=torch.long)
    for k, cs in enumerate(classes):
        task_of[cs] = k
    accs, hit, n = [], 0, 0
    for t in range(m):
        s = _scores(d["klog"][t], classes, how, tc)
        cand = s.topk(top if top else 1, dim=1, largest=False).indices
        scores = torch.full((s.shape[0], cand.shape[1], C), float("-inf"))
        for j, cs in enumerate(classes):
            ex = d["E" if expert == "task" else "G"][t][j]
            ex = ex[:, cs] if ex.shape[1] == C else ex
            for k in range(cand.shape[1]):
                rows = cand[:, k] == j
                scores[rows.nonzero()[:, :1], k, torch.as_tensor(cs)[None, :]] = ex[rows]
        if top:
            pred = combine_soft(s, cand, scores, tk, te).argmax(1)
        else:
            pred = scores[:, 0].argmax(1)
        accs.append(100.0 * float((pred == d["ys"][t]).float().mean()))
        hit += int((task_of[pred] == t).sum())
        n += len(pred)
    return sum(accs) / m, 100.0 * hit / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("caches", nargs="+")
    ap.add_argument("--pre-dir", default="runs/cache/pre")
    ap.add_argument("--grid", action="store_true")
    args = ap.parse_args()
    data = {Path(p).name: precompute(p, Path(args.pre_dir)) for p in args.caches}
    streams: dict[str, list[str]] = collections.OrderedDict()
    for name in data:
        streams.setdefault(re.sub(r"-s\d+$", "", name), []).append(name)
    rules = dict(RULES)
    if args.grid:
        for tc in (0.05, 0.07, 0.1, 0.15):
            for te in (0.35, 0.5, 0.7, 1.0):
                for top in (0, 2, 3):
                    rules[f"mean tc{tc} te{te} top{top}"] = ("mean", tc, 1.0, te, top, "task")

    def ranpac(d: dict) -> float:
        return sum(100.0 * float((p == y).float().mean()) for p, y in zip(d["ranpac"], d["ys"])) / len(
            d["ys"]
        )

    def oracle(d: dict) -> float:
        accs = []
        for t, cs in enumerate(d["classes"]):
            pred = torch.as_tensor(cs)[d["E"][t][t].argmax(1)]
            accs.append(100.0 * float((pred == d["ys"][t]).float().mean()))
        return sum(accs) / len(accs)

    base = {s: sum(ranpac(data[n]) for n in ns) / len(ns) for s, ns in streams.items()}
    print("| rule | " + " | ".join(f"{s} ({len(ns)} seeds)" for s, ns in streams.items()) + " |")
    print("|---" * (len(streams) + 1) + "|")
    print("| `ranpac` (final accuracy) | " + " | ".join(f"{base[s]:.2f}" for s in streams) + " |")
    orc = {s: sum(oracle(data[n]) for n in ns) / len(ns) for s, ns in streams.items()}
    print(
        "| oracle, own task head (points over ranpac) | "
        + " | ".join(f"{orc[s] - base[s]:+.2f}" for s in streams)
        + " |"
    )
    for name, rule in rules.items():
        cells = []
        for s, ns in streams.items():
            v = [evaluate(data[n], rule) for n in ns]
            acc, ret = sum(a for a, _ in v) / len(v), sum(r for _, r in v) / len(v)
            cells.append(f"{acc - base[s]:+.2f} ({ret:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
