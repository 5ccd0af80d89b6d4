"""The multi-key signature of one task (Definition 3.1), learned with Eq. 18 and scored as in Eq. 2.

:func:`fit_signature` turns a task's embeddings ``H = h_k(x), x in D_k`` (its own adapter) into
``tau`` Gaussian signature patterns ``(m_k^t, Lambda_k^t)``; :func:`fit_clusters` does steps 1-2 and
:func:`signature_from_fit` steps 3-5, so one clustering can be stored in several forms:

1. optional L2 normalisation of the rows (``cfg.normalize``);
2. the task's covariance ``C`` (:func:`~proteus.signatures.fitting.task_covariance`: ``cfg.prior`` is
   ``"ridge"``, ``cov(H) + max(reg_covar, 1e-3 tr(cov(H)) / d) I``, or the Ledoit-Wolf / OAS shrinkage of
   ``cov(H)``) and a clustering fit per ``cfg.method`` (:data:`~proteus.signatures.fitting.METHODS`):

   * ``"dpgmm"``: :class:`~proteus.signatures.dpgmm.DPGMM` with truncation ``T = cfg.max_components``
     (Eq. 18 with a Dirichlet-process prior) and a Wishart prior on each component's precision with
     ``cfg.prior_dof`` degrees of freedom (None: d) whose covariance matrix is ``C`` (``cfg.prior_scale
     = "sklearn"``, scikit-learn's default: the prior's expected covariance is then ``C / d``) or ``dof C``
     (``"expected"``: the prior's expected covariance is ``C``, so each component's covariance is ``(d C
     + N_t S_t) / (d + N_t)``, its own scatter shrunk towards the task's covariance);
   * ``"kmeans"``: ``K = cfg.max_components`` hard clusters (the ablation), then one Gaussian per cluster
     with covariance ``(n_k S_k + d S_pool) / (n_k + d)``: the cluster's own scatter ``S_k`` shrunk
     towards the pooled within-cluster covariance ``S_pool`` with the weight of ``d`` pseudo-points, so
     tiny clusters fall back to the shared covariance and large ones keep their own;
   * ``"gaussian"``: one Gaussian with covariance ``C`` (the single-key signature of Eq. 2).

3. inactive components are dropped (weight < ``1e-3`` or fewer than 2 assigned training points; if none
   survives, the heaviest one is kept) and ``n_active`` is reported;
4. the survivors become :class:`~proteus.signatures.gaussian.GaussianComponents` of kind
   ``cfg.covariance`` (:data:`~proteus.signatures.gaussian.COVARIANCES`): ``"full"`` (precision Cholesky
   factors), ``"ppca"`` (rank ``min(cfg.rank or 128, d - 1, N - 1)`` plus isotropic: an approximation) or
   ``"shared"``, built from the factored covariances
   (:class:`~proteus.signatures.gaussian.SharedComponents`): for ``"dpgmm"`` the posterior's own structure
   (:meth:`DPGMM.posterior_factors`: covariance prior shared, data term per component); for ``"kmeans"``
   the same identity with the pooled covariance as the shared matrix, ``(n_k S_k + d S_pool) / (n_k + d)
   + reg I = d / (n_k + d) (S_pool + reg (n_k + d) / d I + n_k S_k / d)``; for ``"gaussian"`` the one
   covariance itself (no low-rank part). With ``cfg.rank = None`` (the default) every factor row is kept
   and ``"shared"`` equals ``"full"`` at any N; a ``cfg.rank`` budget of ``T * rank`` rows approximates
   once the components' data terms outgrow it (tools/studies/scale_check.py measures by how much);
5. with ``cfg.calibrate = "standardize"`` (:data:`CALIBRATIONS`) the median and robust scale (1.4826 x
   MAD, floored at ``1e-6 (1 + |median|)``) of the training inputs' best-component scores are stored and
   every later score is standardised with them.

:meth:`Signature.score` returns the (N, T_active) score matrix (lower is better): ``cfg.score`` (the
Gaussian NLL or the Mahalanobis term of Eq. 2, :data:`SCORES`) after the same normalisation
(``cfg.normalize``, :data:`NORMALIZATIONS`), then the calibration.
:meth:`Signature.to_tensors` returns ``(tensors, meta)``: tensors for safetensors and a JSON-serialisable
dict; :meth:`Signature.from_tensors` inverts it (bit-exact for float32 storage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from proteus.registry import Registry
from proteus.signatures.errors import SignatureFitError, check_finite_rows
from proteus.signatures.fitting import METHODS, ClusterFit, task_covariance
from proteus.signatures.gaussian import COVARIANCES, GaussianComponents
from proteus.signatures.options import STORAGE_DTYPES, SignatureConfig
from proteus.tensor_rules import TENSOR_RULES, Fields, Schema
from proteus.tensor_rules import F as Field

__all__ = [
    "CALIBRATIONS",
    "NORMALIZATIONS",
    "SCORES",
    "Signature",
    "fit_clusters",
    "fit_signature",
    "signature_from_fit",
]

_MIN_WEIGHT = 1e-3
_MIN_POINTS = 2
_MAD_TO_SIGMA = 1.4826
_FORMAT = 1
#: ``signature.storage_dtype``: "auto" stores each kind in its own dtype (``auto_storage``): kind "shared" in
#: float16 (its low-rank rows; the eigenbasis as float32 Householder vectors: within 1e-5 of float32, half
#: the bytes), the other kinds in float32


def _resolve_storage(name: str, kind: str) -> str:
    """The concrete storage dtype of ``signature.storage_dtype`` for components of ``kind`` ("auto": the
    kind's own, :attr:`GaussianComponents.auto_storage`)."""
    return COVARIANCES.get(kind).auto_storage if name == "auto" else name


T = TypeVar("T")


class Calibration(Protocol):
    """A per-task score calibration: ``fit`` on the signature's own training embeddings, ``apply`` to
    later scores."""

    def fit(self, sig: Signature, H: Tensor) -> tuple[float, float] | None: ...

    def apply(self, s: Tensor, calibration: tuple[float, float] | None) -> Tensor: ...


class NoCalibration:
    """Raw scores."""

    def fit(self, sig: Signature, H: Tensor) -> tuple[float, float] | None:
        return None

    def apply(self, s: Tensor, calibration: tuple[float, float] | None) -> Tensor:
        return s


class Standardize:
    """Scores standardised by the median and robust scale (1.4826 x MAD, floored at ``1e-6 (1 +
    |median|)``) of the training inputs' best-component scores."""

    def fit(self, sig: Signature, H: Tensor) -> tuple[float, float] | None:
        best = sig.raw_score(H).min(dim=1).values.to(torch.float64)
        med = float(best.median())
        mad = float((best - med).abs().median())
        return med, max(_MAD_TO_SIGMA * mad, 1e-6 * (1.0 + abs(med)))

    def apply(self, s: Tensor, calibration: tuple[float, float] | None) -> Tensor:
        if calibration is None:
            return s
        med, scale = calibration
        return (s - med) / scale


#: ``signature.normalize``: the row normalisation before fitting and scoring
NORMALIZATIONS: Registry[Callable[[Tensor], Tensor]] = Registry("signature.normalize")
NORMALIZATIONS.register("none", "the embeddings as they are (the paper)")(lambda H: H)
NORMALIZATIONS.register("l2", "each row scaled to unit L2 norm")(lambda H: F.normalize(H, dim=1))
#: ``signature.score``: the (N, T) score of embeddings against the components (Eq. 2)
SCORES: Registry[Callable[[GaussianComponents, Tensor], Tensor]] = Registry("signature.score")
SCORES.register("nll", "Gaussian negative log-likelihood, log-determinant included")(lambda c, H: c.nll(H))
SCORES.register("mahalanobis", "the Mahalanobis term of Eq. 2")(lambda c, H: c.mahalanobis(H))
#: ``signature.calibrate``: the per-task score calibration
CALIBRATIONS: Registry[Calibration] = Registry("signature.calibrate")
CALIBRATIONS.register("none")(NoCalibration())
CALIBRATIONS.register("standardize")(Standardize())


def _check_choice(name: str, value: str, choices: Registry[Any] | tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"signature.{name} must be one of {tuple(choices)}, got {value!r}")


def _lookup(name: str, value: str, registry: Registry[T]) -> T:
    """The strategy ``value`` of the ``signature.<name>`` registry; ValueError naming the choices."""
    _check_choice(name, value, registry)
    return registry.get(value)


#: total variance below this fraction of the mean squared norm: the embeddings are one point
_IDENTICAL_REL = 1e-10


def _normalise(H: Tensor, how: str) -> Tensor:
    return NORMALIZATIONS.get(how)(H)


#: what :meth:`Signature.from_tensors` reads of its meta (:attr:`Signature.meta`)
SIGNATURE_META: Schema = {
    "method": Field("str", True),
    "normalize": Field("str", True),
    "score": Field("str", True),
    "calibrate": Field("str", True),
    "calibration": Field("list[number]|null"),
    "n_active": Field("dim"),
    "d": Field("dim"),
    "n_train": Field("count"),
    "n_iter": Field("count"),
    "converged": Field("bool"),
    "storage_dtype": Field("str"),
    "lower_bound": Field("float|null"),
}
#: a signature's record; its tensors are its components' (role "signature": the common ones and each
#: covariance kind's, declared where they are defined). The keys that store signatures mount the role
#: under their own prefix and record (:class:`~proteus.engine.keys.GaussianKeys`: ``signature/``).
TENSOR_RULES.declare("signature", "Signature", Fields(SIGNATURE_META))


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
        _check_choice("normalize", normalize, NORMALIZATIONS)
        _check_choice("score", score_kind, SCORES)
        _check_choice("calibrate", calibrate, CALIBRATIONS)
        _check_choice("storage_dtype", storage_dtype, STORAGE_DTYPES)
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
        return SCORES.get(self.score_kind)(self.components, Hn)

    def score(self, H: Tensor) -> Tensor:
        """Signature scores (N, T_active) of embeddings ``H (N, d)``; lower is better."""
        return CALIBRATIONS.get(self.calibrate).apply(self.raw_score(H), self.calibration)

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
            "rank": None if self.components.rank is None else int(self.components.rank),
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
        dtype = _resolve_storage(self.storage_dtype, self.components.kind)
        t = {k: v.cpu() for k, v in self.components.to_tensors(dtype).items()}
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
def _check_embeddings(H: Tensor) -> Tensor:
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
    return H


def fit_clusters(H: Tensor, cfg: SignatureConfig, seed: int = 0) -> ClusterFit:
    """Steps 1-2 of :func:`fit_signature`: the clustering of the (normalised) embeddings ``H (N, d)``,
    which does not depend on how the components are then stored (``covariance``, ``rank``,
    ``storage_dtype``): :func:`signature_from_fit` stores one fit in any of those forms."""
    method = _lookup("method", cfg.method, METHODS)
    normalise = _lookup("normalize", cfg.normalize, NORMALIZATIONS)
    H = _check_embeddings(H)
    N = H.shape[0]
    with torch.no_grad():
        X = normalise(H.detach().to(torch.float64))
        Xc = X - X.mean(0)
        # identical up to float32 round-off (a batched forward may differ in the last bits per row)
        if float((Xc * Xc).sum()) <= _IDENTICAL_REL * float((X * X).sum()):
            raise SignatureFitError(f"singular covariance: all {N} embeddings are identical")
        return method(X, cfg, seed, task_covariance(X, cfg))


def signature_from_fit(H: Tensor, cfg: SignatureConfig, fit: ClusterFit) -> Signature:
    """Steps 3-5 of :func:`fit_signature` for a clustering of ``H`` from :func:`fit_clusters`."""
    kind = _lookup("covariance", cfg.covariance, COVARIANCES)
    calibration = _lookup("calibrate", cfg.calibrate, CALIBRATIONS)
    H = _check_embeddings(H)
    N = H.shape[0]
    with torch.no_grad():
        weights = fit.weights
        counts = fit.counts.to(weights.device)
        active = ((weights >= _MIN_WEIGHT) & (counts >= _MIN_POINTS)).nonzero().flatten()
        if active.numel() == 0:
            active = weights.argmax().reshape(1)
        storage = _resolve_storage(cfg.storage_dtype, cfg.covariance)
        comps = kind.from_fit(fit, active, cfg.rank, N)
        if storage != "float32":  # score as the stored (rounded) factors score, before and after a reload
            comps = GaussianComponents.from_tensors(comps.to_tensors(storage))
        sig = Signature(
            comps,
            method=cfg.method,
            normalize=cfg.normalize,
            score_kind=cfg.score,
            calibrate=cfg.calibrate,
            n_train=N,
            lower_bound=fit.lower_bound,
            n_iter=fit.n_iter,
            converged=fit.converged,
            storage_dtype=storage,
        )
        sig.calibration = calibration.fit(sig, H)
        scores = sig.raw_score(H[: min(N, 256)])
        if not bool(torch.isfinite(scores).all()):
            raise SignatureFitError(
                "the fitted signature gives non-finite scores on its own training embeddings"
            )
    return sig


def fit_signature(H: Tensor, cfg: SignatureConfig, seed: int = 0) -> Signature:
    """Fit the multi-key signature (Eq. 18) of one task's embeddings ``H (N, d)`` under its own adapter:
    :func:`fit_clusters`, then :func:`signature_from_fit`.

    Raises :class:`SignatureFitError` naming the problem (NaN / inf rows, too few rows, constant or
    singular embeddings, a failed fit); the caller adds the task's name.
    """
    return signature_from_fit(H, cfg, fit_clusters(H, cfg, seed))
