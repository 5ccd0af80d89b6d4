"""A backbone with PROTEUS adapters on its adaptable maps, and the batched multi-adapter forward.

Training (Eq. 15) runs the suffix with the open task's composition. Retrieval (Alg. 2) needs every
task's embedding of every input: the frozen prefix runs once, its output is repeated once per requested
composition, and each LoRA layer applies composition g to the g-th group of the batch -- one forward
for all tasks (:meth:`AdaptedBackbone.embed`). Groups may also differ in size, so that each input runs
under its own task in one forward (:meth:`AdaptedBackbone.suffix_each`: the second stage of prediction
with keys in one space).

Per map, the update of each group runs factored, ``((x A) * C[t_g]) B^T``, or merged, with the cached
weight ``W_0 + B diag(C[t_g]) A^T`` (Eq. 9 summed into the map), chosen from the shapes
(:meth:`AdaptedBackbone.merge_plan`): merged where the factored update would cost more than
``merge_threshold`` times the map itself. The merged weights live in one cache per backbone
(:class:`~proteus.adapters.lora.MergedCache`) bounded by ``merge_budget_bytes`` (``eval.merge_budget_mb``):
a forward merges the costliest maps first while its tasks' weights fit the budget and runs the rest
factored, and the least recently used weights leave the cache first, so memory stays bounded however many
tasks are learned.

Inference forwards (no gradients) of the prefix and the suffix may run through ``torch.compile``
(``compile_mode``, the config's ``compile``: :class:`proteus.devices.CompiledForward`); training stays eager.
Compiled forwards run every map factored: the merged form's per-task weight cache and in-place GEMMs break
dynamo's graph at every map (a recompile per layer shape) and fail inductor's stride checks.

Stored per task (:meth:`AdaptedBackbone.task_tensors`): ``adapter/<map>/A``, ``B`` and ``s`` for every
adapted map (:meth:`LoRAUnit.task_tensors`), with the rules a knowledge base holds them to
(:data:`proteus.tensor_rules.TENSOR_RULES`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from proteus.adapters.lora import LoRAUnit, LoRAWrapper, MergedCache, set_composition
from proteus.backbones.base import Backbone
from proteus.devices import CompiledForward, compile_failure, compiles
from proteus.kb.packs import spans
from proteus.tensor_rules import TENSOR_RULES, NeedsRecord, SameGroups, ShapeRule, SideBySide, Together

#: a task's adapter of map m: A (q, r) and B (p, r) its own r directions (Eq. 9), s its coefficients of the
#: earlier tasks' directions of the map (its row of S)
#: a stored task's A of map m, (q, r)
ADAPTER_A = r"adapter/(?P<m>.+)/A"
TENSOR_RULES.declare(
    "proteus", "AdaptedBackbone",
    ShapeRule(ADAPTER_A, ("kb.q[{m}]", "obj.r[{m}]"),
              "A (q, r) and B (p, r) share the rank r; every task's A of a map has the same q"),
    ShapeRule(r"adapter/(?P<m>.+)/B", ("kb.p[{m}]", "obj.r[{m}]"),
              "A (q, r) and B (p, r) share the rank r; every task's B of a map has the same p"),
    ShapeRule(r"adapter/(?P<m>.+)/s", ("sum.r[{m}]",),
              "s has one entry per column of the earlier tasks' adapters of the map"),
    Together(r"adapter/(?P<g>.+)/(?:A|B|s)", ("adapter/{g}/A", "adapter/{g}/B", "adapter/{g}/s")),
    SameGroups(r"adapter/(?P<g>.+)/A", "has_adapter", "adapter"),
    NeedsRecord("adapter/", "has_adapter"),  # read only for a task whose record says it has one
    SideBySide(r"adapter/.+/(?:A|B|s)"),  # a pack's tasks appended at once (append_stored)
)  # fmt: skip


def ranks_from_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """A stored task's rank on each adapted map from its tensors' shapes (``adapter/<map>/A`` is (q, r)):
    fewer than the task's rank where the map had no orthogonal room left (Eq. 15); empty without one."""
    pat = re.compile(ADAPTER_A)
    return {m["m"]: s[1] for n, s in shapes.items() if (m := pat.fullmatch(n)) and len(s) == 2}


def append_stored(units: dict[str, LoRAUnit], tasks: list[tuple[Mapping[str, torch.Tensor], str]]) -> None:
    """Append stored tasks' adapters (``adapter/<map>/A|B|s`` each, ``who`` naming each in errors) to the
    ``units`` of their maps: the tasks of one pack of a knowledge base as one piece per map
    (:func:`proteus.kb.packs.spans`), any other task as its own (:meth:`LoRAUnit.append_stored`)."""
    runs = spans([t for t, _ in tasks], [f"adapter/{n}/{x}" for n in units for x in "ABs"])
    for first, _, blocks in runs:  # (a run of a pack's tasks holds every name: its blocks say so)
        t, who = tasks[first]
        if blocks is None and (gap := [n for n in units if f"adapter/{n}/A" not in t]):
            raise KeyError(f"{who}: adapter tensors for {gap[0]!r} missing from the knowledge base")
    for n, u in units.items():
        pieces = []
        for first, _, blocks in runs:
            if blocks is None:
                A, B, s = (tasks[first][0][f"adapter/{n}/{x}"] for x in "ABs")
                pieces.append((A, B, s, [int(A.shape[-1]) if A.ndim else 0], [s.numel()]))
            else:
                (A, ranks), (B, _), (s, counts) = (blocks[f"adapter/{n}/{x}"] for x in "ABs")
                pieces.append((A, B, s, ranks, counts))
        u.append_stored(pieces, _Named(tasks, n))


class _Named(Sequence[str]):
    """How errors name each task's map ``name`` (``"<who>: <map>"``), made only for the one that fails."""

    def __init__(self, tasks: list[tuple[Mapping[str, torch.Tensor], str]], name: str) -> None:
        self.tasks, self.name = tasks, name

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return f"{self.tasks[i][1]}: {self.name}"

    def __len__(self) -> int:
        return len(self.tasks)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


class AdaptedBackbone(nn.Module):
    """A frozen :class:`Backbone` whose adaptable maps carry :class:`LoRAUnit` s (one per map)."""

    #: "auto": merged weights where the factored update costs more than ``merge_threshold`` x the map,
    #: within ``merge_budget_bytes`` (None: no limit); "always" / "never": every map merged / factored
    merge: str = "auto"
    merge_threshold: float = 0.25
    #: the default byte budget of the merged-weight cache (``eval.merge_budget_mb``: 1 GiB)
    DEFAULT_MERGE_BUDGET = 1 << 30
    #: the config's ``compile`` (:data:`proteus.devices.COMPILE_MODES`): "none" runs every forward eagerly;
    #: otherwise the prefix and suffix forwards without gradients go through ``torch.compile`` in that mode
    compile_mode: str = "none"

    def __init__(self, backbone: Backbone, scaling: float = 1.0, enabled: bool = True) -> None:
        super().__init__()
        self.backbone = backbone
        self._compiled: dict[str, CompiledForward] = {}
        self._plan: tuple[tuple, list[str]] = ((), [])
        self.wrappers: dict[str, LoRAWrapper] = {}
        self.units: dict[str, LoRAUnit] = {}
        self.merged_cache = MergedCache(self.DEFAULT_MERGE_BUDGET)
        if enabled:
            for t in backbone.adapt_targets():
                w = LoRAWrapper(t.module, t.slices, scaling, self.merged_cache)
                _set_submodule(backbone, t.name, w)
                self.wrappers[t.name] = w
                for k, u in zip(w.units.keys(), w.unit_list()):
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
        if m < self.num_tasks:
            self.clear_merged()
        for u in self.units.values():
            u.truncate(m)

    def task_tensors(self, task: int) -> dict[str, torch.Tensor]:
        """What a knowledge base stores of one task's adapter: ``adapter/<map>/{A,B,s}`` for every map."""
        return {f"adapter/{n}/{k}": v for n, u in self.units.items() for k, v in u.task_tensors(task).items()}

    def adopt(self, task: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Task ``task`` is stored as ``tensors`` (its committed object, memory-mapped): each map's row of S
        is held from there (:meth:`LoRAUnit.adopt`); from a pack, the rows of all its tasks at once, one view
        per map."""
        pack, first = getattr(tensors, "pack", None), task - getattr(tensors, "slot", 0)
        for n, u in self.units.items():
            name = f"adapter/{n}/s"
            if task >= u.num_tasks or name not in tensors:
                continue
            run = None if pack is None else pack.span(name, 0, pack.count)  # (a pack: all its tasks at once)
            if run is None or first + len(run[1]) > u.num_tasks or not u.adopt(first, *run):
                u.adopt(task, tensors[name])

    def append_tasks_tensors(self, tasks: list[tuple[Mapping[str, torch.Tensor], str]]) -> None:
        """Append tasks' adapters (:meth:`task_tensors`' form; ``who`` names each in errors), map by map; the
        tasks of a knowledge base's pack in one operation per map (:func:`append_stored`)."""
        append_stored(self.units, tasks)

    def lora_parameters(self) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        for u in self.units.values():
            if u.A_new is not None and u.B_new is not None:  # u.training_task
                out += [u.A_new, u.B_new]
        return out

    def transfer_parameters(self) -> list[nn.Parameter]:
        return [u.s for u in self.units.values() if u.s is not None]

    # ------------------------------------------------------------------ merged weights
    @property
    def merge_budget_bytes(self) -> int | None:
        """The byte budget of the merged-weight cache (None: no limit)."""
        return self.merged_cache.budget

    @merge_budget_bytes.setter
    def merge_budget_bytes(self, budget: int | None) -> None:
        self.merged_cache.budget = None if budget is None else int(budget)
        self.merged_cache.evict()

    def merge_plan(self) -> list[str]:
        """The maps that may run merged, costliest first: with ``merge = "auto"`` those whose factored
        update with every task's columns costs more than ``merge_threshold`` x the map
        (:meth:`LoRAWrapper.factored_cost`) and one of whose merged weights fits the budget; every map
        with ``"always"``, none with ``"never"``. A forward merges them in this order while its tasks'
        weights fit the budget (:meth:`merged_maps`)."""
        key = (self.merge, self.merge_threshold, self.merge_budget_bytes,
               tuple(u.total_rank for u in self.units.values()))  # fmt: skip
        if key == self._plan[0]:
            return self._plan[1]
        plan: list[str] = []
        if self.merge != "never":
            budget = self.merge_budget_bytes
            ranked = sorted(self.wrappers.items(), key=lambda nw: -nw[1].factored_cost())
            for name, w in ranked:
                if self.merge == "auto" and (
                    w.factored_cost() <= self.merge_threshold
                    or (budget is not None and w.merged_bytes_per_task() > budget)
                ):
                    continue
                plan.append(name)
        self._plan = (key, plan)
        return plan

    def merged_maps(self, n_tasks: int) -> set[str]:
        """The maps a forward over ``n_tasks`` distinct compositions runs merged: :meth:`merge_plan`'s
        that fit the budget together (:meth:`MergedCache.fitting`; all of them with ``"always"``)."""
        sizes = [(name, self.wrappers[name].merged_bytes_per_task()) for name in self.merge_plan()]
        return self.merged_cache.fitting(sizes, n_tasks, bounded=self.merge == "auto")

    def merged_nbytes(self) -> int:
        """Bytes of merged weights in the cache (at most ``merge_budget_bytes`` between forwards)."""
        return self.merged_cache.nbytes

    def prepare_merged(self, tasks: list[int] | None = None, kind: str = "task") -> int:
        """Build the merged weights of ``tasks`` (default: all) for the maps a forward over them would
        merge (:meth:`merged_maps`) now rather than on first use (a server's warm-up; timings without the
        one-off cost). Returns the bytes cached."""
        tasks = list(range(self.num_tasks)) if tasks is None else tasks
        if tasks and self.merge != "never":
            for name in self.merged_maps(len(set(tasks))):
                self.wrappers[name].merged_weights(tasks, kind)
        return self.merged_nbytes()

    def clear_merged(self) -> None:
        for w in self.wrappers.values():
            w.clear_merged()

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def compose(
        self, tasks: list[int] | None, kind: str = "task", sizes: list[int] | None = None
    ) -> Iterator[None]:
        """Within the block, group g of every batch is embedded with composition ``tasks[g]``: equal
        groups, or ``sizes[g]`` rows each. The maps of :meth:`merge_plan` run merged, the others factored
        over the columns the compositions use."""
        if tasks is None:
            yield
            return
        plan = self.merged_maps(len(set(tasks))) if self.merge != "never" and not self._compiles() else set()
        for name, w in self.wrappers.items():
            units = w.unit_list()
            cols = [u.used_columns(tasks) for u in units]
            if name in plan:
                w.merged = (tasks, kind)
            if name not in plan or self.merge == "auto":  # "auto": factored where merging does not pay
                for u, c in zip(units, cols):
                    set_composition(u, u.coefficients(tasks, kind)[:, :c], sizes)
            w.groups = len(tasks) if sizes is None else sum(sizes)
            w.sizes = sizes
        try:
            yield
        finally:
            for u in self.units.values():
                u.composed = None
            for w in self.wrappers.values():
                w.groups, w.sizes, w.merged = 1, None, None

    def _compiles(self) -> bool:
        """Whether forwards now go through ``torch.compile`` (a mode set, no gradients, no failure)."""
        return compiles(self.compile_mode) and not torch.is_grad_enabled() and compile_failure() is None

    def _forward(self, part: str, x: torch.Tensor) -> Any:
        """The backbone's ``forward_prefix``, ``forward_prefix_taps`` or ``forward_suffix`` (``part``) of
        ``x``: compiled once per process and mode (:attr:`compile_mode`) without gradients, else eager."""
        fn = getattr(self.backbone, f"forward_{part}")  # prefix, prefix_taps or suffix
        if not self._compiles():
            return fn(x)
        c = self._compiled.get(part)
        if c is None or c.mode != self.compile_mode:
            c = self._compiled[part] = CompiledForward(fn, self.compile_mode)
        return c(x)

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen prefix h_0(x), shared by all tasks."""
        with torch.no_grad():
            return self._forward("prefix", x)

    def prefix_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`prefix` and the channel statistics of the backbone's tap blocks
        (``Backbone.forward_prefix_taps``), in one forward (compiled like the prefix)."""
        with torch.no_grad():
            return self._forward("prefix_taps", x)

    def suffix(self, z: torch.Tensor, tasks: list[int] | None = None, kind: str = "task") -> torch.Tensor:
        """Embed prefix outputs. ``tasks=None``: the open task's training composition, (N, d).
        Otherwise one group per entry of ``tasks``: (G, N, d)."""
        if tasks is None:
            return self._forward("suffix", z)
        G, n = len(tasks), z.shape[0]
        zz = z.repeat(G, *([1] * (z.dim() - 1)))
        with self.compose(tasks, kind):
            h = self._forward("suffix", zz)
        return h.reshape(G, n, -1)

    def suffix_grouped(
        self, z: torch.Tensor, tasks: list[int], sizes: list[int], kind: str = "task"
    ) -> torch.Tensor:
        """(N, d): the first ``sizes[0]`` rows of ``z`` under composition ``tasks[0]``, the next
        ``sizes[1]`` under ``tasks[1]``, ... in one forward."""
        if sum(sizes) != z.shape[0] or len(sizes) != len(tasks):
            raise ValueError(f"sizes {sizes} must give one group per task and add up to {z.shape[0]}")
        with self.compose(tasks, kind, sizes):
            return self._forward("suffix", z)

    def suffix_each(self, z: torch.Tensor, tasks: torch.Tensor, kind: str = "task") -> torch.Tensor:
        """(N, d): row i of ``z`` under composition ``tasks[i]``, one forward (rows grouped by task)."""
        order = torch.argsort(tasks.cpu(), stable=True)
        uniq, counts = torch.unique_consecutive(tasks.cpu()[order], return_counts=True)
        h = self.suffix_grouped(z[order.to(z.device)], uniq.tolist(), counts.tolist(), kind)
        out = torch.empty_like(h)
        out[order.to(h.device)] = h
        return out

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
        return {n: u.row(task).detach().cpu().clone() for n, u in self.units.items()}
