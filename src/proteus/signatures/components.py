"""The base of the Gaussian signature components of Eq. 2 / Eq. 18 and the registry of their kinds.

Eq. 2 scores an embedding ``h`` against a signature pattern ``(m, Lambda)`` with the Mahalanobis term
``S(h) = (h - m)^T Lambda^{-1} (h - m)``; the retrieval rule of Section 3.1 uses the negative Gaussian
log-likelihood ``0.5 (S(h) + log|Lambda| + d log 2 pi)``. :class:`GaussianComponents` holds T such
patterns in one d-dimensional space and does what every covariance form shares: the weights, means,
centre and log-determinants, batched chunked scoring (:meth:`GaussianComponents.mahalanobis`,
:meth:`GaussianComponents.nll`), storage and selection. Each form is a subclass registered in
:data:`COVARIANCES` under its ``signature.covariance`` name (:mod:`~proteus.signatures.gaussian` lists
them); it stores its own factors and scores centred rows.

Scoring always runs in float32 or higher. Storage (:meth:`GaussianComponents.to_tensors`): a kind's large
factors take the storage dtype (float16 or float32); weights, means, log-determinants and the centre stay
in float32. A stored dict names its kind by its first factor tensor (:attr:`GaussianComponents.factor_names`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from proteus.registry import Registry
from proteus.signatures.householder import unpack_orthogonal
from proteus.signatures.posterior import PosteriorFactors
from proteus.tensor_rules import TENSOR_RULES, Required, ShapeRule

__all__ = ["COVARIANCES", "ComponentSource", "GaussianComponents", "compute_dtype"]

_CHUNK_ELEMENTS = 1 << 24
#: stored tensors every kind has; the per-component ones among them
_COMMON = ("weights", "means", "center", "logdet")
_COMMON_PER_COMPONENT = ("weights", "means", "logdet")

#: ``signature.covariance`` -> the :class:`GaussianComponents` subclass that stores that form
COVARIANCES: Registry[type[GaussianComponents]] = Registry("signature.covariance")


def _markers() -> str:
    """``a|b|...``: the tensors that mark a stored kind (each kind's first factor; kind "shared" stored
    compactly holds ``prior_qr`` instead of ``prior_evecs``, :meth:`GaussianComponents.from_tensors`)."""
    names = [COVARIANCES.get(n).factor_names[0] for n in COVARIANCES]
    return "|".join([*names, "prior_qr"] if "prior_evecs" in names else names)


#: what every stored kind holds (:meth:`GaussianComponents.to_tensors`), against its signature's record
#: (``n_active`` components in ``d`` dimensions); each kind declares its own factors where it is defined
TENSOR_RULES.declare(
    "signature", "GaussianComponents",
    Required(lambda: (*_COMMON, _markers()), lambda record: isinstance(record, dict)),
    ShapeRule("means", ("meta:n_active", "meta:d"),
              "a signature's means are (components, d), as its record says"),
    ShapeRule("means", ("*", "kb.d"), "every task's {record} lives in one space of d dimensions"),
    ShapeRule("(?:weights|logdet)", ("meta:n_active",), "one entry per signature component"),
    ShapeRule("center", ("meta:d",), "one entry per embedding dimension"),
)  # fmt: skip


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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scoring dtype: float32 or higher."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ComponentSource(Protocol):
    """What a clustering hands to :meth:`GaussianComponents.from_fit` (a
    :class:`~proteus.signatures.fitting.ClusterFit`): weights and means of all its components, their dense
    covariances ``cov_fn(index)`` (K, d, d) and their factored form ``shared_fn(index)``."""

    weights: Tensor
    means: Tensor

    # read-only (a dataclass's callable fields are not settable members for a type checker)
    @property
    def cov_fn(self) -> Callable[..., Tensor]: ...

    @property
    def shared_fn(self) -> Callable[[Tensor], PosteriorFactors]: ...


class GaussianComponents(ABC):
    """T Gaussians ``N(m_t, Lambda_t)`` in one d-dim space, with batched Mahalanobis / NLL scoring.

    The base of the covariance kinds (:data:`COVARIANCES`); a subclass stores its factors
    (:meth:`_set_factors`, :meth:`_factor_tensors`) and scores centred rows (:meth:`_maha`).
    Build one with a subclass's constructor, :meth:`from_fit` or :meth:`from_tensors`. Attributes:
    ``weights`` (T,), ``means`` (T, d), ``center`` (d,), ``logdet`` (T,), ``n_components``, ``d``,
    ``rank`` (None for ``"full"``).
    """

    #: the ``signature.covariance`` name
    kind: ClassVar[str]
    #: the kind's own stored tensors, in storage order; the first one marks the kind in a stored dict
    factor_names: ClassVar[tuple[str, ...]]
    #: those of them with one entry per component (:meth:`select` indexes them)
    per_component: ClassVar[tuple[str, ...]]
    #: whether the kind keeps a rank (``signature.rank``) of each covariance, not every dimension
    ranked: ClassVar[bool] = True
    #: the dtype ``signature.storage_dtype=auto`` stores the kind's factors in
    auto_storage: ClassVar[str] = "float32"
    rank: int | None = None
    #: the compactly stored eigenbasis this object was loaded from (kind "shared"), if any
    _packed_basis: Tensor | None = None

    weights: Tensor
    means: Tensor
    center: Tensor
    logdet: Tensor
    n_components: int
    d: int

    @classmethod
    @abstractmethod
    def from_fit(
        cls, fit: ComponentSource, active: Tensor, rank: int | None, n_train: int
    ) -> GaussianComponents:
        """The components ``active`` of a clustering of ``n_train`` embeddings, in this kind (float32);
        ``rank`` is ``signature.rank``."""

    # ------------------------------------------------------------------ construction from stored tensors
    @classmethod
    def _stored(cls, t: dict[str, Tensor]) -> GaussianComponents:
        obj = cls.__new__(cls)
        obj._set(t)
        return obj

    def _set(self, t: dict[str, Tensor]) -> None:
        t = {k: v.contiguous() for k, v in t.items()}  # same layouts: bit-identical scores after reload
        self.weights = t["weights"]
        self.means = t["means"]
        self.center = t["center"]
        self.logdet = t["logdet"]
        T, d = self.means.shape
        self.n_components, self.d = int(T), int(d)
        mc = self.means - self.center
        self._set_factors(t, mc)
        self._mc = mc

    @abstractmethod
    def _set_factors(self, t: dict[str, Tensor], mc: Tensor) -> None:
        """Hold the kind's stored tensors ``t`` and derive its scoring factors (``mc``: centred means)."""

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> GaussianComponents:
        """Rebuild from :meth:`to_tensors`'s dict, of whichever kind it holds (float16 factors are
        upcast to float32)."""
        packed = None
        if "prior_qr" in tensors and "prior_evecs" not in tensors and "means" in tensors:
            # kind "shared" stored compactly (float16 factors): the eigenbasis as Householder vectors
            packed = tensors["prior_qr"]
            V = unpack_orthogonal(packed, int(tensors["means"].shape[-1]))
            tensors = {k: v for k, v in tensors.items() if k != "prior_qr"} | {
                "prior_evecs": V.to(packed.dtype)
            }
        kinds = [COVARIANCES.get(name) for name in COVARIANCES]
        kind = next((k for k in kinds if k.factor_names[0] in tensors), None)
        if kind is None:
            raise KeyError(f"GaussianComponents tensors hold none of {[k.factor_names[0] for k in kinds]}")
        need = [*_COMMON, *kind.factor_names]
        missing = [k for k in need if k not in tensors]
        if missing:
            raise KeyError(f"GaussianComponents tensors lack {missing}")
        floats = [k for k in need if tensors[k].is_floating_point()]
        wide = max((tensors[k].dtype for k in floats), key=lambda dt: torch.finfo(dt).bits)
        cdt = compute_dtype(wide)
        obj = kind._stored({k: (tensors[k].to(cdt) if k in floats else tensors[k]) for k in need})
        obj._packed_basis = packed  # stored again as it came (bit-identical round trips)
        return obj

    def to_tensors(self, dtype: str | torch.dtype = torch.float32) -> dict[str, Tensor]:
        """Tensors for safetensors: the big factor in ``dtype`` (float16/float32), the rest float32+."""
        small = self.means.dtype  # float32 (or float64 when computed in float64)
        out = {
            "weights": self.weights.to(small),
            "means": self.means.to(small),
            "center": self.center.to(small),
            "logdet": self.logdet.to(small),
            **self._factor_tensors(_dtype(dtype), small),
        }
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    @abstractmethod
    def _factor_tensors(self, big: torch.dtype, small: torch.dtype) -> dict[str, Tensor]:
        """The kind's stored tensors (:attr:`factor_names`): large factors in ``big``, the rest ``small``."""

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
        N, T = X.shape[0], self.n_components
        out = torch.empty((N, T), dtype=self.dtype, device=self.device)
        chunk = max(1, _CHUNK_ELEMENTS // self._row_cost())
        for s in range(0, N, chunk):
            out[s : s + chunk] = self._maha(X[s : s + chunk])
        return out.clamp_min_(0.0)

    @abstractmethod
    def _row_cost(self) -> int:
        """Elements of the largest intermediate per input row (sets the chunk of rows scored at once)."""

    @abstractmethod
    def _maha(self, xs: Tensor) -> Tensor:
        """Mahalanobis terms (n, T) of rows ``xs`` already centred on ``center``."""

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
        rows = {*_COMMON_PER_COMPONENT, *self.per_component}
        sel = {k: (v.index_select(0, idx) if k in rows else v) for k, v in t.items()}
        sel.update(self._select_rows(t, idx))
        return GaussianComponents.from_tensors(sel)

    def _select_rows(self, t: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
        """Stored tensors whose rows are not one per component, restricted to the components ``idx``."""
        return {}

    def __repr__(self) -> str:
        extra = "" if self.rank is None else f", rank={self.rank}"
        return (
            f"{type(self).__name__}(T={self.n_components}, d={self.d}, kind={self.kind!r}{extra}, "
            f"dtype={self.dtype})"
        )
