"""Score prediction rules on cached embeddings (``embed_cache.py``): every rule on the same adapters.

    python tools/studies/domain_rules.py runs/cache/domains5-s0 [more caches ...] [--json out.json]

A rule is a *task posterior* (which task an input is from) and a *within-task expert* (which of that
task's classes), combined hard (the best task, then its expert) or soft (``log p(t|x) + log p(c|x,t)``
with temperatures). Task posteriors: LDA keys in the first adapter's space (``proteus-lda``), the same with
the head's random projection, the RanPAC head's classes, the DP-GMM signatures (``proteus``), and fusions.
Experts: the head of Eq. 23 (all tasks' statistics) under the task's adapter, over all classes or the
task's; a per-task ridge head under the task's own adapter (or the first adapter: what the adapters add).
``ranpac``, ``frozen`` and the oracles are recomputed from the same cache.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as nnf
from safetensors.torch import load_file

from proteus.config import SignatureConfig
from proteus.heads import RanPACHead
from proteus.signatures import fit_signature

NEG = float("-inf")


class Cache:
    def __init__(self, path: str) -> None:
        p = Path(path)
        self.name = p.name
        self.meta = json.loads((p / "meta.json").read_text())
        self.t = load_file(str(p / "tensors.safetensors"))
        self.classes = self.meta["classes"]
        self.m = len(self.classes)
        self.cfg = self.meta["config"]
        self.C = 1 + max(max(c) for c in self.classes)
        self.task_of = torch.zeros(self.C, dtype=torch.long)
        for k, cs in enumerate(self.classes):
            self.task_of[cs] = k
        self.ys = [self.test(t, "y") for t in range(self.m)]
        self.true_task = [self.task_of[y] for y in self.ys]

    def train(self, k: int, kind: str) -> torch.Tensor:
        return self.t[f"train/{k}/{kind}"]

    def test(self, t: int, j: int | str) -> torch.Tensor:
        return self.t[f"test/{t}/{j}"]

    def new_head(self, rp_dim: int | None = None, **kw) -> RanPACHead:
        h = self.cfg["head"]
        return RanPACHead(
            self.train(0, "own").shape[1], rp_dim=h["rp_dim"] if rp_dim is None else rp_dim,
            gamma_min_exp=h["gamma_min_exp"], gamma_max_exp=h["gamma_max_exp"], holdout=h["holdout"],
            selection=h["gamma_selection"], seed=self.cfg["seed"], **kw,
        )  # fmt: skip

    def head(self, kind: str, rp_dim: int | None = None, l2: bool = False) -> RanPACHead:
        """A head accumulated over every task's training inputs of ``kind`` (own, first, frozen)."""
        head = self.new_head(rp_dim)
        for k in range(self.m):
            head.update(_l2(self.train(k, kind), l2), self.train(k, "y"), num_classes=self.C)
        return head


def _l2(X: torch.Tensor, on: bool) -> torch.Tensor:
    return nnf.normalize(X, dim=1) if on else X


# ----------------------------------------------------------------------------------------- task scores
def per_task(logits: torch.Tensor, classes: list[list[int]], how: str = "max") -> torch.Tensor:
    """(N, m) a task's score = its best class score (``max``) or the sum of its class scores (``sum``: the
    ridge regression onto task indicators, as the regression is linear in its targets)."""
    if how == "sum":
        return torch.stack([logits[:, cs].sum(1) for cs in classes], 1)
    return torch.stack([logits[:, cs].max(1).values for cs in classes], 1)


def task_posteriors(c: Cache) -> dict[str, list[torch.Tensor]]:
    """name -> per test set (N, m) task scores, higher = more likely."""
    m = c.m
    out: dict[str, list[torch.Tensor]] = {}
    K = c.head("first", rp_dim=0, l2=True)
    Kf = c.head("frozen", rp_dim=0, l2=True)
    Hf = c.head("first")
    logits = {
        "lda": [K.decision_function(_l2(c.test(t, 0), True)).float() for t in range(m)],
        "frozen-lda": [Kf.decision_function(_l2(c.test(t, "frozen"), True)).float() for t in range(m)],
        "ranpac-head": [Hf.decision_function(c.test(t, 0)).float() for t in range(m)],
    }
    for name, lg in logits.items():
        out[name] = [per_task(x, c.classes) for x in lg]
        out[f"{name}-sum"] = [per_task(x, c.classes, "sum") for x in lg]
    sc = SignatureConfig(**{k: v for k, v in c.cfg["signature"].items()})
    sc = replace(sc, normalize="l2", prior="oas", prior_scale="expected", keys="adapter")
    sigs = [fit_signature(c.train(j, "own"), sc, seed=j) for j in range(m)]
    out["dpgmm"] = [
        torch.stack([-sigs[j].score(c.test(t, j)).min(1).values for j in range(m)], 1).float()
        for t in range(m)
    ]
    return out


# ----------------------------------------------------------------------------------------- experts
def experts(c: Cache) -> dict[str, list[list[torch.Tensor]]]:
    """name -> E[t][j] (N_t, C): class scores of test set t under task j's adapter (only task j's classes
    are read from column block j)."""
    m = c.m
    out: dict[str, list[list[torch.Tensor]]] = {}
    H = c.head("own")
    out["global head"] = [[H.decision_function(c.test(t, j)).float() for j in range(m)] for t in range(m)]
    variants = (("task head", "own", None, 0), ("task head on adapter 1", "first", 0, 0),
                ("task head rp", "own", None, None), ("task head l2", "own", None, -1))  # fmt: skip
    for name, kind, space, rp in variants:
        heads = []
        for j in range(m):
            h = c.new_head(rp_dim=0 if rp == -1 else rp)
            cs = c.classes[j]
            loc = {int(x): i for i, x in enumerate(cs)}
            h.update(_l2(c.train(j, kind), rp == -1), torch.tensor([loc[int(v)] for v in c.train(j, "y")]))
            heads.append(h)
        rows = []
        for t in range(m):
            row = []
            for j in range(m):
                full = torch.full((len(c.ys[t]), c.C), NEG)
                full[:, c.classes[j]] = (
                    heads[j]
                    .decision_function(_l2(c.test(t, j if space is None else space), rp == -1))
                    .float()
                )
                row.append(full)
            rows.append(row)
        out[name] = rows
    K = c.head("first", rp_dim=0, l2=True)
    klog = [K.decision_function(_l2(c.test(t, 0), True)).float() for t in range(m)]
    out["key classes"] = [[klog[t] for _ in range(m)] for t in range(m)]
    if "clf/0/weight" in c.t:  # the adapter's own trained classifier (logits: calibrated by training)
        rows = []
        for t in range(m):
            row = []
            for j in range(m):
                full = torch.full((len(c.ys[t]), c.C), NEG)
                W, b = c.t[f"clf/{j}/weight"], c.t[f"clf/{j}/bias"]
                full[:, c.classes[j]] = c.test(t, j) @ W.T + b
                row.append(full)
            rows.append(row)
        out["trained clf"] = rows
    return out


# ----------------------------------------------------------------------------------------- combination
def predict_hard(c: Cache, T: torch.Tensor, E: list[torch.Tensor], t: int, mask: bool) -> torch.Tensor:
    task = T.argmax(1)
    rows = torch.arange(len(task))
    logits = torch.stack(E)[task, rows]
    if mask:
        logits = logits.masked_fill(c.task_of[None, :] != task[:, None], NEG)
    return logits.argmax(1)


def lse_tasks(logits: torch.Tensor, classes: list[list[int]], tau: float) -> torch.Tensor:
    """(N, m) log p(t|x) = log sum_{c in t} softmax(logits / tau)_c."""
    lp = torch.log_softmax(logits / tau, 1)
    return torch.stack([torch.logsumexp(lp[:, cs], 1) for cs in classes], 1)


def predict_mix(
    c: Cache, logp_t: torch.Tensor, E: list[torch.Tensor], te: float, w: float = 1.0
) -> torch.Tensor:
    """argmax_c log p(t(c)|x) + w log p(c|x, t(c)), p(c|x,t) = softmax over t's classes of E[t] / te."""
    score = torch.full((logp_t.shape[0], c.C), NEG)
    for j, cs in enumerate(c.classes):
        score[:, cs] = logp_t[:, j : j + 1] + w * torch.log_softmax(E[j][:, cs] / te, 1)
    return score.argmax(1)


def predict_soft(c: Cache, T: torch.Tensor, E: list[torch.Tensor], tk: float, te: float) -> torch.Tensor:
    logp = torch.log_softmax(T / tk, 1)
    score = torch.full((T.shape[0], c.C), NEG)
    for j, cs in enumerate(c.classes):
        score[:, cs] = logp[:, j : j + 1] + torch.log_softmax(E[j][:, cs] / te, 1)
    return score.argmax(1)


def evaluate(c: Cache, quick: bool = False) -> dict[str, dict[str, float]]:
    m = c.m
    res: dict[str, dict[str, float]] = {}

    def record(name: str, pred: Callable[[int], torch.Tensor]) -> None:
        preds = [pred(t) for t in range(m)]
        accs = [100.0 * float((p == c.ys[t]).float().mean()) for t, p in enumerate(preds)]
        n = sum(len(y) for y in c.ys)
        ret = 100.0 * sum(int((c.task_of[p] == tt).sum()) for p, tt in zip(preds, c.true_task)) / n
        res[name] = {"final": sum(accs) / m, "retrieval": ret, "per_task": accs}

    Hf = c.head("first")
    Hz = c.head("frozen")
    record("ranpac", lambda t: Hf.decision_function(c.test(t, 0)).argmax(1))
    record("frozen", lambda t: Hz.decision_function(c.test(t, "frozen")).argmax(1))
    X = experts(c)
    onehot = [torch.nn.functional.one_hot(tt, m).float() for tt in c.true_task]
    for en, E in X.items():
        record(f"oracle | {en}", lambda t, E=E: predict_hard(c, onehot[t], E[t], t, True))
    record(
        "oracle | global head, all classes",
        lambda t: predict_hard(c, onehot[t], X["global head"][t], t, False),
    )
    if quick:
        return res
    P = task_posteriors(c)

    # fusions of task scores: z-scored sums
    def z(x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-9)

    P["lda+dpgmm (z)"] = [z(a) + z(b) for a, b in zip(P["lda"], P["dpgmm"])]
    P["lda-sum+dpgmm (z)"] = [z(a) + z(b) for a, b in zip(P["lda-sum"], P["dpgmm"])]
    for pn, T in P.items():
        record(
            f"{pn} | global head, all classes",
            lambda t, T=T: predict_hard(c, T[t], X["global head"][t], t, False),
        )
        for en in ("global head", "task head", "trained clf"):
            if en not in X:
                continue
            record(f"{pn} | {en}", lambda t, T=T, E=X[en]: predict_hard(c, T[t], E[t], t, True))
    K = c.head("first", rp_dim=0, l2=True)
    klog = [K.decision_function(_l2(c.test(t, 0), True)).float() for t in range(m)]
    for tk in (0.05, 0.1, 0.2):
        LT = [lse_tasks(klog[t], c.classes, tk) for t in range(m)]
        record(
            f"lda lse {tk} | task head", lambda t, LT=LT: predict_hard(c, LT[t], X["task head"][t], t, True)
        )
        for en in ("task head", "global head", "trained clf"):
            if en not in X:
                continue
            for te in (0.1, 0.2, 0.5, 1.0):
                record(
                    f"lda lse {tk} | {en} soft {te}",
                    lambda t, LT=LT, E=X[en], te=te: predict_mix(c, LT[t], E[t], te),
                )
        # product of experts: the key's own class posterior times the task expert's
        for te in (0.2, 0.5):
            for w in (0.5, 1.0):

                def poe(t, tk=tk, te=te, w=w):
                    lp = torch.log_softmax(klog[t] / tk, 1)
                    score = torch.full_like(lp, NEG)
                    for j, cs in enumerate(c.classes):
                        score[:, cs] = lp[:, cs] + w * torch.log_softmax(X["task head"][t][j][:, cs] / te, 1)
                    return score.argmax(1)

                record(f"lda poe {tk} | task head {te} x{w}", poe)
    for pn in ("lda",):
        for en in ("task head",):
            for tk in (0.1, 0.2):
                for te in (0.2, 0.5, 1.0):
                    record(
                        f"{pn} soft {tk} | {en} soft {te}",
                        lambda t, tk=tk, te=te, T=P[pn], E=X[en]: predict_soft(c, T[t], E[t], tk, te),
                    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("caches", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--grep", default="", help="print only rules containing this")
    ap.add_argument("--quick", action="store_true", help="ranpac, frozen and the oracles only")
    ap.add_argument("--per-task", action="store_true", help="print each task's accuracy")
    args = ap.parse_args()
    allres = {}
    for p in args.caches:
        allres[p] = evaluate(Cache(p), args.quick)
    names = list(next(iter(allres.values())))
    print(
        f"{'rule':58s} " + " ".join(f"{Path(c).name[-13:]:>13s}" for c in args.caches) + "    mean  vs ranpac"
    )
    for n in names:
        if args.grep not in n and n not in ("ranpac", "frozen"):
            continue
        vals = [allres[c][n]["final"] for c in args.caches]
        rets = [allres[c][n]["retrieval"] for c in args.caches]
        gain = [allres[c][n]["final"] - allres[c]["ranpac"]["final"] for c in args.caches]
        cells = " ".join(f"{v:6.2f}({r:4.1f})" for v, r in zip(vals, rets))
        mean_gain = sum(gain) / len(gain)
        print(f"{n:58s} {cells}  {sum(vals) / len(vals):6.2f}  {mean_gain:+6.2f} min {min(gain):+6.2f}")
        if args.per_task:
            for c in args.caches:
                print(
                    f"{'':8s}{Path(c).name:>30s}: " + " ".join(f"{a:6.2f}" for a in allres[c][n]["per_task"])
                )
    if args.json:
        Path(args.json).write_text(json.dumps(allres, indent=1))


if __name__ == "__main__":
    main()
