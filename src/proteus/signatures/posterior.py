"""The fitted variational DP-GMM (Eq. 18's learner): its queries, lower bound and factored covariances.

:class:`VariationalPosterior` holds what :class:`~proteus.signatures.dpgmm.DPGMM` fits, the variational
posterior of a truncated stick-breaking DP-GMM with full covariances in the eigenbasis of the covariance
prior, and answers scikit-learn's queries on it (``score_samples``, ``predict``, ``predict_proba``,
``covariances_``, ``precisions_cholesky_``) plus :meth:`VariationalPosterior.posterior_factors`, the
covariances in factored form (shared prior + per-component data term) that compact signatures store.
The fitting (k-means initialisation, E/M steps, the screened E-step) is in :mod:`proteus.signatures.dpgmm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from proteus.signatures.errors import SignatureFitError, as_tensor
from proteus.signatures.woodbury import MahalanobisFactors

__all__ = ["PosteriorFactors", "VariationalPosterior"]


@dataclass
class PosteriorFactors:
    """The DP-GMM posterior's expected covariances of K components, in factored form.

    ``covariance_k = scale_k (C0 + ridge_k I + V F_k^T F_k V^T)`` where ``C0 = V diag(prior_evals) V^T``
    is the covariance prior (scikit-learn's ``W0^{-1}``, shared by every component), ``scale_k = 1 /
    nu_k`` (degrees of freedom), ``ridge_k = N_k reg_covar`` and ``F_k`` (r_k, d), in the prior's
    eigenbasis, stacks the component's data term: one row ``sqrt(resp_nk) (x_n - xbar_k)`` per point
    with responsibility above ``_SUPPORT_EPS`` and the mean-shrinkage row ``sqrt(beta0 N_k / beta_k)
    (xbar_k - m0)``, so ``r_k <= N_k + 1`` (support + 1).
    """

    prior_evals: Tensor  # (d,) e, ascending
    prior_evecs: Tensor  # (d, d) V, columns
    scale: Tensor  # (K,) 1 / nu_k
    ridge: Tensor  # (K,) N_k reg_covar
    factors: list[Tensor]  # K tensors (r_k, d), prior eigenbasis
    sizes: Tensor  # (K,) N_k


class VariationalPosterior:
    """The fitted state of a :class:`~proteus.signatures.dpgmm.DPGMM` and the queries on it.

    Subclasses fit it and provide ``_weighted_log_prob(Xr, x2=None)`` (scikit-learn's
    ``_estimate_weighted_log_prob`` in the rotated basis).
    """

    reg_covar: float
    n_components_: int
    n_features_in_: int
    weight_concentration_: tuple[Tensor, Tensor]
    mean_precision_: Tensor
    degrees_of_freedom_: Tensor
    _factors: MahalanobisFactors
    _B: list[Tensor]
    _means_r: Tensor
    _nk: Tensor
    _V: Tensor
    _e: Tensor
    _mu0: Tensor
    _cov_cache: Tensor | None
    _prec_chol_cache: Tensor | None

    def _weighted_log_prob(self, Xr: Tensor, x2: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ queries
    def score_samples(self, X: Tensor | np.ndarray) -> Tensor:
        """Per-sample log-likelihood, exactly scikit-learn's ``score_samples``: the logsumexp over
        components of the variational weighted log-probabilities (expected log weights and expected
        Gaussian log-likelihood under the posterior)."""
        return torch.logsumexp(self._weighted_log_prob(self._rotate(X)), dim=1)

    def score(self, X: Tensor | np.ndarray) -> float:
        """Mean of :meth:`score_samples`."""
        return float(self.score_samples(X).mean())

    def predict(self, X: Tensor | np.ndarray) -> Tensor:
        """Most probable component of each row (argmax of the weighted log-probabilities)."""
        return self._weighted_log_prob(self._rotate(X)).argmax(dim=1)

    def predict_proba(self, X: Tensor | np.ndarray) -> Tensor:
        """Responsibilities (N, T)."""
        wlp = self._weighted_log_prob(self._rotate(X))
        return torch.softmax(wlp, dim=1)

    @property
    def covariances_(self) -> Tensor:
        if self._cov_cache is None:
            self._cov_cache = self.component_covariances(None)
        return self._cov_cache

    @property
    def precisions_cholesky_(self) -> Tensor:
        if self._prec_chol_cache is None:
            cov = self.covariances_
            L, info = torch.linalg.cholesky_ex(cov)
            if bool((info != 0).any()):
                bad = (info != 0).nonzero().flatten().tolist()
                raise SignatureFitError(f"covariance of component(s) {bad} is not positive definite")
            eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
            self._prec_chol_cache = torch.linalg.solve_triangular(L, eye, upper=False).mT.contiguous()
        return self._prec_chol_cache

    def component_covariances(self, index: Tensor | list[int] | None = None) -> Tensor:
        """Covariances ``Num_k / dof_k`` of the selected components in the original basis, (K, d, d)."""
        self._check_fitted()
        ks = list(range(self.n_components_)) if index is None else [int(i) for i in index]
        V = self._V
        out = []
        for k in ks:
            B = self._B[k]
            num = B.T @ B
            num.diagonal().add_(1.0 / self._factors.inv_D[k])
            out.append((V @ num @ V.T) / self.degrees_of_freedom_[k])
        if not out:
            d = V.shape[0]
            return torch.zeros((0, d, d), dtype=V.dtype, device=V.device)
        cov = torch.stack(out)
        return 0.5 * (cov + cov.mT)

    @property
    def component_sizes_(self) -> Tensor:
        """``N_k``: each component's summed responsibilities (T,) from the last M-step (scikit-learn's
        ``nk``, including its ``10 eps``)."""
        self._check_fitted()
        return self._nk

    def posterior_factors(self, index: Tensor | list[int] | None = None) -> PosteriorFactors:
        """The structure of the expected covariances of the selected components (see
        :class:`PosteriorFactors`): ``covariance_k = scale_k (C0 + ridge_k I + V F_k^T F_k V^T)`` with the
        covariance prior ``C0 = V diag(e) V^T`` shared by every component. Same numbers as
        :meth:`component_covariances`, which forms that sum densely."""
        self._check_fitted()
        ks = list(range(self.n_components_)) if index is None else [int(i) for i in index]
        idx = torch.tensor(ks, dtype=torch.long, device=self._e.device)
        nk = self._nk.index_select(0, idx)
        return PosteriorFactors(
            prior_evals=self._e,
            prior_evecs=self._V,
            scale=1.0 / self.degrees_of_freedom_.index_select(0, idx),
            ridge=nk * self.reg_covar,
            factors=[self._B[k] for k in ks],
            sizes=nk,
        )

    # ------------------------------------------------------------------ variational terms
    def _log_weights(self) -> Tensor:
        a, b = self.weight_concentration_
        dg_sum = torch.special.digamma(a + b)
        dg_a = torch.special.digamma(a)
        dg_b = torch.special.digamma(b)
        cum = torch.cumsum(dg_b - dg_sum, 0)
        return dg_a - dg_sum + torch.cat([cum.new_zeros(1), cum[:-1]])

    def _log_prob_const(self, d: int) -> Tensor:
        """The per-component terms of scikit-learn's weighted log-probability other than the Mahalanobis."""
        dof = self.degrees_of_freedom_
        i = torch.arange(d, dtype=dof.dtype, device=dof.device)
        log_lambda = d * math.log(2.0) + torch.special.digamma(0.5 * (dof[None, :] - i[:, None])).sum(0)
        return (
            -0.5 * d * math.log(2.0 * math.pi)
            - 0.5 * self._factors.logdet_num
            + 0.5 * (log_lambda - d / self.mean_precision_)
            + self._log_weights()
        )

    def _lower_bound(self, resp: Tensor, log_resp: Tensor) -> float:
        """scikit-learn's ``_compute_lower_bound`` for the DP prior and full covariances."""
        d = self._means_r.shape[1]
        dof = self.degrees_of_freedom_
        ldpc = -0.5 * self._factors.logdet_num  # log|prec chol| - 0.5 d log dof
        i = torch.arange(d, dtype=dof.dtype, device=dof.device)
        log_wishart = -(
            dof * ldpc
            + dof * d * 0.5 * math.log(2.0)
            + torch.lgamma(0.5 * (dof[None, :] - i[:, None])).sum(0)
        )
        a, b = self.weight_concentration_
        betaln = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
        log_norm_weight = -betaln.sum()
        ent = torch.where(resp > 0, resp * log_resp, torch.zeros_like(resp)).sum()
        lb = -ent - log_wishart.sum() - log_norm_weight - 0.5 * d * self.mean_precision_.log().sum()
        return float(lb)

    def _finalise(self) -> None:
        a, b = self.weight_concentration_
        s = a + b
        w = a / s * torch.cat([s.new_ones(1), torch.cumprod(b / s, 0)[:-1]])
        self.weights_ = w / w.sum()
        self.means_ = self._means_r @ self._V.T + self._mu0
        for name in ("weights_", "means_", "degrees_of_freedom_", "mean_precision_"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise SignatureFitError(f"the DP-GMM fit produced non-finite {name.rstrip('_')}")
        if not self._factors.all_finite():
            raise SignatureFitError("the DP-GMM fit produced non-finite covariance factors")

    # ------------------------------------------------------------------ helpers
    def _check_fitted(self) -> None:
        if not hasattr(self, "_factors"):
            raise RuntimeError("DPGMM is not fitted yet; call fit(X) first")

    def _rotate(self, X: Tensor | np.ndarray) -> Tensor:
        self._check_fitted()
        X = as_tensor(X, self._V.device, self._V.dtype)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, the model was fitted on {self.n_features_in_}")
        return (X - self._mu0) @ self._V
