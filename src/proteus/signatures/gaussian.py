"""The Gaussian signature components of Eq. 2 / Eq. 18, stored for fast batched scoring.

Eq. 2 scores an embedding ``h`` against a signature pattern ``(m, Lambda)`` with the Mahalanobis term
``S(h) = (h - m)^T Lambda^{-1} (h - m)``; the retrieval rule of Section 3.1 uses the negative Gaussian
log-likelihood ``0.5 (S(h) + log|Lambda| + d log 2 pi)``. :class:`GaussianComponents` holds T such
patterns in one d-dimensional space, in one of two forms:

* ``"full"``: the precision Cholesky factor ``A_t`` (``Lambda_t^{-1} = A_t A_t^T``), so
  ``S_t(h) = ||A_t^T (h - m_t)||^2``: one (N, d) x (d, T d) matrix product for all components.
* ``"ppca"`` (low rank plus isotropic): ``Lambda_t = U_t diag(lam_t) U_t^T + sigma_t^2 I`` with the top-q
  eigenvectors ``U_t`` (d, q), ``lam_t`` the eigenvalues above the noise level, and ``sigma_t^2`` the mean
  of the d - q discarded eigenvalues, so the likelihood stays in the full d-dimensional space. The
  Woodbury identity gives ``S_t(h) = (||r||^2 - sum_j lam_j / (lam_j + sigma^2) (u_j^T r)^2) / sigma^2``
  (``r = h - m_t``) and ``log|Lambda_t| = sum_j log(lam_j + sigma^2) + (d - q) log sigma^2`` exactly.
  ``sigma^2`` is floored at ``1e-6`` times the mean eigenvalue (``_SIGMA2_FLOOR``).

Scoring is batched over samples and components on the tensors' device and always runs in float32 or
higher. Rows are centred on the mean of the component means before the products (``center``) to
limit cancellation.

Storage (:meth:`GaussianComponents.to_tensors`): the large factors (``prec_chol`` or ``U``) take the
storage dtype (float16 or float32); means, weights, eigenvalues, noise, log-determinants and the centre
stay in float32, because float16 cannot hold small variances or large log-determinants.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proteus.signatures.dpgmm import SignatureFitError

__all__ = ["GaussianComponents"]

_SIGMA2_FLOOR = 1e-6
_CHUNK_ELEMENTS = 1 << 24
_KINDS = ("full", "ppca")


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float16": torch.float16,
        "float32": torch.float32,
        "float64": torch.float64,
        "bfloat16": torch.bfloat16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scoring dtype: float32 or higher."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class GaussianComponents:
    """T Gaussians ``N(m_t, Lambda_t)`` in one d-dim space, with batched Mahalanobis / NLL scoring.

    ``GaussianComponents(weights (T,), means (T, d), covariances (T, d, d), kind="full"|"ppca",
    rank=q, dtype=torch.float32)``: factors are computed in float64 from the covariances, then held in
    ``dtype`` (float32 or float64). ``rank`` is used by ``"ppca"`` only and is clipped to ``d - 1``.
    Raises :class:`SignatureFitError` for a non-finite or non positive-definite covariance.
    """

    def __init__(
        self,
        weights: Tensor,
        means: Tensor,
        covariances: Tensor,
        kind: str = "full",
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        if means.ndim != 2 or covariances.shape != (means.shape[0], means.shape[1], means.shape[1]):
            raise ValueError(
                f"means (T, d) and covariances (T, d, d) do not match: {tuple(means.shape)}, "
                f"{tuple(covariances.shape)}"
            )
        T, d = means.shape
        if T == 0:
            raise SignatureFitError("no Gaussian components to store")
        cdt = _compute_dtype(dtype)
        w = weights.detach().to(torch.float64).reshape(T)
        m = means.detach().to(torch.float64)
        C = covariances.detach().to(torch.float64)
        C = 0.5 * (C + C.mT)
        if not bool(torch.isfinite(C).all() and torch.isfinite(m).all()):
            raise SignatureFitError("component means or covariances are not finite")
        center = m.mean(0)
        t: dict[str, Tensor] = {"weights": w, "means": m, "center": center}
        if kind == "full":
            L, info = torch.linalg.cholesky_ex(C)
            if bool((info != 0).any()):
                bad = (info != 0).nonzero().flatten().tolist()
                raise SignatureFitError(f"singular covariance: component(s) {bad} are not positive definite")
            eye = torch.eye(d, dtype=C.dtype, device=C.device).expand_as(C)
            t["prec_chol"] = torch.linalg.solve_triangular(L, eye, upper=False).mT  # A, precision = A A^T
            t["logdet"] = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        else:
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
        self._set({k: v.to(cdt) for k, v in t.items()}, kind)

    # ------------------------------------------------------------------ construction from stored tensors
    def _set(self, t: dict[str, Tensor], kind: str) -> None:
        t = {k: v.contiguous() for k, v in t.items()}  # same layouts: bit-identical scores after reload
        self.kind = kind
        self.weights = t["weights"]
        self.means = t["means"]
        self.center = t["center"]
        self.logdet = t["logdet"]
        T, d = self.means.shape
        self.n_components, self.d = int(T), int(d)
        mc = self.means - self.center
        if kind == "full":
            A = t["prec_chol"]  # (T, d, d)
            self.prec_chol = A
            self._A_cat = A.permute(1, 0, 2).reshape(d, T * d).contiguous()
            self._off = torch.einsum("td,tde->te", mc, A)  # (T, d)
        else:
            self.U, self.lam, self.sigma2 = t["U"], t["lam"], t["sigma2"]
            q = self.U.shape[2]
            self.rank = int(q)
            self._U_cat = self.U.permute(1, 0, 2).reshape(d, T * q).contiguous()
            self._off = torch.einsum("td,tdq->tq", mc, self.U)  # (T, q)
            self._shrink = self.lam / (self.lam + self.sigma2[:, None])  # (T, q)
            self._mc2 = (mc * mc).sum(1)
        self._mc = mc

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> GaussianComponents:
        """Rebuild from :meth:`to_tensors`'s dict (float16 factors are upcast to float32)."""
        kind = "full" if "prec_chol" in tensors else "ppca"
        need = ["weights", "means", "center", "logdet"] + (
            ["prec_chol"] if kind == "full" else ["U", "lam", "sigma2"]
        )
        missing = [k for k in need if k not in tensors]
        if missing:
            raise KeyError(f"GaussianComponents tensors lack {missing}")
        wide = max((tensors[k].dtype for k in need), key=lambda dt: torch.finfo(dt).bits)
        cdt = _compute_dtype(wide)
        obj = cls.__new__(cls)
        obj._set({k: tensors[k].to(cdt) for k in need}, kind)
        return obj

    def to_tensors(self, dtype: str | torch.dtype = torch.float32) -> dict[str, Tensor]:
        """Tensors for safetensors: the big factor in ``dtype`` (float16/float32), the rest float32+."""
        sd = _dtype(dtype)
        small = self.means.dtype  # float32 (or float64 when computed in float64)
        out = {
            "weights": self.weights.to(small),
            "means": self.means.to(small),
            "center": self.center.to(small),
            "logdet": self.logdet.to(small),
        }
        if self.kind == "full":
            out["prec_chol"] = self.prec_chol.to(sd)
        else:
            out["U"] = self.U.to(sd)
            out["lam"] = self.lam.to(small)
            out["sigma2"] = self.sigma2.to(small)
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    # ------------------------------------------------------------------ scoring
    @property
    def device(self) -> torch.device:
        return self.means.device

    @property
    def dtype(self) -> torch.dtype:
        return self.means.dtype

    def mahalanobis(self, X: Tensor) -> Tensor:
        """``(x - m_t)^T Lambda_t^{-1} (x - m_t)`` for all rows and components, (N, T)."""
        if X.ndim != 2 or X.shape[1] != self.d:
            raise ValueError(f"expected (N, {self.d}) embeddings, got {tuple(X.shape)}")
        X = X.to(device=self.device, dtype=self.dtype) - self.center
        N, T, d = X.shape[0], self.n_components, self.d
        out = torch.empty((N, T), dtype=self.dtype, device=self.device)
        if self.kind == "full":
            chunk = max(1, _CHUNK_ELEMENTS // (T * d))
            for s in range(0, N, chunk):
                Y = (X[s : s + chunk] @ self._A_cat).view(-1, T, d)
                Y.sub_(self._off[None])
                out[s : s + chunk] = Y.square_().sum(-1)
        else:
            q = self.rank
            chunk = max(1, _CHUNK_ELEMENTS // max(T * q, T))
            for s in range(0, N, chunk):
                xs = X[s : s + chunk]
                r2 = (xs * xs).sum(1, keepdim=True) - 2.0 * (self._mc @ xs.T).T + self._mc2[None]
                if q > 0:
                    P = (xs @ self._U_cat).view(-1, T, q)
                    P.sub_(self._off[None])
                    r2 = r2 - (P.square_() * self._shrink[None]).sum(-1)
                out[s : s + chunk] = r2 / self.sigma2[None]
        return out.clamp_min_(0.0)

    def nll(self, X: Tensor) -> Tensor:
        """Negative Gaussian log-likelihood ``0.5 (maha + log|Lambda_t| + d log 2 pi)``, (N, T)."""
        return 0.5 * (self.mahalanobis(X) + self.logdet[None] + self.d * math.log(2.0 * math.pi))

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        """Bytes of the stored tensors (as held, i.e. in the compute dtype)."""
        return sum(v.numel() * v.element_size() for v in self.to_tensors(self.dtype).values())

    def to(self, device: torch.device | str) -> GaussianComponents:
        """Move every tensor to ``device`` (in place); returns ``self``."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device))
        return self

    def select(self, index: Tensor | list[int]) -> GaussianComponents:
        """A new object with the given components only."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.device)
        t = self.to_tensors(self.dtype)
        per_comp = {"weights", "means", "logdet", "prec_chol", "U", "lam", "sigma2"}
        sel = {k: (v.index_select(0, idx) if k in per_comp else v) for k, v in t.items()}
        return GaussianComponents.from_tensors(sel)

    def __repr__(self) -> str:
        extra = f", rank={self.rank}" if self.kind == "ppca" else ""
        return (
            f"GaussianComponents(T={self.n_components}, d={self.d}, kind={self.kind!r}{extra}, "
            f"dtype={self.dtype})"
        )
