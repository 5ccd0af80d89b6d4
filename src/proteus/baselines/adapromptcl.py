"""AdaPromptCL: adaptive prompt tuning by semantic grouping of tasks (Kim et al., ICML 2024).

The method as the authors' released code (kaist-dmlab/AdaPromptCL @ fb67cc1: ``engine.py``'s
``train_and_evaluate`` and ``uni_or_specific_prompts``, ``prompt.py``) runs it with the README's flags
``--data_driven_evolve --uni_or_specific --converge_thrh 0.4 --mergable_prompts --postmerge_thrh 0.6``,
rebuilt on the shared baseline learner. It is DualPrompt's e-prompt machinery (prefix tuning in
``baseline.prompt_layers``, blocks 0-4, no g-prompt; keys matched to the frozen [CLS] query) with a pool of
prompts shared by *semantic groups* of tasks instead of one prompt per task:

* **warm-up, per task t**: ``evolve_epoch + 1`` epochs (CIFAR-100 2 + 1, ImageNet-R 7 + 1: the release
  checks after epoch ``evolve_epoch``) train a *candidate* prompt (every candidate starts from the same
  draw, the release's ``prompt_same_init``), its key and the task's head;
* **grouping** (:class:`SemanticGroups`): the candidate's mean over blocks, key/value halves and length,
  L2-normalised, is added to the earlier tasks' warm-up vectors.

  - *assign*: a BIRCH tree (threshold ``converge_thrh`` 0.4) takes it (``partial_fit``); the task joins the
    group of its BIRCH cluster, whose prompt is the candidate of the cluster's first task (``shared``), or
    opens a new group with its own candidate (``specific``);
  - *refine* (``mergable_prompts``): a coarser BIRCH tree (``postmerge_thrh`` 0.6) finds the earlier tasks
    the new one could merge with beyond its fine cluster. If there are any, the candidates of that
    coarse group are re-clustered: 1000 BIRCH fits (threshold 0.4) on random orderings, the fewest
    clusters and one more; the cluster count of the best mean silhouette; K-Means (100 runs each) with
    ``kmeans_top_n`` = 2 counts above it. Each partition that keeps every earlier task's existing merged
    group intact adds the new task's group as a *block*; a block of several tasks gets a new prompt,
    copied (with its key) from the prompt of the block without the new task; the new task trains all
    its new blocks' prompts (each input one of them at random); the prompts of each coarse group's
    fewest-cluster partition are the ones matched at test (``merge``);
* **after the warm-up**: for t > 0 the head is restored to its state before the warm-up (bit-equal) and
  the optimiser re-created; the group's prompt is trained for ``uni_epochs`` 5 (shared),
  ``spcf_epochs`` 100 (specific) or ``min(5 n, 50)`` (merge, n prompts) epochs, capped by
  ``train.epochs`` (the release's ``--epochs`` 50); the first task trains no further (``left_1Tepochs``
  0). ``reinit_clf``: ten epochs before a task's training ends the head is reset again to that state and
  the optimiser re-created, so it is trained in the last ten epochs only;
* the loss is DualPrompt's: the cross-entropy over the task's classes (masked) minus
  ``match_weight`` (1.0) times the cosine of the query and the used prompt's key; gradient clip 1.0;
* **test**: the query's most cosine-similar key (top 1) among the prompts in use picks the prompt; one
  head over all seen classes (the per-task heads concatenated).

This module is the whole method -- the grouping, its learner and its declaration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.cluster import Birch, KMeans
from sklearn.metrics import silhouette_score
from torch import nn

from proteus.baselines.learner import OpenTask
from proteus.baselines.persist import need
from proteus.baselines.prompts import PromptClassifier, PromptOptions
from proteus.config import ConfigError, declare
from proteus.engine.runtime import task_seed
from proteus.errors import NotFittedError
from proteus.learners import LEARNERS, LearnerState
from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, option

__all__ = [
    "AdaPromptCL",
    "Decision",
    "SemanticGroups",
    "distinct_partitions",
    "kmeans_counts",
    "warmup_vector",
]

#: the release's ``evolve_epoch`` by benchmark (configs/{cifar100,imr,vtab}_dualprompt.py); others: CIFAR's
EVOLVE_EPOCH = {"cifar100": 2, "imagenet-r": 7, "vtab": 19}


def warmup_vector(prompt: torch.Tensor) -> np.ndarray:
    """(d,) float64: an e-prompt (n_layers, 2, L, d) averaged over blocks, key/value halves and length,
    L2-normalised (the release's ``prompt.mean(0).mean(0).mean(1)``, then ``F.normalize``)."""
    v = prompt.detach().float().cpu().mean(dim=(0, 1, 2))
    return F.normalize(v, dim=0).double().numpy()


def distinct_partitions(labels: list[np.ndarray]) -> list[np.ndarray]:
    """The different partitions among label vectors, whatever the label names: the vectors in
    lexicographic order (``np.unique(axis=0)``), each kept unless an earlier one groups the same items
    (the release's ``remove_duplicates``)."""
    if not labels:
        return []
    out, seen = [], set()
    for lab in np.unique(np.stack(labels), axis=0):
        canon = tuple(int(np.flatnonzero(lab == lab[i])[0]) for i in range(len(lab)))
        if canon not in seen:
            seen.add(canon)
            out.append(lab)
    return out


def kmeans_counts(silhouettes: dict[int, list[float]], fewest: int, n: int, top_n: int) -> list[int]:
    """The cluster counts K-Means re-clusters ``n`` merge candidates with: the ``top_n`` counts above the
    count of the best mean silhouette over the BIRCH orderings (the first on ties), or above the fewest
    BIRCH clusters when no ordering had a silhouette; each at most ``n``."""
    base = max(silhouettes, key=lambda c: np.mean(silhouettes[c])) if silhouettes else fewest
    return [base + j for j in range(1, top_n + 1) if n >= base + j]


@dataclass
class Decision:
    """Where task t's training goes after its warm-up."""

    task: int
    #: "first" (task 0), "specific" (a new group, its own candidate), "shared" (an existing group's
    #: prompt) or "merge" (the prompts of its new merged blocks)
    kind: str
    #: the prompts trained after the warm-up (each input one of them at random)
    train_pids: list[int]
    #: merged prompts to create first: (new prompt id, the prompt id it is copied from)
    new_prompts: list[tuple[int, int]] = field(default_factory=list)
    #: the first task of t's fine BIRCH cluster (t itself when it opens a group)
    group_task: int = 0

    def to_record(self) -> dict[str, Any]:
        """What a task's record in a knowledge base keeps of it (``prompt_group``)."""
        return {"kind": self.kind, "prompts": list(self.train_pids), "group_task": self.group_task}

    @classmethod
    def from_record(cls, task: int, record: dict[str, Any]) -> Decision:
        """Task ``task``'s decision from its record's ``prompt_group`` (:meth:`to_record`)."""
        g = record.get("prompt_group") or {}
        pids = [int(p) for p in g.get("prompts", [])]
        return cls(task, str(g.get("kind", "")), pids, group_task=int(g.get("group_task", task)))


class SemanticGroups:
    """AdaPromptCL's semantic grouping of tasks by their warm-up prompts (the release's
    ``uni_or_specific_prompts`` with ``mergable_prompts``).

    Prompt ids are indices in the learner's pool: task t's candidate is ``cand_pid[t]``; merged prompts
    get the next free ids. :meth:`assign` takes task t's normalised warm-up vector and returns its
    :class:`Decision`; :attr:`inference_pids` are the prompts whose keys are matched at test.
    """

    def __init__(
        self,
        converge_thrh: float = 0.4,
        postmerge_thrh: float = 0.6,
        mergable: bool = True,
        remerge_samples: int = 1000,
        kmeans_run: int = 100,
        kmeans_top_n: int = 2,
        seed: int = 0,
    ) -> None:
        self.converge_thrh, self.postmerge_thrh, self.mergable = converge_thrh, postmerge_thrh, mergable
        self.remerge_samples, self.kmeans_run, self.kmeans_top_n = remerge_samples, kmeans_run, kmeans_top_n
        self.seed = seed
        self.vectors: list[np.ndarray] = []
        self.cand_pid: list[int] = []
        #: task -> the prompt it was trained into after its warm-up (-1: merged blocks)
        self.converged: list[int] = []
        self.kinds: list[str] = []
        self.birch = Birch(n_clusters=None, threshold=converge_thrh)
        self.post_birch = Birch(n_clusters=None, threshold=postmerge_thrh)
        #: tasks that were merge candidates (the release's ``seen``; task 0 from the start)
        self.seen: list[int] = [0]
        #: coarse BIRCH cluster id -> (its merge candidates, the task that registered them)
        self.merge_groups: dict[int, tuple[list[int], int]] = {}
        #: groups of tasks sharing a merged prompt (singletons: a task's own candidate) and their prompts
        self.blocks: list[frozenset[int]] = []
        self.block_pid: dict[frozenset[int], int] = {}
        #: task -> (fewest clusters, that partition's blocks) of its re-clustering
        self.reduce_hist: dict[int, tuple[int, list[frozenset[int]]]] = {}
        self.reclustered: list[int] = []
        self.inference_pids: list[int] = []

    # ------------------------------------------------------------------ the decision
    def fine_labels(self) -> np.ndarray:
        return self.birch.predict(np.stack(self.vectors))

    def assign(self, t: int, vector: np.ndarray, cand_pid: int, n_prompts: int) -> Decision:
        """Task t's group from its warm-up ``vector`` (normalised, (d,)); ``cand_pid`` is its candidate's
        prompt id and ``n_prompts`` the pool's size (merged prompts are numbered from there)."""
        if t != len(self.vectors):
            raise ValueError(f"adapromptcl: task {t} assigned after {len(self.vectors)} tasks")
        rng = np.random.RandomState(task_seed(self.seed, t) % 2**32)
        v = np.asarray(vector, dtype=np.float64).reshape(1, -1)
        self.vectors.append(v[0])
        self.cand_pid.append(int(cand_pid))
        X = np.stack(self.vectors)
        self.birch.partial_fit(v)
        fine = self.birch.predict(X)
        group_task = int(np.flatnonzero(fine == fine[t])[0])
        decision: Decision | None = None
        zero_covered = False
        if self.mergable:
            self.post_birch.partial_fit(v)
            if t == 0:
                self.blocks = [frozenset({0})]
                self.block_pid = {frozenset({0}): self.cand_pid[0]}
            else:
                coarse = self.post_birch.predict(X)
                fine_c = set(np.flatnonzero(fine == fine[t]).tolist())
                union = sorted(set(np.flatnonzero(coarse == coarse[t]).tolist()) | fine_c)
                if len(union) > len(fine_c):  # the coarse group reaches beyond t's fine cluster
                    self.seen.append(t)
                    cands = [c for c in union if c in self.seen]
                    key = int(coarse[cands[0]])
                    previous = self.merge_groups.get(key)
                    self.merge_groups[key] = (cands, t)
                    decision = self._remerge(t, cands, n_prompts, rng)
                    if decision is None:  # no partition keeps the earlier blocks: the fine decision
                        self.seen.pop()
                        if previous is None:
                            del self.merge_groups[key]
                        else:
                            self.merge_groups[key] = previous
                    else:
                        zero_covered = self._recluster()
        if decision is None:
            kind = "first" if t == 0 else ("specific" if group_task == t else "shared")
            pid = self.cand_pid[group_task]
            decision = Decision(t, kind, [pid], group_task=group_task)
            self.converged.append(pid)
        else:
            decision.group_task = group_task
            self.converged.append(-1)
        self.kinds.append(decision.kind)
        self.inference_pids = self._inference_pids(t, fine, zero_covered)
        return decision

    def _remerge(
        self, t: int, cands: list[int], n_prompts: int, rng: np.random.RandomState
    ) -> Decision | None:
        """Re-cluster the merge candidates' warm-up vectors; add t's blocks. None when none is added."""
        P = np.stack([self.vectors[c] for c in cands])
        n = len(P)
        min_cls: int | None = None
        fewest: list[np.ndarray] = []
        one_more: list[np.ndarray] = []
        silhouettes: dict[int, list[float]] = {}
        for _ in range(self.remerge_samples):
            perm = rng.permutation(n)
            lab = Birch(n_clusters=None, threshold=self.converge_thrh).fit(P[perm]).predict(P)
            top = int(lab.max())
            if min_cls is None or top < min_cls:
                min_cls, fewest, one_more = top, [], []
            if top == min_cls:
                fewest.append(lab)
            if top == min_cls + 1:
                one_more.append(lab)
            c = len(np.unique(lab))
            if 1 < c < n and n > 2:
                silhouettes.setdefault(c, []).append(float(silhouette_score(P, lab)))
        assert min_cls is not None
        for k in kmeans_counts(silhouettes, min_cls + 1, n, self.kmeans_top_n):
            for _ in range(self.kmeans_run):
                perm = rng.permutation(n)
                km = KMeans(n_clusters=k, n_init=5, random_state=rng.randint(2**31 - 1)).fit(P[perm])
                one_more.append(km.predict(P))
        before = len(self.blocks)
        for labels in (fewest, one_more):
            self._add_blocks(distinct_partitions(labels), cands, t)
        new = self.blocks[before:]
        if not new:
            return None
        pids: list[int] = []
        copies: list[tuple[int, int]] = []
        for block in new:
            if len(block) == 1:
                pid = self.cand_pid[t]
            else:
                pid = n_prompts + len(copies)
                copies.append((pid, self.block_pid[block - {t}]))
            self.block_pid[block] = pid
            pids.append(pid)
        return Decision(t, "merge", pids, copies)

    def _add_blocks(self, partitions: list[np.ndarray], cands: list[int], t: int) -> None:
        """The release's ``manage_blocks``: each partition of ``cands`` whose groups of earlier tasks are all
        existing blocks adds t's group as a block; the fewest-group such partition is t's re-clustering."""
        arr = np.asarray(cands)
        for lab in partitions:
            groups = [frozenset(arr[lab == u].tolist()) for u in dict.fromkeys(lab.tolist())]
            if any(g - {t} and (g - {t}) not in self.blocks for g in groups):
                continue
            mine = next(g for g in groups if t in g)
            if mine not in self.blocks:
                self.blocks.append(mine)
            if t not in self.reduce_hist or self.reduce_hist[t][0] > len(groups):
                self.reduce_hist[t] = (len(groups), groups)

    def _recluster(self) -> bool:
        """The prompts of every coarse group's fewest-cluster partition; whether the last such partition
        merges task 0 (its candidate then leaves the prompts in use)."""
        pids: list[int] = []
        zero_covered = False
        for _, ti in self.merge_groups.values():
            if ti not in self.reduce_hist:
                continue
            blocks = self.reduce_hist[ti][1]
            pids += [self.block_pid[b] for b in blocks]
            zero_covered = any(0 in b for b in blocks if len(b) > 1)
        self.reclustered = pids
        return zero_covered

    def _inference_pids(self, t: int, fine: np.ndarray, zero_covered: bool) -> list[int]:
        used = {p for p in self.converged if p != -1}
        if not self.mergable:
            return sorted(used)
        used |= set(self.reclustered)
        if zero_covered:
            used.discard(self.cand_pid[0])
        if t > 0:
            rest = set(range(t + 1))
            for cands, ti in self.merge_groups.values():
                if ti in self.reduce_hist and len(np.unique(fine[cands])) > self.reduce_hist[ti][0]:
                    rest -= set(cands)  # reduced by the merge: its prompts are the reclustered ones
            used |= {self.converged[i] for i in rest}
            used.discard(-1)
        return sorted(used)

    # ------------------------------------------------------------------ persistence
    def to_meta(self) -> dict[str, Any]:
        """Everything but the warm-up vectors (tensors of their own), as JSON."""
        return {
            "converge_thrh": self.converge_thrh, "postmerge_thrh": self.postmerge_thrh,
            "mergable": self.mergable, "remerge_samples": self.remerge_samples,
            "kmeans_run": self.kmeans_run, "kmeans_top_n": self.kmeans_top_n, "seed": self.seed,
            "cand_pid": list(self.cand_pid), "converged": list(self.converged), "kinds": list(self.kinds),
            "seen": list(self.seen),
            "merge_groups": [[k, c, t] for k, (c, t) in self.merge_groups.items()],
            "blocks": [[sorted(b), self.block_pid[b]] for b in self.blocks],
            "reduce_hist": [[t, n, [sorted(b) for b in bs]] for t, (n, bs) in self.reduce_hist.items()],
            "reclustered": list(self.reclustered), "inference_pids": list(self.inference_pids),
        }  # fmt: skip

    @classmethod
    def from_meta(cls, meta: dict[str, Any], vectors: list[np.ndarray]) -> SemanticGroups:
        """The grouping as :meth:`to_meta` and the warm-up vectors left it: the BIRCH trees are grown again
        from the vectors in task order (``partial_fit`` is deterministic)."""
        g = cls(
            meta["converge_thrh"], meta["postmerge_thrh"], meta["mergable"], meta["remerge_samples"],
            meta["kmeans_run"], meta["kmeans_top_n"], meta["seed"],
        )  # fmt: skip
        for v in vectors:
            v = np.asarray(v, dtype=np.float64)
            g.vectors.append(v)
            g.birch.partial_fit(v[None])
            if g.mergable:
                g.post_birch.partial_fit(v[None])
        g.cand_pid, g.converged, g.kinds = (
            list(meta["cand_pid"]),
            list(meta["converged"]),
            list(meta["kinds"]),
        )
        g.seen = list(meta["seen"])
        g.merge_groups = {int(k): (list(c), int(t)) for k, c, t in meta["merge_groups"]}
        g.blocks = [frozenset(b) for b, _ in meta["blocks"]]
        g.block_pid = {frozenset(b): int(p) for b, p in meta["blocks"]}
        g.reduce_hist = {int(t): (int(n), [frozenset(b) for b in bs]) for t, n, bs in meta["reduce_hist"]}
        g.reclustered, g.inference_pids = list(meta["reclustered"]), list(meta["inference_pids"])
        return g


@dataclass
class AdaPromptCLOptions(PromptOptions):
    """AdaPromptCL's options: the release's flags and defaults (configs/*_dualprompt.py, README commands)."""

    pool_size: int = option(10, help="the prompt pool's size (the release: 300)", range=AT_LEAST_1)
    match_weight: float = option(0.1, help="the key-query pull constraint's weight", range=NON_NEGATIVE)
    converge_thrh: float = option(
        0.4, help="the BIRCH threshold that assigns a task to a group", range=POSITIVE
    )
    postmerge_thrh: float = option(0.6, help="the coarser BIRCH threshold of the refinement", range=POSITIVE)
    mergable_prompts: bool = option(True, help="refine the groups after each task (--mergable_prompts)")
    remerge_samples: int = option(
        1000, help="sampling_size_for_remerge: BIRCH runs on shuffled orders", range=AT_LEAST_1
    )
    kmeans_run: int = option(100, help="K-Means runs per candidate count", range=AT_LEAST_1)
    kmeans_top_n: int = option(
        2, help="the counts above the best mean silhouette's that K-Means tries", range=NON_NEGATIVE
    )
    uni_epochs: int = option(5, help="epochs of a shared group's prompt", range=NON_NEGATIVE)
    spcf_epochs: int = option(100, help="epochs of a specific prompt", range=NON_NEGATIVE)
    mergable_epochs: int = option(
        5, help="epochs per prompt of a merge (min(5 n, max_mergable_epochs))", range=NON_NEGATIVE
    )
    max_mergable_epochs: int = option(50, help="a merge's epochs at most", range=NON_NEGATIVE)
    first_task_epochs: int = option(
        0, help="left_1Tepochs: the first task's extra epochs", range=NON_NEGATIVE
    )
    head_last_epochs: int = option(
        10, help="reinit_clf: the head trains in the last this many epochs", range=NON_NEGATIVE
    )


@LEARNERS.register(
    "adapromptcl", help="AdaPromptCL: prompts shared by semantic groups of tasks (BIRCH/K-Means)"
)
class AdaPromptCL(PromptClassifier):
    """AdaPromptCL: e-prompts shared by semantic groups of tasks, grouped by their warm-up prompts."""

    name = "adapromptcl"
    Options = AdaPromptCLOptions

    def _make_state(self, d: int) -> None:
        b = self.options_
        self._gen = torch.Generator().manual_seed(self.config.seed)
        self._shape = (len(b.prompt_layers), 2, b.prompt_length, d)
        # prompt_same_init: every prompt of the pool starts from this one draw
        self.init_prompt_ = torch.rand(*self._shape, generator=self._gen) * 2 - 1
        self.pool_: list[nn.Parameter] = []
        self.keys_: list[nn.Parameter] = []
        o = self.options_
        self.groups_ = SemanticGroups(
            o.converge_thrh, o.postmerge_thrh, o.mergable_prompts, o.remerge_samples, o.kmeans_run,
            o.kmeans_top_n, self.config.seed,
        )  # fmt: skip
        self.decisions_: list[Decision] = []
        self._train_pids = torch.zeros(0, dtype=torch.long)

    @property
    def evolve_epoch(self) -> int:
        """The release's ``evolve_epoch`` of this benchmark (:data:`EVOLVE_EPOCH`); the warm-up is one
        epoch more."""
        name = self.config.benchmark.name
        return next((e for k, e in EVOLVE_EPOCH.items() if name.startswith(k)), EVOLVE_EPOCH["cifar100"])

    def left_epochs(self, d: Decision) -> int:
        """The epochs after the warm-up the release gives a decision (before the ``train.epochs`` cap)."""
        if d.kind == "first":
            return self.options_.first_task_epochs
        if d.kind == "merge":
            n = len(d.train_pids)
            return (
                min(self.options_.mergable_epochs * n, self.options_.max_mergable_epochs)
                if n > 1
                else self.options_.max_mergable_epochs
            )
        return self.options_.spcf_epochs if d.kind == "specific" else self.options_.uni_epochs

    # ------------------------------------------------------------------ the pool
    def _new_prompt(self, prompt: torch.Tensor, key: torch.Tensor) -> int:
        cap = self.options_.pool_size
        if len(self.pool_) >= cap:
            raise ConfigError(f"adapromptcl: the prompt pool (baseline.pool_size={cap}) is full; raise it")
        self.pool_.append(self._frozen(prompt.detach().cpu().clone()))
        self.keys_.append(self._frozen(key.detach().cpu().clone()))
        return len(self.pool_) - 1

    def _params(self) -> dict[str, nn.Parameter]:
        out = {}
        for i, (p, k) in enumerate(zip(self.pool_, self.keys_)):
            out[f"e.{i}"], out[f"key.{i}"] = p, k
        return out

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        # what a failed task must give back: a shared group's prompt is trained in place
        prompts = [p.detach().clone() for p in self.pool_]
        keys = [q.detach().clone() for q in self.keys_]
        self._snapshot = (copy.deepcopy(self.groups_), len(self.pool_), prompts, keys)
        key = torch.rand(self.embed_dim, generator=self._gen) * 2 - 1
        self._cand = self._new_prompt(self.init_prompt_, key)

    def abort_task(self, k: int) -> None:
        snap = getattr(self, "_snapshot", None)
        if snap is None or not hasattr(self, "groups_"):
            return
        groups, n, prompts, keys = snap
        del self.pool_[n:], self.keys_[n:], self.decisions_[k:]
        with torch.no_grad():
            for p, old in zip(self.pool_, prompts):
                p.copy_(old)
            for q, old in zip(self.keys_, keys):
                q.copy_(old)
        for p in [*self.pool_, *self.keys_]:
            p.requires_grad_(False)
        self.groups_ = groups

    def trainable(self) -> list[nn.Parameter]:
        pids = sorted(set(self._train_pids.tolist()))
        return [*(self.pool_[i] for i in pids), *(self.keys_[i] for i in pids)]

    # ------------------------------------------------------------------ forward
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """(B,) the prompt of each query: the most cosine-similar key among the prompts in use (top 1)."""
        pids = self.groups_.inference_pids if hasattr(self, "groups_") else []
        if not pids:
            raise NotFittedError("adapromptcl: no prompts in use yet; call fit_task first")
        keys = torch.stack([self.keys_[i] for i in pids])
        best = (F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T).argmax(1)
        return torch.as_tensor(pids, device=q.device)[best]

    def prompted(self, z: torch.Tensor, pid: torch.Tensor) -> torch.Tensor:
        """(B, d) the class token after the final norm with each input's prompt ``pid`` as prefixes."""
        uniq, inv = pid.unique(return_inverse=True)
        E = torch.stack([self.pool_[int(i)] for i in uniq])[inv]  # (B, n_e, 2, L, d)
        prefixes = {layer: (E[:, j, 0], E[:, j, 1]) for j, layer in enumerate(self.options_.prompt_layers)}
        return self.run_blocks(self.tokens(z), prefixes)[:, 0]

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        """Training: each input under one of the phase's prompts (at random when several), its key pulled
        towards the query. Inference: under the prompt of its best key."""
        q = self.query(z)
        B = q.shape[0]
        if not train:
            return self.prompted(z, self.select(q))
        choices = self._train_pids
        pick = (
            torch.randint(len(choices), (B,), generator=self._gen)
            if len(choices) > 1
            else torch.zeros(B, dtype=torch.long)
        )
        pid = choices[pick].to(q.device)
        keys = torch.stack([self.keys_[int(i)] for i in choices])[pick.to(q.device)]
        cos = F.cosine_similarity(q, keys, dim=-1)
        self.aux_loss = -self.options_.match_weight * cos.sum() / B
        return self.prompted(z, pid)

    # ------------------------------------------------------------------ training
    def planned_epochs(self) -> int:
        """The warm-up's epochs, then ``train.epochs``."""
        return self.evolve_epoch + 1 + int(self.config.train.epochs)

    def train_epochs(self, run: OpenTask) -> None:
        """The release's phases of a task within the shared loop: a warm-up of the candidate prompt, its key
        and the head; the semantic-group decision (:meth:`SemanticGroups.assign`); then the decision's
        prompts for the epochs it leaves, the head reset to its pre-warm-up state (from the second task on,
        and before the last ``head_last_epochs``) with a new optimiser."""
        W, E = self.evolve_epoch + 1, int(self.config.train.epochs)
        head0 = {n: t.detach().clone() for n, t in run.head.state_dict().items()}

        def phase(pids: list[int]) -> tuple[list[nn.Parameter], Any]:
            for p in [*self.pool_, *self.keys_]:
                p.requires_grad_(False)
            self._train_pids = torch.as_tensor(pids, dtype=torch.long)
            own = self.trainable()
            for p in own:
                p.requires_grad_(True)
            return self.optimiser(run, own)

        params, opt = phase([self._cand])  # warm-up: the candidate prompt, its key and the head
        for e in range(W):
            self.run_epoch(run, e, W + E, params, opt)
        warm = warmup_vector(self.pool_[self._cand])
        decision = self.groups_.assign(run.k, warm, self._cand, len(self.pool_))
        for pid, base in decision.new_prompts:
            assert pid == len(self.pool_)
            self._new_prompt(self.pool_[base], self.keys_[base])
        if run.k > 0:  # the release restores the head after the warm-up from the second task on
            run.head.load_state_dict(head0)
        left = self.left_epochs(decision)
        params, opt = phase(decision.train_pids)
        resets = {left + W - 1 - self.options_.head_last_epochs, E + W - 1 - self.options_.head_last_epochs}
        trained = 0
        for e in range(W - 1, W + min(left, E)):
            if e >= W:
                self.run_epoch(run, e, W + E, params, opt)
                trained += 1
            if e in resets:  # reinit_clf: the head from its pre-warm-up state, a new optimiser
                run.head.load_state_dict(head0)
                params, opt = phase(decision.train_pids)
        opt.zero_grad(set_to_none=True)
        for p in [*self.pool_, *self.keys_, *run.head.parameters()]:
            p.requires_grad_(False)
        self._train_pids = torch.zeros(0, dtype=torch.long)
        self.decisions_.append(decision)
        run.extra.update(group=decision.kind, prompts=list(decision.train_pids), epochs_after_warmup=trained)

    # ------------------------------------------------------------------ persistence
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update(
            {f"warmup.{t}": torch.from_numpy(v).contiguous() for t, v in enumerate(self.groups_.vectors)}
        )
        return out

    def state(self) -> LearnerState:
        """The per-task records with each task's group decision; the grouping (:meth:`SemanticGroups.to_meta`)
        in the global meta, its warm-up vectors as ``warmup.<t>`` tensors."""
        st = super().state()
        for (rec, _), d in zip(st.tasks, self.decisions_):
            rec["prompt_group"] = d.to_record()
        assert st.head is not None
        st.head[0]["groups"] = self.groups_.to_meta()
        return st

    def restore(self, state: LearnerState) -> AdaPromptCL:
        """As every baseline (:meth:`load_state`), then each task's group decision from its record."""
        super().restore(state)
        self.decisions_ = [Decision.from_record(k, rec) for k, (rec, _) in enumerate(state.tasks)]
        return self

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The pool (frozen prompts ``prompt.e.<i>`` and keys), the grouping from the meta's ``groups`` and
        the warm-up vectors, then as every prompt method."""
        for _ in range(sum(n.startswith("prompt.e.") for n in tensors)):
            self._new_prompt(self.init_prompt_, torch.zeros(self.embed_dim))
        vectors = [need(tensors, f"warmup.{t}").double().numpy() for t in range(self.num_tasks)]
        self.groups_ = SemanticGroups.from_meta(meta["groups"], vectors)
        super().load_state(meta, tensors)


declare(
    "adapromptcl",
    "AdaPromptCL (Kim et al., ICML 2024): e-prompts shared by semantic groups of tasks (BIRCH / K-Means)",
    base=None,
    learner="adapromptcl",
    baseline__optimizer="adam", baseline__lr=0.025 * 128 / 256, baseline__schedule="constant",
    baseline__pool_size=300, baseline__prompt_length=8, baseline__prompt_layers=[0, 1, 2, 3, 4],
    baseline__match_weight=1.0, baseline__clip_grad=1.0,
)  # fmt: skip
