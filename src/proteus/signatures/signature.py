"""The multi-key signature of one task (Definition 3.1), learned with Eq. 18 and scored as in Eq. 2.

:func:`fit_signature` turns a task's embeddings ``H = h_k(x), x in D_k`` (its own adapter) into
``tau`` Gaussian signature patterns ``(m_k^t, Lambda_k^t)``:

1. optional L2 normalisation of the rows (``cfg.normalize``);
2. a clustering fit per ``cfg.method``:

   * ``"dpgmm"``: :class:`~proteus.signatures.dpgmm.DPGMM` with truncation ``T = cfg.max_components``
     (Eq. 18 with a Dirichlet-process prior). Its covariance prior is ``cov(H) + lambda I`` with
     ``lambda = max(cfg.reg_covar, 1e-3 * trace(cov(H)) / d)`` (``_PRIOR_RIDGE``): embeddings after a
     LayerNorm, or fewer embeddings than dimensions, make ``cov(H)`` singular;
   * ``"kmeans"``: ``K = cfg.max_components`` hard clusters (the ablation), then one Gaussian per cluster
     with covariance ``(n_k S_k + d S_pool) / (n_k + d)``: the cluster's own scatter ``S_k`` shrunk
     towards the pooled within-cluster covariance ``S_pool`` with the weight of ``d`` pseudo-points, so
     tiny clusters fall back to the shared covariance and large ones keep their own;
   * ``"gaussian"``: one Gaussian (the single-key signature of Eq. 2).

   For k-means and the single Gaussian, covariances get the same ridge ``lambda``.
3. inactive components are dropped (weight < ``1e-3`` or fewer than 2 assigned training points; if none
   survives, the heaviest one is kept) and ``n_active`` is reported;
4. the survivors become :class:`~proteus.signatures.gaussian.GaussianComponents` of kind
   ``cfg.covariance`` with rank ``min(cfg.rank, d - 1, N - 1)``. Kind ``"shared"`` is built from the
   factored covariances instead (:meth:`GaussianComponents.shared`, a budget of ``cfg.rank`` factor rows
   per component on average, at most d): for ``"dpgmm"`` the posterior's own structure
   (:meth:`DPGMM.posterior_factors`: covariance prior shared, data term per component); for ``"kmeans"``
   the same identity with the pooled covariance as the shared matrix, ``(n_k S_k + d S_pool) / (n_k + d)
   + reg I = d / (n_k + d) (S_pool + reg (n_k + d) / d I + n_k S_k / d)``; for ``"gaussian"`` the one
   covariance itself (no low-rank part). All three are exact while the budget holds every factor;
5. with ``cfg.calibrate == "standardize"`` the median and robust scale (1.4826 x MAD, floored at
   ``1e-6 (1 + |median|)``) of the training inputs' best-component scores are stored and every later
   score is standardised with them.

:meth:`Signature.score` returns the (N, T_active) score matrix (lower is better): ``cfg.score`` (the
Gaussian NLL or the Mahalanobis term of Eq. 2) after the same normalisation, then the calibration.
:meth:`Signature.to_tensors` returns ``(tensors, meta)``: tensors for safetensors and a JSON-serialisable
dict; :meth:`Signature.from_tensors` inverts it (bit-exact for float32 storage).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from proteus.config import SignatureConfig
from proteus.signatures.dpgmm import DPGMM, PosteriorFactors, SignatureFitError, check_finite_rows, kmeans
from proteus.signatures.gaussian import GaussianComponents

__all__ = ["CHOICES", "Signature", "fit_signature"]

_PRIOR_RIDGE = 1e-3
_MIN_WEIGHT = 1e-3
_MIN_POINTS = 2
_MAD_TO_SIGMA = 1.4826
_FORMAT = 1

_METHODS = ("dpgmm", "kmeans", "gaussian")
_NORMALIZE = ("none", "l2")
_SCORES = ("nll", "mahalanobis")
_CALIBRATE = ("none", "standardize")
_STORAGE = ("float32", "float16")
_COVARIANCES = ("full", "ppca", "shared")
#: allowed values of the ``signature.*`` config keys, declared once
CHOICES = {
    "method": _METHODS,
    "normalize": _NORMALIZE,
    "score": _SCORES,
    "calibrate": _CALIBRATE,
    "storage_dtype": _STORAGE,
    "covariance": _COVARIANCES,
}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"signature.{name} must be one of {choices}, got {value!r}")


def _normalise(H: Tensor, how: str) -> Tensor:
    return F.normalize(H, dim=1) if how == "l2" else H


class Signature:
    """The multi-key signature of one task: Gaussian components plus how to score against them.

    Build it with :func:`fit_signature` or :meth:`from_tensors`. Attributes: ``components``
    (:class:`GaussianComponents`), ``method``, ``normalize``, ``score_kind``, ``calibrate``,
    ``calibration`` (``(median, scale)`` or ``None``), ``n_active``, ``d``, ``n_train``,
    ``lower_bound``, ``n_iter``, ``converged``, ``storage_dtype``.
    """

    def __init__(
        self,
        components: GaussianComponents,
        *,
        method: str,
        normalize: str,
        score_kind: str,
        calibrate: str,
        calibration: tuple[float, float] | None = None,
        n_train: int = 0,
        lower_bound: float | None = None,
        n_iter: int = 0,
        converged: bool = True,
        storage_dtype: str = "float32",
    ) -> None:
        _check_choice("normalize", normalize, _NORMALIZE)
        _check_choice("score", score_kind, _SCORES)
        _check_choice("calibrate", calibrate, _CALIBRATE)
        _check_choice("storage_dtype", storage_dtype, _STORAGE)
        self.components = components
        self.method = method
        self.normalize = normalize
        self.score_kind = score_kind
        self.calibrate = calibrate
        self.calibration = calibration
        self.n_train = int(n_train)
        self.lower_bound = lower_bound
        self.n_iter = int(n_iter)
        self.converged = bool(converged)
        self.storage_dtype = storage_dtype

    # ------------------------------------------------------------------ properties
    @property
    def n_active(self) -> int:
        return self.components.n_components

    @property
    def d(self) -> int:
        return self.components.d

    @property
    def device(self) -> torch.device:
        return self.components.device

    # ------------------------------------------------------------------ scoring
    def raw_score(self, H: Tensor) -> Tensor:
        """Uncalibrated (N, T_active) scores of ``cfg.score`` kind after the normalisation."""
        if H.ndim != 2 or H.shape[1] != self.d:
            raise ValueError(f"expected (N, {self.d}) embeddings, got {tuple(H.shape)}")
        Hn = _normalise(H.to(device=self.device, dtype=self.components.dtype), self.normalize)
        if self.score_kind == "nll":
            return self.components.nll(Hn)
        return self.components.mahalanobis(Hn)

    def score(self, H: Tensor) -> Tensor:
        """Signature scores (N, T_active) of embeddings ``H (N, d)``; lower is better."""
        s = self.raw_score(H)
        if self.calibrate == "standardize" and self.calibration is not None:
            med, scale = self.calibration
            s = (s - med) / scale
        return s

    def mahalanobis(self, H: Tensor) -> Tensor:
        """Mahalanobis distances (N, T_active) after the normalisation (the quantity of Definition 3.3)."""
        return self.components.mahalanobis(
            _normalise(H.to(self.device, self.components.dtype), self.normalize)
        )

    def logdets(self) -> Tensor:
        """``log|Lambda_t|`` of the active components (T_active,)."""
        return self.components.logdet

    # ------------------------------------------------------------------ storage
    @property
    def meta(self) -> dict[str, Any]:
        """JSON-serialisable description (everything but the tensors)."""
        return {
            "format": _FORMAT,
            "method": self.method,
            "normalize": self.normalize,
            "score": self.score_kind,
            "calibrate": self.calibrate,
            "calibration": None if self.calibration is None else [float(v) for v in self.calibration],
            "covariance": self.components.kind,
            "rank": int(self.components.rank) if self.components.kind in ("ppca", "shared") else None,
            "n_active": self.n_active,
            "d": self.d,
            "n_train": self.n_train,
            "lower_bound": None if self.lower_bound is None else float(self.lower_bound),
            "n_iter": self.n_iter,
            "converged": self.converged,
            "storage_dtype": self.storage_dtype,
        }

    def to_tensors(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """``(tensors, meta)``: tensors (CPU) in ``storage_dtype`` for safetensors, meta for JSON."""
        t = {k: v.cpu() for k, v in self.components.to_tensors(self.storage_dtype).items()}
        return t, self.meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], meta: dict[str, Any]) -> Signature:
        """Inverse of :meth:`to_tensors`."""
        comps = GaussianComponents.from_tensors(tensors)
        cal = meta.get("calibration")
        sig = cls(
            comps,
            method=str(meta["method"]),
            normalize=str(meta["normalize"]),
            score_kind=str(meta["score"]),
            calibrate=str(meta["calibrate"]),
            calibration=None if cal is None else (float(cal[0]), float(cal[1])),
            n_train=int(meta.get("n_train", 0)),
            lower_bound=meta.get("lower_bound"),
            n_iter=int(meta.get("n_iter", 0)),
            converged=bool(meta.get("converged", True)),
            storage_dtype=str(meta.get("storage_dtype", "float32")),
        )
        if int(meta.get("n_active", sig.n_active)) != sig.n_active or int(meta.get("d", sig.d)) != sig.d:
            raise ValueError(
                f"signature meta (n_active={meta.get('n_active')}, d={meta.get('d')}) does not match its "
                f"tensors (n_active={sig.n_active}, d={sig.d})"
            )
        return sig

    def nbytes(self) -> int:
        """Bytes of the stored tensors in ``storage_dtype``."""
        return sum(v.numel() * v.element_size() for v in self.to_tensors()[0].values())

    def to(self, device: torch.device | str) -> Signature:
        """Move the components to ``device`` (in place); returns ``self``."""
        self.components.to(device)
        return self

    def __repr__(self) -> str:
        return (
            f"Signature(method={self.method!r}, n_active={self.n_active}, d={self.d}, "
            f"covariance={self.components.kind!r}, score={self.score_kind!r}, calibrate={self.calibrate!r})"
        )


# ====================================================================== fitting
def _ridge(C: Tensor, reg_covar: float) -> float:
    d = C.shape[0]
    return max(float(reg_covar), _PRIOR_RIDGE * float(C.diagonal().sum()) / d)


def _fit_dpgmm(X: Tensor, cfg: SignatureConfig, seed: int, C: Tensor, lam: float) -> dict[str, Any]:
    d = X.shape[1]
    prior = C + lam * torch.eye(d, dtype=X.dtype, device=X.device)
    gm = DPGMM(
        n_components=cfg.max_components,
        covariance_prior=prior,
        reg_covar=cfg.reg_covar,
        tol=cfg.tol,
        max_iter=cfg.max_iter,
        random_state=seed,
        device=X.device,
        dtype=X.dtype,
    )
    labels = gm.fit(X).last_labels_
    counts = torch.bincount(labels, minlength=gm.n_components_)
    return {
        "weights": gm.weights_,
        "counts": counts,
        "means": gm.means_,
        "cov_fn": gm.component_covariances,
        "shared_fn": gm.posterior_factors,
        "labels": labels,
        "lower_bound": gm.lower_bound_,
        "n_iter": gm.n_iter_,
        "converged": gm.converged_,
    }


def _fit_kmeans(X: Tensor, cfg: SignatureConfig, seed: int, lam: float) -> dict[str, Any]:
    N, d = X.shape
    labels, _, n_iter = kmeans(X - X.mean(0), cfg.max_components, int(seed), max_iter=max(cfg.max_iter, 1))
    K = int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=K)
    nk = counts.to(X.dtype)
    means = (
        torch.zeros((K, d), dtype=X.dtype, device=X.device).index_add_(0, labels, X)
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

    return {
        "weights": nk / N,
        "counts": counts,
        "means": means,
        "cov_fn": cov_fn,
        "shared_fn": shared_fn,
        "labels": labels,
        "lower_bound": None,
        "n_iter": n_iter,
        "converged": True,
    }


def _fit_gaussian(X: Tensor, C: Tensor, lam: float) -> dict[str, Any]:
    N, d = X.shape
    cov = (C + lam * torch.eye(d, dtype=X.dtype, device=X.device))[None]

    def shared_fn(index: Tensor | list[int]) -> PosteriorFactors:
        e, V = torch.linalg.eigh(cov[0])
        one = torch.ones(1, dtype=X.dtype, device=X.device)
        return PosteriorFactors(e, V, one, 0.0 * one, [X.new_zeros((0, d))], N * one)

    return {
        "weights": torch.ones(1, dtype=X.dtype, device=X.device),
        "counts": torch.tensor([N], device=X.device),
        "means": X.mean(0, keepdim=True),
        "cov_fn": lambda index=None: cov,
        "shared_fn": shared_fn,
        "labels": torch.zeros(N, dtype=torch.long, device=X.device),
        "lower_bound": None,
        "n_iter": 0,
        "converged": True,
    }


def fit_signature(H: Tensor, cfg: SignatureConfig, seed: int = 0) -> Signature:
    """Fit the multi-key signature (Eq. 18) of one task's embeddings ``H (N, d)`` under its own adapter.

    Raises :class:`SignatureFitError` naming the problem (NaN / inf rows, too few rows, constant or
    singular embeddings, a failed fit); the caller adds the task's name.
    """
    _check_choice("method", cfg.method, _METHODS)
    _check_choice("normalize", cfg.normalize, _NORMALIZE)
    _check_choice("score", cfg.score, _SCORES)
    _check_choice("calibrate", cfg.calibrate, _CALIBRATE)
    _check_choice("covariance", cfg.covariance, _COVARIANCES)
    _check_choice("storage_dtype", cfg.storage_dtype, _STORAGE)
    if not isinstance(H, Tensor) or H.ndim != 2:
        raise SignatureFitError(
            f"expected a 2-D (N, d) tensor of embeddings, got {getattr(H, 'shape', type(H))}"
        )
    if not H.dtype.is_floating_point:
        H = H.float()
    check_finite_rows(H)
    N, d = H.shape
    if N < 2:
        raise SignatureFitError(f"need at least 2 embeddings to fit a signature, got {N}")
    if d < 1:
        raise SignatureFitError("embeddings have no features (d = 0)")

    with torch.no_grad():
        X = _normalise(H.detach().to(torch.float64), cfg.normalize)
        Xc = X - X.mean(0)
        C = (Xc.T @ Xc) / (N - 1)
        if float(C.diagonal().sum()) <= 0.0:
            raise SignatureFitError(f"singular covariance: all {N} embeddings are identical")
        lam = _ridge(C, cfg.reg_covar)
        if cfg.method == "dpgmm":
            fit = _fit_dpgmm(X, cfg, seed, C, lam)
        elif cfg.method == "kmeans":
            fit = _fit_kmeans(X, cfg, seed, lam)
        else:
            fit = _fit_gaussian(X, C, lam)

        weights = fit["weights"]
        counts = fit["counts"].to(weights.device)
        active = ((weights >= _MIN_WEIGHT) & (counts >= _MIN_POINTS)).nonzero().flatten()
        if active.numel() == 0:
            active = weights.argmax().reshape(1)
        if cfg.covariance == "shared":
            pf = fit["shared_fn"](active)
            comps = GaussianComponents.shared(
                weights.index_select(0, active),
                fit["means"].index_select(0, active),
                pf.prior_evals,
                pf.prior_evecs,
                pf.scale,
                pf.ridge,
                pf.factors,
                rank=max(1, min(int(cfg.rank), d)),
                dtype=torch.float32,
            )
        else:
            covs = fit["cov_fn"](active)
            rank = max(0, min(int(cfg.rank), d - 1, N - 1))
            comps = GaussianComponents(
                weights.index_select(0, active),
                fit["means"].index_select(0, active),
                covs,
                kind=cfg.covariance,
                rank=rank,
                dtype=torch.float32,
            )
        sig = Signature(
            comps,
            method=cfg.method,
            normalize=cfg.normalize,
            score_kind=cfg.score,
            calibrate=cfg.calibrate,
            n_train=N,
            lower_bound=fit["lower_bound"],
            n_iter=fit["n_iter"],
            converged=fit["converged"],
            storage_dtype=cfg.storage_dtype,
        )
        if cfg.calibrate == "standardize":
            best = sig.raw_score(H).min(dim=1).values.to(torch.float64)
            med = float(best.median())
            mad = float((best - med).abs().median())
            scale = max(_MAD_TO_SIGMA * mad, 1e-6 * (1.0 + abs(med)))
            sig.calibration = (med, scale)
        scores = sig.raw_score(H[: min(N, 256)])
        if not bool(torch.isfinite(scores).all()):
            raise SignatureFitError(
                "the fitted signature gives non-finite scores on its own training embeddings"
            )
    return sig
