"""TOSCA: a small adapter and calibrator on the backbone's last embedding, one per task, chosen by entropy
(TMLR 2026), class-incrementally.

The method as the authors' released code runs it (``models/tosca.py``, ``backbone/vit_tosca.py``,
``backbone/linears.py``, ``exps/tosca_*.json`` in the first commit of ladka6/continious_learning). The
backbone is frozen whole; its last embedding ``x`` (the pooled, normalised [CLS] of a ViT) meets one module
per task, trained on that task alone and then frozen. With ``baseline.flow = tosca`` (the release's) the
module is

    ``m = LayerNorm(x + MLP(x))``,  ``out = m * SE(m)``,

``MLP`` a bottleneck ``d -> d / mlp_ratio -> d`` with GELU, ``SE`` a squeeze-excitation gate
``sigmoid(W_2 relu(W_1 m))`` of width ``d / se_ratio`` without biases. The other flows are the paper's
ablations (:data:`FLOWS`): the calibrator alone, the adapter alone, or both side by side.

Per task t:

* **train**: a new module (task 1's with torch's default initialisation, later ones Xavier-uniform weights
  and zero biases, as the release re-initialises its one module after every task) and one cosine
  classifier over every class seen so far, ``sigma cos(out, w_c)`` (the release's ``CosineLinear``: the
  first task's rows drawn ``U(-1/sqrt(d), 1/sqrt(d))`` and ``sigma = 1``; a later task's new rows start at
  zero, the earlier rows and ``sigma`` where the last task left them). SGD (``baseline.optimizer``) trains
  the module, *every* row and ``sigma`` on the cross-entropy over every seen class plus
  ``baseline.l1`` times the L1 norm of the module's parameters; ``CosineAnnealingLR`` over the epochs
  (the release's ``eta_min`` is 1e-8, here 0);
* **after training**: each of task t's rows is set to its class's mean ``out`` over the task's
  un-augmented training images (the release's ``replace_fc``); the earlier rows keep what training made of
  them;
* **test**: every task's module embeds the input; the task whose logits over every seen class have the
  least entropy (``-sum p log(p + 1e-9)``) gives the prediction and is the retrieved task.

One deliberate difference (``docs/experiments.md``, "TOSCA"): the release chooses one task per test batch,
by the batch's mean entropy, so an image's prediction depends on the images it is evaluated with. Here each
input chooses its own task (``baseline.selection = input``); ``batch`` is the release's rule over each
batch of ``eval.batch_size`` images.

The embedding is the whole frozen backbone's, so it is this learner's "prefix" (what the shared loop caches
once per image): training and every task's module then cost a few matrix products per image.

This module is the whole method -- its learner and its declaration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.adaptformer import fit_epochs
from proteus.baselines.learner import KB_LAYOUT, ContinualClassifier, TrainingOptions, entropy, task_stats
from proteus.baselines.persist import linear, need
from proteus.config import declare
from proteus.engine.errors import TaskError
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS
from proteus.options import AT_LEAST_1, NON_NEGATIVE, option
from proteus.registry import Registry
from proteus.streams import Task
from proteus.tensor_rules import TENSOR_RULES, ShapeRule

__all__ = ["FLOWS", "TOSCA", "ToscaModule", "cosine_logits"]

#: the release's entropy guard (``log(p + 1e-9)``)
EPS = 1e-9

#: ``baseline.flow``: how a task's module maps the embedding (the paper's ablations; ``tosca`` is the method)
FLOWS: Registry[Callable[[ToscaModule, torch.Tensor], torch.Tensor]] = Registry("baseline.flow")


@FLOWS.register("tosca", help="m = LayerNorm(x + MLP(x)), then m * SE(m): the adapter, then the calibrator")
def _tosca(mod: ToscaModule, x: torch.Tensor) -> torch.Tensor:
    m = mod.norm(x + mod.mlp(x))
    return m * mod.se(m)


@FLOWS.register("tosca_r", help="x * SE(x) + LayerNorm(MLP(x)): the calibrator and the adapter side by side")
def _tosca_r(mod: ToscaModule, x: torch.Tensor) -> torch.Tensor:
    return x * mod.se(x) + mod.norm(mod.mlp(x))


@FLOWS.register("adapter", help="LayerNorm(MLP(x)): the adapter alone")
def _adapter(mod: ToscaModule, x: torch.Tensor) -> torch.Tensor:
    return mod.norm(mod.mlp(x))


@FLOWS.register("calibrator", help="x * SE(x): the calibrator alone")
def _calibrator(mod: ToscaModule, x: torch.Tensor) -> torch.Tensor:
    return x * mod.se(x)


class ToscaModule(nn.Module):
    """One task's module on the embedding (module doc): ``norm``, the bottleneck ``mlp`` and the gate ``se``,
    composed by ``flow`` (:data:`FLOWS`). Built with torch's default initialisation."""

    def __init__(self, dim: int, mlp_ratio: int, se_ratio: int, flow: str) -> None:
        super().__init__()
        self.flow = FLOWS.get(flow)
        hidden, gate = max(dim // mlp_ratio, 1), max(dim // se_ratio, 1)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.se = nn.Sequential(
            nn.Linear(dim, gate, bias=False), nn.ReLU(), nn.Linear(gate, dim, bias=False), nn.Sigmoid()
        )

    def xavier_(self) -> ToscaModule:
        """Xavier-uniform weights, zero biases, LayerNorm at (1, 0): the release's ``reset_tosca``."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flow(self, x)


def cosine_logits(out: torch.Tensor, rows: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``sigma cos(out, w_c)`` for every row ``w_c`` (the release's ``CosineLinear``): (N, C)."""
    return sigma * (F.normalize(out, dim=-1) @ F.normalize(rows, dim=1).T)


@dataclasses.dataclass
class TOSCAOptions(TrainingOptions):
    flow: str = option("tosca", help="the module on the embedding (the paper's ablations)", choices=FLOWS)
    mlp_ratio: int = option(16, help="the adapter's bottleneck is d / mlp_ratio wide", range=AT_LEAST_1)
    se_ratio: int = option(16, help="the calibrator's gate is d / se_ratio wide", range=AT_LEAST_1)
    l1: float = option(5e-4, help="the L1 penalty on the module's parameters", range=NON_NEGATIVE)
    selection: str = option(
        "input",
        help="the task by least entropy per input, or per batch of eval.batch_size (the release's)",
        choices=("input", "batch"),
    )  # fmt: skip


@LEARNERS.register(
    "tosca", help="TOSCA: an adapter and a calibrator on the last embedding per task, by entropy"
)
class TOSCA(ContinualClassifier):
    """TOSCA (module doc). Fitted attributes besides :class:`ContinualClassifier`'s: ``modules_`` (one
    frozen :class:`ToscaModule` per task) and ``sigma_``, the cosine classifier's scale; ``heads_`` hold its
    rows, task by task (their biases are zero and unused)."""

    name = "tosca"
    Options = TOSCAOptions

    def _setup(self) -> None:
        self.modules_ = nn.ModuleList()
        self.sigma_ = torch.ones(1, device=self.device_)

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The whole frozen backbone's embedding (what every task's module reads)."""
        with torch.no_grad():
            return self.backbone_.forward_suffix(self.backbone_.forward_prefix(x))

    def _rows(self) -> torch.Tensor:
        """(C_seen, d) every seen class's row, task after task."""
        if not len(self.heads_):
            return torch.zeros(0, self.embed_dim, device=self.device_)
        return torch.cat([cast(nn.Linear, h).weight for h in self.heads_])

    def _new_module(self, k: int) -> ToscaModule:
        """Task k's module before training: torch's default initialisation for the first task, Xavier after
        (drawn from torch's global stream, which the task's seed set)."""
        b = self.options_
        module = ToscaModule(self.embed_dim, b.mlp_ratio, b.se_ratio, b.flow)
        return (module if k == 0 else module.xavier_()).to(self.device_)

    def _new_rows(self, k: int, n: int) -> torch.Tensor:
        """Task k's n classifier rows before training: ``U(-1/sqrt(d), 1/sqrt(d))`` for the first task (a new
        ``CosineLinear``), zero after (the release widens its classifier with zero rows)."""
        if k:
            return torch.zeros(n, self.embed_dim, device=self.device_)
        bound = 1.0 / math.sqrt(self.embed_dim)
        return torch.empty(n, self.embed_dim, device=self.device_).uniform_(-bound, bound)

    # ------------------------------------------------------------------ one task
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        b = self.options_
        classes = [int(c) for c in task.classes]
        known = len(self.labels_)
        column = {c: i for i, c in enumerate([*self.labels_, *classes])}
        state: dict[str, Any] = {}

        def groups() -> list[dict[str, Any]]:  # the module drawn first, then the first task's rows
            state["module"] = module = self._new_module(k)
            new = self._new_rows(k, len(classes))
            state["rows"] = rows = nn.Parameter(torch.cat([self._rows().detach(), new]))
            state["sigma"] = sigma = nn.Parameter(self.sigma_.detach().clone())
            return [{"params": [*module.parameters(), rows, sigma]}]

        def step_loss(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            module = state["module"]
            logits = cosine_logits(module(z.float()), state["rows"], state["sigma"])
            target = torch.as_tensor([column[int(c)] for c in y.tolist()], device=z.device)
            aux = b.l1 * sum(p.abs().sum() for p in module.parameters()) if b.l1 else logits.new_zeros(())
            return F.cross_entropy(logits, target), aux

        losses, (z, y, _) = fit_epochs(self, task, k, groups, step_loss)
        module, rows, sigma = state["module"].requires_grad_(False), state["rows"].detach(), state["sigma"]
        if z is None or y is None:  # trained on augmented images: the prototypes on un-augmented ones
            z, y = self.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
        with torch.no_grad(), self.embedder_.autocast():
            out = torch.cat([module(c.to(self.device_).float()).float() for c in z.split(256)])
        y = y.to(self.device_)
        for i, c in enumerate(classes):
            rows[known + i] = out[y == c].mean(0)
        stats = task_stats(losses, [*module.parameters(), rows, sigma])
        # every change at once: the earlier tasks' rows moved with this task's training
        sizes = [len(cs) for cs in [*self.task_classes_, classes]]
        heads = nn.ModuleList(
            linear(part, torch.zeros(len(part), device=self.device_), self.device_)
            for part in rows.split(sizes)
        )
        self.modules_.append(module)
        self.heads_, self.sigma_ = heads, sigma.detach().clone()
        self.task_classes_.append(classes)
        self.labels_ += classes
        return stats

    def abort_task(self, k: int) -> None:
        del self.modules_[k:]

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def infer(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C_seen) the logits under the least-entropy task's module and (N,) that task."""
        if not self.num_tasks or len(self.modules_) != self.num_tasks:
            raise NotFittedError(f"{self.name}: not fitted; call fit_task first")
        rows, outs, picks = self._rows(), [], []
        for chunk in z.split(self.config.eval.batch_size):
            chunk = chunk.to(self.device_).float()
            with self.embedder_.autocast():
                logits = torch.stack([cosine_logits(m(chunk), rows, self.sigma_) for m in self.modules_])
            logits = logits.float()  # (m, B, C)
            ent = entropy(logits, EPS)  # (m, B)
            if self.options_.selection == "batch":
                task = ent.mean(1).argmin().expand(chunk.shape[0])
            else:
                task = ent.argmin(0)
            outs.append(logits[task, torch.arange(chunk.shape[0], device=logits.device)].cpu())
            picks.append(task.cpu())
        return torch.cat(outs), torch.cat(picks)

    def logits_prefix(self, z: torch.Tensor) -> torch.Tensor:
        return self.infer(z)[0]

    # ------------------------------------------------------------------ knowledge base
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every task's rows (``head.<t>.*``), each task's module ``tosca.<t>.<name>`` and ``tosca.sigma``."""
        own = {
            f"tosca.{t}.{n}": p.detach().cpu().contiguous()
            for t, m in enumerate(self.modules_)
            for n, p in m.state_dict().items()
        }
        return {**super().state_tensors(), **own, "tosca.sigma": self.sigma_.detach().cpu().contiguous()}

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        sigma = need(tensors, "tosca.sigma")
        if sigma.shape != (1,):
            raise TaskError(f"tensor 'tosca.sigma': shape {tuple(sigma.shape)}, expected (1,)")
        modules = nn.ModuleList()
        for t in range(self.num_tasks):
            module = self._new_module(0)
            names = list(module.state_dict())
            try:
                module.load_state_dict({n: need(tensors, f"tosca.{t}.{n}").float() for n in names})
            except RuntimeError as e:  # a shape that does not fit the module these options build
                why = str(e).splitlines()[-1].strip()
                raise TaskError(f"task {t + 1}'s module (tosca.{t}.*): {why}") from None
            modules.append(module.requires_grad_(False))
        self.modules_, self.sigma_ = modules, sigma.float().to(self.device_)


_M = r"tosca\.(?P<t>\d+)\."
TENSOR_RULES.declare(
    KB_LAYOUT, "TOSCA",
    ShapeRule(_M + r"norm\.(weight|bias)", ("kb.linear_d",), "a task module's LayerNorm: one per feature",
              on="head"),
    ShapeRule(_M + r"mlp\.0\.weight", ("obj.tosca_hidden", "kb.linear_d"), "the adapter's down projection",
              on="head"),
    ShapeRule(_M + r"mlp\.0\.bias", ("obj.tosca_hidden",), "the adapter's down bias", on="head"),
    ShapeRule(_M + r"mlp\.2\.weight", ("kb.linear_d", "obj.tosca_hidden"), "the adapter's up projection",
              on="head"),
    ShapeRule(_M + r"mlp\.2\.bias", ("kb.linear_d",), "the adapter's up bias", on="head"),
    ShapeRule(_M + r"se\.0\.weight", ("obj.tosca_gate", "kb.linear_d"), "the calibrator's squeeze",
              on="head"),
    ShapeRule(_M + r"se\.2\.weight", ("kb.linear_d", "obj.tosca_gate"), "the calibrator's excitation",
              on="head"),
    ShapeRule(r"tosca\.sigma", ("*",), "the cosine classifier's scale (one number)", on="head"),
)  # fmt: skip

declare(
    "tosca",
    "TOSCA (TMLR 2026): an adapter and a calibrator on the frozen backbone's last embedding, one per task, "
    "the task by least entropy; a cosine classifier whose rows are the class prototypes",
    base=None,
    learner="tosca",
    baseline__optimizer="sgd", baseline__lr=0.025, baseline__momentum=0.9,
    baseline__schedule="cosine-annealing", train__weight_decay=0.0,
)  # fmt: skip
