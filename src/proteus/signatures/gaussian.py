"""The Gaussian signature components of Eq. 2 / Eq. 18, stored for fast batched scoring.

Eq. 2 scores an embedding ``h`` against a signature pattern ``(m, Lambda)`` with the Mahalanobis term
``S(h) = (h - m)^T Lambda^{-1} (h - m)``; the retrieval rule of Section 3.1 uses the negative Gaussian
log-likelihood ``0.5 (S(h) + log|Lambda| + d log 2 pi)``. :class:`GaussianComponents` holds T such
patterns in one d-dimensional space; each covariance form is one subclass, registered in
:data:`COVARIANCES` under its ``signature.covariance`` name:

* ``"full"`` (:class:`FullComponents`): the precision Cholesky factor; ``"ppca"``
  (:class:`PPCAComponents`): low rank plus isotropic, scored by Woodbury -- both in
  :mod:`proteus.signatures.dense`, whose docstring gives their formulas.
* ``"shared"`` (:class:`SharedComponents`, shared full matrix plus per-component low rank, built from a
  fit's factored covariances, :class:`~proteus.signatures.posterior.PosteriorFactors`, e.g.
  :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors`):
  ``Lambda_t = V diag(e)^{1/2} (iso_t + ridge_t diag(e)^{-1} + U_t^T U_t) diag(e)^{1/2} V^T``, where
  ``P = V diag(e) V^T`` is one d x d matrix per task (the DP-GMM's covariance prior, i.e. scikit-learn's
  ``W0^{-1}``) and ``U_t`` (q_t, d) lives in P's whitened space. The DP-GMM's expected covariances
  ``(W0^{-1} + N_t reg I + N_t S_t + beta_0 N_t / beta_t (xbar_t - m0)(xbar_t - m0)^T) / nu_t`` have
  exactly that form with ``U_t`` of rank ``r_t <= N_t + 1``, so the scores equal ``"full"``'s whenever
  the ``r_t`` fit the rank budget (``T * rank`` rows shared by the components; see
  :func:`~proteus.signatures.shared.shared_tensors` for the approximation beyond it). Scoring whitens each
  input once, ``z = diag(e)^{-1/2} V^T (x - c)`` (``N d^2``), then per component uses Woodbury on the
  ``q_t``-dim core: ``S_t = ||z - mu_t||^2_{D_t^{-1}} - ||F_t^T (z - mu_t)||^2`` with ``D_t = iso_t +
  ridge_t / e`` and ``F_t = D_t^{-1} U_t^T C_t^{-T}``, ``C_t C_t^T = I + U_t D_t^{-1} U_t^T`` (``N d sum_t
  q_t``); ``log|Lambda_t|`` is stored. An eigen-whitening (rather than a Cholesky factor of P) keeps the
  ``N_t reg_covar I`` term of the posterior diagonal, hence exact, in the whitened space.

Scoring is batched over samples and components on the tensors' device and always runs in float32 or
higher. Rows are centred on the mean of the component means before the products (``center``) to
limit cancellation.

Storage (:meth:`GaussianComponents.to_tensors`): the large factors (``prec_chol``, ``U`` or ``lowrank``)
take the storage dtype (float16 or float32); means, weights, eigenvalues, noise, log-determinants and the
centre stay in float32, because float16 cannot hold small variances or large log-determinants. The
shared matrix's eigenvectors (``prior_evecs``, d x d per task) stay float32 too: in float16 they moved
the NLL of a d = 768 DP-GMM signature by up to 1.5e-3 (relative), against 3e-5 for float16 ``lowrank``.
A stored dict names its kind by its first factor tensor (:attr:`GaussianComponents.factor_names`).
"""

from __future__ import annotations

from proteus.signatures.components import COVARIANCES, ComponentSource, GaussianComponents
from proteus.signatures.dense import FullComponents, PPCAComponents
from proteus.signatures.shared import SharedComponents, allocate_ranks

__all__ = [
    "COVARIANCES",
    "ComponentSource",
    "FullComponents",
    "GaussianComponents",
    "PPCAComponents",
    "SharedComponents",
]

#: kept importable from this module (tests, older callers)
_allocate_ranks = allocate_ranks
