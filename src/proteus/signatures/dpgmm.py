"""Variational Dirichlet-process Gaussian mixture (DP-GMM) in torch: the learner of Eq. 18.

Section 3.1 replaces the single Gaussian of Eq. 2 by a multi-key signature (Definition 3.1) learned with
Eq. 18, "a generalized non-parametric clustering scheme such as the Dirichlet Process for Gaussian Mixture
Models (DP-GMMs)". :class:`DPGMM` is that model: the truncated stick-breaking variational DP-GMM of
scikit-learn's ``BayesianGaussianMixture(weight_concentration_prior_type="dirichlet_process",
covariance_type="full")`` with the same priors (weight concentration 1/T, mean precision 1, mean prior
= data mean, degrees of freedom = d, covariance prior = empirical covariance), the same E/M updates,
the same lower bound and the same convergence test (``|lower_bound - previous| < tol``), written in
torch so that it runs on any device and dtype.

What differs from scikit-learn is how the updates are computed, never what they compute:

* The fit runs in the eigenbasis of the covariance prior ``C0 = V diag(e) V^T`` with the mean prior
  at the origin (the model is rotation-equivariant). There the unnormalised component covariance is
  ``Num_k = diag(e + N_k reg_covar) + B_k B_k^T`` with ``B_k`` the (responsibility-weighted, centred)
  points of component k plus one column for the mean-shrinkage term.
* A component whose weighted support (points with responsibility > ``_SUPPORT_EPS``) is narrower than
  ``d`` is factorised with the Woodbury identity (cost ``O(N d s_k)`` instead of ``O(N d^2)``);
  a wide one with a dense Cholesky. Responsibilities below ``_SUPPORT_EPS = 1e-12`` are dropped from
  the scatter matrices only (``N_k`` and the component means use every point); the relative effect on
  the covariances is below ``N * 1e-12``.
* All Mahalanobis terms of the E-step are one matrix product with the stacked factors. For large
  problems the E-step is screened (see :meth:`DPGMM._weighted_log_prob`): a bfloat16 pass (where
  bfloat16 products are native, e.g. CPUs with AVX512-BF16), exact upper bounds from low-dimensional
  marginals, or a float32 pass, each with a generous error bound, select the (sample, component) pairs
  that can be within 50 nats of a sample's best; only those are computed in full float64. The others
  have responsibilities below ``exp(-50)`` relative to the best and keep their bound.
* The k-means initialisation (:func:`~proteus.signatures.kmeans.kmeans`) draws its k-means++ seeds
  from ``numpy.random.RandomState(random_state)`` exactly as scikit-learn's ``KMeans`` does, so the same
  ``random_state`` gives the same initial partition and hence the same fit as scikit-learn (the DP-GMM
  often stops two iterations after its initialisation in high dimension, so the initial partition
  decides the model).

Deviations from scikit-learn, all documented: ``N < n_components`` reduces the truncation level to
``N`` (scikit-learn raises), and every failure (non-finite input, ``N < 2``, a singular covariance
prior, a non positive-definite covariance, a non-finite lower bound) raises :class:`SignatureFitError`.
No ``ConvergenceWarning`` is emitted; read ``converged_``.

Layout: this module fits (initialisation, E/M steps, the screened E-step);
:mod:`~proteus.signatures.posterior` holds the fitted posterior and its queries,
:mod:`~proteus.signatures.woodbury` the Mahalanobis factors, :mod:`~proteus.signatures.kmeans` the
k-means, :mod:`~proteus.signatures.errors` :class:`SignatureFitError` and the input checks.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from proteus.signatures.errors import SignatureFitError, as_tensor, check_finite_rows, like
from proteus.signatures.kmeans import Draws, kmeans, kmeans_plusplus
from proteus.signatures.posterior import PosteriorFactors, VariationalPosterior
from proteus.signatures.woodbury import (
    augment_bf16,
    bf16_is_fast,
    factorise,
    maha_bf16,
    maha_over_dof,
    maha_pairs,
    marginal_bounds,
)

__all__ = ["DPGMM", "PosteriorFactors", "SignatureFitError", "check_finite_rows", "kmeans"]

#: responsibilities below this are left out of the scatter matrices (not out of N_k or the means)
_SUPPORT_EPS = 1e-12
#: rows of an E-step product held in memory at once, as a number of elements
_CHUNK_ELEMENTS = 1 << 24
#: E-step screening (see DPGMM._weighted_log_prob): a pair is computed exactly when it may lie within
#: this many nats of its row's best pair
_SCREEN_MARGIN = 50.0
#: dimension of the marginals that bound the Mahalanobis terms in the first screening stage
_MARGINAL_DIM = 128
#: assumed bound on the float32 product's relative rounding error (measured errors are ~1e-6)
_SCREEN_REL_ERR = 1e-4
#: screening is used for problems with at least this many multiply-adds in the E-step product ...
_SCREEN_MIN_WORK = 1 << 28
#: ... and while at most this fraction of the pairs needs the exact computation (float32 stage) ...
_SCREEN_MAX_FRACTION = 0.25
#: ... (marginal-bound stage, whose per-pair computation is costlier)
_MARGINAL_MAX_FRACTION = 0.15
#: bfloat16 stage (first where bfloat16 products are native): assumed bound on its relative error, 16
#: bfloat16 units (the measured maximum at d = 768 is about one unit, 2^-8)
_BF16_REL_ERR = 16 * 2.0**-8
#: ... used while at most this fraction of the pairs needs the exact computation
_BF16_MAX_FRACTION = 0.25
#: rows of the bfloat16 product held at once, as a number of elements (small blocks stay in cache)
_BF16_CHUNK_ELEMENTS = 1 << 21


class DPGMM(VariationalPosterior):
    """Variational DP-GMM with full covariances, equal to scikit-learn's ``BayesianGaussianMixture``
    (``weight_concentration_prior_type="dirichlet_process"``, ``covariance_type="full"``), in torch.

    Parameters follow scikit-learn; ``None`` priors take scikit-learn's defaults (weight concentration
    ``1 / n_components``, mean precision 1, mean prior = data mean, degrees of freedom ``d``, covariance
    prior = ``cov(X)`` with ``ddof=1``). ``init_params`` is ``"kmeans"`` (the project's torch k-means,
    seeded by ``random_state``), ``"k-means++"`` (seeds only) or ``"random"``. With ``N <
    n_components`` the truncation level becomes ``N`` (``n_components_``). ``dtype`` is the compute
    dtype (float64 recommended); ``device`` defaults to the data's device.

    Fitted attributes: ``weights_ (T,)``, ``means_ (T, d)``, ``covariances_ (T, d, d)``,
    ``precisions_cholesky_ (T, d, d)`` (scikit-learn's convention: upper triangular ``U`` with
    ``precision = U U^T``), ``converged_``, ``n_iter_``, ``lower_bound_``, ``lower_bounds_``,
    ``weight_concentration_``, ``mean_precision_``, ``degrees_of_freedom_``, ``n_components_``,
    ``covariance_prior_`` (the prior used, ``W0^{-1}``), ``component_sizes_`` (``N_k``).
    :meth:`posterior_factors` gives the covariances in factored form (shared prior + per-component data
    term of rank ``<= N_k + 1``), from which :meth:`GaussianComponents.shared` stores compact signatures.
    ``covariances_`` and ``precisions_cholesky_`` are computed on first access. ``last_labels_`` is the
    argmax of the last E-step's responsibilities (those the final M-step used); :meth:`fit_predict`
    recomputes labels with the final parameters, as scikit-learn (``fit`` skips that extra E-step).
    """

    def __init__(
        self,
        n_components: int = 20,
        weight_concentration_prior: float | None = None,
        mean_precision_prior: float | None = None,
        degrees_of_freedom_prior: float | None = None,
        covariance_prior: Tensor | np.ndarray | None = None,
        reg_covar: float = 1e-6,
        tol: float = 1e-3,
        max_iter: int = 100,
        init_params: str = "kmeans",
        random_state: int | None = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float64,
        *,
        mean_prior: Tensor | np.ndarray | None = None,
    ) -> None:
        if n_components < 1:
            raise ValueError(f"n_components must be >= 1, got {n_components}")
        if init_params not in ("kmeans", "k-means++", "random"):
            raise ValueError(f"init_params must be 'kmeans', 'k-means++' or 'random', got {init_params!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.n_components = int(n_components)
        self.weight_concentration_prior = weight_concentration_prior
        self.mean_precision_prior = mean_precision_prior
        self.degrees_of_freedom_prior = degrees_of_freedom_prior
        self.covariance_prior = covariance_prior
        self.mean_prior = mean_prior
        self.reg_covar = float(reg_covar)
        self.tol = float(tol)
        self.max_iter = int(max_iter)
        self.init_params = init_params
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        #: screen the E-step of large float64 problems (same results; see _weighted_log_prob)
        self.screen = True
        self._screen_hits = 0.0
        self._marg_hits = 0.0
        self._bf16_hits = 0.0
        #: the bfloat16 screening stage (where bfloat16 products are native; see _weighted_log_prob)
        self.screen_bf16 = True

    # ------------------------------------------------------------------ public API
    def fit(self, X: Tensor | np.ndarray) -> DPGMM:
        """Fit on ``X (N, d)``: k-means initial responsibilities, then variational EM."""
        self._fit(X, None)
        return self

    def fit_predict(self, X: Tensor | np.ndarray) -> Tensor:
        """Fit, then return the component of each training point (after a final E-step, as scikit-learn)."""
        self._fit(X, None)
        with torch.no_grad():
            return self._e_step(self._rotate(X)).argmax(dim=1)

    # ------------------------------------------------------------------ fitting
    def _fit(self, X: Tensor | np.ndarray, init_resp: Tensor | np.ndarray | None) -> DPGMM:
        """Fit from given initial responsibilities (N, T) or, with ``None``, from ``init_params``.

        This is the hook the tests use to start from scikit-learn's exact initialisation.
        """
        with torch.no_grad():
            return self._fit_impl(X, init_resp)

    def _fit_impl(self, X: Tensor | np.ndarray, init_resp: Tensor | np.ndarray | None) -> DPGMM:
        X = as_tensor(X, self.device, self.dtype)
        check_finite_rows(X)
        N, d = X.shape
        if N < 2:
            raise SignatureFitError(f"a DP-GMM needs at least 2 samples, got N={N}")
        T = min(self.n_components, N)
        if init_resp is not None:
            init_resp = as_tensor(init_resp, X.device, self.dtype)
            if init_resp.shape[0] != N:
                raise ValueError(f"init_resp has {init_resp.shape[0]} rows, X has {N}")
            T = init_resp.shape[1]
        self.n_components_ = T
        self.n_features_in_ = d
        self._screen_hits = 0.0
        self._marg_hits = 0.0
        self._bf16_hits = 0.0
        self._cov_cache: Tensor | None = None
        self._prec_chol_cache: Tensor | None = None

        # ---- priors (scikit-learn's defaults)
        self.weight_concentration_prior_ = (
            1.0 / T if self.weight_concentration_prior is None else float(self.weight_concentration_prior)
        )
        self.mean_precision_prior_ = (
            1.0 if self.mean_precision_prior is None else float(self.mean_precision_prior)
        )
        if self.mean_prior is None:
            mu0 = X.mean(0)
        else:
            mu0 = like(self.mean_prior, X).reshape(-1)
            if mu0.shape[0] != d:
                raise ValueError(f"mean_prior has {mu0.shape[0]} features, X has {d}")
        if self.degrees_of_freedom_prior is None:
            self.degrees_of_freedom_prior_ = float(d)
        elif self.degrees_of_freedom_prior > d - 1.0:
            self.degrees_of_freedom_prior_ = float(self.degrees_of_freedom_prior)
        else:
            raise ValueError(
                f"degrees_of_freedom_prior must be > {d - 1}, got {self.degrees_of_freedom_prior}"
            )
        if self.covariance_prior is None:
            Xc = X - X.mean(0)
            C0 = (Xc.T @ Xc) / (N - 1)
        else:
            C0 = like(self.covariance_prior, X)
            if C0.shape != (d, d):
                raise ValueError(f"covariance_prior must be ({d}, {d}), got {tuple(C0.shape)}")
        C0 = 0.5 * (C0 + C0.T)
        if not bool(torch.isfinite(C0).all()):
            raise SignatureFitError("covariance prior is not finite")
        e, V = torch.linalg.eigh(C0)
        e_max = float(e[-1])
        floor = max(e_max, 0.0) * d * float(torch.finfo(X.dtype).eps)
        if e_max <= 0.0 or float(e[0]) <= floor:
            why = " (N <= d: the empirical covariance is rank-deficient)" if N <= d else ""
            raise SignatureFitError(
                f"singular covariance prior: smallest eigenvalue {float(e[0]):.3g}, largest {e_max:.3g}"
                f"{why}; pass a regularised covariance_prior (e.g. cov(X) + lambda I)"
            )
        self.mean_prior_ = mu0
        self.covariance_prior_ = C0
        self._mu0, self._V, self._e = mu0, V, e
        Xr = (X - mu0) @ V

        # ---- initial responsibilities
        if init_resp is None:
            resp = initial_resp(Xr, T, self.init_params, self.random_state)
        else:
            resp = init_resp
        self._x2 = Xr * Xr
        self._xaug: Tensor | None = None  # bfloat16 [Xr, 1], made by the first bfloat16 pass
        self._m_step(Xr, resp)

        lower_bound = -math.inf
        self.last_labels_ = resp.argmax(dim=1)
        self.lower_bounds_: list[float] = []
        self.converged_ = False
        n_iter = 0
        for n_iter in range(1, self.max_iter + 1):  # noqa: B007 - n_iter is reported
            prev = lower_bound
            log_resp = self._e_step(Xr)
            resp = log_resp.exp()
            self.last_labels_ = log_resp.argmax(dim=1)
            self._m_step(Xr, resp)
            lower_bound = self._lower_bound(resp, log_resp)
            if not math.isfinite(lower_bound):
                raise SignatureFitError(f"the DP-GMM lower bound became {lower_bound} at iteration {n_iter}")
            self.lower_bounds_.append(lower_bound)
            if abs(lower_bound - prev) < self.tol:
                self.converged_ = True
                break
        self.n_iter_ = n_iter if self.max_iter > 0 else 0
        self.lower_bound_ = float(lower_bound)
        self._finalise()
        del self._x2, self._xaug
        return self

    def _m_step(self, Xr: Tensor, resp: Tensor) -> None:
        """Variational M-step (scikit-learn's ``_m_step`` / ``_initialize``) in the rotated basis."""
        N, d = Xr.shape
        T = resp.shape[1]
        eps = float(torch.finfo(resp.dtype).eps)
        nk = resp.sum(0) + 10.0 * eps
        xk = (resp.T @ Xr) / nk[:, None]
        # weights: Beta(1 + N_k, alpha + sum_{j>k} N_j)
        tail = torch.flip(torch.cumsum(torch.flip(nk, [0]), 0), [0])
        tail = torch.cat([tail[1:], tail.new_zeros(1)])
        self.weight_concentration_ = (1.0 + nk, self.weight_concentration_prior_ + tail)
        self._nk = nk
        # means
        kappa0 = self.mean_precision_prior_
        self.mean_precision_ = kappa0 + nk
        self._means_r = (nk[:, None] * xk) / self.mean_precision_[:, None]  # mean prior is 0 here
        # Wishart
        self.degrees_of_freedom_ = self.degrees_of_freedom_prior_ + nk
        beta = nk * kappa0 / self.mean_precision_
        D = self._e[None, :] + (nk * self.reg_covar)[:, None]  # (T, d)
        self._B = []
        for k in range(T):
            rk = resp[:, k]
            idx = (rk > _SUPPORT_EPS).nonzero().flatten()
            rows = (Xr.index_select(0, idx) - xk[k]) * rk.index_select(0, idx).sqrt()[:, None]
            self._B.append(torch.cat([rows, (beta[k].sqrt() * xk[k])[None, :]], 0))
        self._factors = factorise(self._B, D, self._means_r)

    def _weighted_log_prob(self, Xr: Tensor, x2: Tensor | None = None) -> Tensor:
        """scikit-learn's ``_estimate_weighted_log_prob`` (N, T): ``E[log pi_k] + E[log N(x | k)]``.

        Large float64 problems are screened first, so that only the pairs (row, component) that can
        matter get the full ``O(d s_k)`` Mahalanobis computation, in float64:

        0. where bfloat16 products are native (:func:`~proteus.signatures.woodbury.bf16_is_fast`), the
           product in bfloat16 with an assumed error of ``_BF16_REL_ERR`` (16 bfloat16 units) of its
           magnitude; the best pair of each row is computed exactly and every pair whose estimate plus
           error reaches within ``_SCREEN_MARGIN`` of it too (``screen_bf16 = False`` skips the stage);
        1. upper bounds from each component's marginal on the ``_MARGINAL_DIM`` leading eigen-directions
           of the covariance prior (exact bounds, see :func:`~proteus.signatures.woodbury.marginal_bounds`);
           the best-bounded pair of each row is computed exactly, and every pair whose bound is within
           ``_SCREEN_MARGIN`` nats of that value is computed exactly too;
        2. if that leaves too many pairs (clusters not separated enough), a float32 pass with a
           generous rounding-error bound selects the pairs instead;
        3. otherwise (responsibilities spread over many components), a plain float64 pass.

        Pairs left out keep their bound (stage 1) or float32 value (stage 2); their responsibilities are
        below ``exp(-_SCREEN_MARGIN)`` (about 2e-22) relative to their row's best, far under
        ``_SUPPORT_EPS``, so results equal the plain pass to rounding. A stage that selected too many
        pairs is not tried again until the next fit. Set ``screen = False`` to always take the plain pass.
        """
        return _screened_log_prob(self, Xr, x2)

    def _e_step(self, Xr: Tensor) -> Tensor:
        wlp = self._weighted_log_prob(Xr, getattr(self, "_x2", None))
        return wlp - torch.logsumexp(wlp, dim=1, keepdim=True)


def initial_resp(Xr: Tensor, T: int, init_params: str, random_state: int | None) -> Tensor:
    """(N, T) initial responsibilities as scikit-learn draws them for the same ``random_state``:
    ``"random"`` (uniform, normalised), ``"kmeans"`` (one-hot k-means labels) or k-means++ seeds (one
    point per component)."""
    N = Xr.shape[0]
    rs = np.random.RandomState(random_state)  # scikit-learn's stream for the same random_state
    if init_params == "random":
        resp = torch.from_numpy(rs.uniform(size=(N, T))).to(device=Xr.device, dtype=Xr.dtype)
        return resp / resp.sum(1, keepdim=True)
    resp = torch.zeros((N, T), dtype=Xr.dtype, device=Xr.device)
    if init_params == "kmeans":
        labels, _, _ = kmeans(Xr, T, rs)
        resp[torch.arange(N, device=Xr.device), labels] = 1.0
    else:  # k-means++ seeds: one point per component
        _, idx = kmeans_plusplus(Xr, T, Draws(rs), (Xr * Xr).sum(1))
        resp[idx, torch.arange(T, device=Xr.device)] = 1.0
    return resp


def _screened_log_prob(gm: DPGMM, Xr: Tensor, x2: Tensor | None) -> Tensor:
    """:meth:`DPGMM._weighted_log_prob` of a fitted (or fitting) model ``gm`` (the screening stages read
    this module's constants when called)."""
    N, d = Xr.shape
    dof = gm.degrees_of_freedom_[None, :]
    const = gm._log_prob_const(d)[None, :]
    f = gm._factors
    T = const.shape[1]
    R = f.S.shape[0]
    screen = gm.screen and Xr.dtype == torch.float64 and N * R * d >= _SCREEN_MIN_WORK
    if screen and gm.screen_bf16 and gm._bf16_hits <= _BF16_MAX_FRACTION and bf16_is_fast(Xr.device):
        A = getattr(gm, "_xaug", None)
        if A is None or A.shape[0] != N:
            A = augment_bf16(Xr)
            if x2 is not None:  # fitting: the same rows come back at every E-step
                gm._xaug = A
        q, mag = maha_bf16(f, gm._means_r, Xr, A, x2, _BF16_CHUNK_ELEMENTS)
        wlp = const - 0.5 * dof * q
        err = 0.5 * dof * (_BF16_REL_ERR * mag) + 1e-6
        best = wlp.argmax(dim=1)
        first = torch.zeros((N, T), dtype=torch.bool, device=Xr.device)
        first[torch.arange(N, device=Xr.device), best] = True
        for rows, k, qk in maha_pairs(f, gm._means_r, Xr, first):
            wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
        floor = wlp.gather(1, best[:, None]) - _SCREEN_MARGIN  # an exact value: at most the row's best
        cand = (wlp + err >= floor) & ~first
        gm._bf16_hits = (float(cand.sum()) + N) / (N * T)
        if gm._bf16_hits <= _BF16_MAX_FRACTION:
            for rows, k, qk in maha_pairs(f, gm._means_r, Xr, cand):
                wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
            return wlp
    p = min(_MARGINAL_DIM, d)
    marginal_pays = 4 * p * p * T <= d * R  # the bounds must cost well under the exact pass
    if screen and marginal_pays and gm._marg_hits <= _MARGINAL_MAX_FRACTION:
        bounds = marginal_bounds(f, gm._B, gm._means_r, Xr, p, _CHUNK_ELEMENTS)
        wlp = const - 0.5 * dof * bounds  # upper bounds
        best = wlp.argmax(dim=1)
        first = torch.zeros((N, T), dtype=torch.bool, device=Xr.device)
        first[torch.arange(N, device=Xr.device), best] = True
        for rows, k, qk in maha_pairs(f, gm._means_r, Xr, first):
            wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
        floor = wlp.gather(1, best[:, None]) - _SCREEN_MARGIN
        cand = (wlp >= floor) & ~first
        gm._marg_hits = (float(cand.sum()) + N) / (N * T)
        if gm._marg_hits <= _MARGINAL_MAX_FRACTION:
            for rows, k, qk in maha_pairs(f, gm._means_r, Xr, cand):
                wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
            return wlp
    if screen and gm._screen_hits <= _SCREEN_MAX_FRACTION:
        q, mag_low = maha_over_dof(f, gm._means_r, Xr, x2, True, _CHUNK_ELEMENTS)
        assert mag_low is not None
        wlp = const - 0.5 * dof * q
        tol = _SCREEN_REL_ERR if torch.get_float32_matmul_precision() == "highest" else 1e-2
        err = 0.5 * dof * (tol * mag_low) + 1e-6
        floor = (wlp - err).max(dim=1, keepdim=True).values - _SCREEN_MARGIN
        cand = (wlp + err) >= floor
        gm._screen_hits = float(cand.sum()) / max(cand.numel(), 1)
        if gm._screen_hits <= _SCREEN_MAX_FRACTION:
            for rows, k, qk in maha_pairs(f, gm._means_r, Xr, cand):
                wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
            return wlp
    q, _ = maha_over_dof(f, gm._means_r, Xr, x2, False, _CHUNK_ELEMENTS)
    return const - 0.5 * dof * q
