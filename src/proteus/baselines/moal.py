"""MoAL: momentum-based analytic learning (Gao et al., CVPR 2025, "Knowledge Memorization and Rumination
for Pre-trained Model-based Class-Incremental Learning"), class-incrementally.

The method as the authors' released code runs it (Zi-Jian-Gao/Moal @ d83d3d6:
``models/adapt_ac_com_sdc_EMA_auto.py``, ``utils/inc_net.py`` ``MultiBranchCosineIncrementalNet_adapt_AC``,
``utils/AC_net.py`` ``SimpleVitNet_AL``, ``backbone/linears.py``, ``exps/Moal_*.json``). One parallel
adapter (AdaptFormer's, :mod:`proteus.baselines.adaptformer`; bottleneck ``ffn_num`` = 64) on the frozen
backbone, shared by every task, and an analytic head on a random ReLU expansion of its embedding ``h``:

    ``a = relu(E h)`` (E: H x d, drawn once, ``U(-1/sqrt(d), 1/sqrt(d))``),  logits ``= a W`` (W: H x C).

Task 1 (knowledge memorisation):

* **train**: the adapter and a cosine classifier over the task's classes (``sigma cos(h, w_c)``: the
  release's ``CosineLinear``, rows ``U(-1/sqrt(d), 1/sqrt(d))``, ``sigma = 1``) by SGD under
  ``CosineAnnealingLR`` on the cross-entropy, weight decay on both; the classifier is then dropped;
* **head**: over one more pass of the task's training loader (its images as training draws them, the
  adapter in eval mode), the ridge ``gamma`` is chosen among ``10^-8 .. 10^8`` by fitting on the pass's
  first 80% and scoring the mean squared error on the rest (the release's ``optimise_ridge_parameter``), and

      ``R = (A^T A + gamma I)^{-1}``,  ``W = 0.9 R A^T Y``     (A: the pass's expansions, Y: one-hot labels;
      the release's ``cls_align``, its factor 0.9 included).

Task t >= 2 (momentum adaptation, analytic update, rumination):

* **train**: the adapter goes on from where task t - 1 left it, with the later tasks' cosine classifier
  over every class seen (its first task's rows drawn after task 1 and never trained then, each later task's
  new rows zero, ``sigma`` carried on: the release's ``CosineLinear2``), the cross-entropy over every seen
  class. After each epoch the adapter's moving average moves, ``theta_bar <- alpha theta_bar + (1 - alpha)
  theta`` (``theta_bar`` starts at the adapter of task t - 1; ``alpha`` = ``baseline.adapter_ema``, the
  release's 0.999), and at the end the adapter *is* ``theta_bar``;
* **class means**: the new classes' means of ``h`` over their un-augmented training images; the earlier
  classes' means are carried by a linear map ``f`` from the old adapter's embedding to the new one's of the
  same images (one pass of the training loader), fitted by SGD on their mean squared error (lr 0.01,
  momentum 0.9, weight decay 5e-4, batches of 32, ``CosineAnnealingLR(T_max=10)`` stepped per epoch over
  ``baseline.drift_epochs`` epochs, 90% / 10% split, the epoch of least held-out error kept): ``mu_c <-
  f(mu_c)`` (the release's ``cali_prototye_model``);
* **analytic update**: over a further pass of the loader, batch by batch, the recursive least squares of
  the release's ``IL_align`` (Woodbury's identity),

      ``R <- R - R A_b^T (I + A_b R A_b^T)^{-1} A_b R``,  ``W <- W + R A_b^T (Y_b - A_b W)``;

* **rumination** (``baseline.rumination``; the release's ``_compute_relations``, ``_build_feature_set``,
  ``cali_weight``): each earlier class c is paired with the new class r whose mean is closest in cosine; its
  pseudo-features are r's embeddings shifted by ``mu_c - mu_r``. Over the new classes' embeddings and the
  pseudo-features, shuffled, in batches of ``train.batch_size``, the same update runs on the rows that the
  head as the update over the task left it misclassifies (the release tests every batch against that head,
  not against the one the rumination goes on updating).

Prediction: the argmax of ``relu(E h) W`` over every class seen, ``h`` under the one adapter (no task
retrieval). ``R`` and ``W`` are kept in float64 (the release: float32 after a float64 first inverse).

This module is the whole method -- its learner and its declaration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.adaptformer import (
    KEYS,
    AdapterLike,
    AdapterSet,
    ParallelAdapterOptions,
    adapted_suffix,
    clone_set,
    fit_epochs,
    init_set,
    load_set,
    set_tensors,
    sites_of,
)
from proteus.baselines.learner import KB_LAYOUT, ContinualClassifier, TrainingOptions, task_stats
from proteus.baselines.persist import linear, need
from proteus.baselines.tosca import cosine_logits
from proteus.config import declare
from proteus.engine.errors import TaskError
from proteus.engine.runtime import task_seed
from proteus.learners import LEARNERS
from proteus.options import MAX_SQUARE_SIDE, NON_NEGATIVE, POSITIVE, UNIT, Interval, option
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, ShapeRule

__all__ = ["RIDGES", "MoAL", "drift_map", "relations", "rls_update", "select_ridge"]

#: the ridges the first task's head chooses among (the release's ``10.0 ** np.arange(-8, 9)``)
RIDGES = tuple(10.0**e for e in range(-8, 9))
#: the first task's head is ``FIRST_SCALE R A^T Y`` (the release's ``0.9 * Delta``)
FIRST_SCALE = 0.9
#: the mean-drift map's SGD: learning rate, momentum, weight decay, batch size, CosineAnnealingLR's T_max and
#: the share of the pass it is fitted on (the release's ``cali_prototye_model``)
DRIFT_LR, DRIFT_MOMENTUM, DRIFT_DECAY, DRIFT_BATCH, DRIFT_PERIOD, DRIFT_SPLIT = 0.01, 0.9, 5e-4, 32, 10, 0.9


@dataclasses.dataclass
class MoALOptions(ParallelAdapterOptions, TrainingOptions):
    adapter_ema: float = option(
        0.999, help="alpha: the adapter's moving average over the epochs of tasks 2.. (0: none)", range=UNIT
    )
    hidden: int = option(
        5000, help="H: the analytic head's random ReLU expansion (Hidden)", range=Interval(1, MAX_SQUARE_SIDE)
    )
    ridge: float | None = option(
        None, help="the head's ridge (null: chosen at the first task, 10^-8 .. 10^8)", range=POSITIVE
    )
    drift_epochs: int = option(
        1000, help="epochs of the map that carries the earlier class means to the new adapter (0: none)",
        range=NON_NEGATIVE,
    )  # fmt: skip
    rumination: bool = option(
        True, help="update the head on misclassified pseudo-features of earlier classes"
    )


# ---------------------------------------------------------------------------------------------- the head
def select_ridge(A: torch.Tensor, Y: torch.Tensor) -> float:
    """The ridge of :data:`RIDGES` whose least-squares fit on the first 80% of the rows of ``A`` (N, H)
    predicts the one-hot ``Y`` (N, C) of the remaining rows with the least mean squared error, in float32 as
    the release computes it (with fewer rows than H the smallest ridges' fits are float32 round-off there,
    which decides the choice)."""
    A, Y = A.float(), Y.float()
    n = int(A.shape[0] * 0.8)
    G, Q = A[:n].T @ A[:n], A[:n].T @ Y[:n]
    eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    losses = [float(F.mse_loss(A[n:] @ torch.linalg.solve(G + r * eye, Q), Y[n:])) for r in RIDGES]
    return RIDGES[min(range(len(RIDGES)), key=lambda i: (math.isnan(losses[i]), losses[i]))]


def rls_update(
    R: torch.Tensor, W: torch.Tensor, A: torch.Tensor, Y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recursive least-squares step on the rows ``A`` (b, H) with targets ``Y`` (b, C): Woodbury's
    ``R - R A^T (I + A R A^T)^{-1} A R`` and ``W + R' A^T (Y - A W)`` with the new ``R'`` (whose ``R' A^T``
    is ``R A^T (I + A R A^T)^{-1}``). No rows: unchanged."""
    if not len(A):
        return R, W
    RA = R @ A.T
    K = torch.eye(len(A), dtype=R.dtype, device=R.device) + A @ RA
    return R - RA @ torch.linalg.solve(K, RA.T), W + RA @ torch.linalg.solve(K, Y - A @ W)


# ---------------------------------------------------------------------------------------------- the drift
def drift_init(d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The drift map's initial weight (d, d) and bias (d,): ``nn.Linear``'s ``U(-1/sqrt(d), 1/sqrt(d))``."""
    bound = 1 / math.sqrt(d)
    w = (torch.rand(d, d, generator=g) * 2 - 1) * bound
    return w, (torch.rand(d, generator=g) * 2 - 1) * bound


def drift_map(
    old: torch.Tensor, new: torch.Tensor, epochs: int, g: torch.Generator
) -> tuple[nn.Linear | None, dict[str, float]]:
    """The linear map from ``old`` (N, d) embeddings to ``new`` ones of the same images (module doc): a
    random 90% / 10% split, then ``epochs`` epochs of SGD on the mean squared error over the 90% in shuffled
    batches, the epoch of least held-out error kept. Returns the map (None: no epoch gave a finite error)
    and the held-out errors of the map and of the identity."""
    n, d = old.shape
    perm = torch.randperm(n, generator=g)
    tr, va = perm[: int(DRIFT_SPLIT * n)], perm[int(DRIFT_SPLIT * n) :]
    f = nn.Linear(d, d).to(old.device)
    w, b = drift_init(d, g)
    with torch.no_grad():
        f.weight.copy_(w)
        f.bias.copy_(b)
    opt = torch.optim.SGD(f.parameters(), lr=DRIFT_LR, momentum=DRIFT_MOMENTUM, weight_decay=DRIFT_DECAY)
    best, state = math.inf, None
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = DRIFT_LR * (1 + math.cos(math.pi * epoch / DRIFT_PERIOD)) / 2
        for idx in tr[torch.randperm(len(tr), generator=g)].split(DRIFT_BATCH):
            loss = F.mse_loss(f(old[idx]), new[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            val = float(F.mse_loss(f(old[va]), new[va]))
        if val < best:
            best, state = val, {k: t.detach().clone() for k, t in f.state_dict().items()}
    if state is None:
        return None, {"drift_val_mse": math.nan, "identity_val_mse": float(F.mse_loss(old[va], new[va]))}
    f.load_state_dict(state)
    return f.requires_grad_(False), {
        "drift_val_mse": best,
        "identity_val_mse": float(F.mse_loss(old[va], new[va])),
    }


def relations(old_means: torch.Tensor, new_means: torch.Tensor) -> torch.Tensor:
    """(K,) for each earlier class's mean, the new class whose mean is closest in cosine (its row)."""
    return (F.normalize(old_means, dim=1) @ F.normalize(new_means, dim=1).T).argmax(1)


# ---------------------------------------------------------------------------------------------- the learner
@LEARNERS.register("moal", help="MoAL: one momentum-averaged adapter, an analytic head and rumination")
class MoAL(ContinualClassifier):
    """MoAL (module doc). Fitted attributes besides :class:`ContinualClassifier`'s: ``adapter_`` (the one
    adapter), ``expansion_`` (H, d), ``R_`` (H, H) and ``W_`` (H, C_seen) in float64, ``means_`` (C_seen,
    d), the later tasks' cosine classifier ``rows_`` (C_seen, d) and ``sigma_``; ``heads_`` hold the columns
    of ``W`` task by task (float32, zero biases)."""

    name = "moal"
    Options = MoALOptions

    def _setup(self) -> None:
        self.sites_ = sites_of(self.backbone_)
        self.adapter_: AdapterSet | None = None
        self.expansion_: torch.Tensor | None = None
        self.R_: torch.Tensor | None = None
        self.W_: torch.Tensor | None = None
        self.means_ = torch.zeros(0, self.embed_dim, device=self.device_)
        self.rows_ = torch.zeros(0, self.embed_dim, device=self.device_)
        self.sigma_ = torch.ones(1, device=self.device_)

    @property
    def head_in(self) -> int:
        """The heads' input: the H random features."""
        return int(self.options_.hidden)

    def embed(self, z: torch.Tensor, adapter: AdapterLike, train: bool = False) -> torch.Tensor:
        """(B, d) embeddings of prefix outputs under ``adapter`` (``train``: the bottleneck's dropout on)."""
        b = self.options_
        return adapted_suffix(
            self.backbone_, z, adapter, self.sites_, scale=b.adapter_scale, dropout=b.adapter_dropout,
            training=train,
        )  # fmt: skip

    def expand(self, h: torch.Tensor, expansion: torch.Tensor | None = None) -> torch.Tensor:
        """``relu(E h)``: (B, H) float32."""
        E = self.expansion_ if expansion is None else expansion
        assert E is not None
        return F.relu(h.float() @ E.T)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        assert self.adapter_ is not None
        return self.expand(self.embed(z, self.adapter_))

    @torch.no_grad()
    def _embed_all(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *adapters: AdapterLike
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One pass: per adapter the (N, d) embeddings of the batches (eval mode), and the (N,) labels."""
        outs: list[list[torch.Tensor]] = [[] for _ in adapters]
        ys = []
        for zb, yb in batches:
            with self.embedder_.autocast():
                for out, a in zip(outs, adapters):
                    out.append(self.embed(zb.to(self.device_), a).float())
            ys.append(yb.to(self.device_))
        return [torch.cat(o) for o in outs], torch.cat(ys)

    def _passes(self, task: Task, k: int, z: Any, y: Any, loader: Any) -> Iterator[Any]:
        """The training loader's passes after the training epochs: each item one more epoch's batches (the
        cached prefix outputs in the next order the task's generator draws, or augmented images)."""
        g = torch.Generator().manual_seed(task_seed(self.config.seed, k))
        if z is not None:
            for _ in range(self.config.train.epochs):
                torch.randperm(len(z), generator=g)
        while True:
            yield self.batches(z, y, loader, g)

    # ------------------------------------------------------------------ one task
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        b, d = self.options_, self.embed_dim
        classes = [int(c) for c in task.classes]
        cols = {c: i for i, c in enumerate([*self.labels_, *classes])}
        state: dict[str, Any] = {}

        def groups() -> list[dict[str, Any]]:  # the adapter drawn first, then the first task's rows
            if self.adapter_ is None:
                adapter = init_set(self.sites_, b.adapter_rank, self.device_)
                rows, sigma = self._new_rows(len(classes)), torch.ones(1)
            else:
                adapter = [{n: nn.Parameter(t.clone()) for n, t in a.items()} for a in self.adapter_]
                rows = torch.cat([self.rows_.cpu(), torch.zeros(len(classes), d)])
                sigma = self.sigma_.cpu().clone()
            state["rows"], state["sigma"] = (
                nn.Parameter(rows.to(self.device_)),
                nn.Parameter(sigma.to(self.device_)),
            )
            state["adapter"], state["ema"] = adapter, clone_set(adapter)
            return [{"params": [p for a in adapter for p in a.values()] + [state["rows"], state["sigma"]]}]

        def step_loss(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.embed(z, state["adapter"], train=True)
            logits = cosine_logits(h.float(), state["rows"], state["sigma"])
            target = torch.as_tensor([cols[int(c)] for c in y.tolist()], device=z.device)
            return F.cross_entropy(logits, target), logits.new_zeros(())

        def after_epoch(epoch: int) -> None:  # the moving average of tasks 2..
            if k:
                a = b.adapter_ema
                with torch.no_grad():
                    for ema, p in zip(state["ema"], state["adapter"]):
                        for key in KEYS:
                            ema[key] = a * ema[key] + (1 - a) * p[key].detach()

        losses, (z, y, loader) = fit_epochs(self, task, k, groups, step_loss, after_epoch=after_epoch)
        adapter = state["ema"] if k else clone_set(state["adapter"])
        stats = task_stats(losses, [p for a in state["adapter"] for p in a.values()] + [state["rows"]])
        passes = self._passes(task, k, z, y, loader)
        g = torch.Generator().manual_seed(task_seed(self.config.seed, k, 800))
        if z is None or y is None:  # trained on augmented images: the class means on un-augmented ones
            z, y = self.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
        (h,), hy = self._embed_all(zip(z.split(256), y.split(256)), adapter)
        new_means = torch.stack([h[hy == c].mean(0) for c in classes])
        if k == 0:
            expansion, rows = self._draw_head(len(classes), g)
            sigma, means = torch.ones(1, device=self.device_), new_means
            R, W, extra = self._first_head(next(passes), adapter, expansion, classes, cols)
        else:
            assert self.expansion_ is not None
            expansion, rows, sigma = self.expansion_, state["rows"].detach(), state["sigma"].detach()
            means, R, W, extra = self._later_head(
                next(passes), next(passes), adapter, (h, hy), new_means, classes, cols, g
            )
        stats.update(extra)
        sizes = [len(cs) for cs in [*self.task_classes_, classes]]
        heads = nn.ModuleList(
            linear(part.T.float(), torch.zeros(part.shape[1], device=self.device_), self.device_)
            for part in W.split(sizes, dim=1)
        )
        # every change at once: nothing to undo before this line
        self.adapter_, self.expansion_, self.R_, self.W_ = adapter, expansion, R, W
        self.means_, self.rows_, self.sigma_ = means, rows, sigma.clone()
        self.heads_ = heads
        self.task_classes_.append(classes)
        self.labels_ += classes
        return stats

    def _new_rows(self, n: int, g: torch.Generator | None = None) -> torch.Tensor:
        """n cosine-classifier rows ``U(-1/sqrt(d), 1/sqrt(d))`` (``CosineLinear``'s), from ``g`` or torch's
        global stream (CPU)."""
        return (torch.rand(n, self.embed_dim, generator=g) * 2 - 1) / math.sqrt(self.embed_dim)

    def _draw_head(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """After task 1, from ``g``: the expansion ``E`` (H, d), ``U(-1/sqrt(d), 1/sqrt(d))`` (an
        ``nn.Linear`` without bias), and the later tasks' cosine classifier's rows of task 1's n classes."""
        d = self.embed_dim
        E = (torch.rand(self.options_.hidden, d, generator=g) * 2 - 1) / math.sqrt(d)
        return E.to(self.device_), self._new_rows(n, g).to(self.device_)

    def _first_head(
        self, batches: Iterator[Any], adapter: AdapterSet, expansion: torch.Tensor, classes: list[int],
        cols: dict[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:  # fmt: skip
        """Task 1's ``R`` and ``W`` over one pass (module doc), the ridge chosen unless given."""
        (h,), y = self._embed_all(batches, adapter)
        A = self.expand(h, expansion).double()
        Y = F.one_hot(torch.as_tensor([cols[int(c)] for c in y.tolist()]), len(cols)).to(A)
        ridge = self.options_.ridge if self.options_.ridge is not None else select_ridge(A, Y)
        G = A.T @ A
        G.diagonal().add_(ridge)
        R = torch.linalg.inv(G).contiguous()  # (its own layout would round a restored R's products otherwise)
        return R, FIRST_SCALE * (R @ (A.T @ Y)), {"ridge": ridge}

    def _later_head(
        self, drift_pass: Iterator[Any], head_pass: Iterator[Any], adapter: AdapterSet,
        plain: tuple[torch.Tensor, torch.Tensor], new_means: torch.Tensor, classes: list[int],
        cols: dict[int, int], g: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:  # fmt: skip
        """Task t's means, ``R`` and ``W`` (t >= 2): the earlier means carried by the drift map, the
        recursive update over one pass, then rumination (module doc)."""
        b, extra = self.options_, dict[str, Any]()
        assert self.adapter_ is not None and self.R_ is not None and self.W_ is not None
        old_means = self.means_.to(self.device_)
        if b.drift_epochs:
            (old, new), _ = self._embed_all(drift_pass, self.adapter_, adapter)
            f, extra = drift_map(old, new, b.drift_epochs, g)
            if f is not None:
                with torch.no_grad():
                    old_means = f(old_means)
        C = len(cols)
        R, W = self.R_, torch.cat([self.W_, self.W_.new_zeros(self.W_.shape[0], len(classes))], 1)
        for zb, yb in head_pass:
            with torch.no_grad(), self.embedder_.autocast():
                A = self.expand(self.embed(zb.to(self.device_), adapter)).double()
            Y = F.one_hot(torch.as_tensor([cols[int(c)] for c in yb.tolist()]), C).to(A)
            R, W = rls_update(R, W, A, Y)
        if b.rumination:
            R, W, extra["ruminated"] = self._ruminate(R, W, plain, old_means, new_means, classes, cols, g)
        return torch.cat([old_means, new_means]), R, W, extra

    def _ruminate(
        self, R: torch.Tensor, W: torch.Tensor, plain: tuple[torch.Tensor, torch.Tensor],
        old_means: torch.Tensor, new_means: torch.Tensor, classes: list[int], cols: dict[int, int],
        g: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
        """The recursive update on the misclassified rows of the new classes' embeddings and the earlier
        classes' pseudo-features, shuffled, batch by batch (module doc). Returns R, W and the rows used."""
        h, y = plain
        xs = [h[y == c].double() for c in classes]
        labels = [torch.full((len(x),), cols[c]) for x, c in zip(xs, classes)]
        for j, r in enumerate(relations(old_means, new_means).tolist()):
            xs.append(xs[r] - new_means[r].double() + old_means[j].double())
            labels.append(torch.full((len(xs[r]),), j))
        x, lab = torch.cat(xs).float(), torch.cat(labels).to(self.device_)
        used, W0 = 0, W  # misclassified by the head as the update over the task left it (the release's test)
        for idx in torch.randperm(len(x), generator=g).split(self.config.train.batch_size):
            A = self.expand(x[idx.to(x.device)]).double()
            yb = lab[idx.to(lab.device)]
            wrong = (A @ W0).argmax(1) != yb
            R, W = rls_update(R, W, A[wrong], F.one_hot(yb[wrong], W.shape[1]).to(A))
            used += int(wrong.sum())
        return R, W, used

    # ------------------------------------------------------------------ knowledge base
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The heads, the adapter (``adapter.open.<block>.<key>``), ``moal.expansion``, ``moal.R``,
        ``moal.W``, ``moal.means``, ``moal.rows`` and ``moal.sigma``."""
        assert self.adapter_ is not None
        own = {"expansion": self.expansion_, "R": self.R_, "W": self.W_, "means": self.means_}
        own.update(rows=self.rows_, sigma=self.sigma_)
        out = {**super().state_tensors(), **set_tensors("adapter.open", self.adapter_)}
        return {
            **out,
            **{f"moal.{n}": t.detach().cpu().contiguous() for n, t in own.items() if t is not None},
        }

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if not self.num_tasks:
            return
        H, d, C = self.options_.hidden, self.embed_dim, len(self.labels_)
        want = {"expansion": (H, d), "R": (H, H), "W": (H, C), "means": (C, d), "rows": (C, d), "sigma": (1,)}
        got = {}
        for n, shape in want.items():
            t = need(tensors, f"moal.{n}")
            if tuple(t.shape) != shape:
                raise TaskError(f"tensor 'moal.{n}': shape {tuple(t.shape)}, expected {shape}")
            got[n] = t.to(self.device_, torch.float64 if n in ("R", "W") else torch.float32, copy=True)
        self.adapter_ = load_set(
            tensors, "adapter.open", self.sites_, self.options_.adapter_rank, self.device_
        )
        self.expansion_, self.R_, self.W_ = got["expansion"], got["R"], got["W"]
        self.means_, self.rows_, self.sigma_ = got["means"], got["rows"], got["sigma"]


TENSOR_RULES.declare(
    KB_LAYOUT, "MoAL",
    ShapeRule(r"moal\.expansion", ("kb.linear_d", "obj.moal_d"), "MoAL's random expansion: H x the embedding",
              on="head"),
    ShapeRule(r"moal\.R", ("kb.linear_d", "kb.linear_d"), "MoAL's inverse regularised Gram: H x H",
              on="head"),
    ShapeRule(r"moal\.W", ("kb.linear_d", "obj.moal_classes"), "MoAL's analytic head: H x the classes",
              on="head"),
    ShapeRule(r"moal\.(means|rows)", ("obj.moal_classes", "obj.moal_d"),
              "MoAL's class means and cosine rows: a row per class", on="head"),
    ShapeRule(r"moal\.sigma", ("*",), "MoAL's cosine classifier's scale (one number)", on="head"),
)  # fmt: skip

declare(
    "moal",
    "MoAL (Gao et al., CVPR 2025): one parallel adapter averaged with momentum over the epochs of later "
    "tasks, an analytic (recursive least-squares) head on a random ReLU expansion, and rumination on "
    "pseudo-features of the earlier classes",
    base=None,
    learner="moal",
    baseline__optimizer="sgd", baseline__lr=0.01, baseline__momentum=0.9,
    baseline__schedule="cosine-annealing", baseline__adapter_rank=64, train__weight_decay=5e-4,
)  # fmt: skip
