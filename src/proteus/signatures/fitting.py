"""The clusterings behind a task's signature (Eq. 18) and the covariance estimate they share.

:func:`task_covariance` estimates a task's covariance from its (normalised) embeddings, in float64:

* ``prior = "ridge"``: ``cov(H) + lambda I`` with ``lambda = max(reg_covar, 1e-3 tr(cov(H)) / d)``
  (``PRIOR_RIDGE``). The ridge only keeps the matrix invertible: with fewer embeddings than dimensions,
  or N close to d, the small sample eigenvalues are far below the true ones (Marchenko-Pastur), so a
  test input's Mahalanobis term under its own task is many times d, by an amount that differs from task
  to task (docs/retrieval.md, "Covariance estimation").
* ``prior = "ledoit-wolf"`` / ``"oas"``: ``(1 - rho) cov(H) + rho (tr(cov(H)) / d) I`` with the
  shrinkage ``rho`` of Ledoit & Wolf (2004) or of Chen et al.'s oracle approximating shrinkage (2010),
  computed from the data alone (no parameter): large when N is close to d, small when N >> d.

:func:`fit_dpgmm` uses it as the DP-GMM's covariance prior (scikit-learn's ``W0^{-1}``, with the Wishart
prior's degrees of freedom ``d`` by default, ``prior_dof`` otherwise), :func:`fit_gaussian` as the one
covariance of Eq. 2, :func:`fit_kmeans` as the pooled covariance its clusters shrink towards. Each
returns a :class:`ClusterFit`: weights, counts, means, dense covariances on demand and the factored
form that :meth:`~proteus.signatures.gaussian.GaussianComponents.shared` stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from proteus.config import SignatureConfig
from proteus.devices import index_add
from proteus.signatures.dpgmm import DPGMM, PosteriorFactors
from proteus.signatures.kmeans import kmeans

__all__ = [
    "PRIORS",
    "PRIOR_RIDGE",
    "PRIOR_SCALES",
    "ClusterFit",
    "fit_dpgmm",
    "fit_gaussian",
    "fit_kmeans",
    "shrinkage",
    "task_covariance",
]

#: the ridge of ``prior = "ridge"``, relative to the mean variance ``tr(cov) / d``
PRIOR_RIDGE = 1e-3
#: how a task's covariance (the DP-GMM's covariance prior) is estimated
PRIORS = ("ridge", "ledoit-wolf", "oas")
#: how the DP-GMM's Wishart prior is scaled (see fit_dpgmm)
PRIOR_SCALES = ("sklearn", "expected")


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


def shrinkage(Xc: Tensor, how: str) -> float:
    """Shrinkage intensity ``rho`` in [0, 1] towards ``(tr(S) / d) I`` of the sample covariance ``S`` of the
    centred rows ``Xc`` (N, d): Ledoit-Wolf's ``min(b^2, d^2) / d^2`` (their Lemma 3.2-3.4 estimates, as
    scikit-learn's ``ledoit_wolf_shrinkage``) or OAS's ``min(1, (tr(S^2) / d + mu^2) / ((N + 1)
    (tr(S^2) / d - mu^2 / d)))`` (as scikit-learn's ``oas``), both with the ``1 / N`` covariance."""
    N, d = Xc.shape
    S = (Xc.T @ Xc) / N
    mu = float(S.diagonal().sum()) / d
    if mu <= 0.0:
        return 0.0
    if how == "oas":
        alpha = float((S * S).mean())
        den = (N + 1.0) * (alpha - mu * mu / d)
        return 1.0 if den <= 0.0 else min(1.0, (alpha + mu * mu) / den)
    X2 = Xc * Xc
    beta_ = float((X2.T @ X2).sum()) / N  # sum_ij mean_n x_ni^2 x_nj^2
    delta_ = float((S * S).sum())  # ||S||_F^2
    beta = (beta_ - delta_) / (d * N)
    delta = (delta_ - 2.0 * mu * float(S.diagonal().sum()) + d * mu * mu) / d  # ||S - mu I||_F^2 / d
    beta = min(beta, delta)
    return 0.0 if beta <= 0.0 else beta / delta


def task_covariance(X: Tensor, cfg: SignatureConfig) -> tuple[Tensor, float]:
    """``(C, lambda)``: the task's regularised covariance (see the module docstring) and the ridge that
    k-means and the single Gaussian add to their own covariances (``lambda = max(reg_covar, 1e-3 tr /
    d)`` for ``"ridge"``, ``reg_covar`` for the shrinkage estimates, which are well conditioned)."""
    N, d = X.shape
    Xc = X - X.mean(0)
    C = (Xc.T @ Xc) / (N - 1)
    prior = cfg.prior
    if prior == "ridge":
        lam = max(float(cfg.reg_covar), PRIOR_RIDGE * float(C.diagonal().sum()) / d)
        return C + lam * torch.eye(d, dtype=X.dtype, device=X.device), lam
    rho = shrinkage(Xc, prior)
    mean_var = float(C.diagonal().sum()) / d
    C = (1.0 - rho) * C
    C.diagonal().add_(rho * mean_var + float(cfg.reg_covar))
    return C, float(cfg.reg_covar)


def fit_dpgmm(X: Tensor, cfg: SignatureConfig, seed: int, prior: Tensor) -> ClusterFit:
    """The DP-GMM of Eq. 18 with covariance prior ``prior`` (scikit-learn's other defaults)."""
    d = X.shape[1]
    dof = float(d) if cfg.prior_dof is None else float(cfg.prior_dof)
    if cfg.prior_scale == "expected":
        prior = dof * prior  # W0^{-1} = nu0 C: the prior's expected covariance is C itself
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


def fit_kmeans(X: Tensor, cfg: SignatureConfig, seed: int, lam: float) -> ClusterFit:
    """The K-means ablation: ``K = max_components`` hard clusters, each with covariance ``(n_k S_k + d
    S_pool) / (n_k + d)`` (its scatter shrunk towards the pooled within-cluster covariance ``S_pool + lam
    I`` with the weight of d pseudo-points) plus ``reg_covar I``."""
    N, d = X.shape
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


def fit_gaussian(X: Tensor, C: Tensor) -> ClusterFit:
    """One Gaussian (the single-key signature of Eq. 2) with the task's regularised covariance ``C``."""
    N, d = X.shape
    cov = C[None]

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
