"""The continual learner: PROTEUS training (Algorithm 1) and inference (Algorithm 2), and its variants.

For each task k (Algorithm 1):
  line 5   learn the adapter dW_k by Eq. 15 (cross-entropy over the task's classes, elastic net on S,
           new directions orthogonal to the old ones)                  -> :meth:`_train_adapter`
  line 6   fit the multi-key signature (Eq. 18) on h_k(x), x in D_k    -> :func:`fit_signature`
  line 7   add (multi-key, value) to the KB                           -> :meth:`save` / :mod:`proteus.kb`
  8-12     accumulate G and e(c) from h_k(x)                           -> :class:`RanPACHead`

At test time (Algorithm 2) every input is embedded under every task's adapter in one batched forward,
the (task, component) with the best signature score is retrieved, and Eq. 23 classifies the embedding
under the retrieved adapter (:meth:`predict`).

A method is configuration over these parts (:mod:`proteus.methods`): which adapters are trained
(``train.tasks``), how S enters (``adapter.transfer``), and which composition embeds an input
(``retrieval.mode``: signature retrieval, the first adapter, the last one, or all units summed).

Reliability (GitHub issue 4): :meth:`ContinualLearner.learn_task` is transactional -- when it raises, the
task's adapter and head update are undone and the learner is the one that held the earlier tasks. Under
``torchrun`` the embedding passes are sharded by batches across ranks and the adapter training is
data-parallel with summed gradients (:mod:`proteus.distributed`). :func:`~proteus.faults.crash_point`
marks the phases that the crash-safety tests kill.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from proteus import distributed as dist
from proteus.adapters import AdaptedBackbone
from proteus.backbones import build_backbone
from proteus.backbones.transforms import build_transform
from proteus.config import RunConfig
from proteus.faults import crash_point
from proteus.heads import RanPACHead
from proteus.signatures import RetrievalResult, Signature, fit_signature, retrieve
from proteus.signatures.dpgmm import SignatureFitError

log = logging.getLogger("proteus")


#: ``signature.keys`` whose keys are an LDA head over all classes in one fixed space (docs/retrieval.md)
LDA_KEYS = ("frozen-lda", "first-adapter-lda")

class TaskError(ValueError):
    """Bad task input (names the task or class at fault)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available; under torchrun ``auto``/``cuda`` mean ``cuda:LOCAL_RANK``."""
    return dist.device_for_rank(name)


class _Images(Dataset):
    """Applies a transform to a (PIL image, label) dataset and returns (tensor, label)."""

    def __init__(self, ds: Dataset, transform: Callable) -> None:
        self.ds, self.transform = ds, transform

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img, y = self.ds[i]
        return self.transform(img), int(y)


@dataclass
class Prediction:
    label: torch.Tensor  # (N,) global class
    task: torch.Tensor | None  # (N,) retrieved task (None without retrieval)
    component: torch.Tensor | None
    score: torch.Tensor | None  # (N,) best signature score (lower = better)
    logits: torch.Tensor  # (N, C) head scores


class ContinualLearner:
    """One continual learner (method = configuration). Fitted state lives in attributes ending in ``_``."""

    def __init__(self, config: RunConfig, progress: bool = True) -> None:
        self.cfg = config
        self.progress = progress and dist.is_main()  # one set of progress bars under torchrun
        self.device = resolve_device(config.device)
        bcfg = config.backbone
        self.backbone = build_backbone(
            bcfg.name,
            pretrained=bcfg.pretrained,
            weights=bcfg.weights,
            img_size=bcfg.img_size,
            adapt_last=bcfg.adapt_last,
        )
        self.model_ = AdaptedBackbone(
            self.backbone, scaling=config.adapter.scaling, enabled=config.adapter.enabled
        ).to(self.device)
        self.eval_transform = build_transform(self.backbone.data_config, train=False)
        self.train_transform = build_transform(
            self.backbone.data_config, train=True, augment=config.train.augment
        )
        self.tasks_: list[dict[str, Any]] = []
        self.signatures_: list[Signature | None] = []
        #: signatures on the frozen backbone's features (``signature.keys`` "frozen" / "adapter+frozen")
        self.frozen_signatures_: list[Signature | None] = []
        #: ``signature.keys`` "frozen-lda" / "first-adapter-lda": an LDA (ridge) head over all classes in
        #: one fixed key space (the frozen backbone's features, or the first task's adapter, which never
        #: changes after task 1), accumulated like G; a task's key is its classes' scores (Eq. 23 form)
        self.task_head_: RanPACHead | None = None
        self.head_: RanPACHead | None = None
        self.amp = self.device.type == "cuda"

    # ================================================================== properties
    @property
    def num_tasks(self) -> int:
        return len(self.tasks_)

    @property
    def num_adapters(self) -> int:
        return self.model_.num_tasks

    @property
    def num_classes(self) -> int:
        return 1 + max((max(t["classes"]) for t in self.tasks_), default=-1)

    @property
    def uses_retrieval(self) -> bool:
        return self.cfg.retrieval.mode == "signature" and self.num_adapters > 0

    def task_seed(self, k: int) -> int:
        return int(self.cfg.seed) * 100_003 + 7919 * (k + 1)

    def class_names(self) -> list[str]:
        names: dict[int, str] = {}
        for t in self.tasks_:
            names.update(zip(t["classes"], t["class_names"]))
        return [names.get(c, str(c)) for c in range(self.num_classes)]

    # ================================================================== data
    def _loader(self, ds: Dataset, shuffle: bool, seed: int, batch_size: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        return DataLoader(
            ds, batch_size=batch_size, shuffle=shuffle, generator=g, num_workers=self.cfg.train.num_workers
        )

    def _bar(self, it: Iterable, desc: str, total: int | None = None) -> Iterable:
        return tqdm(it, desc=desc, total=total, disable=not self.progress, leave=False, dynamic_ncols=True)

    @torch.no_grad()
    def prefix_dataset(self, ds: Dataset, desc: str = "prefix") -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen-prefix outputs of a dataset under the evaluation transform (cacheable: the prefix is
        shared by all tasks)."""
        if len(ds) == 0:  # type: ignore[arg-type]
            raise TaskError(f"{desc}: empty dataset")
        zs, ys = [], []
        bs = self.cfg.eval.batch_size
        images: Dataset = _Images(ds, self.eval_transform)
        n = len(images)  # type: ignore[arg-type]
        if dist.is_distributed():  # this rank's block of whole batches (proteus.distributed)
            mine = dist.shard_range(math.ceil(n / bs))
            images = Subset(images, range(mine.start * bs, min(mine.stop * bs, n)))
        for x, y in self._bar(self._loader(images, False, 0, bs), desc):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                z = self.model_.prefix(x.to(self.device))
            zs.append(z.float())
            ys.append(y)
        z_all = dist.all_gather_rows(torch.cat(zs) if zs else None)
        y_all = dist.all_gather_rows(torch.cat(ys) if ys else None)
        assert z_all is not None and y_all is not None
        return z_all, y_all

    @torch.no_grad()
    def embed_prefix(
        self,
        z: torch.Tensor,
        tasks: list[int] | None,
        kind: str = "task",
        batch_size: int | None = None,
        shard: bool = True,
    ) -> torch.Tensor:
        """Embed cached prefix outputs: (G, N, d) for ``tasks`` (None: the plain backbone, (1, N, d)).

        Under torchrun (and ``shard``) each rank embeds its block of whole chunks and the result is gathered
        in the original order; every rank must then call this with the same ``z``."""
        bs = batch_size or self.cfg.eval.batch_size
        groups = tasks if tasks is not None else [None]
        # about one evaluation batch per forward in total (G groups x per images): large batches run
        # slower per image on CPU caches, and memory stays bounded for many tasks
        per = max(1, bs // max(1, len(groups)))
        starts = range(0, z.shape[0], per)
        sharded = shard and dist.is_distributed()
        if sharded:
            mine = dist.shard_range(len(starts))
            starts = starts[mine.start : mine.stop]
        out = []
        for i in starts:
            zb = z[i : i + per].to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                if tasks is None:
                    h = self.model_.suffix(zb)[None]
                else:
                    h = self.model_.suffix(zb, tasks, kind)
            out.append(h.float().cpu())
        if sharded:
            local = torch.cat(out, 1).transpose(0, 1) if out else None
            gathered = dist.all_gather_rows(local)  # (N, G, d), rows in the original order
            assert gathered is not None
            return gathered.transpose(0, 1).contiguous()
        return torch.cat(out, 1)

    # ================================================================== training (Algorithm 1)
    def _rank_for(self, k: int) -> int:
        a = self.cfg.adapter
        if a.budget_decay is None:
            return a.rank
        return max(a.min_rank, int(round(a.rank * math.exp(-a.budget_decay * k))))

    def lam_for(self, k: int) -> float:
        """lambda for task k (0-based): initial lambda decayed by ``lam_decay`` after each task."""
        return self.cfg.adapter.lam * self.cfg.adapter.lam_decay**k

    def _trains_adapter(self, k: int) -> bool:
        mode = self.cfg.train.tasks
        if not self.cfg.adapter.enabled or mode == "none":
            return False
        return mode == "all" or (mode == "first" and k == 0)

    def head_composition(self, k: int) -> tuple[list[int] | None, str]:
        """Which composition embeds inputs for the head and for prediction, as of task k (0-based)."""
        mode = self.cfg.retrieval.mode
        m = self.num_adapters
        if m == 0 or mode == "none":
            return None, "task"
        if mode == "first":
            return [0], "task"
        if mode == "all-units":
            return [min(k, m - 1)], "all-units"
        return [min(k, m - 1)], "task"  # signature (own adapter) and last

    def _penalty(self, lam: float) -> torch.Tensor:
        a = self.cfg.adapter
        tot = torch.zeros((), device=self.device)
        for s in self.model_.transfer_parameters():
            tot = tot + a.alpha * s.abs().sum() + (1 - a.alpha) * s.norm()
        return lam * tot

    @torch.no_grad()
    def _prox(self, lam: float) -> None:
        """Proximal step of the elastic net on S: soft-threshold (l1) then group shrinkage (l2)."""
        a = self.cfg.adapter
        eta = a.s_lr
        for s in self.model_.transfer_parameters():
            if s.grad is not None:
                s -= eta * s.grad
            s.copy_(torch.sign(s) * (s.abs() - eta * lam * a.alpha).clamp_min(0))
            n = s.norm()
            if n > 0:
                s.mul_((1 - eta * lam * (1 - a.alpha) / n).clamp_min(0))

    def _train_adapter(self, task: Any, k: int, z_train: torch.Tensor | None, y_train: torch.Tensor) -> dict:
        cfg, a = self.cfg, self.cfg.adapter
        seed = self.task_seed(k)
        torch.manual_seed(seed)
        rank = self._rank_for(k)
        ranks = self.model_.begin_task(rank, a.transfer, a.orthogonal, seed)
        if min(ranks.values()) < rank:
            capped = {n: r for n, r in ranks.items() if r < rank}
            log.warning(
                "task %d: rank reduced on %d maps (no orthogonal room left): %s", k, len(capped), capped
            )
        classes = list(task.classes)
        local = {c: i for i, c in enumerate(classes)}
        clf = nn.Linear(self.model_.embed_dim, len(classes)).to(self.device)
        params: list[nn.Parameter] = self.model_.lora_parameters() + list(clf.parameters())
        s_params = self.model_.transfer_parameters()
        if a.s_update == "adam":
            params += s_params
        elif a.s_update != "prox":
            raise ValueError(f"adapter.s_update must be 'prox' or 'adam', got {a.s_update!r}")
        opt = torch.optim.Adam(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        lam = self.lam_for(k)
        y_local = torch.as_tensor([local[int(c)] for c in y_train.tolist()])
        g = torch.Generator().manual_seed(seed)
        losses = []
        n = y_local.shape[0]
        bs = cfg.train.batch_size
        steps = cfg.train.epochs * math.ceil(n / bs)
        bar = self._bar(range(steps), f"task {k + 1}: train", total=steps)
        it = iter(())
        img_loader = None
        if z_train is None:
            img_loader = self._loader(_Images(task.train, self.train_transform), True, seed, bs)
        # under torchrun each rank trains on its block of every batch; gradients are summed across ranks
        # (proteus.distributed: weighted so that the sum is the full batch's gradient)
        distributed = dist.is_distributed()
        trainable = params + [s for s in s_params if all(s is not q for q in params)]
        part = 1.0
        for _ in bar:
            if z_train is not None:
                try:
                    idx = next(it)
                except StopIteration:
                    it = iter(torch.randperm(n, generator=g).split(bs))
                    idx = next(it)
                if distributed:
                    mine = dist.shard_range(len(idx))
                    part, idx = len(mine) / len(idx), idx[mine.start : mine.stop]
                zb, yb = z_train[idx].to(self.device), y_local[idx].to(self.device)
            else:
                try:
                    xb, yb_g = next(it)
                except StopIteration:
                    it = iter(img_loader)
                    xb, yb_g = next(it)
                if distributed:
                    mine = dist.shard_range(len(yb_g))
                    part = len(mine) / len(yb_g)
                    xb, yb_g = xb[mine.start : mine.stop], yb_g[mine.start : mine.stop]
                zb = self.model_.prefix(xb.to(self.device))
                yb = torch.as_tensor([local[int(c)] for c in yb_g.tolist()], device=self.device)
            opt.zero_grad(set_to_none=True)
            for s in s_params:
                s.grad = None
            loss = torch.zeros((), device=self.device)
            if len(yb):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                    h = self.model_.suffix(zb)
                    loss = F.cross_entropy(clf(h.float()), yb)
                penalty = self._penalty(lam) if a.s_update == "adam" and s_params else 0.0
                if distributed:
                    total = loss * part + penalty / dist.world_size()
                else:
                    total = loss + penalty
                total.backward()
            if distributed:
                loss = self._all_reduce_grads(trainable, loss.detach() * part)
            opt.step()
            if a.s_update == "prox" and s_params:
                self._prox(lam)
            losses.append(float(loss.detach()))
            if hasattr(bar, "set_postfix") and len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if distributed:  # identical on every rank already; make it bit-identical whatever the hardware
            dist.broadcast_(self.model_.lora_parameters() + s_params)
        s_all = torch.cat([s.detach().flatten() for s in s_params]) if s_params else torch.zeros(0)
        self.model_.end_task()
        return {
            "rank": rank,
            "ranks_min": min(ranks.values()) if ranks else 0,
            "lambda": lam,
            "loss_first": float(np.mean(losses[: max(1, len(losses) // 10)])) if losses else None,
            "loss_last": float(np.mean(losses[-max(1, len(losses) // 10) :])) if losses else None,
            "steps": steps,
            "s_mean_abs": float(s_all.abs().mean()) if s_all.numel() else None,
            "s_nonzero_frac": float((s_all != 0).float().mean()) if s_all.numel() else None,
        }

    @staticmethod
    def _all_reduce_grads(tensors: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients of ``tensors`` and ``loss`` over ranks in one flat all_reduce; returns the
        summed loss. A tensor without a gradient on every rank keeps ``grad = None``."""
        dev = loss.device
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
        parts = [g.reshape(-1).float().to(dev) for g in grads]
        flags = torch.tensor([float(t.grad is not None) for t in tensors], device=dev)
        flat = torch.cat([*parts, flags, loss.reshape(1).float()])
        dist.all_reduce_sum_(flat)
        i = 0
        for t, flag in zip(tensors, flat[-1 - len(tensors) : -1].tolist()):
            n = t.numel()
            t.grad = flat[i : i + n].view_as(t).to(t.dtype).clone() if flag > 0 else None
            i += n
        return flat[-1]

    def _use_prefix_cache(self) -> bool:
        mode = self.cfg.train.cache_prefix
        if self.cfg.train.augment:
            return False
        return mode in ("auto", "true", True)

    def learn_task(self, task: Any) -> dict[str, Any]:
        """Learn one task (Algorithm 1, lines 5-12). Returns timing and diagnostic statistics."""
        k = self.num_tasks
        if task.index != k:
            raise TaskError(f"task {task.index + 1}: the learner holds {k} tasks, so task {k + 1} comes next")
        if len(task.train) == 0:
            raise TaskError(f"task {task.index + 1}: the training set is empty")
        seen = {c for t in self.tasks_ for c in t["classes"]}
        dup = sorted(seen & set(task.classes))
        if dup:
            names = [task.class_names[task.classes.index(c)] for c in dup]
            raise TaskError(f"task {k + 1}: classes {names} already belong to an earlier task")
        # Transactional: if anything below raises (bad data, a failed fit, KeyboardInterrupt), the adapter
        # opened or appended for this task and the head update are undone, so the learner is exactly the
        # one that held k tasks (signatures_ and tasks_ are only appended after the last step that can fail).
        m0, head0, thead0 = self.num_adapters, self.head_, self.task_head_
        try:
            return self._learn_task(task, k)
        except BaseException:
            self._rollback_adapter(m0)
            self.head_ = head0  # RanPACHead.update is atomic: it raises before changing the head
            self.task_head_ = thead0
            raise

    def _learn_task(self, task: Any, k: int) -> dict[str, Any]:
        stats: dict[str, Any] = {"task": k}
        t0 = time.perf_counter()
        z_train, y_train = self.prefix_dataset(task.train, f"task {k + 1}: prefix")
        stats["seconds_prefix"] = time.perf_counter() - t0
        crash_point("learn:prefix")
        t0 = time.perf_counter()
        if self._trains_adapter(k):
            stats["train"] = self._train_adapter(
                task, k, z_train if self._use_prefix_cache() else None, y_train
            )
        stats["seconds_train"] = time.perf_counter() - t0
        crash_point("learn:train")

        # line 6: signature of the task's embeddings under its own adapter
        t0 = time.perf_counter()
        sig = None
        if self.cfg.retrieval.mode == "signature" and self.cfg.signature.keys in LDA_KEYS:
            # a copy (d x d statistics, cheap): a later step of this task may still fail, and the rollback
            # must find the key head as it was before the task
            old = self.task_head_
            thead = copy.deepcopy(old) if old is not None else self._new_head(rp_dim=0)
            try:
                thead.update(
                    self._lda_key_features(z_train).to(self.device),
                    y_train.to(self.device),
                    num_classes=max(task.classes) + 1,
                )
            except (ValueError, FloatingPointError) as e:
                raise TaskError(f"task {k + 1}: LDA key update failed: {e}") from None
            self.task_head_ = thead
        elif self.cfg.retrieval.mode == "signature" and self.num_adapters > 0:
            h_own = self.embed_prefix(z_train, [min(k, self.num_adapters - 1)])[0]
            try:
                sig = fit_signature(h_own.to(self.device), self.cfg.signature, seed=self.task_seed(k))
            except SignatureFitError as e:
                raise TaskError(f"task {k + 1}: signature fit failed: {e}") from None
            stats["signature"] = {"n_active": int(sig.n_active)}
        fsig = None
        if self.cfg.retrieval.mode == "signature" and self.cfg.signature.keys in ("frozen", "adapter+frozen"):
            h_frozen = self.embed_prefix(z_train, None)[0]
            try:
                fsig = fit_signature(h_frozen.to(self.device), self.cfg.signature, seed=self.task_seed(k) + 1)
            except SignatureFitError as e:
                raise TaskError(f"task {k + 1}: frozen-key signature fit failed: {e}") from None
            stats.setdefault("signature", {})["n_active_frozen"] = int(fsig.n_active)
        stats["seconds_signature"] = time.perf_counter() - t0
        crash_point("learn:signature")

        # lines 8-12: head statistics from the embeddings the method predicts with
        t0 = time.perf_counter()
        tasks, kind = self.head_composition(k)
        h_head = self.embed_prefix(z_train, tasks, kind)[0]
        if not torch.isfinite(h_head).all():
            n_bad = int((~torch.isfinite(h_head)).any(1).sum())
            raise TaskError(f"task {k + 1}: embeddings contain NaN or inf ({n_bad} of {len(h_head)} images)")
        head = self.head_ if self.head_ is not None else self._new_head()
        try:
            head.update(h_head.to(self.device), y_train.to(self.device), num_classes=max(task.classes) + 1)
        except (ValueError, FloatingPointError) as e:
            raise TaskError(f"task {k + 1}: head update failed: {e}") from None
        self.head_ = head
        stats["seconds_head"] = time.perf_counter() - t0
        stats["gamma"] = float(head.gamma_)
        crash_point("learn:head")
        self.signatures_.append(sig)
        self.frozen_signatures_.append(fsig)
        self.tasks_.append(
            {
                "index": k,
                "classes": [int(c) for c in task.classes],
                "class_names": list(task.class_names),
                "n_train": int(len(task.train)),
                "has_adapter": self._trains_adapter(k),
                "stats": stats,
            }
        )
        return stats

    def _rollback_adapter(self, m: int) -> AdaptedBackbone:
        """Undo a task's adapter: close a task still being trained and drop every adapter after the first
        ``m`` (the in-memory state is then the one before the task)."""
        for u in self.model_.units.values():
            if u.training_task:
                u.A_new = u.B_new = u.s = None
                u.s_fixed = torch.zeros(0, device=u.A.device, dtype=u.A.dtype)
                u.basis = torch.zeros(u.in_features, 0, device=u.A.device, dtype=u.A.dtype)
            if u.num_tasks > m:
                cols = u.columns(m)
                u.A, u.B = u.A[:, : cols.start], u.B[:, : cols.start]
                u.C = u.C[:m, : cols.start]
                u.ranks = u.ranks[:m]
        return self.model_

    # ================================================================== inference (Algorithm 2)
    @property
    def uses_frozen_keys(self) -> bool:
        return self.cfg.signature.keys in ("frozen", "adapter+frozen", "frozen-lda")

    def retrieve_embeddings(self, H: torch.Tensor, F: torch.Tensor | None = None) -> Any:
        """H: (m, N, d), embeddings under the first m tasks' adapters; F: (N, d) frozen-backbone features
        (needed with ``signature.keys`` "frozen" or "adapter+frozen") -> RetrievalResult over those tasks.

        With two keys a task's score is the sum of its adapter-key and frozen-key scores (each reduced
        over its components as the retrieval rule says); the component reported is the adapter key's."""
        m = H.shape[0]
        top_k = self.cfg.retrieval.top_k
        keys = self.cfg.signature.keys
        if keys == "frozen-lda":
            return self._retrieve_lda(m, F)
        if keys == "first-adapter-lda":
            return self._retrieve_lda(m, H[0])
        res = None
        if keys != "frozen":
            sigs = self.signatures_[:m]
            res = retrieve([s.score(H[j].to(s.device)).cpu() for j, s in enumerate(sigs) if s], top_k)
        if keys == "adapter":
            return res
        if F is None:
            raise ValueError(f"signature.keys={keys!r} needs the frozen-backbone features F")
        fsigs = self.frozen_signatures_[:m]
        fres = retrieve([s.score(F.to(s.device)).cpu() for s in fsigs if s], top_k)
        if res is None:
            return fres
        total = res.task_scores + fres.task_scores
        task = total.argmin(1)
        rows = torch.arange(len(task))
        res.task, res.score, res.task_scores = task, total[rows, task], total
        component = torch.zeros_like(task)  # the chosen task's best adapter-key component
        for t in task.unique().tolist():
            idx = (task == t).nonzero().flatten()
            sig = self.signatures_[t]
            component[idx] = sig.score(H[t, idx].to(sig.device)).cpu().argmin(1)
        res.component = component
        return res

    def _lda_key_features(self, z: torch.Tensor) -> torch.Tensor:
        """Training inputs (cached prefix outputs) in the LDA key space, normalised as
        ``signature.normalize`` says."""
        if self.cfg.signature.keys == "frozen-lda":
            X = self.embed_prefix(z, None)[0]
        else:  # "first-adapter-lda": the space of the first task's adapter, frozen since task 1
            if self.num_adapters == 0:
                raise TaskError("signature.keys='first-adapter-lda' needs the first task to train an adapter")
            X = self.embed_prefix(z, [0])[0]
        return self._normalise_keys(X)

    def _normalise_keys(self, X: torch.Tensor) -> torch.Tensor:
        return F.normalize(X.float(), dim=1) if self.cfg.signature.normalize == "l2" else X

    def _retrieve_lda(self, m: int, X: torch.Tensor | None) -> Any:
        """Task retrieval by the LDA keys: X holds the inputs in the key space (frozen features, or the
        embeddings under the first adapter); a task's score is minus its best class score."""
        keys = self.cfg.signature.keys
        if X is None or self.task_head_ is None:
            raise ValueError(f"signature.keys={keys!r} needs its key-space features and a fitted key head")
        X = self._normalise_keys(X)
        logits = self.task_head_.decision_function(X.to(self.device)).float().cpu()
        scores = torch.full((X.shape[0], m), float("inf"))
        for j, t in enumerate(self.tasks_[:m]):
            scores[:, j] = -logits[:, t["classes"]].max(1).values
        task = scores.argmin(1)
        rows = torch.arange(len(task))
        return RetrievalResult(
            task=task, component=torch.zeros_like(task), score=scores[rows, task], task_scores=scores
        )

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        assert self.head_ is not None, "no task learned yet"
        return self.head_.decision_function(h.to(self.device)).float().cpu()

    @torch.no_grad()
    def predict(self, x: torch.Tensor, num_tasks: int | None = None) -> Prediction:
        """Algorithm 2 on a batch of transformed images: one batched forward under all adapters.

        ``num_tasks = m`` retrieves among the first m tasks only (adapters and signatures; the head stays
        the full one): the inference latency as a function of m (App. "Complexity of PROTEUS Inference").
        """
        if self.head_ is None:
            raise RuntimeError("predict called before any task was learned")
        m = self.num_tasks if num_tasks is None else max(1, min(int(num_tasks), self.num_tasks))
        z = self.model_.prefix(x.to(self.device))
        if self.uses_retrieval:
            H = self.embed_prefix(z, list(range(min(m, self.num_adapters))), shard=False)
            F = self.embed_prefix(z, None, shard=False)[0] if self.uses_frozen_keys else None
            res = self.retrieve_embeddings(H, F)
            h = H[res.task, torch.arange(H.shape[1])]
            logits = self.classify(h)
            return Prediction(logits.argmax(1), res.task, res.component, res.score, logits)
        tasks, kind = self.head_composition(m - 1)
        h = self.embed_prefix(z, tasks, kind, shard=False)[0]
        logits = self.classify(h)
        return Prediction(logits.argmax(1), None, None, None, logits)

    def transform_images(self, images: list) -> torch.Tensor:
        return torch.stack([self.eval_transform(im) for im in images])

    # ================================================================== state for the KB
    def state(self) -> dict[str, Any]:
        """Everything a knowledge base needs, as JSON metadata and tensors per task."""
        out = {"tasks": [], "head": None}
        for k, t in enumerate(self.tasks_):
            tensors: dict[str, torch.Tensor] = {}
            if t["has_adapter"]:
                for name, u in self.model_.units.items():
                    for key, v in u.task_tensors(k).items():
                        tensors[f"adapter/{name}/{key}"] = v
            sig_meta = None
            sig = self.signatures_[k]
            if sig is not None:
                st, sig_meta = sig.to_tensors()
                tensors.update({f"signature/{n}": v for n, v in st.items()})
            fsig_meta = None
            fsig = self.frozen_signatures_[k] if k < len(self.frozen_signatures_) else None
            if fsig is not None:
                st, fsig_meta = fsig.to_tensors()
                tensors.update({f"frozen_signature/{n}": v for n, v in st.items()})
            out["tasks"].append(
                {"meta": {**t, "signature": sig_meta, "frozen_signature": fsig_meta}, "tensors": tensors}
            )
        if self.head_ is not None:
            meta, tensors = self.head_.meta(), self.head_.state_tensors()
            if self.task_head_ is not None:  # the LDA keys travel in the head's object
                meta = {**meta, "task_head": self.task_head_.meta()}
                tensors = {
                    **tensors,
                    **{f"task_head/{n}": v for n, v in self.task_head_.state_tensors().items()},
                }
            out["head"] = {"meta": meta, "tensors": tensors}
        return out

    def load_task(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        k = self.num_tasks
        if meta["index"] != k:
            raise TaskError(f"knowledge base task {meta['index'] + 1} is out of order (expected {k + 1})")
        if meta["has_adapter"]:
            for name, u in self.model_.units.items():
                key = f"adapter/{name}"
                if f"{key}/A" not in tensors:
                    raise TaskError(
                        f"task {k + 1}: adapter tensors for {name!r} missing from the knowledge base"
                    )
                u.append_task(tensors[f"{key}/A"], tensors[f"{key}/B"], tensors[f"{key}/s"])
        sig = None
        if meta.get("signature") is not None:
            st = {n[len("signature/") :]: v for n, v in tensors.items() if n.startswith("signature/")}
            sig = Signature.from_tensors(st, meta["signature"]).to(self.device)
        self.signatures_.append(sig)
        fsig = None
        if meta.get("frozen_signature") is not None:
            pre = "frozen_signature/"
            st = {n[len(pre) :]: v for n, v in tensors.items() if n.startswith(pre)}
            fsig = Signature.from_tensors(st, meta["frozen_signature"]).to(self.device)
        self.frozen_signatures_.append(fsig)
        keys = ("signature", "frozen_signature")
        self.tasks_.append({key: v for key, v in meta.items() if key not in keys})

    def _new_head(self, rp_dim: int | None = None) -> RanPACHead:
        h = self.cfg.head
        return RanPACHead(
            self.model_.embed_dim,
            rp_dim=h.rp_dim if rp_dim is None else rp_dim,
            gamma_min_exp=h.gamma_min_exp,
            gamma_max_exp=h.gamma_max_exp,
            holdout=h.holdout,
            selection=h.gamma_selection,
            seed=self.cfg.seed,
            device=self.device,
        )

    def load_head(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        pre = "task_head/"
        own = {k: v.to(self.device) for k, v in tensors.items() if not k.startswith(pre)}
        self.head_ = self._new_head()
        self.head_.load_state_tensors(own, {k: v for k, v in meta.items() if k != "task_head"})
        if "task_head" in meta:
            th = {k[len(pre) :]: v.to(self.device) for k, v in tensors.items() if k.startswith(pre)}
            self.task_head_ = self._new_head(rp_dim=0)
            self.task_head_.load_state_tensors(th, meta["task_head"])
