"""The dense covariance kinds of the Gaussian signature components (Eq. 2): ``"full"`` and ``"ppca"``.

Both are built from dense covariances (T, d, d), factorised in float64:

* ``"full"`` (:class:`FullComponents`): the precision Cholesky factor ``A_t`` (``Lambda_t^{-1} = A_t
  A_t^T``), so ``S_t(h) = ||A_t^T (h - m_t)||^2``: one (N, d) x (d, T d) matrix product for all components.
* ``"ppca"`` (:class:`PPCAComponents`, low rank plus isotropic): ``Lambda_t = U_t diag(lam_t) U_t^T +
  sigma_t^2 I`` with the top-q eigenvectors ``U_t`` (d, q), ``lam_t`` the eigenvalues above the noise
  level, and ``sigma_t^2`` the mean of the d - q discarded eigenvalues, so the likelihood stays in the full
  d-dimensional space. The Woodbury identity gives ``S_t(h) = (||r||^2 - sum_j lam_j / (lam_j + sigma^2)
  (u_j^T r)^2) / sigma^2`` (``r = h - m_t``) and ``log|Lambda_t| = sum_j log(lam_j + sigma^2) + (d - q) log
  sigma^2`` exactly. ``sigma^2`` is floored at ``1e-6`` times the mean eigenvalue (``_SIGMA2_FLOOR``).

Rows are centred on the mean of the component means before the products (``center``) to limit
cancellation. Storage: ``prec_chol`` or ``U`` take the storage dtype, ``lam`` and ``sigma2`` stay float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proteus.signatures.components import COVARIANCES, ComponentSource, GaussianComponents, compute_dtype
from proteus.signatures.errors import SignatureFitError
from proteus.tensor_rules import TENSOR_RULES, ShapeRule, Together

__all__ = ["FullComponents", "PPCAComponents"]

_SIGMA2_FLOOR = 1e-6
#: the "ppca" rank when ``signature.rank`` is None
_PPCA_RANK = 128


def _dense_inputs(weights: Tensor, means: Tensor, covariances: Tensor) -> dict[str, Tensor]:
    """Weights, means (float64), symmetrised covariances (T, d, d) and the centre; checks shapes and
    finiteness."""
    if means.ndim != 2 or covariances.shape != (means.shape[0], means.shape[1], means.shape[1]):
        raise ValueError(
            f"means (T, d) and covariances (T, d, d) do not match: {tuple(means.shape)}, "
            f"{tuple(covariances.shape)}"
        )
    T = means.shape[0]
    if T == 0:
        raise SignatureFitError("no Gaussian components to store")
    w = weights.detach().to(torch.float64).reshape(T)
    m = means.detach().to(torch.float64)
    C = covariances.detach().to(torch.float64)
    C = 0.5 * (C + C.mT)
    if not bool(torch.isfinite(C).all() and torch.isfinite(m).all()):
        raise SignatureFitError("component means or covariances are not finite")
    return {"weights": w, "means": m, "center": m.mean(0), "C": C}


def _active(fit: ComponentSource, active: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The weights, means and dense covariances of a fit's ``active`` components."""
    return fit.weights.index_select(0, active), fit.means.index_select(0, active), fit.cov_fn(active)


@COVARIANCES.register("full", "precision Cholesky factors: exact")
class FullComponents(GaussianComponents):
    """Kind ``"full"``: ``FullComponents(weights (T,), means (T, d), covariances (T, d, d),
    dtype=torch.float32)`` stores the precision Cholesky factors ``A_t`` (computed in float64, held in
    ``dtype``), ``S_t(h) = ||A_t^T (h - m_t)||^2``. Raises :class:`SignatureFitError` for a non-finite or
    non positive-definite covariance."""

    kind = "full"
    factor_names = ("prec_chol",)
    ranked = False
    per_component = ("prec_chol",)

    def __init__(
        self, weights: Tensor, means: Tensor, covariances: Tensor, dtype: torch.dtype = torch.float32
    ) -> None:
        t = _dense_inputs(weights, means, covariances)
        C = t.pop("C")
        L, info = torch.linalg.cholesky_ex(C)
        if bool((info != 0).any()):
            bad = (info != 0).nonzero().flatten().tolist()
            raise SignatureFitError(f"singular covariance: component(s) {bad} are not positive definite")
        eye = torch.eye(C.shape[-1], dtype=C.dtype, device=C.device).expand_as(C)
        t["prec_chol"] = torch.linalg.solve_triangular(L, eye, upper=False).mT  # A, precision = A A^T
        t["logdet"] = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        self._set({k: v.to(compute_dtype(dtype)) for k, v in t.items()})

    @classmethod
    def from_fit(
        cls, fit: ComponentSource, active: Tensor, rank: int | None, n_train: int
    ) -> GaussianComponents:
        return cls(*_active(fit, active))

    def _set_factors(self, t: dict[str, Tensor], mc: Tensor) -> None:
        T, d = self.n_components, self.d
        A = t["prec_chol"]  # (T, d, d)
        self.prec_chol = A
        self._A_cat = A.permute(1, 0, 2).reshape(d, T * d).contiguous()
        self._off = torch.einsum("td,tde->te", mc, A)  # (T, d)

    def _factor_tensors(self, big: torch.dtype, small: torch.dtype) -> dict[str, Tensor]:
        return {"prec_chol": self.prec_chol.to(big)}

    def _row_cost(self) -> int:
        return self.n_components * self.d

    def _maha(self, xs: Tensor) -> Tensor:
        Y = (xs @ self._A_cat).view(-1, self.n_components, self.d)
        Y.sub_(self._off[None])
        return Y.square_().sum(-1)


TENSOR_RULES.declare(
    "signature", "full",
    ShapeRule("prec_chol", ("meta:n_active", "meta:d", "meta:d"),
              "one (d, d) factor per signature component"),
)  # fmt: skip


@COVARIANCES.register("ppca", "top-q eigenpairs plus isotropic noise: an approximation")
class PPCAComponents(GaussianComponents):
    """Kind ``"ppca"``: ``PPCAComponents(weights (T,), means (T, d), covariances (T, d, d), rank=q,
    dtype=torch.float32)`` stores the top-q eigenpairs and the mean discarded eigenvalue (``rank`` is
    clipped to ``d - 1``). Raises :class:`SignatureFitError` for a non-finite or zero-variance covariance."""

    kind = "ppca"
    factor_names = ("U", "lam", "sigma2")
    per_component = ("U", "lam", "sigma2")

    def __init__(
        self,
        weights: Tensor,
        means: Tensor,
        covariances: Tensor,
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        t = _dense_inputs(weights, means, covariances)
        C = t.pop("C")
        d = C.shape[-1]
        q = max(0, min(int(rank), d - 1))
        evals, evecs = torch.linalg.eigh(C)  # ascending
        mean_eval = evals.mean(1).clamp_min(0.0)
        if bool((mean_eval <= 0).any()):
            bad = (mean_eval <= 0).nonzero().flatten().tolist()
            raise SignatureFitError(f"singular covariance: component(s) {bad} have zero variance")
        top = evals[:, d - q :].flip(-1)  # descending
        U = evecs[:, :, d - q :].flip(-1)
        sigma2 = evals[:, : d - q].mean(1).clamp_min(_SIGMA2_FLOOR * mean_eval)
        lam = (top - sigma2[:, None]).clamp_min(0.0)
        t["U"], t["lam"], t["sigma2"] = U, lam, sigma2
        t["logdet"] = torch.log(lam + sigma2[:, None]).sum(1) + (d - q) * sigma2.log()
        self._set({k: v.to(compute_dtype(dtype)) for k, v in t.items()})

    @classmethod
    def from_fit(
        cls, fit: ComponentSource, active: Tensor, rank: int | None, n_train: int
    ) -> GaussianComponents:
        q = max(0, min(int(rank or _PPCA_RANK), fit.means.shape[1] - 1, n_train - 1))
        return cls(*_active(fit, active), rank=q)

    def _set_factors(self, t: dict[str, Tensor], mc: Tensor) -> None:
        T, d = self.n_components, self.d
        self.U, self.lam, self.sigma2 = t["U"], t["lam"], t["sigma2"]
        q = self.U.shape[2]
        self.rank = int(q)
        self._U_cat = self.U.permute(1, 0, 2).reshape(d, T * q).contiguous()
        self._off = torch.einsum("td,tdq->tq", mc, self.U)  # (T, q)
        self._shrink = self.lam / (self.lam + self.sigma2[:, None])  # (T, q)
        self._mc2 = (mc * mc).sum(1)

    def _factor_tensors(self, big: torch.dtype, small: torch.dtype) -> dict[str, Tensor]:
        return {"U": self.U.to(big), "lam": self.lam.to(small), "sigma2": self.sigma2.to(small)}

    def _row_cost(self) -> int:
        return max(self.n_components * int(self.rank or 0), self.n_components)

    def _maha(self, xs: Tensor) -> Tensor:
        T, q = self.n_components, int(self.rank or 0)
        r2 = (xs * xs).sum(1, keepdim=True) - 2.0 * (self._mc @ xs.T).T + self._mc2[None]
        if q > 0:
            P = (xs @ self._U_cat).view(-1, T, q)
            P.sub_(self._off[None])
            r2 = r2 - (P.square_() * self._shrink[None]).sum(-1)
        return r2 / self.sigma2[None]


TENSOR_RULES.declare(
    "signature", "ppca",
    ShapeRule("U", ("meta:n_active", "meta:d", "obj.q"), "(components, d, q) factors"),
    ShapeRule("lam", ("meta:n_active", "obj.q"), "(components, q) eigenvalues"),
    ShapeRule("sigma2", ("meta:n_active",), "one entry per signature component"),
    Together("(?:U|lam|sigma2)", ("U", "lam", "sigma2")),
)  # fmt: skip
