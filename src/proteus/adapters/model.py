"""A backbone with PROTEUS adapters on its adaptable maps, and the batched multi-adapter forward.

Training (Eq. 15) runs the suffix with the open task's composition. Retrieval (Alg. 2) needs every
task's embedding of every input: the frozen prefix runs once, its output is repeated once per requested
composition, and each LoRA layer applies composition g to the g-th group of the batch -- one forward
for all tasks (:meth:`AdaptedBackbone.embed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from proteus.adapters.lora import LoRAUnit, LoRAWrapper
from proteus.backbones.base import Backbone


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


class AdaptedBackbone(nn.Module):
    """A frozen :class:`Backbone` whose adaptable maps carry :class:`LoRAUnit` s (one per map)."""

    def __init__(self, backbone: Backbone, scaling: float = 1.0, enabled: bool = True) -> None:
        super().__init__()
        self.backbone = backbone
        self.wrappers: dict[str, LoRAWrapper] = {}
        self.units: dict[str, LoRAUnit] = {}
        if enabled:
            for t in backbone.adapt_targets():
                w = LoRAWrapper(t.module, t.slices, scaling)
                _set_submodule(backbone, t.name, w)
                self.wrappers[t.name] = w
                for k, u in w.units.items():
                    self.units[t.name if k == "w" else f"{t.name}:{k}"] = u

    # ------------------------------------------------------------------ state
    @property
    def num_tasks(self) -> int:
        return next(iter(self.units.values())).num_tasks if self.units else 0

    @property
    def embed_dim(self) -> int:
        return self.backbone.embed_dim

    def begin_task(self, rank: int, transfer: str, orthogonal: bool, seed: int) -> dict[str, int]:
        g = torch.Generator().manual_seed(seed)
        return {n: u.begin_task(rank, transfer, orthogonal, g) for n, u in self.units.items()}

    def end_task(self) -> None:
        for u in self.units.values():
            u.end_task()

    def truncate(self, m: int) -> None:
        """Keep the first ``m`` tasks' adapters and close any open task (rollback of a failed task)."""
        for u in self.units.values():
            u.truncate(m)

    def lora_parameters(self) -> list[nn.Parameter]:
        out = []
        for u in self.units.values():
            if u.training_task:
                out += [u.A_new, u.B_new]
        return out

    def transfer_parameters(self) -> list[nn.Parameter]:
        return [u.s for u in self.units.values() if u.s is not None]

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def compose(self, tasks: list[int] | None, kind: str = "task") -> Iterator[None]:
        """Within the block, group g of every batch is embedded with composition ``tasks[g]``."""
        if tasks is None:
            yield
            return
        for u in self.units.values():
            u.coef = u.coefficients(tasks, kind)
        for w in self.wrappers.values():
            w.groups = len(tasks)
        try:
            yield
        finally:
            for u in self.units.values():
                u.coef = None
            for w in self.wrappers.values():
                w.groups = 1

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen prefix h_0(x), shared by all tasks."""
        with torch.no_grad():
            return self.backbone.forward_prefix(x)

    def suffix(self, z: torch.Tensor, tasks: list[int] | None = None, kind: str = "task") -> torch.Tensor:
        """Embed prefix outputs. ``tasks=None``: the open task's training composition, (N, d).
        Otherwise one group per entry of ``tasks``: (G, N, d)."""
        if tasks is None:
            return self.backbone.forward_suffix(z)
        G, n = len(tasks), z.shape[0]
        zz = z.repeat(G, *([1] * (z.dim() - 1)))
        with self.compose(tasks, kind):
            h = self.backbone.forward_suffix(zz)
        return h.reshape(G, n, -1)

    def embed(self, x: torch.Tensor, tasks: list[int] | None = None, kind: str = "task") -> torch.Tensor:
        return self.suffix(self.prefix(x), tasks, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)

    # ------------------------------------------------------------------ analysis
    def unit_cosines(self) -> dict[str, torch.Tensor]:
        """Per unit: (m, m) cosine similarity of the tasks' own updates B_tau A_tau^T (Figs. 9-10)."""
        out = {}
        for name, u in self.units.items():
            m = u.num_tasks
            gram = torch.zeros(m, m, dtype=torch.float64)
            for i in range(m):
                ci = u.columns(i)
                for j in range(m):
                    cj = u.columns(j)
                    ata = u.A[:, ci].double().T @ u.A[:, cj].double()
                    btb = u.B[:, ci].double().T @ u.B[:, cj].double()
                    gram[i, j] = (ata * btb).sum()
            norms = gram.diagonal().clamp_min(1e-300).sqrt()
            out[name] = gram / (norms[:, None] * norms[None, :])
        return out

    def transfer_matrix(self, task: int) -> dict[str, torch.Tensor]:
        """Per unit: task's S coefficients over older directions (Fig. 8 heatmaps)."""
        return {n: u.C[task, : u.columns(task).start].detach().cpu() for n, u in self.units.items()}
