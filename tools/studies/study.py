"""Shared pieces of the retrieval studies (retrieval_ablation.py, frozen_keys.py): their command-line
arguments and config, a tied-covariance LDA on L2-normalised features, and the frozen prefix of mirrored
images for flip test-time augmentation.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as nnf
import torchvision.transforms.functional as TF


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The data and config arguments of ``proteus run`` that the studies share."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmark", required=True)
    ap.add_argument("--data")
    ap.add_argument("--tasks", dest="tasks_file")
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    return ap


def resolve(args: argparse.Namespace, method: str, extra_sets: tuple[str, ...] = ()):
    """The run config for ``method`` from the parsed arguments (as ``proteus run`` resolves it)."""
    from proteus.experiment import resolve_config

    data = {k: v for k, v in (("data", args.data), ("tasks_file", args.tasks_file)) if v}
    over = {"seed": args.seed, "benchmark": data}
    return resolve_config(args.benchmark, method, args.config, [*args.set, *extra_sets], over)


class TiedLDA:
    """Class means and one within-class covariance tied across all classes, shrunk ``shrink`` towards
    its mean eigenvalue, on L2-normalised rows; scores are squared Mahalanobis distances."""

    def __init__(self, shrink: float = 0.1) -> None:
        self.shrink = shrink

    def fit(self, Xs: list[torch.Tensor], ys: list[torch.Tensor]) -> TiedLDA:
        X = nnf.normalize(torch.cat(Xs).double(), dim=1)
        Y = torch.cat(ys)
        self.labels_ = torch.as_tensor(sorted(Y.unique().tolist()))
        self.means_ = torch.stack([X[Y == c].mean(0) for c in self.labels_.tolist()])
        R = X - self.means_[torch.searchsorted(self.labels_, Y)]
        S = R.T @ R / len(X)
        d = S.shape[0]
        eye = torch.eye(d, dtype=S.dtype)
        self.precision_ = torch.linalg.inv((1 - self.shrink) * S + self.shrink * S.trace() / d * eye)
        return self

    def distances(self, Z: torch.Tensor, classes: list[int] | None = None) -> torch.Tensor:
        """(N, C) squared Mahalanobis distances to the class means (``classes``: only those, in order)."""
        mus = self.means_
        if classes is not None:
            mus = mus[torch.searchsorted(self.labels_, torch.as_tensor(classes))]
        Z = nnf.normalize(Z.double(), dim=1)
        P = self.precision_
        W = Z @ P
        return (W * Z).sum(1, keepdim=True) - 2 * W @ mus.T + ((mus @ P) * mus).sum(1)[None]

    def predict(self, Z: torch.Tensor, classes: list[int] | None = None) -> torch.Tensor:
        labels = self.labels_ if classes is None else torch.as_tensor(classes)
        return labels[self.distances(Z, classes).argmin(1)]


def mirrored_prefix(learner, ds) -> torch.Tensor:
    """The frozen prefix's outputs for the horizontally mirrored images of ``ds``."""
    learner.kb_header()  # builds the learner
    base = learner.embedder_.transform
    learner.embedder_.transform = lambda im: TF.hflip(base(im))
    try:
        return learner.prefix_dataset(ds)[0]
    finally:
        learner.embedder_.transform = base
