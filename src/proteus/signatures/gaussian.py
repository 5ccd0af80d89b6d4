"""The Gaussian signature components of Eq. 2 / Eq. 18, stored for fast batched scoring.

Eq. 2 scores an embedding ``h`` against a signature pattern ``(m, Lambda)`` with the Mahalanobis term
``S(h) = (h - m)^T Lambda^{-1} (h - m)``; the retrieval rule of Section 3.1 uses the negative Gaussian
log-likelihood ``0.5 (S(h) + log|Lambda| + d log 2 pi)``. :class:`GaussianComponents` holds T such
patterns in one d-dimensional space, in one of three forms:

* ``"full"``: the precision Cholesky factor ``A_t`` (``Lambda_t^{-1} = A_t A_t^T``), so
  ``S_t(h) = ||A_t^T (h - m_t)||^2``: one (N, d) x (d, T d) matrix product for all components.
* ``"ppca"`` (low rank plus isotropic): ``Lambda_t = U_t diag(lam_t) U_t^T + sigma_t^2 I`` with the top-q
  eigenvectors ``U_t`` (d, q), ``lam_t`` the eigenvalues above the noise level, and ``sigma_t^2`` the mean
  of the d - q discarded eigenvalues, so the likelihood stays in the full d-dimensional space. The
  Woodbury identity gives ``S_t(h) = (||r||^2 - sum_j lam_j / (lam_j + sigma^2) (u_j^T r)^2) / sigma^2``
  (``r = h - m_t``) and ``log|Lambda_t| = sum_j log(lam_j + sigma^2) + (d - q) log sigma^2`` exactly.
  ``sigma^2`` is floored at ``1e-6`` times the mean eigenvalue (``_SIGMA2_FLOOR``).
* ``"shared"`` (shared full matrix plus per-component low rank; built by :meth:`GaussianComponents.shared`
  from a fit's factored covariances, e.g. :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors`):
  ``Lambda_t = V diag(e)^{1/2} (iso_t + ridge_t diag(e)^{-1} + U_t^T U_t) diag(e)^{1/2} V^T``, where
  ``P = V diag(e) V^T`` is one d x d matrix per task (the DP-GMM's covariance prior, i.e. scikit-learn's
  ``W0^{-1}``) and ``U_t`` (q_t, d) lives in P's whitened space. The DP-GMM's expected covariances
  ``(W0^{-1} + N_t reg I + N_t S_t + beta_0 N_t / beta_t (xbar_t - m0)(xbar_t - m0)^T) / nu_t`` have
  exactly that form with ``U_t`` of rank ``r_t <= N_t + 1``, so the scores equal ``"full"``'s whenever
  the ``r_t`` fit the rank budget (``T * rank`` rows shared by the components; see
  :meth:`GaussianComponents.shared` for the approximation beyond it). Scoring whitens each input once,
  ``z = diag(e)^{-1/2} V^T (x - c)`` (``N d^2``), then per component uses Woodbury on the ``q_t``-dim
  core: ``S_t = ||z - mu_t||^2_{D_t^{-1}} - ||F_t^T (z - mu_t)||^2`` with ``D_t = iso_t + ridge_t / e``
  and ``F_t = D_t^{-1} U_t^T C_t^{-T}``, ``C_t C_t^T = I + U_t D_t^{-1} U_t^T`` (``N d sum_t q_t``);
  ``log|Lambda_t|`` is stored. An eigen-whitening (rather than a Cholesky factor of P) keeps the
  ``N_t reg_covar I`` term of the posterior diagonal, hence exact, in the whitened space.

Scoring is batched over samples and components on the tensors' device and always runs in float32 or
higher. Rows are centred on the mean of the component means before the products (``center``) to
limit cancellation.

Storage (:meth:`GaussianComponents.to_tensors`): the large factors (``prec_chol``, ``U`` or ``lowrank``)
take the storage dtype (float16 or float32); means, weights, eigenvalues, noise, log-determinants and the
centre stay in float32, because float16 cannot hold small variances or large log-determinants. The
shared matrix's eigenvectors (``prior_evecs``, d x d per task) stay float32 too: in float16 they moved
the NLL of a d = 768 DP-GMM signature by up to 1.5e-3 (relative), against 3e-5 for float16 ``lowrank``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proteus.signatures.dpgmm import SignatureFitError

__all__ = ["GaussianComponents"]

_SIGMA2_FLOOR = 1e-6
_CHUNK_ELEMENTS = 1 << 24
_KINDS = ("full", "ppca")  # kinds built from dense covariances; "shared" comes from GaussianComponents.shared
_PER_COMPONENT = {"weights", "means", "logdet", "prec_chol", "U", "lam", "sigma2", "iso", "ridge", "ranks"}


def _allocate_ranks(sizes: list[int], budget: int, d: int) -> list[int]:
    """Factor rows kept per component: ``q_t = min(r_t, tau, d)`` with the largest cap ``tau`` whose total
    fits ``budget`` (rows that small components do not need go to the large ones); the rows left below
    the budget by the integer cap go one each to the largest components."""
    need = [min(r, d) for r in sizes]
    if sum(need) <= budget:
        return need
    lo, hi = 0, max(need)
    while lo < hi:  # largest tau with sum(min(need, tau)) <= budget
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in need) <= budget:
            lo = mid
        else:
            hi = mid - 1
    out = [min(n, lo) for n in need]
    spare = budget - sum(out)
    for k in sorted(range(len(out)), key=lambda i: -need[i]):
        if spare <= 0:
            break
        if out[k] < need[k]:
            out[k] += 1
            spare -= 1
    return out


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
    Kind ``"shared"`` needs factored covariances: build it with :meth:`shared`.
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
        if kind == "shared":
            raise ValueError(
                "kind='shared' needs the factored covariances (shared prior + per-component low-rank data "
                "term), not dense ones: build it with GaussianComponents.shared(...)"
            )
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

    @classmethod
    def shared(
        cls,
        weights: Tensor,
        means: Tensor,
        prior_evals: Tensor,
        prior_evecs: Tensor,
        scale: Tensor,
        ridge: Tensor,
        factors: list[Tensor],
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> GaussianComponents:
        """Components of kind ``"shared"`` from factored covariances
        ``Lambda_t = scale_t (P + ridge_t I + V F_t^T F_t V^T)``: ``P = V diag(prior_evals) V^T`` is shared by
        all components and ``F_t`` (r_t, d) is given in P's eigenbasis (``prior_evecs`` = V, columns), as
        :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors` returns them.

        In P's whitened space (``z = diag(e)^{-1/2} V^T x``) the covariance is ``scale_t (D_t + G_t^T G_t)``
        with the diagonal ``D_t = 1 + ridge_t / e`` and ``G_t = F_t diag(e)^{-1/2}``. The components share a
        budget of ``T * rank`` factor rows (:func:`_allocate_ranks`): component t keeps ``q_t`` rows, all of
        them (exact) when the ``r_t`` fit the budget. A component with ``r_t > q_t`` keeps the top ``q_t``
        eigenpairs of ``M_t = D_t^{-1/2} G_t^T G_t D_t^{-1/2}`` exactly and replaces the ``d - q_t`` others,
        ``mu_j``, by one value ``s_t`` chosen to preserve the trace of the precision, ``(d - q_t) / (1 + s_t)
        = sum_j 1 / (1 + mu_j)`` (so the Mahalanobis term of inputs spread evenly over those directions is
        unbiased), i.e. ``D_t`` becomes ``(1 + s_t) D_t``; its log-determinant stays exact (computed from
        all eigenvalues of ``M_t``). Computed in float64, held in ``dtype``.
        """
        f64 = torch.float64
        if means.ndim != 2:
            raise ValueError(f"means must be (T, d), got {tuple(means.shape)}")
        T, d = means.shape
        if T == 0:
            raise SignatureFitError("no Gaussian components to store")
        if prior_evals.shape != (d,) or prior_evecs.shape != (d, d) or len(factors) != T:
            raise ValueError(
                f"shared covariance parts do not match means {tuple(means.shape)}: prior_evals "
                f"{tuple(prior_evals.shape)}, prior_evecs {tuple(prior_evecs.shape)}, {len(factors)} factors"
            )
        dev = means.device
        e = prior_evals.detach().to(device=dev, dtype=f64)
        V = prior_evecs.detach().to(device=dev, dtype=f64)
        c = scale.detach().to(device=dev, dtype=f64).reshape(T)
        a = ridge.detach().to(device=dev, dtype=f64).reshape(T)
        m = means.detach().to(f64)
        if not bool(torch.isfinite(e).all() and torch.isfinite(V).all() and torch.isfinite(m).all()):
            raise SignatureFitError("component means or the shared covariance are not finite")
        if float(e.min()) <= 0.0:
            raise SignatureFitError(f"singular shared covariance: smallest eigenvalue {float(e.min()):.3g}")
        if not bool(torch.isfinite(c).all() and torch.isfinite(a).all() and (c > 0).all() and (a >= 0).all()):
            raise SignatureFitError("component scales must be positive and ridges non-negative")
        Fs = [f.detach().to(device=dev, dtype=f64).reshape(-1, d) for f in factors]
        ranks = _allocate_ranks([f.shape[0] for f in Fs], T * max(0, int(rank)), d)
        inv_sqrt_e = e.rsqrt()
        rows: list[Tensor] = []
        gain = torch.ones(T, dtype=f64, device=dev)
        log_core = torch.zeros(T, dtype=f64, device=dev)  # log|I + M_t| (exact)
        for k, (F, q) in enumerate(zip(Fs, ranks)):
            if not bool(torch.isfinite(F).all()):
                raise SignatureFitError(f"component {k}: covariance factor is not finite")
            G = F * inv_sqrt_e[None, :]  # (r, d): rows in P's whitened space
            r = G.shape[0]
            sqrt_D = (1.0 + a[k] / e).sqrt()
            Gt = G / sqrt_D[None, :]
            if r <= q:  # exact: the factor itself
                log_core[k] = torch.log1p(torch.linalg.eigvalsh(Gt @ Gt.T).clamp_min(0.0)).sum()
                rows.append(G)
                continue
            if r <= d:  # eigenpairs of M_t from the (r, r) Gram matrix
                mu, Ur = torch.linalg.eigh(Gt @ Gt.T)
                mu, Ur = mu.flip(0).clamp_min(0.0), Ur.flip(1)[:, :q]
                E = (Gt.T @ Ur) * torch.where(mu[:q] > 0, mu[:q], torch.ones_like(mu[:q])).rsqrt()[None, :]
            else:
                mu, E = torch.linalg.eigh(Gt.T @ Gt)
                mu, E = mu.flip(0).clamp_min(0.0), E.flip(1)[:, :q]
            log_core[k] = torch.log1p(mu).sum()
            rest = torch.cat([mu[q:], mu.new_zeros(max(0, d - mu.shape[0]))])
            s_k = (rest.numel() / (1.0 / (1.0 + rest)).sum() - 1.0) if rest.numel() else mu.new_zeros(())
            s_k = s_k.clamp_min(0.0)
            rows.append((sqrt_D[:, None] * E * (mu[:q] - s_k).clamp_min(0.0).sqrt()[None, :]).T)
            gain[k] = 1.0 + s_k
        lowrank = torch.cat(rows, 0) if rows else e.new_zeros((0, d))
        sizes = torch.tensor([x.shape[0] for x in rows], dtype=torch.int64, device=dev)
        seg = torch.repeat_interleave(torch.arange(T, device=dev), sizes)
        lowrank = lowrank * c.sqrt().index_select(0, seg)[:, None]
        iso = c * gain
        D = 1.0 + a[:, None] / e[None, :]  # (T, d)
        logdet = e.log().sum() + d * c.log() + D.log().sum(1) + log_core
        t = {
            "weights": weights.detach().to(device=dev, dtype=f64).reshape(T),
            "means": m,
            "center": m.mean(0),
            "logdet": logdet,
            "prior_evecs": V,
            "prior_evals": e,
            "lowrank": lowrank,
            "ranks": sizes,
            "iso": iso,
            "ridge": iso * a,
        }
        obj = cls.__new__(cls)
        cdt = _compute_dtype(dtype)
        obj._set({k: (v.to(cdt) if v.is_floating_point() else v) for k, v in t.items()}, "shared")
        return obj

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
        elif kind == "shared":
            self._set_shared(t, mc)
        else:
            self.U, self.lam, self.sigma2 = t["U"], t["lam"], t["sigma2"]
            q = self.U.shape[2]
            self.rank = int(q)
            self._U_cat = self.U.permute(1, 0, 2).reshape(d, T * q).contiguous()
            self._off = torch.einsum("td,tdq->tq", mc, self.U)  # (T, q)
            self._shrink = self.lam / (self.lam + self.sigma2[:, None])  # (T, q)
            self._mc2 = (mc * mc).sum(1)
        self._mc = mc

    def _set_shared(self, t: dict[str, Tensor], mc: Tensor) -> None:
        """Scoring factors of kind ``"shared"``, derived in float64 from the stored tensors (the same stored
        tensors always give the same factors): the whitening ``W = V diag(e)^{-1/2}``, the whitened means
        ``mu_t``, ``1 / D'_t`` with ``D'_t = iso_t + ridge_t / e``, and per component the Woodbury factor
        ``F_t = D'^{-1}_t U_t^T C_t^{-T}`` (d, q_t) with ``C_t C_t^T = I + U_t D'^{-1}_t U_t^T`` and ``U_t``
        (q_t, d) the component's rows of ``lowrank``."""
        f64, cdt = torch.float64, mc.dtype
        V, e = t["prior_evecs"], t["prior_evals"]
        self.prior_evecs, self.prior_evals = V, e
        self.lowrank, self.ranks = t["lowrank"], t["ranks"].to(torch.int64)
        self.iso, self.ridge = t["iso"], t["ridge"]
        T, d = mc.shape
        sizes = [int(x) for x in self.ranks.tolist()]
        if len(sizes) != T or sum(sizes) != self.lowrank.shape[0] or min(sizes, default=0) < 0:
            raise ValueError(
                f"shared factors: ranks {sizes} do not match lowrank {tuple(self.lowrank.shape)}"
            )
        self.rank = max(sizes, default=0)
        e64 = e.to(f64)
        W = V.to(f64) * e64.rsqrt()[None, :]
        mu = mc.to(f64) @ W  # (T, d) whitened means
        inv_D = 1.0 / (self.iso.to(f64)[:, None] + self.ridge.to(f64)[:, None] / e64[None, :])
        U = self.lowrank.to(f64)
        Fs, offs = [], []
        start = 0
        for k, q in enumerate(sizes):
            Uk = U[start : start + q]
            start += q
            DU = Uk.T * inv_D[k][:, None]  # (d, q)
            core = Uk @ DU
            core.diagonal().add_(1.0)
            C, info = torch.linalg.cholesky_ex(core)
            if int(info) != 0:
                raise SignatureFitError(f"singular covariance: component {k} is not positive definite")
            Fk = torch.linalg.solve_triangular(C, DU.T, upper=False).T  # (d, q)
            Fs.append(Fk)
            offs.append(mu[k] @ Fk)
        F = torch.cat(Fs, 1) if Fs else U.new_zeros((d, 0))
        seg = torch.repeat_interleave(torch.arange(T, device=U.device), self.ranks.to(U.device))
        self._W = W.to(cdt).contiguous()
        self._F_cat = F.to(cdt).contiguous()  # (d, Q)
        self._off = torch.cat(offs).to(cdt) if offs else F.new_zeros(0).to(cdt)  # (Q,)
        self._seg = torch.zeros((F.shape[1], T), dtype=cdt, device=U.device)  # column -> component indicator
        self._seg[torch.arange(F.shape[1], device=U.device), seg] = 1.0
        # ||y||^2_{D'^{-1}} = [z*z, z] @ [inv_D, -2 mu inv_D]^T + mu^T D'^{-1} mu: one product for all t
        self._base_cat = torch.cat([inv_D, -2.0 * mu * inv_D], 1).to(cdt).contiguous()  # (T, 2d)
        self._mu2 = (mu * mu * inv_D).sum(1).to(cdt)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> GaussianComponents:
        """Rebuild from :meth:`to_tensors`'s dict (float16 factors are upcast to float32)."""
        if "prec_chol" in tensors:
            kind, extra = "full", ["prec_chol"]
        elif "prior_evecs" in tensors:
            kind, extra = "shared", ["prior_evecs", "prior_evals", "lowrank", "ranks", "iso", "ridge"]
        else:
            kind, extra = "ppca", ["U", "lam", "sigma2"]
        need = ["weights", "means", "center", "logdet", *extra]
        missing = [k for k in need if k not in tensors]
        if missing:
            raise KeyError(f"GaussianComponents tensors lack {missing}")
        floats = [k for k in need if tensors[k].is_floating_point()]
        wide = max((tensors[k].dtype for k in floats), key=lambda dt: torch.finfo(dt).bits)
        cdt = _compute_dtype(wide)
        obj = cls.__new__(cls)
        obj._set({k: (tensors[k].to(cdt) if k in floats else tensors[k]) for k in need}, kind)
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
        elif self.kind == "shared":
            out["prior_evecs"] = self.prior_evecs.to(small)  # float32 even for float16 storage (measured)
            out["prior_evals"] = self.prior_evals.to(small)
            out["lowrank"] = self.lowrank.to(sd)
            out["ranks"] = self.ranks
            out["iso"] = self.iso.to(small)
            out["ridge"] = self.ridge.to(small)
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
        elif self.kind == "shared":
            chunk = max(1, _CHUNK_ELEMENTS // max(self._F_cat.shape[1], 2 * d))
            for s in range(0, N, chunk):
                z = X[s : s + chunk] @ self._W  # whitening: once per row for all components
                base = (self._base_cat @ torch.cat([z * z, z], 1).T).T + self._mu2[None]
                P = z @ self._F_cat
                P.sub_(self._off[None])
                out[s : s + chunk] = base - P.square_() @ self._seg
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
        sel = {k: (v.index_select(0, idx) if k in _PER_COMPONENT else v) for k, v in t.items()}
        if self.kind == "shared":  # the rows of the selected components, in the selected order
            ends = torch.cumsum(self.ranks, 0)
            rows = [torch.arange(int(ends[i]) - int(self.ranks[i]), int(ends[i])) for i in idx.tolist()]
            sel["lowrank"] = t["lowrank"].index_select(0, torch.cat(rows).to(self.device))
        return GaussianComponents.from_tensors(sel)

    def __repr__(self) -> str:
        extra = f", rank={self.rank}" if self.kind in ("ppca", "shared") else ""
        return (
            f"GaussianComponents(T={self.n_components}, d={self.d}, kind={self.kind!r}{extra}, "
            f"dtype={self.dtype})"
        )
