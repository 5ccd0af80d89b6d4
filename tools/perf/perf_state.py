"""The m-task state the prediction figures time: a learner whose tasks are built without training
(adapters with random B and sparse S, synthetic signatures, a drawn RanPAC head), and one predict case.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from perf_settings import Case, Settings
from perf_timing import PeakMemory, _autocast, _median, interleaved

from proteus import Proteus
from proteus.adapters import AdaptedBackbone
from proteus.backbones import build_backbone
from proteus.config import BackboneConfig, RunConfig, SignatureConfig
from proteus.core.codec import load_head
from proteus.engine.records import TaskRecord
from proteus.heads import RanPACHead
from proteus.signatures import GaussianComponents, Signature


# ====================================================================== building the m-task state
def _learner(case: Case, dev: torch.device, s: Settings) -> Proteus:
    cfg = RunConfig()
    cfg.device = str(dev)
    cfg.seed = s.seed
    cfg.backbone = BackboneConfig(
        name=case.backbone, pretrained=False, img_size=case.img, adapt_last=case.adapt_last
    )
    cfg.adapter.rank = s.rank
    # the paper's route: Gaussian keys under every adapter, the best task, Eq. 23's head
    cfg.signature = SignatureConfig(
        max_components=s.sig_components, covariance="ppca", rank=s.sig_rank, keys="adapter"
    )
    cfg.head.rp_dim, cfg.head.scope, cfg.retrieval.combine = s.rp_dim, "global", "hard"
    cfg.retrieval.candidates = s.candidates  # the cheap keys exist; the m-forward route switches them off
    clf = Proteus(cfg, progress=False)
    clf.kb_header()  # builds the backbone and its adapters
    return clf


def _add_adapters(model: AdaptedBackbone, upto: int, s: Settings, gen: torch.Generator) -> None:
    """Append tasks until the model holds ``upto``: begin_task, random B (so that LoRA is non-zero) and a
    sparse random S, end_task: the state training would leave, without the training."""
    while model.num_tasks < upto:
        k = model.num_tasks
        model.begin_task(s.rank, "learned", True, seed=10_000 + k)
        with torch.no_grad():
            for u in model.units.values():
                assert u.B_new is not None
                u.B_new.copy_(torch.randn(tuple(u.B_new.shape), generator=gen) * s.lora_b_std)
                if u.s is not None:
                    keep = torch.rand(tuple(u.s.shape), generator=gen) < 0.3
                    u.s.copy_(torch.randn(tuple(u.s.shape), generator=gen) * 0.5 * keep)
        model.end_task()


def synthetic_signature(
    d: int,
    T: int,
    rank: int,
    kind: str,
    gen: torch.Generator,
    storage_dtype: str = "float32",
) -> Signature:
    """A signature of ``T`` components in ``d`` dimensions with random factors, built through
    :meth:`GaussianComponents.from_tensors` exactly as a knowledge base loads one. Its scoring cost and
    its storage equal those of a fitted signature of the same shape (fitting one at d = 1280 takes about
    a minute on 2 cores and does not change either)."""
    f32 = torch.float32
    means = F.normalize(torch.randn(T, d, generator=gen, dtype=torch.float64), dim=1)
    t: dict[str, torch.Tensor] = {
        "weights": torch.full((T,), 1.0 / T, dtype=torch.float64),
        "means": means,
        "center": means.mean(0),
    }
    sigma2 = torch.full((T,), 0.1 / d, dtype=torch.float64)
    if kind == "ppca":
        q = max(0, min(rank, d - 1))
        U = torch.linalg.qr(torch.randn(T, d, q, generator=gen, dtype=torch.float64)).Q
        lam = (10.0 / d) * torch.linspace(1.0, 0.1, q, dtype=torch.float64).expand(T, q).contiguous()
        t.update(U=U, lam=lam, sigma2=sigma2)
        t["logdet"] = torch.log(lam + sigma2[:, None]).sum(1) + (d - q) * sigma2.log()
    else:
        diag = sigma2[:, None, None].rsqrt() * torch.eye(d, dtype=torch.float64)
        noise = torch.randn(T, d, d, generator=gen, dtype=torch.float64).triu(1) * (0.01 / math.sqrt(d))
        t["prec_chol"] = diag + noise * sigma2[:, None, None].rsqrt()
        t["logdet"] = d * sigma2.log()
    comps = GaussianComponents.from_tensors({k: v.to(f32) for k, v in t.items()})
    return Signature(
        comps,
        method="dpgmm",
        normalize="l2",
        score_kind="nll",
        calibrate="none",
        n_train=0,
        storage_dtype=storage_dtype,
    )


def _drawn_head(d: int, rp_dim: int, n_cls: int, s: Settings, dev: torch.device, gen: torch.Generator) -> Any:
    """A RanPAC head with W_out drawn: only W_rand (drawn from the seed) and W_out enter Eq. 23 at
    prediction time; G is not needed to predict, so W_out is drawn instead of solved for and G is zero."""
    head = RanPACHead(d, rp_dim=rp_dim, seed=s.seed, device=dev, gamma=1.0)
    head.W_out_ = torch.randn(head.feature_dim, n_cls, generator=gen, dtype=torch.float64).to(dev)
    head.G_ = torch.zeros(head.feature_dim, head.feature_dim, dtype=torch.float64, device=dev)
    head.Q_ = torch.zeros_like(head.W_out_)
    head.counts_ = torch.ones(n_cls, dtype=torch.long, device=dev)
    head.gamma_ = 1.0
    head.features(torch.zeros(1, d, dtype=torch.float64, device=dev))  # draws W_rand
    return head


#: the prediction routes the harness times (:attr:`Proteus.parts_.route`)
ROUTES = {"m_forward": "all-adapters", "two_stage": "one-space", "candidates": "candidates"}


class _State:
    """A learner holding m tasks (adapters with random B, synthetic signatures, a RanPAC head, LDA keys in
    the first adapter's space) and a plain copy of its backbone (same seeded random weights, no LoRA) for
    the compute limit. :meth:`predict` takes one of three routes (:data:`ROUTES`): the paper's Gaussian
    keys on every adapter (``m_forward``), the LDA keys in one space (``two_stage``), or the Gaussian keys
    on the LDA keys' shortlist of ``Settings.candidates`` tasks (``candidates``)."""

    def __init__(self, case: Case, dev: torch.device, s: Settings, m_max: int) -> None:
        self.case, self.dev, self.s = case, dev, s
        self.gen = torch.Generator().manual_seed(s.seed)
        self.learner = _learner(case, dev, s)
        self.plain = build_backbone(case.backbone, pretrained=False, img_size=case.img).to(dev)
        d = self.learner.model_.embed_dim
        n_cls = s.classes_per_task * m_max
        head = _drawn_head(d, s.rp_dim, n_cls, s, dev, self.gen)
        keys = _drawn_head(d, 0, n_cls, s, dev, self.gen)  # the LDA keys' head (as in the KB: task_head/)
        self.head_state = (
            {**head.meta(), "task_head": {"shortlist": keys.meta()}},
            {**head.state_tensors(), **{f"task_head/{k}": v for k, v in keys.state_tensors().items()}},
        )
        self.x = torch.randn(s.batch, 3, case.img, case.img, generator=self.gen).to(dev)

    def grow(self, m: int) -> None:
        """Hold m tasks: adapters appended through the adapters' own life cycle, then each task's record
        and synthetic signature through the loader a knowledge base uses."""
        L, s = self.learner, self.s
        _add_adapters(L.model_, m, s, self.gen)
        d = L.model_.embed_dim
        while L.num_tasks < m:
            k = L.num_tasks
            sig = synthetic_signature(d, s.sig_components, s.sig_rank, "ppca", self.gen)
            st, meta = sig.to_tensors()
            cls = list(range(k * s.classes_per_task, (k + 1) * s.classes_per_task))
            record = {"index": k, "classes": cls, "class_names": [str(c) for c in cls], "n_train": 0,
                      "has_adapter": False, "stats": {"task": k}, "signature": meta,
                      "frozen_signature": None}  # fmt: skip
            tensors = {f"signature/{n}": v for n, v in st.items()}  # the keys and heads load it as from a KB
            L.parts_.keys.load_task(record, tensors)
            L.parts_.heads.load_task(k, record, tensors)
            L.records_.append(TaskRecord.from_dict(record))
        load_head(L.parts_, *self.head_state)
        self.gaussian_keys = L.keys_
        L.keys_.candidates = None  # the default route: the paper's (m forwards)

    def predict(self, route: str = "m_forward") -> Any:
        """One ``Proteus.predict`` of the batch by a route of :data:`ROUTES`."""
        L, keys = self.learner, self.gaussian_keys
        keys.candidates = self.s.candidates if route == "candidates" else None
        if route == "two_stage":  # the same learner with LDA keys in the first adapter's space
            L.keys_ = keys.shortlist_keys
        try:
            assert L.parts_.route == ROUTES[route], (L.parts_.route, route)
            return L.predict(self.x)
        finally:
            L.keys_, keys.candidates = keys, None

    @torch.no_grad()
    def plain_forward(self, times: int = 1, chunk: int | None = None) -> None:
        """``times`` plain forwards of the batch, each in pieces of ``chunk`` images (default whole)."""
        with _autocast(self.dev):
            for _ in range(times):
                for x in self.x.split(chunk or len(self.x)):
                    self.plain(x)


def _predict_case(case: Case, dev: torch.device, s: Settings, reps: int, memory: bool = False) -> dict:
    st = _State(case, dev, s, s.m)
    st.grow(s.m)
    m = s.m
    L = st.learner
    t0 = time.perf_counter()
    cache = L.model_.prepare_merged()  # the merged weights, built once (a server's warm-up)
    build_s = time.perf_counter() - t0
    # predict embeds in chunks of ``chunk`` images on a CPU (Embedder.images_per_forward); the limit is the
    # plain forwards of the whole batch, and the same forwards in those chunks are reported beside it
    chunk = L.embedder_.images_per_forward(L.embedder_.prefix(st.x[:1]))
    runs = {"ours": st.predict, "limit": lambda: st.plain_forward(m)}
    if chunk < s.batch:
        runs["limit_chunked"] = lambda: st.plain_forward(m, chunk)
    t = interleaved(runs, dev, reps, warmup=1)
    ours, limit = _median(t["ours"]), _median(t["limit"])
    chunked = _median(t["limit_chunked"]) if chunk < s.batch else limit
    # absolute breakdown of the non-backbone parts on embeddings of the shape predict produces (their
    # cost does not depend on the values; this saves another batched forward)
    d = L.model_.embed_dim
    H = torch.randn(m, s.batch, d, generator=st.gen)
    res = L.retrieve(H)
    h = H[res.task, torch.arange(H.shape[1])]
    tp = interleaved({"retrieval": lambda: L.retrieve(H), "head": lambda: L.classify(h)}, dev, 3, warmup=1)
    units = list(L.model_.units.values())
    out = {
        "case": case.label,
        "backbone": case.backbone,
        "img_size": case.img,
        "adapt_last": case.adapt_last,
        "m": m,
        "batch": s.batch,
        "embed_dim": L.model_.embed_dim,
        "adapted_maps": len(units),
        "adapted_layers": len(L.model_.wrappers),
        "merged_maps": len(L.model_.merge_plan()),
        "merged_cache_mb": cache / 2**20,
        "merged_cache_build_s": build_s,
        "total_rank_per_map_max": max((u.total_rank for u in units), default=0),
        "signature_components": s.sig_components,
        "signature_rank": s.sig_rank,
        "rp_dim": s.rp_dim,
        "ours_s": ours,
        "limit_s": limit,
        "plain_forward_s": limit / m,
        "ratio": limit / ours,
        "images_per_forward": chunk,
        "limit_chunked_s": chunked,
        "ratio_chunked": chunked / ours,
        "ours_times_s": t["ours"],
        "limit_times_s": t["limit"],
        "retrieval_s": _median(tp["retrieval"]),
        "head_s": _median(tp["head"]),
    }
    if memory:
        with PeakMemory(dev) as pm:
            st.predict()
        with PeakMemory(dev) as pl:
            st.plain_forward(1)
        out["memory"] = {"predict": pm.result, "one_plain_forward": pl.result}
    return out
