"""Scale-faithful check of the signature storage options (issue 13), on a CPU.

A synthetic stream shaped like CIFAR-100 on ViT-B/16 features (d = 768, 10 tasks of 10 classes, 5,000
training and 1,000 test embeddings per task, classes made of several modes) goes through the learner's
own code: :func:`proteus.signatures.fit_clusters` / :func:`~proteus.signatures.signature_from_fit` (=
:func:`~proteus.signatures.fit_signature`), :func:`~proteus.signatures.retrieve` and
:class:`~proteus.heads.RanPACHead`. Each task has its own "adapter", ``h_j(x) = x + a U_j V_j^T x`` (rank
4), so as in the learner every test input is scored by task j's signature under adapter j and the head
classifies the retrieved adapter's embedding.

For each recipe (a method's ``signature.*`` and ``head.*`` settings) the clustering of every task is fitted
once, then stored in every storage option; each option is compared with full covariances of the same fit:
retrieval agreement, retrieval accuracy, final average accuracy, build time, scoring time and bytes per
task. ``fit s`` is the clustering (shared by the options of a recipe).

    python tools/studies/scale_check.py                       # the paper's scale (about 20-40 min on 1 core)
    python tools/studies/scale_check.py --d 64 --tasks 4 --classes 5 --train 600 --test 200   # seconds

The test ``tests/test_scale.py`` runs it at a reduced size.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from proteus.config import resolve_config
from proteus.heads import RanPACHead
from proteus.signatures import Signature, fit_clusters, retrieve, signature_from_fit

#: storage options compared with "full" (signature.* overrides); "shared" keeps every factor row (exact)
STORAGES: dict[str, dict[str, Any]] = {
    "full": {"covariance": "full", "rank": None, "storage_dtype": "float32"},
    "shared": {"covariance": "shared", "rank": None, "storage_dtype": "float32"},
    "shared-r128": {"covariance": "shared", "rank": 128, "storage_dtype": "float32"},
    "shared-fp16": {"covariance": "shared", "rank": None, "storage_dtype": "float16"},
    "full-fp16": {"covariance": "full", "rank": None, "storage_dtype": "float16"},
    "ppca-r64": {"covariance": "ppca", "rank": 64, "storage_dtype": "float32"},
}


@dataclass
class Shape:
    d: int = 768
    tasks: int = 10
    classes: int = 10
    train: int = 5000
    test: int = 1000
    modes: int = 3
    rank: int = 32
    sep: float = 1.0
    adapter: float = 0.1
    seed: int = 0


class SyntheticStream:
    """Embeddings of a CIFAR-100-like stream: x = mode mean + anisotropic noise ``L z`` (power-law spectrum
    in a random basis shared by all classes). Class means lie in the ``rank`` leading noise directions,
    ``L_r (sep g_c)`` with ``g_c ~ N(0, I)`` (so the Mahalanobis distance between two classes is ``sep
    ||g_c - g_c'||``), and each class has ``modes`` modes ``L_r (sep g_c + 0.6 sep g_cs)``. Adapter j maps
    x to ``x + a sqrt(d) U_j (V_j^T x)`` (U, V: d x 4 with N(0, 1/d) entries)."""

    def __init__(self, s: Shape) -> None:
        self.s = s
        g = torch.Generator().manual_seed(s.seed)
        d = s.d
        Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        lam = 1.0 / torch.arange(1, d + 1, dtype=torch.float64) ** 0.8
        self.L = Q * (lam / lam.mean()).sqrt()[None, :]  # noise = L z
        r = min(s.rank, d)
        C = s.tasks * s.classes
        means = s.sep * torch.randn(C, r, generator=g, dtype=torch.float64)
        modes = means[:, None] + 0.6 * s.sep * torch.randn(C, s.modes, r, generator=g, dtype=torch.float64)
        self.modes = modes @ self.L[:, :r].T  # (C, modes, d)
        self.U = torch.randn(s.tasks, d, 4, generator=g, dtype=torch.float64) / d**0.5
        self.V = torch.randn(s.tasks, d, 4, generator=g, dtype=torch.float64) / d**0.5
        self.g = g

    def classes(self, k: int) -> list[int]:
        return list(range(k * self.s.classes, (k + 1) * self.s.classes))

    def draw(self, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` inputs of task k (balanced classes, uniform modes) in the backbone's space, with labels."""
        cls = torch.tensor(self.classes(k))[torch.arange(n) % self.s.classes]
        mode = torch.randint(self.s.modes, (n,), generator=self.g)
        z = torch.randn(n, self.s.d, generator=self.g, dtype=torch.float64)
        return self.modes[cls, mode] + z @ self.L.T, cls

    def adapt(self, X: torch.Tensor, j: int) -> torch.Tensor:
        """``h_j(x)`` (float32, as embeddings reach the signature)."""
        return (X + self.s.adapter * (X @ self.V[j]) @ self.U[j].T * self.s.d**0.5).float()


def _head(cfg: Any, d: int, rp_dim: int) -> RanPACHead:
    h = cfg.head
    return RanPACHead(
        d, rp_dim=rp_dim, gamma_min_exp=h.gamma_min_exp, gamma_max_exp=h.gamma_max_exp, holdout=h.holdout,
        selection=h.gamma_selection, prototypes=h.prototypes, seed=0,
    )  # fmt: skip


def _stored(sig: Signature) -> Signature:
    """``sig`` after a round trip through its stored tensors (what a knowledge base loads)."""
    tensors, meta = sig.to_tensors()
    return Signature.from_tensors(tensors, meta)


def run_recipe(
    stream: SyntheticStream, method: str, rp_dim: int, storages: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Fit every task's signature once with ``method``'s settings, store it in every option, retrieve and
    classify the test inputs; returns per option the measurements (see the module docstring)."""
    s = stream.s
    cfg = resolve_config(None, method)
    sig_cfg = cfg.signature
    head = _head(cfg, s.d, rp_dim)
    tests, labels, fits, train_h = [], [], [], []
    fit_s = 0.0
    for k in range(s.tasks):
        X, y = stream.draw(k, s.train)
        H = stream.adapt(X, k)
        t0 = time.perf_counter()
        fits.append(fit_clusters(H, sig_cfg, seed=k))
        fit_s += time.perf_counter() - t0
        train_h.append(H)
        head.update(H.double(), y, num_classes=(k + 1) * s.classes)
        Xt, yt = stream.draw(k, s.test)
        tests.append(Xt)
        labels.append(yt)
    X_all, y_all = torch.cat(tests), torch.cat(labels)
    true_task = torch.arange(s.tasks).repeat_interleave(s.test)
    H_all = [stream.adapt(X_all, j) for j in range(s.tasks)]  # every test input under every adapter
    pred = torch.stack([head.predict(H_all[j].double()) for j in range(s.tasks)])  # (m, N)
    out: dict[str, Any] = {"fit_seconds": fit_s, "n_active": None, "options": {}}
    ref_task = None
    for name, over in storages.items():
        sc = replace(sig_cfg, **over)
        t0 = time.perf_counter()
        # as the knowledge base stores them: through the stored tensors (float16 rows are rounded there)
        sigs = [_stored(signature_from_fit(train_h[k], sc, fits[k])) for k in range(s.tasks)]
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        task = retrieve([sigs[j].score(H_all[j]) for j in range(s.tasks)]).task
        score_s = time.perf_counter() - t0
        if ref_task is None:
            ref_task = task
            out["n_active"] = [sg.n_active for sg in sigs]
        final = pred[task, torch.arange(len(task))] == y_all
        out["options"][name] = {
            "agreement": 100.0 * float((task == ref_task).float().mean()),
            "retrieval": 100.0 * float((task == true_task).float().mean()),
            "final": 100.0
            * float(torch.stack([final[true_task == k].float().mean() for k in range(s.tasks)]).mean()),
            "build_seconds": build_s,
            "score_seconds": score_s,
            "bytes_per_task": sum(sg.nbytes() for sg in sigs) / s.tasks,
            "covariance": sc.covariance,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f, v in vars(Shape()).items():
        ap.add_argument(f"--{f}", type=type(v), default=v)
    ap.add_argument("--methods", default="proteus-paper,proteus")
    ap.add_argument("--rp-dim", type=int, default=2000, help="head width (the paper: 10000)")
    ap.add_argument("--storages", default=",".join(STORAGES))
    ap.add_argument("--out")
    args = ap.parse_args()
    shape = Shape(**{f: getattr(args, f) for f in vars(Shape())})
    storages = {k: STORAGES[k] for k in args.storages.split(",")}
    results: dict[str, Any] = {"shape": vars(shape), "methods": {}}
    for method in args.methods.split(","):
        r = run_recipe(SyntheticStream(shape), method, args.rp_dim, storages)
        results["methods"][method] = r
        print(f"\n{method}: clustering {r['fit_seconds']:.1f} s, components per task {r['n_active']}")
        cols = ("agree %", "retr %", "final %", "build s", "score s", "MB/task")
        print(f"{'storage':<20}" + "".join(f"{c:>9}" for c in cols))
        for name, o in r["options"].items():
            vals = (o["agreement"], o["retrieval"], o["final"], o["build_seconds"], o["score_seconds"])
            print(
                f"{name:<20}" + "".join(f"{v:9.2f}" for v in (*vals, o["bytes_per_task"] / 2**20)), flush=True
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
