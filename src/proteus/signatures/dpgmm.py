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
  problems the E-step is screened (see :meth:`DPGMM._weighted_log_prob`): exact upper bounds from
  low-dimensional marginals, or a float32 pass with a generous error bound, select the (sample,
  component) pairs that can be within 50 nats of a sample's best; only those are computed in full
  float64. The others have responsibilities below ``exp(-50)`` relative to the best and keep their bound.
* The k-means initialisation (:func:`kmeans`) draws its k-means++ seeds from ``numpy.random.RandomState
  (random_state)`` exactly as scikit-learn's ``KMeans`` does, so the same ``random_state`` gives the same
  initial partition and hence the same fit as scikit-learn (the DP-GMM often stops two iterations after
  its initialisation in high dimension, so the initial partition decides the model).

Deviations from scikit-learn, all documented: ``N < n_components`` reduces the truncation level to
``N`` (scikit-learn raises), and every failure (non-finite input, ``N < 2``, a singular covariance
prior, a non positive-definite covariance, a non-finite lower bound) raises :class:`SignatureFitError`.
No ``ConvergenceWarning`` is emitted; read ``converged_``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["DPGMM", "PosteriorFactors", "SignatureFitError", "kmeans"]

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


class SignatureFitError(ValueError):
    """A signature (DP-GMM, k-means or Gaussian) could not be fitted; the message names the cause."""


def _as_tensor(X: Tensor | np.ndarray, device: torch.device | str | None, dtype: torch.dtype) -> Tensor:
    if isinstance(X, np.ndarray):
        X = torch.from_numpy(np.ascontiguousarray(X))
    if not isinstance(X, Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(X).__name__}")
    if X.ndim != 2:
        raise SignatureFitError(f"expected a 2-D (N, d) array, got shape {tuple(X.shape)}")
    return X.to(device=device if device is not None else X.device, dtype=dtype)


def _like(value: Tensor | np.ndarray, X: Tensor) -> Tensor:
    """``value`` as a tensor on X's device and dtype."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    return torch.as_tensor(value).to(device=X.device, dtype=X.dtype)


def check_finite_rows(X: Tensor) -> None:
    """Raise :class:`SignatureFitError` naming how many rows contain NaN or inf."""
    nan_rows = int(torch.isnan(X).any(dim=1).sum())
    inf_rows = int(torch.isinf(X).any(dim=1).sum())
    if nan_rows or inf_rows:
        parts = []
        if nan_rows:
            parts.append(f"{nan_rows} NaN row{'s' if nan_rows != 1 else ''}")
        if inf_rows:
            parts.append(f"{inf_rows} row{'s' if inf_rows != 1 else ''} with inf")
        raise SignatureFitError(f"embeddings contain {' and '.join(parts)} (of {X.shape[0]})")


def _mm_nt(A: Tensor, B: Tensor) -> Tensor:
    """``A @ B.T`` for a tall A (N, d) and a short B (K, d), computed as ``(B @ A.T).T``: some CPU BLAS
    builds are several times slower on the (N x d) @ (d x small K) shape."""
    return (B @ A.T).T


def _sq_dist(X: Tensor, C: Tensor, x2: Tensor | None = None, c2: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances (N, K) via ||x||^2 - 2 x.c + ||c||^2, clamped at 0."""
    if x2 is None:
        x2 = (X * X).sum(1)
    if c2 is None:
        c2 = (C * C).sum(1)
    return (x2[:, None] - 2.0 * _mm_nt(X, C) + c2[None, :]).clamp_min_(0.0)


RandomSource = int | np.random.RandomState | torch.Generator | None


class _Draws:
    """The few random numbers k-means++ needs, from a numpy ``RandomState`` (scikit-learn's stream: an
    integer seed gives the draws ``KMeans(random_state=seed)`` makes) or from a ``torch.Generator``."""

    def __init__(self, source: RandomSource) -> None:
        if isinstance(source, torch.Generator):
            self.gen: torch.Generator | None = source
            self.rs: np.random.RandomState | None = None
        else:
            self.gen = None
            self.rs = source if isinstance(source, np.random.RandomState) else np.random.RandomState(source)

    def first(self, n: int) -> int:
        if self.rs is not None:
            return int(self.rs.choice(n, p=np.full(n, 1.0 / n)))
        assert self.gen is not None
        return int(torch.randint(n, (1,), generator=self.gen, device=self.gen.device).item())

    def uniform(self, size: int) -> np.ndarray:
        if self.rs is not None:
            return self.rs.uniform(size=size)
        assert self.gen is not None
        return torch.rand(size, generator=self.gen, device=self.gen.device, dtype=torch.float64).cpu().numpy()


def _kmeans_plusplus(X: Tensor, k: int, draws: _Draws, x2: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy k-means++ seeding exactly as scikit-learn's ``_kmeans_plusplus`` (2 + log k local trials,
    candidates drawn by inverse-CDF of the squared distances); returns ``(centres (k, d), indices (k,))``."""
    N = X.shape[0]
    n_trials = 2 + int(np.log(k))
    idx = [draws.first(N)]
    closest = _sq_dist(X[idx[0] : idx[0] + 1], X, None, x2)[0]
    pot = closest.sum()
    for _ in range(1, k):
        r = torch.from_numpy(draws.uniform(n_trials)).to(device=X.device, dtype=X.dtype) * pot
        cand = torch.searchsorted(torch.cumsum(closest, 0), r).clamp_(max=N - 1)
        d_cand = torch.minimum(_sq_dist(X.index_select(0, cand), X, None, x2), closest[None, :])
        pots = d_cand.sum(1)
        j = int(torch.argmin(pots))
        pot, closest = pots[j], d_cand[j]
        idx.append(int(cand[j]))
    index = torch.tensor(idx, device=X.device)
    return X.index_select(0, index).clone(), index


def kmeans(
    X: Tensor,
    n_clusters: int,
    random_state: RandomSource = 0,
    max_iter: int = 300,
    tol: float = 1e-4,
) -> tuple[Tensor, Tensor, int]:
    """Lloyd's k-means with k-means++ seeding in torch, following scikit-learn's ``KMeans(n_init=1)``.

    Same seeding draws as scikit-learn for an integer ``random_state`` (a ``torch.Generator`` is also
    accepted), same stopping rule (labels unchanged, or total squared centre shift below ``tol`` times
    the mean feature variance), empty clusters re-seeded with the points farthest from their centres.
    ``X`` should be centred (scikit-learn centres it). Returns ``(labels (N,), centres (K, d), n_iter)``.
    """
    N = X.shape[0]
    k = max(1, min(int(n_clusters), N))
    draws = _Draws(random_state)
    x2 = (X * X).sum(1)
    C, _ = _kmeans_plusplus(X, k, draws, x2)
    abs_tol = float(X.var(dim=0, unbiased=False).mean()) * tol
    labels_old = torch.full((N,), -1, dtype=torch.long, device=X.device)
    strict = False
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported
        dist = _sq_dist(X, C, x2)
        labels = dist.argmin(1)
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        onehot = torch.zeros((N, k), dtype=X.dtype, device=X.device)
        onehot[torch.arange(N, device=X.device), labels] = 1.0
        sums = onehot.T @ X
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            far = dist.gather(1, labels[:, None])[:, 0].argsort(descending=True)[: len(empty)].tolist()
            for j, p in zip(empty, far):
                old = int(labels[p])
                sums[old] -= X[p]
                counts[old] -= 1.0
                sums[j] = X[p]
                counts[j] = 1.0
        C_new = sums / counts.clamp_min(1.0)[:, None]
        shift = float(((C_new - C) ** 2).sum())
        C = C_new
        if bool((labels == labels_old).all()):
            strict = True
            break
        if shift <= abs_tol:
            break
        labels_old = labels
    if not strict:
        labels = _sq_dist(X, C, x2).argmin(1)
    return labels, C, n_iter


@dataclass
class _Factors:
    """Stacked Mahalanobis factors of all components (rotated basis), see :meth:`DPGMM._factorise`.

    For a dense component, ``maha/dof = ||FT_k (x - m_k)||^2``; for a Woodbury one,
    ``maha/dof = ||x - m_k||^2_{D_k^{-1}} - ||FT_k (x - m_k)||^2``. Component k owns the rows
    ``bounds[k][0]:bounds[k][1]`` of ``FT``.
    """

    FT: Tensor  # (R, d) stacked factor rows
    off: Tensor  # (R,) FT row . m_k
    S: Tensor  # (R, T) signed component indicator: +1 dense, -1 Woodbury
    bounds: list[tuple[int, int]]
    wood: Tensor  # (T,) bool
    inv_D: Tensor  # (T, d) 1 / (e + N_k reg_covar)
    logdet_num: Tensor  # (T,) log|Num_k|
    low: tuple[Tensor, Tensor] | None = None  # float32 copies of (FT, off) for the screening pass
    marg: tuple[Tensor, Tensor, Tensor] | None = None  # marginal factors, offsets, block sums (_marginal)


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


class DPGMM:
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

    # ------------------------------------------------------------------ fitting
    def _fit(self, X: Tensor | np.ndarray, init_resp: Tensor | np.ndarray | None) -> DPGMM:
        """Fit from given initial responsibilities (N, T) or, with ``None``, from ``init_params``.

        This is the hook the tests use to start from scikit-learn's exact initialisation.
        """
        with torch.no_grad():
            return self._fit_impl(X, init_resp)

    def _fit_impl(self, X: Tensor | np.ndarray, init_resp: Tensor | np.ndarray | None) -> DPGMM:
        X = _as_tensor(X, self.device, self.dtype)
        check_finite_rows(X)
        N, d = X.shape
        if N < 2:
            raise SignatureFitError(f"a DP-GMM needs at least 2 samples, got N={N}")
        T = min(self.n_components, N)
        if init_resp is not None:
            init_resp = _as_tensor(init_resp, X.device, self.dtype)
            if init_resp.shape[0] != N:
                raise ValueError(f"init_resp has {init_resp.shape[0]} rows, X has {N}")
            T = init_resp.shape[1]
        self.n_components_ = T
        self.n_features_in_ = d
        self._screen_hits = 0.0
        self._marg_hits = 0.0
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
            mu0 = _like(self.mean_prior, X).reshape(-1)
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
            C0 = _like(self.covariance_prior, X)
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
            resp = self._initial_resp(Xr, T)
        else:
            resp = init_resp
        self._x2 = Xr * Xr
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
        del self._x2
        return self

    def _initial_resp(self, Xr: Tensor, T: int) -> Tensor:
        N = Xr.shape[0]
        rs = np.random.RandomState(self.random_state)  # scikit-learn's stream for the same random_state
        if self.init_params == "random":
            resp = torch.from_numpy(rs.uniform(size=(N, T))).to(device=Xr.device, dtype=Xr.dtype)
            return resp / resp.sum(1, keepdim=True)
        resp = torch.zeros((N, T), dtype=Xr.dtype, device=Xr.device)
        if self.init_params == "kmeans":
            labels, _, _ = kmeans(Xr, T, rs)
            resp[torch.arange(N, device=Xr.device), labels] = 1.0
        else:  # k-means++ seeds: one point per component
            _, idx = _kmeans_plusplus(Xr, T, _Draws(rs), (Xr * Xr).sum(1))
            resp[idx, torch.arange(T, device=Xr.device)] = 1.0
        return resp

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
        self._factors = self._factorise(D)

    def _factorise(self, D: Tensor) -> _Factors:
        """Per component, Mahalanobis factors of ``Num_k = diag(D_k) + B_k^T B_k`` (see :class:`_Factors`)."""
        T, d = D.shape
        dtype, device = D.dtype, D.device
        eps = float(torch.finfo(dtype).eps)
        means = self._means_r
        inv_D = 1.0 / D
        log_D = D.log().sum(1)
        FT: list[Tensor | None] = [None] * T
        sign = [1.0] * T
        logdet = [torch.zeros((), dtype=dtype, device=device)] * T
        dense: list[int] = []
        for k in range(T):
            B = self._B[k]
            r = B.shape[0]
            if r >= d:
                dense.append(k)
                continue
            Bh = B * inv_D[k].sqrt()[None, :]
            core = Bh @ Bh.T
            if float(core.diagonal().sum()) > 1e-3 / eps:  # Woodbury would cancel badly: go dense
                dense.append(k)
                continue
            core.diagonal().add_(1.0)
            G, info = torch.linalg.cholesky_ex(core)
            if int(info) != 0:
                raise SignatureFitError(f"component {k}: Woodbury core matrix is not positive definite")
            FT[k] = torch.linalg.solve_triangular(G, B * inv_D[k][None, :], upper=False)
            sign[k] = -1.0
            logdet[k] = log_D[k] + 2.0 * G.diagonal().log().sum()
        if dense:
            nums = []
            for k in dense:
                B = self._B[k]
                num = B.T @ B
                num.diagonal().add_(D[k])
                nums.append(num)
            L, info = torch.linalg.cholesky_ex(torch.stack(nums))
            if bool((info != 0).any()):
                bad = [dense[i] for i in (info != 0).nonzero().flatten().tolist()]
                raise SignatureFitError(
                    f"covariance of component(s) {bad} is not positive definite (ill-defined empirical "
                    "covariance; increase reg_covar or regularise the covariance prior)"
                )
            eye = torch.eye(d, dtype=dtype, device=device).expand_as(L)
            Linv = torch.linalg.solve_triangular(L, eye, upper=False)
            ld = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            for i, k in enumerate(dense):
                FT[k] = Linv[i]
                logdet[k] = ld[i]
        rows = [f for f in FT if f is not None]
        assert len(rows) == T
        FT_all = torch.cat(rows, 0)
        sizes = [f.shape[0] for f in rows]
        ends = np.cumsum(sizes).tolist()
        bounds = [(e - n, e) for n, e in zip(sizes, ends)]
        seg = torch.repeat_interleave(torch.arange(T, device=device), torch.tensor(sizes, device=device))
        off = (FT_all * means.index_select(0, seg)).sum(1)
        sign_t = torch.tensor(sign, dtype=dtype, device=device)
        S = torch.zeros((FT_all.shape[0], T), dtype=dtype, device=device)
        S[torch.arange(FT_all.shape[0], device=device), seg] = sign_t.index_select(0, seg)
        return _Factors(
            FT=FT_all,
            off=off,
            S=S,
            bounds=bounds,
            wood=sign_t < 0,
            inv_D=inv_D,
            logdet_num=torch.stack(logdet),
        )

    def _base(self, xs: Tensor, xs2: Tensor | None) -> Tensor:
        """``||x - m_k||^2_{D_k^{-1}}`` (N, T) (the Woodbury components' leading term)."""
        f, m = self._factors, self._means_r
        m_invD = m * f.inv_D
        if xs2 is None:
            xs2 = xs * xs
        return _mm_nt(xs2, f.inv_D) - 2.0 * _mm_nt(xs, m_invD) + (m * m_invD).sum(1)[None, :]

    def _maha_over_dof(
        self, Xr: Tensor, x2: Tensor | None = None, low: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``(x - m_k)^T Num_k^{-1} (x - m_k)`` for all rows and components, (N, T).

        With ``low=True`` the big product runs in float32 (the screening pass) and a magnitude (N, T)
        that bounds the rounding error (relative) is returned as well.
        """
        f = self._factors
        T = f.S.shape[1]
        N = Xr.shape[0]
        out = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device)
        mag = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device) if low else None
        if low:
            if f.low is None:
                f.low = (f.FT.float(), f.off.float())
            FT, off = f.low
            S, Sabs = f.S.float(), f.S.abs().float()
        else:
            FT, off, S, Sabs = f.FT, f.off, f.S, f.S
        R = FT.shape[0]
        chunk = max(1, _CHUNK_ELEMENTS // max(R, T, 1))
        any_wood = bool(f.wood.any())
        wood = f.wood[None, :]
        for s in range(0, N, chunk):
            xs = Xr[s : s + chunk]
            Y = xs.to(FT.dtype) @ FT.T
            Y.sub_(off[None, :]).square_()
            q = (Y @ S).to(Xr.dtype)
            m2 = (Y @ Sabs).to(Xr.dtype) if mag is not None else None
            if any_wood:
                base = self._base(xs, x2[s : s + chunk] if x2 is not None else None)
                base = torch.where(wood, base, torch.zeros_like(base))
                q = q + base
                if m2 is not None:
                    m2 = m2 + base
            out[s : s + chunk] = q
            if mag is not None and m2 is not None:
                mag[s : s + chunk] = m2
        return out.clamp_min_(0.0), mag

    def _marginal(self, Xr: Tensor) -> Tensor:
        """Lower bounds (N, T) on ``maha/dof``: the Mahalanobis term of each component's marginal on the
        ``p`` leading eigen-directions of the covariance prior (a marginal's Mahalanobis distance never
        exceeds the joint one: ``v^T A^{-1} v >= v_P^T (A_PP)^{-1} v_P`` for SPD ``A``)."""
        f, m = self._factors, self._means_r
        T, d = m.shape
        p = min(_MARGINAL_DIM, d)
        if f.marg is None:
            sub = []
            for k in range(T):
                Bp = self._B[k][:, d - p :]
                A = Bp.T @ Bp
                A.diagonal().add_(1.0 / f.inv_D[k, d - p :])
                sub.append(A)
            L, info = torch.linalg.cholesky_ex(torch.stack(sub))
            if bool((info != 0).any()):
                raise SignatureFitError("a component covariance is not positive definite")
            eye = torch.eye(p, dtype=L.dtype, device=L.device).expand_as(L)
            Linv = torch.linalg.solve_triangular(L, eye, upper=False)  # (T, p, p)
            W = Linv.permute(2, 0, 1).reshape(p, T * p)  # column (k, i) = row i of Linv_k
            off = torch.einsum("tij,tj->ti", Linv, m[:, d - p :]).reshape(T * p)
            blocks = torch.eye(T, dtype=L.dtype, device=L.device).repeat_interleave(p, dim=0)  # (T p, T)
            f.marg = (W, off, blocks)
        W, off, blocks = f.marg
        N = Xr.shape[0]
        out = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device)
        chunk = max(1, _CHUNK_ELEMENTS // (T * p))
        for s in range(0, N, chunk):
            Y = Xr[s : s + chunk, d - p :] @ W
            Y.sub_(off[None, :])
            out[s : s + chunk] = Y.square_() @ blocks
        return out

    def _maha_pairs(self, Xr: Tensor, x2: Tensor | None, cand: Tensor) -> list[tuple[Tensor, int, Tensor]]:
        """Exact ``maha/dof`` for the (row, component) pairs marked in ``cand`` (N, T): per component,
        ``(rows, values)``."""
        f, m = self._factors, self._means_r
        out = []
        for k, (a, b) in enumerate(f.bounds):
            rows = cand[:, k].nonzero().flatten()
            if rows.numel() == 0:
                continue
            xs = Xr.index_select(0, rows)
            Y = xs @ f.FT[a:b].T - f.off[a:b][None, :]
            q = (Y * Y).sum(1)
            if bool(f.wood[k]):
                diff = xs - m[k]
                q = (diff * diff * f.inv_D[k]).sum(1) - q
            out.append((rows, k, q.clamp_min(0.0)))
        return out

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

    def _weighted_log_prob(self, Xr: Tensor, x2: Tensor | None = None) -> Tensor:
        """scikit-learn's ``_estimate_weighted_log_prob`` (N, T): ``E[log pi_k] + E[log N(x | k)]``.

        Large float64 problems are screened first, so that only the pairs (row, component) that can
        matter get the full ``O(d s_k)`` Mahalanobis computation, in float64:

        1. upper bounds from each component's marginal on the ``_MARGINAL_DIM`` leading eigen-directions
           of the covariance prior (exact bounds, see :meth:`_marginal`); the best-bounded pair of each
           row is computed exactly, and every pair whose bound is within ``_SCREEN_MARGIN`` nats of that
           value is computed exactly too;
        2. if that leaves too many pairs (clusters not separated enough), a float32 pass with a
           generous rounding-error bound selects the pairs instead;
        3. otherwise (responsibilities spread over many components), a plain float64 pass.

        Pairs left out keep their bound (stage 1) or float32 value (stage 2); their responsibilities are
        below ``exp(-_SCREEN_MARGIN)`` (about 2e-22) relative to their row's best, far under
        ``_SUPPORT_EPS``, so results equal the plain pass to rounding. A stage that selected too many
        pairs is not tried again until the next fit. Set ``screen = False`` to always take the plain pass.
        """
        N, d = Xr.shape
        dof = self.degrees_of_freedom_[None, :]
        const = self._log_prob_const(d)[None, :]
        f = self._factors
        T = const.shape[1]
        R = f.FT.shape[0]
        screen = self.screen and Xr.dtype == torch.float64 and N * R * d >= _SCREEN_MIN_WORK
        p = min(_MARGINAL_DIM, d)
        marginal_pays = 4 * p * p * T <= d * R  # the bounds must cost well under the exact pass
        if screen and marginal_pays and self._marg_hits <= _MARGINAL_MAX_FRACTION:
            wlp = const - 0.5 * dof * self._marginal(Xr)  # upper bounds
            best = wlp.argmax(dim=1)
            first = torch.zeros((N, T), dtype=torch.bool, device=Xr.device)
            first[torch.arange(N, device=Xr.device), best] = True
            for rows, k, qk in self._maha_pairs(Xr, x2, first):
                wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
            floor = wlp.gather(1, best[:, None]) - _SCREEN_MARGIN
            cand = (wlp >= floor) & ~first
            self._marg_hits = (float(cand.sum()) + N) / (N * T)
            if self._marg_hits <= _MARGINAL_MAX_FRACTION:
                for rows, k, qk in self._maha_pairs(Xr, x2, cand):
                    wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
                return wlp
        if screen and self._screen_hits <= _SCREEN_MAX_FRACTION:
            q, mag = self._maha_over_dof(Xr, x2, low=True)
            assert mag is not None
            wlp = const - 0.5 * dof * q
            tol = _SCREEN_REL_ERR if torch.get_float32_matmul_precision() == "highest" else 1e-2
            err = 0.5 * dof * (tol * mag) + 1e-6
            floor = (wlp - err).max(dim=1, keepdim=True).values - _SCREEN_MARGIN
            cand = (wlp + err) >= floor
            self._screen_hits = float(cand.sum()) / max(cand.numel(), 1)
            if self._screen_hits <= _SCREEN_MAX_FRACTION:
                for rows, k, qk in self._maha_pairs(Xr, x2, cand):
                    wlp[rows, k] = const[0, k] - 0.5 * dof[0, k] * qk
                return wlp
        q, _ = self._maha_over_dof(Xr, x2)
        return const - 0.5 * dof * q

    def _e_step(self, Xr: Tensor) -> Tensor:
        wlp = self._weighted_log_prob(Xr, getattr(self, "_x2", None))
        return wlp - torch.logsumexp(wlp, dim=1, keepdim=True)

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
        if not bool(
            torch.isfinite(self._factors.FT).all() and torch.isfinite(self._factors.logdet_num).all()
        ):
            raise SignatureFitError("the DP-GMM fit produced non-finite covariance factors")

    # ------------------------------------------------------------------ helpers
    def _check_fitted(self) -> None:
        if not hasattr(self, "_factors"):
            raise RuntimeError("DPGMM is not fitted yet; call fit(X) first")

    def _rotate(self, X: Tensor | np.ndarray) -> Tensor:
        self._check_fitted()
        X = _as_tensor(X, self._V.device, self._V.dtype)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, the model was fitted on {self.n_features_in_}")
        return (X - self._mu0) @ self._V
