"""The LoRA baselines of Table 1 on PROTEUS's adapter machinery (:mod:`proteus.adapters`): InfLoRA and
SD-LoRA, on every backbone the project supports (timm ViTs: rows of the fused qkv; MobileNetV2: the 1x1
convolutions of the adapted blocks).

Both store task k's branch as columns of each :class:`~proteus.adapters.lora.LoRAUnit` and task k's model
as row k of its composition matrix C (Eq. 9's storage), so the model after task k is the composition of
row k, the "last" adapter.

**InfLoRA** (Liang & Li, CVPR 2024). Task t's branch is ``B_t A_t`` with A_t designed before training and
frozen, B_t trained from zero, and every older branch summed with weight 1. A_t is designed from the
layer's inputs on task t: C = mean x x^T over every token (pixel) of the task, projected off the DualGPM
memory of earlier tasks' inputs, ``A_t = U[:, :r]^T / sqrt(3)`` from the SVD of the projected C. After
training, the memory grows to hold the task's input space up to the energy threshold
``eps_t = gpm_start + (1 - gpm_start) t / T`` (:class:`DualGPM`). Because A_t's rows lie off the old
inputs, the new branch leaves old tasks' outputs (nearly) unchanged.

**SD-LoRA** (Wu et al., ICLR 2025). Old branches are frozen directions ``B_k A_k / (||B_k|| ||A_k||)``
with learned scalar magnitudes alpha_k, and the new branch ``alpha_t B_t A_t`` is trained whole. As in the
released code, the magnitudes are one scalar per task shared by every layer, all re-initialised to
``magnitude_init`` (0.8) when a task opens, and frozen with the task.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from proteus.adapters import AdaptedBackbone
from proteus.adapters.lora import LoRAUnit, LoRAWrapper
from proteus.baselines.learner import BaselineOptions, ContinualClassifier
from proteus.baselines.persist import need
from proteus.config import ConfigError, declare
from proteus.engine.errors import TaskError
from proteus.engine.runtime import task_seed
from proteus.learners import LEARNERS, LearnerState
from proteus.options import AT_LEAST_1, UNIT, option

__all__ = ["DualGPM", "InfLoRA", "LoRAClassifier", "SDLoRA", "ranks_of"]


@dataclasses.dataclass
class LoRAOptions(BaselineOptions):
    rank: int = option(
        10, help="the LoRA rank of each task's branch (InfLoRA's and SD-LoRA's code: 10)", range=AT_LEAST_1
    )


@dataclasses.dataclass
class InfLoRAOptions(LoRAOptions):
    gpm_start: float = option(
        0.95,
        help="the DualGPM threshold eps_t = gpm_start + (1 - gpm_start) t / T (CIFAR 0.95, ImageNet-R 0.98)",
        range=UNIT,
    )


@dataclasses.dataclass
class SDLoRAOptions(LoRAOptions):
    magnitude_init: float = option(0.8, help="SD-LoRA's magnitude initialisation (every task, as released)")


class LoRAClassifier(ContinualClassifier):
    """A baseline whose state is LoRA branches on the backbone's adaptable maps."""

    Options: type = LoRAOptions

    #: rows of a ViT's fused qkv that carry branches
    attention_rows: tuple[str, ...] = ("q", "v")

    def _setup(self) -> None:
        if hasattr(self.backbone_, "attention_rows"):
            self.backbone_.attention_rows = self.attention_rows
        self.model_ = AdaptedBackbone(self.backbone_, scaling=1.0).to(self.device_)
        if not self.model_.units:
            raise ConfigError(f"{self.name}: backbone {self.backbone_.name} has no map that LoRA can wrap")

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        return self.model_.prefix(x)

    def abort_task(self, k: int) -> None:
        self.model_.truncate(k)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        if train:
            return self.model_.suffix(z)
        return self.model_.suffix(z, [self.num_tasks - 1])[0]

    def trainable(self) -> list[nn.Parameter]:
        return self.model_.lora_parameters()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The heads, and per LoRA unit its directions ``A``, ``B``, compositions ``C`` and the rank of each
        task (``lora.<unit>.{A,B,C,ranks}``)."""
        out = super().state_tensors()
        for n, u in self.model_.units.items():
            for key in ("A", "B", "C"):
                out[f"lora.{n}.{key}"] = getattr(u, key).detach().cpu().contiguous()
            out[f"lora.{n}.ranks"] = torch.as_tensor(u.ranks, dtype=torch.int64)
        return out

    @torch.no_grad()
    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Every unit's ``A``, ``B``, ``C`` and ranks (an earlier release's ranks read off ``C``)."""
        m = self.num_tasks
        for n, u in self.model_.units.items():
            A, B, C = (need(tensors, f"lora.{n}.{key}") for key in ("A", "B", "C"))
            stored = tensors.get(f"lora.{n}.ranks")
            ranks = [int(r) for r in stored.tolist()] if stored is not None else ranks_of(C)
            R = sum(ranks)
            want = (m, (u.in_features, R), (u.out_features, R), (m, R))
            if (len(ranks), A.shape, B.shape, C.shape) != want:
                raise TaskError(
                    f"lora.{n}: A {tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)} and ranks {ranks} "
                    f"do not fit {m} tasks of a {u.in_features} -> {u.out_features} map"
                )
            dev, dt = u.A.device, u.A.dtype
            u.A, u.B, u.ranks = A.to(dev, dt), B.to(dev, dt), ranks
            u.C = C.to(dev, dt)
        self.model_.clear_merged()

    @torch.no_grad()
    def input_moments(
        self, z: torch.Tensor | None, loader: Any, tasks: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per wrapped map: C = mean x x^T over every input token (pixel) of a pass over the task's training
        inputs, under the open task's training composition (``tasks=None``) or under task ``tasks[0]``'s
        composition (float64, CPU)."""
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        hooks = []

        def hook(name: str, w: LoRAWrapper):
            def fn(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                x = args[0]
                x = (x.movedim(1, -1) if w.is_conv else x).reshape(-1, w.in_features).double()
                sums[name] = sums.get(name, 0) + (x.T @ x).cpu()
                counts[name] = counts.get(name, 0) + x.shape[0]

            return fn

        for name, w in self.model_.wrappers.items():
            hooks.append(w.register_forward_pre_hook(hook(name, w)))
        try:
            for zb in self.input_pass(z, loader):
                self.model_.suffix(zb, tasks)
        finally:
            for h in hooks:
                h.remove()
        return {n: sums[n] / counts[n] for n in sums}


def ranks_of(C: torch.Tensor) -> list[int]:
    """Each task's rank from the compositions ``C`` (m, R) of an earlier release's knowledge base: row k
    composes its own columns, so they end at its last non-zero entry (the last task ends at R)."""
    ranks, end = [], 0
    for k, row in enumerate(C):
        nz = torch.nonzero(row).flatten()
        stop = C.shape[1] if k == len(C) - 1 else max(end, int(nz[-1]) + 1 if len(nz) else 0)
        ranks.append(stop - end)
        end = stop
    return ranks


class DualGPM:
    """InfLoRA's memory of one layer's input space (Sec. 3.3; ``update_DualGPM`` in the released code).

    ``mode`` "remove": ``basis`` (q x k) spans the old tasks' inputs and new A's rows are designed off it;
    "retain": ``basis`` spans its complement and new A's rows are designed inside it. A layer starts in
    "remove" mode while k < q / 2 and switches to "retain" once the old space exceeds half the width.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self.basis = torch.zeros(width, 0, dtype=torch.float64)
        self.mode = "remove"
        self.started = False

    def project(self, C: torch.Tensor) -> torch.Tensor:
        """C restricted to the space new directions may use (the released code's product form)."""
        if not self.started:
            return C
        M = self.basis
        if self.mode == "remove":
            return C - M @ (M.T @ C)
        return M @ (M.T @ C)

    def free_dim(self) -> int:
        """The dimension of the space new directions may use."""
        if not self.started:
            return self.width
        return self.width - self.basis.shape[1] if self.mode == "remove" else self.basis.shape[1]

    def design(self, C: torch.Tensor, rank: int) -> torch.Tensor:
        """A (q x r'): the top-r' left singular vectors of the projected C, scaled by 1/sqrt(3), with r' the
        requested rank clipped to the free dimension (an SVD past it returns arbitrary vectors)."""
        r = max(0, min(rank, self.free_dim()))
        U, _, _ = torch.linalg.svd(self.project(C), full_matrices=False)
        return U[:, :r] / math.sqrt(3)

    def update(self, C: torch.Tensor, eps: float) -> None:
        """Grow the memory with this task's inputs up to the energy fraction ``eps`` (GPM's criterion on
        the singular values of C, as the released code computes it)."""
        q = self.width
        U1, S1, _ = torch.linalg.svd(C, full_matrices=False)
        total = float((S1**2).sum())
        if total <= 0:
            return
        if not self.started:
            ratio = torch.cumsum(S1**2, 0) / total
            k = max(int((ratio < eps).sum()), 1)
            self.started = True
            # the released code stores U[:, :k] in both modes here, and later reads the "retain" basis as
            # the complement; we store the complement, as its later remove -> retain switch does
            if k < q / 2:
                self.basis, self.mode = U1[:, :k], "remove"
            else:
                self.basis, self.mode = U1[:, k:], "retain"
            return
        M = self.basis
        if self.mode == "remove":
            U, S, _ = torch.linalg.svd(C - M @ (M.T @ C), full_matrices=False)
            acc, ratio = (total - float((S**2).sum())) / total, (S**2) / total
            r = 0
            while r < len(S) and acc < eps:
                acc += float(ratio[r])
                r += 1
            if r:
                self.basis = torch.cat([M, U[:, :r]], 1)[:, :q]
            if self.basis.shape[1] > q / 2:  # switch: keep the complement instead
                Uf, _, _ = torch.linalg.svd(self.basis, full_matrices=True)
                self.basis, self.mode = Uf[:, self.basis.shape[1] :], "retain"
        else:
            U, S, _ = torch.linalg.svd(M @ (M.T @ C), full_matrices=False)
            acc, ratio = float((S**2).sum()) / total, (S**2) / total
            r = 0
            while r < len(S) and acc >= 1 - eps:
                acc -= float(ratio[r])
                r += 1
            if r:
                rest = M - U[:, :r] @ (U[:, :r].T @ M)
                Ui, _, _ = torch.linalg.svd(rest, full_matrices=True)
                self.basis = Ui[:, : M.shape[1] - r]


@LEARNERS.register("inflora")
class InfLoRA(LoRAClassifier):
    """InfLoRA: designed, frozen A per task off the DualGPM space; B trained; old branches summed."""

    name = "inflora"
    Options = InfLoRAOptions
    attention_rows = ("k", "v")

    def _setup(self) -> None:
        super()._setup()
        self.gpm_ = {n: DualGPM(w.in_features) for n, w in self.model_.wrappers.items()}

    def threshold(self, k: int) -> float:
        """eps_t = gpm_start + (1 - gpm_start) t / T (T: the stream's number of tasks)."""
        start = self.options_.gpm_start
        return start + (1.0 - start) * k / self.task_budget

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        rank = self.options_.rank
        self.model_.begin_task(rank, "identity", False, task_seed(self.config.seed, k))
        moments = self.input_moments(z, loader)  # new B = 0: the model of task k - 1
        for name, w in self.model_.wrappers.items():
            A = self.gpm_[name].design(moments[name], rank).to(w.base.weight.dtype)
            for u in w.units.values():
                dev = u.A.device
                u.A_new = nn.Parameter(A.clone().to(dev), requires_grad=False)
                u.B_new = nn.Parameter(torch.zeros(u.out_features, A.shape[1], device=dev, dtype=A.dtype))

    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        self.model_.end_task()
        moments = self.input_moments(z, loader, [k])  # task k's model: every branch, weight 1
        eps = self.threshold(k)
        for name, C in moments.items():
            self.gpm_[name].update(C, eps)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA state and each layer's DualGPM basis ``gpm.<layer>`` (float64, as it is kept)."""
        out = super().state_tensors()
        for n, g in self.gpm_.items():
            out[f"gpm.{n}"] = g.basis.contiguous()
        return out

    def state(self) -> LearnerState:
        """The baseline's state, with each layer's DualGPM mode in the head's meta (``gpm``)."""
        st = super().state()
        assert st.head is not None
        st.head[0]["gpm"] = {n: {"mode": g.mode, "started": g.started} for n, g in self.gpm_.items()}
        return st

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The LoRA state and the DualGPM memories (an earlier release's: float32 bases, modes guessed)."""
        super().load_state(meta, tensors)
        modes = meta.get("gpm") or {}
        for n, g in self.gpm_.items():
            basis = need(tensors, f"gpm.{n}").double()
            if basis.ndim != 2 or basis.shape[0] != g.width or basis.shape[1] > g.width:
                raise TaskError(f"gpm.{n}: shape {tuple(basis.shape)}, expected ({g.width}, <= {g.width})")
            mode = modes.get(n, {"mode": "remove", "started": basis.shape[1] > 0})
            if mode["mode"] not in ("remove", "retain"):
                raise TaskError(f"gpm.{n}: mode {mode['mode']!r} is neither 'remove' nor 'retain'")
            g.basis, g.mode, g.started = basis, str(mode["mode"]), bool(mode["started"])


@LEARNERS.register("sd-lora")
class SDLoRA(LoRAClassifier):
    """SD-LoRA: old directions normalised and frozen, scaled by learned magnitudes; new branch trained."""

    name = "sd-lora"
    Options = SDLoRAOptions

    def _setup(self) -> None:
        super()._setup()
        #: the magnitudes each task ended with (alpha_0..alpha_k)
        self.magnitudes_: list[list[float]] = []

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        b = self.options_
        self.model_.begin_task(b.rank, "zero", False, task_seed(self.config.seed, k))
        dev = next(iter(self.model_.units.values())).A.device
        #: alpha_0..alpha_{k-1} for the old directions, alpha_k for the new one (one scalar each, shared
        #: by every layer; re-initialised every task as in the released code)
        self.alpha_ = nn.Parameter(torch.full((k + 1,), b.magnitude_init, device=dev))
        self._old = {n: self._old_columns(u) for n, u in self.model_.units.items()}

    @staticmethod
    def _old_columns(u: LoRAUnit) -> tuple[torch.Tensor, torch.Tensor]:
        """Per old column: the task j it belongs to, and ||B_j|| ||A_j|| (the released code's normaliser)."""
        if not u.num_tasks:
            return torch.zeros(0, dtype=torch.long, device=u.A.device), u.A.new_zeros(0)
        owners = torch.repeat_interleave(torch.arange(u.num_tasks), torch.as_tensor(u.ranks)).to(u.A.device)
        cols = [u.columns(j) for j in range(u.num_tasks)]
        norms = torch.stack([u.A[:, c].norm() * u.B[:, c].norm() for c in cols]).clamp_min(1e-12)
        return owners, norms[owners]

    def _compose(self, alpha: torch.Tensor) -> None:
        """Old columns: alpha_j / (||B_j|| ||A_j||); the open task's own: alpha_k (set before a forward)."""
        for n, u in self.model_.units.items():
            owners, norms = self._old[n]
            u.s_fixed = alpha[owners] / norms

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        if train:
            self._compose(self.alpha_)
            for u in self.model_.units.values():
                u.new_scale = self.alpha_[-1:]
        return super().features(z, train)

    def trainable(self) -> list[nn.Parameter]:
        return super().trainable() + [self.alpha_]

    @torch.no_grad()
    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        a = self.alpha_.detach()
        self._compose(a)
        for u in self.model_.units.values():
            u.new_scale = None
        self.model_.end_task()
        for u in self.model_.units.values():
            u.scale_own(k, a[-1])  # the task's own directions enter its model with alpha_k, unnormalised
        self.model_.clear_merged()
        self.magnitudes_.append(a.cpu().tolist())

    def state(self) -> LearnerState:
        """The baseline's state, with the magnitudes each task ended with in the head's meta."""
        st = super().state()
        assert st.head is not None
        st.head[0]["magnitudes"] = [list(a) for a in self.magnitudes_]
        return st

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        super().load_state(meta, tensors)
        self.magnitudes_ = [[float(x) for x in a] for a in meta.get("magnitudes") or []]


declare(
    "inflora",
    "InfLoRA (Liang & Li, CVPR 2024): LoRA on k, v with a designed frozen A off the DualGPM space",
    base=None,
    learner="inflora",
    baseline__optimizer="adam", baseline__lr=5e-4, baseline__schedule="cosine", baseline__rank=10,
)  # fmt: skip
declare(
    "sd-lora",
    "SD-LoRA (Wu et al., ICLR 2025): frozen normalised old directions with learned magnitudes",
    base=None,
    learner="sd-lora",
    baseline__optimizer="sgd", baseline__lr=8e-3, baseline__schedule="constant", baseline__rank=10,
)  # fmt: skip
