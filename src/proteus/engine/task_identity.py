"""Task-identity inference (TII): HiDe-Prompt's stage 1 (Wang et al., NeurIPS 2023), shared by the
``hide-prompt`` learner and the ``signature.keys=hide-tii`` retrieval keys of ``ranpac-hide`` (the paper's
Appendix table ``retrieve_significant``).

As the authors' released code runs it (thu-ml/HiDe-Prompt @ 0ed4333: ``trainers/tii_trainer.py`` with
``engines/hide_tii_engine.py``): an MLP on the frozen backbone's class token (``MlpMapping`` with hidden
``[2]``: ``LN(x + W2 GELU(W1 x))``, W1 d -> 2d) and one linear head block per task (:class:`TIIHead`),
trained on each task with Adam at ``tii_lr`` (constant) for ``tii_epochs``, the cross-entropy over the
task's own classes, the gradient norm clipped at ``clip_grad``; the class statistics of its classes stored
(per class, K-Means with ``n_centroids`` centroids, each centroid's mean and per-dimension variance:
:func:`class_statistics`); from the second task on, the MLP and heads re-aligned on pseudo-features of every
seen class (:func:`align_on_pseudo_features`). The task of an input is the task owning the class the TII
predicts (:meth:`TaskIdentityInference.predict_task`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from torch import nn

from proteus.config import RunConfig
from proteus.engine.errors import TaskError, need
from proteus.engine.runtime import task_seed
from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, option

__all__ = [
    "ClassStats",
    "TIIHead",
    "TIIOptions",
    "TaskIdentityInference",
    "align_on_pseudo_features",
    "alignment_generator",
    "cosine_sgd",
    "class_statistics",
    "load_class_stats",
    "pseudo_features",
]


@dataclasses.dataclass
class TIIOptions:
    """The task-identity inference's options (``baseline.*``, read by HiDe-Prompt and by ``ranpac-hide``'s
    keys): ``tii_epochs`` at ``tii_lr`` per task, the re-alignment on pseudo-features of ``n_centroids``
    K-Means centroids per class for ``ca_epochs`` at ``tii_ca_lr``, each step's gradient norm clipped at
    ``clip_grad``."""

    tii_epochs: int = option(20, help="stage 1's epochs per task", range=NON_NEGATIVE)
    tii_lr: float = option(4.6875e-5, help="stage 1's learning rate", range=POSITIVE)
    tii_ca_lr: float = option(4.6875e-4, help="stage 1's alignment learning rate", range=POSITIVE)
    ca_epochs: int = option(30, help="the alignments' epochs", range=NON_NEGATIVE)
    n_centroids: int = option(
        10, help="K-Means centroids per class of the stored statistics", range=AT_LEAST_1
    )
    clip_grad: float | None = option(
        None, help="clip the gradient norm of the trained tensors before each step (HiDe-Prompt: 1.0)",
        range=POSITIVE,
    )  # fmt: skip


ClassStats = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""class -> (k, d) centroid means and (k, d) per-dimension variances, float64 on the CPU."""


def class_statistics(h: torch.Tensor, y: torch.Tensor, n_centroids: int, seed: int) -> ClassStats:
    """Per class of ``y``: K-Means (``n_centroids``, at most the class's images) on its features ``h`` (N, d),
    each cluster's mean and population variance (the release's ``multi-centroid`` storage)."""
    out: ClassStats = {}
    for c in torch.unique(y).tolist():
        x = h[y == c].double().cpu().numpy()
        k = min(n_centroids, len(x))
        with warnings.catch_warnings():  # fewer distinct images than centroids
            warnings.simplefilter("ignore", ConvergenceWarning)
            labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x).labels_
        means = np.stack([x[labels == i].mean(0) for i in range(k)])
        var = np.stack([x[labels == i].var(0) for i in range(k)])
        out[int(c)] = (torch.as_tensor(means), torch.as_tensor(var))
    return out


def pseudo_features(
    stats: ClassStats, classes: list[int], n: int, generator: torch.Generator, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch's pseudo-features, shuffled: ``n`` draws per centroid of every class of ``classes`` from
    N(mean, diag(var) + 1e-4 I), skipping centroids of zero mean variance (a single image), as the release's
    ``train_task_adaptive_prediction`` samples them. A class whose every centroid has zero variance (no more
    images than centroids), which the release would leave out, is drawn from all of them. ``limit``: only
    the first ``limit`` of the shuffled draws, which are all the release's epoch uses (the same distribution:
    the draws are independent, so the shuffle picks the centroids first and only those are drawn). Returns
    (M, d) float32 features and (M,) labels."""
    mus, stds, labels = [], [], []
    for c in classes:
        means, var = stats[c]
        keep = var.mean(1) != 0
        if keep.any():
            means, var = means[keep], var[keep]
        mus.append(means.float())
        stds.append((var + 1e-4).sqrt().float())
        labels += [c] * len(means)
    mu, std, label = torch.cat(mus), torch.cat(stds), torch.as_tensor(labels, dtype=torch.long)
    which = torch.arange(len(mu)).repeat_interleave(n)[torch.randperm(len(mu) * n, generator=generator)]
    which = which[:limit]
    x = mu[which] + std[which] * torch.randn(len(which), mu.shape[1], generator=generator)
    return x, label[which]


def align_on_pseudo_features(
    forward: Any, params: list[nn.Parameter], stats: ClassStats, classes: list[int], *, n: int, steps: int,
    epochs: int, lr: float, generator: torch.Generator, device: torch.device,
) -> list[float]:  # fmt: skip
    """Classifier alignment (the release's ``train_task_adaptive_prediction``): for ``epochs`` epochs, draw
    :func:`pseudo_features` of every class in ``classes`` and take ``steps`` SGD steps (momentum 0.9, no
    weight decay: the release's parameter group sets its parsed ``weight_decay``, 0.0) on batches of ``n``
    of them, the cross-entropy of ``forward(x)``, logits over ``classes`` in order; lr follows
    ``CosineAnnealingLR(T_max=epochs)`` stepped per epoch. Returns the losses."""
    col = {c: i for i, c in enumerate(classes)}

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = pseudo_features(stats, classes, n, generator, limit=steps * n)
        for i in range(steps):
            xb, yb = x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]
            if not len(xb):
                break
            yield xb.to(device), torch.as_tensor([col[int(c)] for c in yb.tolist()], device=device)

    return cosine_sgd(params, batches, forward, lr=lr, weight_decay=0.0, epochs=epochs, period=epochs)


def cosine_sgd(
    params: list[nn.Parameter], batches: Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    forward: Callable[[torch.Tensor], torch.Tensor], *, lr: float, weight_decay: float, epochs: int,
    period: int,
) -> list[float]:  # fmt: skip
    """The classifier alignment's optimisation (HiDe-Prompt's, SLCA's, TUNA's and MOS's releases): SGD
    (momentum 0.9, ``weight_decay``) for ``epochs`` epochs, one step per batch ``(x, target)`` of
    ``batches(epoch)`` on the cross-entropy of ``forward(x)``, the learning rate following
    ``CosineAnnealingLR(T_max=period)`` stepped per epoch. Returns the losses."""
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    losses: list[float] = []
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = lr * (1 + math.cos(math.pi * epoch / period)) / 2
        for x, target in batches(epoch):
            loss = F.cross_entropy(forward(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    opt.zero_grad(set_to_none=True)
    return losses


class TIIHead(nn.Module):
    """Stage 1's model on the frozen class token: the release's ``MlpMapping`` (hidden ``[2]``: Linear
    d -> 2d, GELU, Linear 2d -> d, plus the input, then LayerNorm), then one linear head per task (the
    release's one head over all classes, column block by column block). Linear layers start as timm's:
    N(0, 0.02) truncated, bias 0."""

    def __init__(self, d: int, hidden: int = 2) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(d, hidden * d), nn.Linear(hidden * d, d), nn.LayerNorm(d)
        self.heads = nn.ModuleList()
        for lin in (self.fc1, self.fc2):
            _timm_init(lin)

    def add_head(self, n: int) -> None:
        head = nn.Linear(self.fc1.in_features, n).to(self.fc1.weight.device)
        self.heads.append(_timm_init(head))

    def embed(self, q: torch.Tensor) -> torch.Tensor:
        return self.norm(q + self.fc2(F.gelu(self.fc1(q))))

    def forward(self, q: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """(B, C) logits of the class tokens ``q`` over the columns of ``self.heads[heads]``."""
        e = self.embed(q)
        return torch.cat([h(e) for h in self.heads[heads]], 1)


def _timm_init(lin: nn.Linear) -> nn.Linear:
    nn.init.trunc_normal_(lin.weight, std=0.02)
    nn.init.zeros_(lin.bias)
    return lin


def load_class_stats(
    tensors: dict[str, torch.Tensor], prefix: str, task_classes: list[list[int]]
) -> ClassStats:
    """The class statistics stored as ``<prefix>.<class>.{mean,var}``, in the order they were learned (task
    after task, each task's classes in increasing order: :func:`class_statistics`)."""
    out: ClassStats = {}
    for c in (c for cs in task_classes for c in sorted(cs)):
        if f"{prefix}.{c}.mean" in tensors:
            mu, var = need(tensors, f"{prefix}.{c}.mean"), need(tensors, f"{prefix}.{c}.var")
            if mu.ndim != 2 or mu.shape != var.shape:
                raise TaskError(f"{prefix}.{c}: means {tuple(mu.shape)} and variances {tuple(var.shape)}")
            out[c] = (mu.double(), var.double())
    return out


def alignment_generator(seed: int, k: int, stage: int) -> torch.Generator:
    """The pseudo-features' generator of stage ``stage``'s (1 or 2) alignment after task k."""
    return torch.Generator().manual_seed(task_seed(seed, k, 700 + stage))


class TaskIdentityInference:
    """Stage 1, task-identity inference: the :class:`TIIHead` on the frozen class token (:attr:`net`), its
    training per task (:meth:`fit`), the multi-centroid statistics of every seen class's class tokens
    (:attr:`stats`, :meth:`store`), the re-alignment on their pseudo-features (:meth:`align`) and the
    task of a query (:meth:`predict_task`).

    Args:
        config: the run's configuration (``train.batch_size``, ``seed``).
        options: its options (:class:`TIIOptions`; HiDe-Prompt's carry them).
        d: the class token's width.
        device: where the model lives.
    """

    #: pseudo-features drawn per centroid (and the batch) of the alignment, in ``train.batch_size``s (the
    #: release's per-process count)
    ca_draws: int = 1

    def __init__(self, config: RunConfig, options: TIIOptions, d: int, device: torch.device) -> None:
        self.config, self.options, self.device = config, options, device
        with torch.random.fork_rng(devices=[]):  # the run's seed, not the global stream's state
            torch.manual_seed(config.seed)
            self.net = TIIHead(d).to(device)
        #: class -> its centroids of the prompt-free class tokens
        self.stats: ClassStats = {}

    @property
    def num_tasks(self) -> int:
        return len(self.net.heads)

    def fit(
        self,
        k: int,
        classes: list[int],
        batches: Callable[[torch.Generator], Iterable[tuple[torch.Tensor, Any]]],
    ) -> None:
        """Task k: Adam on the MLP and the heads at ``tii_lr`` (constant), the cross-entropy over task k's
        classes (the release masks the others' logits: their columns get no gradient), clipped.
        ``batches(g)``: one epoch of (class tokens, global labels), shuffled by ``g``."""
        b = self.options
        self.net.add_head(len(classes))
        local = {c: i for i, c in enumerate(classes)}
        params = list(self.net.parameters())
        opt = torch.optim.Adam(params, lr=b.tii_lr, betas=(0.9, 0.999), weight_decay=0.0)
        g = torch.Generator().manual_seed(task_seed(self.config.seed, k, 500))
        self.net.train()
        for _ in range(b.tii_epochs):
            for q, yb in batches(g):
                target = torch.as_tensor([local[int(c)] for c in yb.tolist()], device=self.device)
                loss = F.cross_entropy(self.net(q.to(self.device).float(), slice(k, k + 1)), target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if b.clip_grad is not None:
                    torch.nn.utils.clip_grad_norm_(params, b.clip_grad)
                opt.step()
        opt.zero_grad(set_to_none=True)

    def store(self, k: int, q: torch.Tensor, y: torch.Tensor) -> None:
        """Task k's classes' statistics of their class tokens ``q`` (N, d) with labels ``y``."""
        b = self.options
        self.stats.update(class_statistics(q, y, b.n_centroids, task_seed(self.config.seed, k)))

    def align(self, k: int, seen: list[int], steps: int) -> list[float]:
        """The alignment after task k (k >= 1): MLP and heads on pseudo-features of every ``seen`` class,
        ``steps`` per epoch (the release's ``crct_num``, the classes of the tasks before k)."""
        b = self.options
        return align_on_pseudo_features(
            self.net, list(self.net.parameters()), self.stats, seen,
            n=self.config.train.batch_size * self.ca_draws, steps=steps, epochs=b.ca_epochs,
            lr=b.tii_ca_lr, generator=alignment_generator(self.config.seed, k, 1), device=self.device,
        )  # fmt: skip

    def predict_task(self, q: torch.Tensor) -> torch.Tensor:
        """(B,) the task of each class token: the task owning the predicted class among the seen ones."""
        sizes = [h.out_features for h in self.net.heads]
        owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.as_tensor(sizes)).to(q.device)
        with torch.autocast(q.device.type, enabled=False):
            return owner[self.net(q.float()).argmax(1)]

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.net.state_dict().items()}

    def restore(self, k: int, snapshot: dict[str, torch.Tensor] | None, seen: set[int]) -> None:
        """Back to before task k: its head dropped, the model as ``snapshot`` (if taken), only the ``seen``
        classes' statistics."""
        if snapshot is not None:
            del self.net.heads[k:]
            self.net.load_state_dict(snapshot)
        for c in [c for c in self.stats if c not in seen]:
            del self.stats[c]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``tii.<name>`` (the model) and ``tii_stats.<class>.{mean,var}``."""
        out = {f"tii.{n}": t.detach().cpu().contiguous() for n, t in self.net.state_dict().items()}
        for c, (mu, var) in self.stats.items():
            out[f"tii_stats.{c}.mean"], out[f"tii_stats.{c}.var"] = mu.contiguous(), var.contiguous()
        return out

    def load_state(self, task_classes: list[list[int]], tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`state_tensors` back, for the tasks of ``task_classes``: one head per task, the model, the
        statistics of their classes."""
        for cs in task_classes:
            self.net.add_head(len(cs))
        own = {n[len("tii.") :]: t for n, t in tensors.items() if n.startswith("tii.")}
        self.net.load_state_dict(own)
        self.stats = load_class_stats(tensors, "tii_stats", task_classes)
