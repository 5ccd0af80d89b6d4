"""The clusterings behind a task's signature (Eq. 18) and the covariance estimate they share.

:func:`task_covariance` estimates a task's covariance from its (normalised) embeddings, in float64, with
the estimator ``signature.prior`` names in :data:`PRIORS`:

* ``prior = "ridge"``: ``cov(H) + lambda I`` with ``lambda = max(reg_covar, 1e-3 tr(cov(H)) / d)``
  (``PRIOR_RIDGE``). The ridge only keeps the matrix invertible: with fewer embeddings than dimensions,
  or N close to d, the small sample eigenvalues are far below the true ones (Marchenko-Pastur), so a
  test input's Mahalanobis term under its own task is many times d, by an amount that differs from task
  to task (docs/retrieval.md, "Covariance estimation").
* ``prior = "sample"``: ``cov(H) + reg_covar I``, scikit-learn's own ``covariance_prior`` (the empirical
  covariance, no ridge): what ``proteus-paper``'s 1e-3 ridge is measured against (docs/experiments.md).
* ``prior = "ledoit-wolf"`` / ``"oas"``: ``(1 - rho) cov(H) + rho (tr(cov(H)) / d) I`` with the
  shrinkage ``rho`` of Ledoit & Wolf (2004) or of Chen et al.'s oracle approximating shrinkage (2010),
  computed from the data alone (no parameter): large when N is close to d, small when N >> d.

The clusterings are registered in :data:`METHODS` under their ``signature.method`` name:
:func:`fit_dpgmm` uses the covariance as the DP-GMM's covariance prior (scikit-learn's ``W0^{-1}``, scaled
per ``signature.prior_scale``, :data:`PRIOR_SCALES`, with the Wishart prior's degrees of freedom ``d`` by
default, ``prior_dof`` otherwise), :func:`fit_gaussian` as the one covariance of Eq. 2, :func:`fit_kmeans`
as the pooled covariance its clusters shrink towards. Each returns a :class:`ClusterFit`: weights,
counts, means, dense covariances on demand and the factored form that
:class:`~proteus.signatures.gaussian.SharedComponents` stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from proteus.devices import index_add
from proteus.registry import Registry
from proteus.signatures.dpgmm import DPGMM, PosteriorFactors
from proteus.signatures.kmeans import kmeans
from proteus.signatures.options import SignatureConfig

__all__ = [
    "METHODS",
    "PRIORS",
    "PRIOR_RIDGE",
    "PRIOR_SCALES",
    "ClusterFit",
    "TaskCovariance",
    "fit_dpgmm",
    "fit_gaussian",
    "fit_kmeans",
    "ledoit_wolf_shrinkage",
    "oas_rho",
    "oas_rho_of",
    "oas_shrinkage",
    "task_covariance",
]

#: the ridge of ``prior = "ridge"``, relative to the mean variance ``tr(cov) / d``
PRIOR_RIDGE = 1e-3


class TaskCovariance(NamedTuple):
    """A task's regularised covariance ``C`` (d, d) and the ridge ``lam`` that k-means and the single
    Gaussian add to their own covariances."""

    C: Tensor
    lam: float


#: ``signature.prior``: how a task's covariance (the DP-GMM's covariance prior) is estimated from the
#: centred rows ``Xc`` (N, d) and their sample covariance ``C`` (``1 / (N - 1)``)
Prior = Callable[[Tensor, Tensor, SignatureConfig], TaskCovariance]
PRIORS: Registry[Prior] = Registry("signature.prior")
#: ``signature.prior_scale``: the DP-GMM's ``W0^{-1}`` from the task's covariance and the prior's dof
PRIOR_SCALES: Registry[Callable[[Tensor, float], Tensor]] = Registry("signature.prior_scale")
#: ``signature.method``: the clustering ``fit(X, cfg, seed, task covariance)`` behind the signature; traits:
#: ``components`` (several components: ``signature.max_components`` is read), ``dirichlet_prior`` (the
#: ``signature.prior_*`` options are), ``pooled_scatter`` (each cluster's scatter shrunk to the pooled one)
METHODS: Registry[Callable[[Tensor, SignatureConfig, int, TaskCovariance], ClusterFit]] = Registry(
    "signature.method"
)


@dataclass
class ClusterFit:
    """What a clustering leaves for the signature: ``cov_fn(index)`` gives dense covariances (K, d, d) of
    the selected components, ``shared_fn(index)`` their factored form (:class:`PosteriorFactors`)."""

    weights: Tensor
    counts: Tensor
    means: Tensor
    cov_fn: Callable[..., Tensor]
    shared_fn: Callable[[Tensor], PosteriorFactors]
    labels: Tensor
    lower_bound: float | None
    n_iter: int
    converged: bool


def _scatter(Xc: Tensor) -> tuple[Tensor, float]:
    """The ``1 / N`` sample covariance ``S`` of the centred rows ``Xc`` and its mean variance ``tr S / d``."""
    N, d = Xc.shape
    S = (Xc.T @ Xc) / N
    return S, float(S.diagonal().sum()) / d


def ledoit_wolf_shrinkage(Xc: Tensor) -> float:
    """Ledoit-Wolf's shrinkage intensity ``rho = min(b^2, d^2) / d^2`` in [0, 1] towards ``(tr(S) / d) I`` of
    the sample covariance ``S`` of the centred rows ``Xc`` (N, d) (their Lemma 3.2-3.4 estimates, as
    scikit-learn's ``ledoit_wolf_shrinkage``, with the ``1 / N`` covariance)."""
    N, d = Xc.shape
    S, mu = _scatter(Xc)
    if mu <= 0.0:
        return 0.0
    X2 = Xc * Xc
    beta_ = float((X2.T @ X2).sum()) / N  # sum_ij mean_n x_ni^2 x_nj^2
    delta_ = float((S * S).sum())  # ||S||_F^2
    beta = (beta_ - delta_) / (d * N)
    delta = (delta_ - 2.0 * mu * float(S.diagonal().sum()) + d * mu * mu) / d  # ||S - mu I||_F^2 / d
    beta = min(beta, delta)
    return 0.0 if beta <= 0.0 else beta / delta


def oas_shrinkage(Xc: Tensor) -> float:
    """OAS's shrinkage intensity ``rho = min(1, (tr(S^2) / d + mu^2) / ((N + 1) (tr(S^2) / d - mu^2 / d)))``
    (Chen et al. 2010, as scikit-learn's ``oas``) towards ``mu I``, ``mu = tr(S) / d``, of the ``1 / N``
    sample covariance ``S`` of the centred rows ``Xc`` (N, d)."""
    S, _ = _scatter(Xc)
    return oas_rho(S, Xc.shape[0])


def oas_rho(S: Tensor, n: int) -> float:
    """OAS's shrinkage intensity (:func:`oas_shrinkage`) of a ``1 / n`` sample covariance ``S`` (d, d)."""
    d = S.shape[0]
    return oas_rho_of(float(S.diagonal().sum()) / d, float((S * S).mean()), d, n)


def oas_rho_of(mu: float, alpha: float, d: int, n: int) -> float:
    """:func:`oas_rho` from the mean eigenvalue ``mu`` (trace / d) and ``alpha`` (squared Frobenius norm /
    d^2) of the (d, d) sample covariance; both follow from the n x n Gram matrix ``R R^T / n`` of the
    centred rows, which has the same trace and Frobenius norm (no (d, d) matrix needed)."""
    if mu <= 0.0:
        return 0.0
    den = (n + 1.0) * (alpha - mu * mu / d)
    return 1.0 if den <= 0.0 else min(1.0, (alpha + mu * mu) / den)


@PRIORS.register("ridge", "cov(H) + max(reg_covar, 1e-3 tr / d) I")
def _ridge_prior(Xc: Tensor, C: Tensor, cfg: SignatureConfig) -> TaskCovariance:
    d = C.shape[0]
    lam = max(float(cfg.reg_covar), PRIOR_RIDGE * float(C.diagonal().sum()) / d)
    return TaskCovariance(C + lam * torch.eye(d, dtype=Xc.dtype, device=Xc.device), lam)


@PRIORS.register("sample", "cov(H) + reg_covar I: scikit-learn's default prior, no ridge")
def _sample_prior(Xc: Tensor, C: Tensor, cfg: SignatureConfig) -> TaskCovariance:
    lam = float(cfg.reg_covar)
    return TaskCovariance(C + lam * torch.eye(C.shape[0], dtype=Xc.dtype, device=Xc.device), lam)


def _shrunk_prior(rho_of: Callable[[Tensor], float]) -> Prior:
    """``(1 - rho) C + rho (tr(C) / d) I + reg_covar I`` with the shrinkage ``rho = rho_of(Xc)``."""

    def prior(Xc: Tensor, C: Tensor, cfg: SignatureConfig) -> TaskCovariance:
        rho = rho_of(Xc)
        mean_var = float(C.diagonal().sum()) / C.shape[0]
        C = (1.0 - rho) * C
        C.diagonal().add_(rho * mean_var + float(cfg.reg_covar))
        return TaskCovariance(C, float(cfg.reg_covar))

    return prior


PRIORS.register("ledoit-wolf", "Ledoit-Wolf shrinkage towards tr / d I")(_shrunk_prior(ledoit_wolf_shrinkage))
PRIORS.register("oas", "OAS shrinkage towards tr / d I")(_shrunk_prior(oas_shrinkage))
PRIOR_SCALES.register("sklearn", "W0^{-1} = C: the prior's expected covariance is C / dof")(lambda C, dof: C)
PRIOR_SCALES.register("expected", "W0^{-1} = dof C: the prior's expected covariance is C")(
    lambda C, dof: dof * C  # W0^{-1} = nu0 C: the prior's expected covariance is C itself
)


def task_covariance(X: Tensor, cfg: SignatureConfig) -> TaskCovariance:
    """``(C, lambda)``: the task's regularised covariance per ``cfg.prior`` (see the module docstring) and
    the ridge that k-means and the single Gaussian add to their own covariances (``lambda =
    max(reg_covar, 1e-3 tr / d)`` for ``"ridge"``, ``reg_covar`` for the shrinkage estimates, which are
    well conditioned)."""
    N = X.shape[0]
    Xc = X - X.mean(0)
    C = (Xc.T @ Xc) / (N - 1)
    return PRIORS.get(cfg.prior)(Xc, C, cfg)


@METHODS.register("dpgmm", "the DP-GMM of Eq. 18", dirichlet_prior=True, components=True)
def fit_dpgmm(X: Tensor, cfg: SignatureConfig, seed: int, cov: TaskCovariance) -> ClusterFit:
    """The DP-GMM of Eq. 18 with covariance prior ``W0^{-1}`` the task's covariance scaled per
    ``cfg.prior_scale`` (:data:`PRIOR_SCALES`; scikit-learn's other defaults)."""
    d = X.shape[1]
    dof = float(d) if cfg.prior_dof is None else float(cfg.prior_dof)
    prior = PRIOR_SCALES.get(cfg.prior_scale)(cov.C, dof)
    gm = DPGMM(
        n_components=cfg.max_components,
        covariance_prior=prior,
        degrees_of_freedom_prior=dof,
        reg_covar=cfg.reg_covar,
        tol=cfg.tol,
        max_iter=cfg.max_iter,
        random_state=seed,
        device=X.device,
        dtype=X.dtype,
    )
    labels = gm.fit(X).last_labels_
    return ClusterFit(
        weights=gm.weights_,
        counts=torch.bincount(labels, minlength=gm.n_components_),
        means=gm.means_,
        cov_fn=gm.component_covariances,
        shared_fn=gm.posterior_factors,
        labels=labels,
        lower_bound=gm.lower_bound_,
        n_iter=gm.n_iter_,
        converged=gm.converged_,
    )


@METHODS.register("kmeans", "K-means hard clusters (the ablation)", pooled_scatter=True, components=True)
def fit_kmeans(X: Tensor, cfg: SignatureConfig, seed: int, cov: TaskCovariance) -> ClusterFit:
    """The K-means ablation: ``K = max_components`` hard clusters, each with covariance ``(n_k S_k + d
    S_pool) / (n_k + d)`` (its scatter shrunk towards the pooled within-cluster covariance ``S_pool + lam
    I``, ``lam = cov.lam``, with the weight of d pseudo-points) plus ``reg_covar I``."""
    N, d = X.shape
    lam = cov.lam
    labels, _, n_iter = kmeans(X - X.mean(0), cfg.max_components, int(seed), max_iter=max(cfg.max_iter, 1))
    K = int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=K)
    nk = counts.to(X.dtype)
    means = (
        index_add(torch.zeros((K, d), dtype=X.dtype, device=X.device), 0, labels, X)
        / nk.clamp_min(1)[:, None]
    )
    scatter = torch.zeros((K, d, d), dtype=X.dtype, device=X.device)
    for k in range(K):
        Xk = X[labels == k] - means[k]
        scatter[k] = Xk.T @ Xk
    pooled = scatter.sum(0) / N
    pooled.diagonal().add_(lam)
    covs = (scatter + d * pooled[None]) / (nk + d)[:, None, None]
    covs.diagonal(dim1=-2, dim2=-1).add_(float(cfg.reg_covar))

    def cov_fn(index: Tensor | list[int] | None = None) -> Tensor:
        return covs if index is None else covs[torch.as_tensor(index, dtype=torch.long, device=covs.device)]

    def shared_fn(index: Tensor | list[int]) -> PosteriorFactors:
        # covs_k = d / (n_k + d) * (pooled + reg (n_k + d) / d I + Xc_k^T Xc_k / d): pooled is the shared part
        ks = [int(i) for i in index]
        e, V = torch.linalg.eigh(0.5 * (pooled + pooled.T))
        sel = nk[ks]
        factors = [((X[labels == k] - means[k]) @ V) / d**0.5 for k in ks]
        return PosteriorFactors(e, V, d / (sel + d), float(cfg.reg_covar) * (sel + d) / d, factors, sel)

    return ClusterFit(nk / N, counts, means, cov_fn, shared_fn, labels, None, n_iter, True)


@METHODS.register("gaussian", "one Gaussian (the single-key signature of Eq. 2)", components=False)
def fit_gaussian(X: Tensor, cfg: SignatureConfig, seed: int, task_cov: TaskCovariance) -> ClusterFit:
    """One Gaussian (the single-key signature of Eq. 2) with the task's regularised covariance
    ``task_cov.C`` (``cfg`` and ``seed`` are not used)."""
    N, d = X.shape
    cov = task_cov.C[None]

    def shared_fn(index: Tensor | list[int]) -> PosteriorFactors:
        e, V = torch.linalg.eigh(cov[0])
        one = torch.ones(1, dtype=X.dtype, device=X.device)
        return PosteriorFactors(e, V, one, 0.0 * one, [X.new_zeros((0, d))], N * one)

    return ClusterFit(
        weights=torch.ones(1, dtype=X.dtype, device=X.device),
        counts=torch.tensor([N], device=X.device),
        means=X.mean(0, keepdim=True),
        cov_fn=lambda index=None: cov,
        shared_fn=shared_fn,
        labels=torch.zeros(N, dtype=torch.long, device=X.device),
        lower_bound=None,
        n_iter=0,
        converged=True,
    )
