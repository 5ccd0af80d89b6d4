"""KLDA (Momeni, Mazumder and Liu, AAAI 2025): linear discriminant analysis over random Fourier features of
the frozen backbone's embeddings; no gradient, no task retrieval.

The RBF kernel ``k(h, h') = exp(-gamma ||h - h'||^2)`` is approximated by ``D`` random Fourier features
(Rahimi and Recht), ``phi(h) = sqrt(2 / D) cos(h W + b)`` with ``W ~ N(0, 2 gamma)`` (d x D) and
``b ~ U(0, 2 pi)`` (D), drawn once from the run's seed: scikit-learn's ``RBFSampler`` map. ``gamma``
unset takes the first task's ``1 / (d Var(h))`` (scikit-learn's ``gamma="scale"``) and keeps it.

Task t adds, for each of its classes c, the class mean ``mu_c`` of ``phi`` and its scatter
``sum_{i in c} (phi_i - mu_c)(phi_i - mu_c)^T`` to one shared within-class scatter S. A prediction is LDA
under the shared covariance ``Sigma = S / N`` (N: the images learned so far), shrunk towards its mean
eigenvalue, ``Sigma_a = (1 - a) Sigma + a (tr(Sigma) / D) I``::

    delta_c(phi) = phi^T Sigma_a^{-1} mu_c - mu_c^T Sigma_a^{-1} mu_c / 2 + log(n_c / N)

and the argmax over every class seen. Each class arrives with one task (class-incremental), so the
statistics after task t are those of the t tasks' data pooled: the learner equals LDA fitted on all of it at
once, which is scikit-learn's ``RBFSampler`` + ``LinearDiscriminantAnalysis(solver="lsqr",
shrinkage=a)`` on the same features (``tests/test_klda.py``). The paper's ensemble of several random maps
(KLDA-E) is not built.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from proteus.baselines.learner import KB_LAYOUT, ContinualClassifier
from proteus.baselines.persist import linear, need
from proteus.config import declare
from proteus.engine.runtime import task_seed
from proteus.learners import LEARNERS
from proteus.options import AT_LEAST_1, POSITIVE, UNIT, option
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, ShapeRule

__all__ = ["KLDA", "KLDAOptions", "discriminants", "random_features"]


@dataclasses.dataclass
class KLDAOptions:
    """KLDA's ``baseline.*`` options (no training: ``train.*`` does not apply)."""

    rff_dim: int = option(5000, help="D: the number of random Fourier features", range=AT_LEAST_1)
    rbf_gamma: float | None = option(
        None, help="the RBF kernel's gamma (null: 1 / (d Var(h)) of the first task's embeddings)",
        range=POSITIVE,
    )  # fmt: skip
    shrinkage: float = option(
        0.1, help="a: the covariance shrunk towards its mean eigenvalue, (1 - a) Sigma + a tr(Sigma) / D I",
        range=UNIT,
    )  # fmt: skip


def random_features(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sqrt(2 / D) cos(h W + b)``: the random Fourier features of ``h`` (N, d), float64."""
    return math.sqrt(2.0 / W.shape[1]) * torch.cos(h.double() @ W + b)


def discriminants(
    means: torch.Tensor, counts: torch.Tensor, scatter: torch.Tensor, shrinkage: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """LDA's linear discriminants ``(coef (C, D), intercept (C,))`` of class ``means`` (C, D) and ``counts``
    under the shared covariance ``scatter / N`` shrunk towards its mean eigenvalue (module doc)."""
    n = counts.sum()
    sigma = scatter / n
    shrunk = (1 - shrinkage) * sigma
    shrunk.diagonal().add_(shrinkage * sigma.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(shrunk)
    if int(info) == 0:
        coef = torch.cholesky_solve(means.T, L).T
    else:  # singular (no shrinkage, fewer images than features): the least-squares solution, as lsqr's
        coef = torch.linalg.lstsq(shrunk, means.T, driver="gelsd").solution.T
    intercept = -0.5 * (means * coef).sum(1) + torch.log(counts / n)
    return coef, intercept


@LEARNERS.register("klda", help="KLDA: LDA over random Fourier features of frozen embeddings (no training)")
class KLDA(ContinualClassifier):
    """Kernel LDA over the frozen backbone's embeddings (module doc).

    Fitted attributes besides :class:`ContinualClassifier`'s: ``W_`` (d, D) and ``b_`` (D,), the random
    map; ``means_`` (C, D) and ``counts_`` (C,), the classes' statistics task after task; ``scatter_``
    (D, D), the shared within-class scatter. ``heads_`` hold the discriminants of each task's classes under
    the covariance of every task learned (rewritten by each task).
    """

    name = "klda"
    Options = KLDAOptions
    option_sections = ("backbone",)
    resumes_legacy = True

    def _setup(self) -> None:
        self.W_: torch.Tensor | None = None
        self.b_: torch.Tensor | None = None
        self.means_ = torch.zeros(0, 0, dtype=torch.float64)
        self.counts_ = torch.zeros(0, dtype=torch.float64)
        self.scatter_: torch.Tensor | None = None

    @property
    def head_in(self) -> int:
        """The heads' input: the D random features."""
        return int(self.options_.rff_dim)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        assert self.W_ is not None and self.b_ is not None
        return random_features(self.backbone_.forward_suffix(z), self.W_, self.b_)  # on the learner's device

    def _draw(self, h: torch.Tensor, k: int) -> None:
        """The random map, drawn at the first task from the run's seed (``gamma``: its own, or the scale of
        the first task's embeddings ``h``)."""
        o = self.options_
        gamma = o.rbf_gamma if o.rbf_gamma is not None else 1.0 / (h.shape[1] * float(h.double().var(None)))
        g = torch.Generator().manual_seed(
            task_seed(self.config.seed, k)
        )  # drawn on the CPU: any device alike
        W = torch.randn(h.shape[1], o.rff_dim, generator=g, dtype=torch.float64) * math.sqrt(2 * gamma)
        b = torch.rand(o.rff_dim, generator=g, dtype=torch.float64) * (2 * math.pi)
        self.W_, self.b_ = W.to(self.device_), b.to(self.device_)
        self.scatter_ = torch.zeros(o.rff_dim, o.rff_dim, dtype=torch.float64, device=self.device_)

    @torch.no_grad()
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        z, y = self.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
        h = torch.cat([self.backbone_.forward_suffix(c.to(self.device_)).float() for c in z.split(256)])
        y = y.to(self.device_)
        if self.W_ is None:
            self._draw(h, k)
        assert self.W_ is not None and self.b_ is not None and self.scatter_ is not None
        phi = random_features(h, self.W_, self.b_)
        classes = [int(c) for c in task.classes]
        means = torch.stack([phi[y == c].mean(0) for c in classes])
        local = {c: i for i, c in enumerate(classes)}
        centred = phi - means[torch.as_tensor([local[c] for c in y.tolist()], device=phi.device)]
        counts = torch.stack([(y == c).sum() for c in classes]).double()
        stats = (
            torch.cat([self.means_.to(phi.device).reshape(-1, phi.shape[1]), means]),
            torch.cat([self.counts_.to(phi.device), counts]),
            self.scatter_ + centred.T @ centred,
        )
        heads = self._heads(*stats, [*self.task_classes_, classes])  # before any change: nothing to undo
        self.means_, self.counts_, self.scatter_ = stats
        self.heads_ = heads
        self.task_classes_.append(classes)
        self.labels_ += classes
        return {"steps": 0, "loss_first": None, "loss_last": None, "trainable_params": 0}

    def _heads(
        self, means: torch.Tensor, counts: torch.Tensor, scatter: torch.Tensor, task_classes: list[list[int]]
    ) -> nn.ModuleList:
        """Every task's head: its classes' discriminants under the covariance of all tasks learned."""
        coef, intercept = discriminants(means, counts, scatter, self.options_.shrinkage)
        heads, start = nn.ModuleList(), 0
        for cs in task_classes:
            rows = slice(start, start + len(cs))
            heads.append(linear(coef[rows].float(), intercept[rows].float(), self.device_))
            start += len(cs)
        return heads

    def abort_task(self, k: int) -> None:
        if k == 0:  # the random map was drawn for this task
            self._setup()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        assert self.W_ is not None and self.b_ is not None and self.scatter_ is not None
        own = {
            "W": self.W_,
            "b": self.b_,
            "means": self.means_,
            "counts": self.counts_,
            "scatter": self.scatter_,
        }
        return {**super().state_tensors(), **{f"klda.{n}": t.cpu().contiguous() for n, t in own.items()}}

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        W, b, means, counts, scatter = (
            need(tensors, f"klda.{n}").to(self.device_, copy=True)
            for n in ("W", "b", "means", "counts", "scatter")
        )
        self.W_, self.b_, self.means_, self.counts_, self.scatter_ = W, b, means, counts, scatter


TENSOR_RULES.declare(
    KB_LAYOUT, "KLDA",
    ShapeRule(r"klda\.W", ("obj.klda_d", "kb.linear_d"), "KLDA's random map: embedding width x D", on="head"),
    ShapeRule(r"klda\.b", ("kb.linear_d",), "KLDA's random phases: one per feature", on="head"),
    ShapeRule(r"klda\.means", ("obj.klda_classes", "kb.linear_d"), "KLDA's class means: a row per class",
              on="head"),
    ShapeRule(r"klda\.counts", ("obj.klda_classes",), "KLDA's class counts: one per class", on="head"),
    ShapeRule(r"klda\.scatter", ("kb.linear_d", "kb.linear_d"), "KLDA's shared scatter: D x D", on="head"),
)  # fmt: skip

declare(
    "klda",
    "KLDA (Momeni et al., AAAI 2025): LDA with one shared covariance over random Fourier features of the "
    "frozen backbone's embeddings (no training, no retrieval)",
    base=None,
    learner="klda",
)
