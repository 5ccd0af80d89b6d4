"""Persistence of the RanPAC head: its meta (JSON) and tensors (safetensors), restored bit-exactly.

:class:`HeadState` is a mixin of :class:`~proteus.heads.ranpac.RanPACHead` (the head's own file is
the statistics of Algorithm 1 lines 8-12 and Eq. 23); it reads and writes the head's hyper-parameters
and fitted tensors ``W_rand``, ``G``, ``Q``, ``counts`` and ``W_out``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["HeadState", "SUPPORTED_DTYPES", "dtype_name"]

SUPPORTED_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
_FORMAT = "proteus.heads.ranpac"
_FORMAT_VERSION = 1

H = TypeVar("H", bound="HeadState")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HeadState:
    """``meta`` / ``state_tensors`` / ``load_state_tensors`` / ``from_state_tensors`` for the head."""

    embed_dim: int
    rp_dim: int
    gamma_min_exp: int
    gamma_max_exp: int
    holdout: float
    selection: str
    seed: int
    dtype: torch.dtype
    device: torch.device | str | None
    gamma: float | None
    W_rand_: Tensor | None
    G_: Tensor | None
    Q_: Tensor | None
    counts_: Tensor | None
    gamma_: float | None
    W_out_: Tensor | None
    gamma_selection_: Any
    prototypes: str
    P_: Tensor | None
    n_samples_: int
    n_updates_: int

    def __init__(self, embed_dim: int, rp_dim: int = 10000, **kw: Any) -> None:
        raise NotImplementedError

    @property
    def feature_dim(self) -> int:
        raise NotImplementedError

    @property
    def num_classes_(self) -> int:
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable description of the head (hyper-parameters and scalar fitted state);
        ``prototypes`` only when it is not ``"sum"`` (heads written before it existed read as ``"sum"``)."""
        out: dict[str, Any] = {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "embed_dim": self.embed_dim,
            "rp_dim": self.rp_dim,
            "gamma_min_exp": self.gamma_min_exp,
            "gamma_max_exp": self.gamma_max_exp,
            "holdout": self.holdout,
            "selection": self.selection,
            "prototypes": self.prototypes,
            "seed": self.seed,
            "dtype": dtype_name(self.dtype),
            "fixed_gamma": self.gamma,
            "gamma": self.gamma_,
            "num_classes": self.num_classes_,
            "n_samples": self.n_samples_,
            "n_updates": self.n_updates_,
        }
        if self.prototypes != "sum":
            out["prototypes"] = self.prototypes
        return out

    def state_tensors(self) -> dict[str, Tensor]:
        """Fitted tensors for safetensors storage (contiguous CPU copies). ``W_rand`` is stored too."""
        out: dict[str, Tensor] = {}
        for key, t in (
            ("W_rand", self.W_rand_),
            ("G", self.G_),
            ("Q", self.Q_),
            ("counts", self.counts_),
            ("W_out", self.W_out_),
            ("P", self.P_),
        ):
            if t is not None:
                out[key] = t.detach().to("cpu", copy=True).contiguous()
        return out

    def load_state_tensors(self: H, tensors: dict[str, Tensor], meta: dict[str, Any]) -> H:
        """Restore a head saved with :meth:`state_tensors` and :meth:`meta` (bit-exact; no dtype casts)."""
        if meta.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"not a RanPAC head state: format={meta.get('format')!r}")
        dtype_name = meta["dtype"]
        dtype = {v: k for k, v in SUPPORTED_DTYPES.items()}.get(dtype_name)
        if dtype is None:
            raise ValueError(f"unsupported dtype {dtype_name!r} in head meta")
        self.embed_dim = int(meta["embed_dim"])
        self.rp_dim = int(meta["rp_dim"])
        self.gamma_min_exp = int(meta.get("gamma_min_exp", self.gamma_min_exp))
        self.gamma_max_exp = int(meta.get("gamma_max_exp", self.gamma_max_exp))
        self.holdout = float(meta.get("holdout", self.holdout))
        self.selection = str(meta.get("selection", self.selection))
        self.prototypes = str(meta.get("prototypes", "sum"))
        self.seed = int(meta["seed"])
        self.dtype = dtype
        self.gamma = None if meta.get("fixed_gamma") is None else float(meta["fixed_gamma"])
        m, c = self.feature_dim, int(meta["num_classes"])
        device = torch.device(self.device) if self.device is not None else None
        if "G" not in tensors and int(meta.get("n_samples", 0)) == 0:  # saved before the first update
            w = tensors.get("W_rand")
            self.W_rand_ = None if w is None or self.rp_dim == 0 else w.to(device or w.device)
            self.G_ = self.Q_ = self.P_ = self.counts_ = self.W_out_ = None
            self.gamma_, self.gamma_selection_, self.n_samples_, self.n_updates_ = None, None, 0, 0
            return self
        expected = {
            "G": ((m, m), dtype),
            "Q": ((m, c), dtype),
            "counts": ((c,), torch.long),
            "W_out": ((m, c), dtype),
        }
        if self.prototypes != "sum":
            expected["P"] = ((m, c), dtype)
        if self.rp_dim > 0:
            expected["W_rand"] = ((self.embed_dim, self.rp_dim), dtype)
        for key, (shape, dt) in expected.items():
            if key not in tensors:
                raise ValueError(f"head state is missing tensor {key!r}")
            t = tensors[key]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(
                    f"head tensor {key!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                    f"expected {shape}, {dt}"
                )
        device = device or tensors["G"].device
        self.W_rand_ = tensors["W_rand"].to(device) if self.rp_dim > 0 else None
        self.G_ = tensors["G"].to(device)
        self.Q_ = tensors["Q"].to(device)
        self.counts_ = tensors["counts"].to(device)
        self.W_out_ = tensors["W_out"].to(device)
        self.P_ = tensors["P"].to(device) if self.prototypes != "sum" else None
        self.gamma_ = None if meta.get("gamma") is None else float(meta["gamma"])
        self.n_samples_ = int(meta.get("n_samples", int(self.counts_.sum())))
        self.n_updates_ = int(meta.get("n_updates", 0))
        self.gamma_selection_ = None
        return self

    @classmethod
    def from_state_tensors(
        cls: type[H],
        tensors: dict[str, Tensor],
        meta: dict[str, Any],
        device: torch.device | str | None = None,
    ) -> H:
        """Build a head from :meth:`state_tensors` and :meth:`meta`."""
        dtype = {v: k for k, v in SUPPORTED_DTYPES.items()}.get(meta.get("dtype", ""), torch.float64)
        head = cls(
            embed_dim=int(meta["embed_dim"]),
            rp_dim=int(meta["rp_dim"]),
            seed=int(meta["seed"]),
            dtype=dtype,
            device=device,
        )
        return head.load_state_tensors(tensors, meta)
