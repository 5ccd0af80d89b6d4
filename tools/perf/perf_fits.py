"""Fitting sections: ``dpgmm_speedup_vs_sklearn`` / ``dpgmm_heldout_loglik_rel_diff`` and
``train_step_overhead``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from perf_settings import Settings, _figure
from perf_state import _add_adapters, _learner
from perf_timing import PeakMemory, _median, interleaved

from proteus import Proteus
from proteus.core.parts import task_seed
from proteus.signatures import DPGMM


def _mixture(n: int, d: int, k: int, gen: torch.Generator, params: dict | None = None) -> tuple[Any, dict]:
    """Samples of a Gaussian mixture with structure: k clusters, each with its own rank-16 covariance
    plus isotropic noise and its own weight."""
    if params is None:
        r = min(16, d)
        params = {
            "means": torch.randn(k, d, generator=gen, dtype=torch.float64),
            "factors": torch.randn(k, d, r, generator=gen, dtype=torch.float64) / 4.0,
            "noise": 0.3,
            "weights": torch.distributions.Dirichlet(torch.full((k,), 3.0, dtype=torch.float64)).sample(),
        }
    lab = torch.multinomial(params["weights"], n, replacement=True, generator=gen)
    z = torch.randn(n, params["factors"].shape[2], generator=gen, dtype=torch.float64)
    X = params["means"][lab] + torch.einsum("ndr,nr->nd", params["factors"][lab], z)
    X += params["noise"] * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return X, params


def _blas_threads() -> Any:
    """numpy/scipy BLAS threads limited to torch's thread count, so that both sides get the same cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # scikit-learn depends on it; keep going without the limit
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(limits=torch.get_num_threads())


def section_dpgmm(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import BayesianGaussianMixture

    gen = torch.Generator().manual_seed(s.seed)
    torch.manual_seed(s.seed)  # the Dirichlet draw of the cluster weights
    X, params = _mixture(s.dpgmm_n, s.dpgmm_d, s.dpgmm_true_clusters, gen)
    Xh, _ = _mixture(s.dpgmm_heldout, s.dpgmm_d, s.dpgmm_true_clusters, gen, params)
    Xn, Xhn = X.numpy(), Xh.numpy()
    Xd = X.to(dev)
    kw = {"n_components": s.dpgmm_T, "tol": s.dpgmm_tol, "max_iter": s.dpgmm_max_iter, "random_state": s.seed,
          "reg_covar": 1e-6}  # fmt: skip
    fitted: dict[str, Any] = {}

    def ours() -> None:
        fitted["ours"] = DPGMM(**kw, device=dev, dtype=torch.float64).fit(Xd)

    def sk() -> None:
        with warnings.catch_warnings(), _blas_threads():
            warnings.simplefilter("ignore", ConvergenceWarning)
            fitted["sk"] = BayesianGaussianMixture(
                **kw, weight_concentration_prior_type="dirichlet_process", covariance_type="full",
                init_params="kmeans",
            ).fit(Xn)  # fmt: skip

    # warm both code paths on a small problem (library loading, first-call costs), then time
    Xw, _ = _mixture(200, 8, 3, gen)
    DPGMM(n_components=3, max_iter=5, device=dev).fit(Xw.to(dev))
    with warnings.catch_warnings(), _blas_threads():
        warnings.simplefilter("ignore", ConvergenceWarning)
        BayesianGaussianMixture(n_components=3, max_iter=5).fit(Xw.numpy())
    t = interleaved(
        {"ours": ours, "sklearn": sk}, dev, {"ours": s.dpgmm_ours_reps, "sklearn": s.dpgmm_sklearn_reps}, 0
    )
    to, ts = _median(t["ours"]), _median(t["sklearn"])
    g, m = fitted["ours"], fitted["sk"]
    ll_ours = float(g.score_samples(Xh.to(dev)).mean())
    ll_sk = float(m.score_samples(Xhn).mean())
    rel = abs(ll_ours - ll_sk) / abs(ll_sk)
    log(f"  ours {to:.2f} s, sklearn {ts:.2f} s, speedup {ts / to:.2f}; held-out loglik rel diff {rel:.2e}")
    common = {
        "d": s.dpgmm_d, "n_train": s.dpgmm_n, "n_heldout": s.dpgmm_heldout, "T": s.dpgmm_T,
        "max_iter": s.dpgmm_max_iter, "tol": s.dpgmm_tol, "true_clusters": s.dpgmm_true_clusters,
        "data": "mixture of Gaussians with rank-16 cluster covariances plus isotropic noise (float64)",
        "ours_n_iter": int(g.n_iter_), "sklearn_n_iter": int(m.n_iter_),
        "ours_converged": bool(g.converged_), "sklearn_converged": bool(m.converged_),
        "sklearn_device": "cpu", "ours_device": str(dev), "threads": torch.get_num_threads(),
    }  # fmt: skip
    return {
        "dpgmm_speedup_vs_sklearn": _figure(
            "dpgmm_speedup_vs_sklearn",
            ts / to,
            ours_s=to,
            sklearn_s=ts,
            ours_times_s=t["ours"],
            sklearn_times_s=t["sklearn"],
            **common,
        ),
        "dpgmm_heldout_loglik_rel_diff": _figure(
            "dpgmm_heldout_loglik_rel_diff", rel, ours_loglik=ll_ours, sklearn_loglik=ll_sk, **common
        ),
    }


def section_train(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    case = s.train_case
    gen = torch.Generator().manual_seed(s.seed)
    x = torch.randn(s.train_batch, 3, case.img, case.img, generator=gen).to(dev)
    y = torch.randint(s.train_classes, (s.train_batch,), generator=gen).to(dev)

    def setup(k: int) -> tuple[Proteus, Callable[[], None]]:
        """The learner's own training step (:meth:`AdapterTrainer.step`, s_update = "prox") at task k + 1."""
        L = _learner(case, dev, s)
        model = L.model_
        _add_adapters(model, k, s, gen)
        t = L.trainer_.open_task(list(range(s.train_classes)), k, seed=task_seed(L.config, k))
        z = L.embedder_.prefix(x)  # the learner caches the frozen prefix

        def step() -> None:
            L.trainer_.step(t, z, y)

        return L, step

    Lr, lora_step = setup(0)

    def against_lora(k: int, step_k: Callable[[], None]) -> dict[str, list[float]]:
        """Task k's step and the plain LoRA step, interleaved (side by side)."""
        t = interleaved({"proteus": step_k, "lora": lora_step}, dev, s.train_reps, warmup=1)
        pk, lk = _median(t["proteus"]), _median(t["lora"])
        log(f"  task {k}: proteus step {pk:.3f} s, plain LoRA step {lk:.3f} s, overhead {pk / lk:.3f}")
        return t

    Lp, proteus_step = setup(s.train_task - 1)
    t = against_lora(s.train_task, proteus_step)
    tp, tl = _median(t["proteus"]), _median(t["lora"])
    later: dict[str, dict[str, float]] = {}  # task k -> its step against plain LoRA's (the growth with k)
    for k in s.train_later_tasks:
        tk = against_lora(k, setup(k - 1)[1])
        pk, lk = _median(tk["proteus"]), _median(tk["lora"])
        later[str(k)] = {"overhead": pk / lk, "proteus_s": pk, "lora_s": lk}
    with PeakMemory(dev) as mp:
        proteus_step()
    with PeakMemory(dev) as ml:
        lora_step()
    up = next(iter(Lp.model_.units.values()))
    return {
        "train_step_overhead": _figure(
            "train_step_overhead",
            tp / tl,
            measured=f"forward + backward + Adam (+ proximal S step) on one cached-prefix batch; PROTEUS at "
            f"task {s.train_task} ({s.train_task - 1} frozen tasks, learned S, orthogonal new directions) vs "
            "a fresh adapter at task 1 (plain LoRA, same rank, same maps)",
            case=case.label,
            batch=s.train_batch,
            rank=s.rank,
            old_rank_per_map=up.total_rank,
            proteus_s=tp,
            lora_s=tl,
            proteus_times_s=t["proteus"],
            lora_times_s=t["lora"],
            later_tasks=later,
        ),
        "memory": {
            "train": {
                "case": case.label,
                "batch": s.train_batch,
                "proteus_step": mp.result,
                "plain_lora_step": ml.result,
            }
        },
    }
