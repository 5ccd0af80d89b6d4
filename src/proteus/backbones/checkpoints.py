"""Local weights files (``--weights FILE``): safetensors, or .pth read with ``weights_only=True``, checked
against the backbone with messages that name the file, the backbone and the keys at fault."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from proteus.backbones.weights import WeightsError, WeightsNotFoundError

__all__ = [
    "load_checked",
    "load_state_dict_file",
]

log = logging.getLogger(__name__)

#: Extra directories (``os.pathsep``-separated) searched for verified copies before any download.

_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")


def _where(path: Path, backbone: str | None) -> str:
    return f"{path}" if backbone is None else f"{path} (weights for backbone {backbone})"


def load_state_dict_file(path: str | Path, *, backbone: str | None = None) -> dict[str, Tensor]:
    """Load a state dict safely: ``.safetensors``, or a ``.pth``/``.pt``/``.bin`` pickle (``weights_only``).

    Common wrappers (``{"state_dict": ...}``, ``{"model": ...}``) and a DataParallel ``module.`` prefix
    are removed. Raises :class:`WeightsError` naming the file (and ``backbone`` when given) for a missing
    file (:class:`WeightsNotFoundError`, also a ``FileNotFoundError``), a directory, an unknown format, an
    empty, truncated or corrupt file, a pickle that needs arbitrary code (refused by
    ``weights_only=True``) or non-tensor entries.
    """
    path = Path(path)
    where = _where(path, backbone)
    if not path.exists():
        raise WeightsNotFoundError(
            f"weights file not found: {where}; check the path given to --weights (backbone.weights)"
        )
    if path.is_dir():
        raise WeightsError(
            f"{where}: is a directory, not a weights file; pass the checkpoint file itself "
            "(.safetensors, .pth, .pt or .bin)"
        )
    if not path.is_file():
        raise WeightsError(f"{where}: not a regular file; pass a .safetensors, .pth, .pt or .bin file")
    if not os.access(path, os.R_OK):
        raise WeightsError(f"{where}: permission denied; make the file readable")
    suffix = path.suffix.lower()
    if suffix in (".safetensors", ".pth", ".pt", ".bin", ".ckpt") and path.stat().st_size == 0:
        raise WeightsError(f"{where}: the file is empty (an interrupted download or copy?); fetch it again")
    obj: Any
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            obj = load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise WeightsError(
                f"{where}: not a readable safetensors file, truncated or corrupt ({exc}); fetch it again"
            ) from exc
    elif suffix in (".pth", ".pt", ".bin", ".ckpt"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            text = str(exc)
            first = text.splitlines()[0] if text else type(exc).__name__
            if "weights_only" in text or "Unsupported global" in text or "Weights only load failed" in text:
                raise WeightsError(
                    f"{where}: refused by torch.load(weights_only=True): the pickle holds Python objects "
                    "other than tensors and plain containers, so loading it could run arbitrary code. "
                    f"Convert it to a plain state_dict or .safetensors. ({first})"
                ) from exc
            raise WeightsError(
                f"{where}: corrupt, truncated or not a PyTorch checkpoint ({type(exc).__name__}: {first}); "
                "pass a file written by torch.save(model.state_dict(), ...) or a .safetensors file"
            ) from exc
    else:
        raise WeightsError(
            f"{where}: unsupported weights format {suffix or '(no suffix)'!r}; "
            "use .safetensors, .pth, .pt or .bin"
        )

    for _ in range(3):  # unwrap e.g. {"model": {"state_dict": ...}}
        if isinstance(obj, Mapping) and not all(isinstance(v, Tensor) for v in obj.values()):
            inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
            if inner is None:
                break
            obj = inner
    if not isinstance(obj, Mapping):
        raise WeightsError(
            f"{where}: expected a state dict (a mapping of names to tensors), got {type(obj).__name__}"
        )
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise WeightsError(f"{where}: not a state dict: non-tensor entries such as {bad[:3]}")
    state = {str(k): v for k, v in obj.items()}
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def _examples(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (", ..." if len(names) > n else "")


def load_checked(
    module: nn.Module,
    state: Mapping[str, Tensor],
    *,
    path: str | Path,
    backbone: str,
    ignore_unexpected: Sequence[str] = (),
) -> None:
    """Load ``state`` into ``module`` after checking that it fits exactly.

    Every tensor of ``module.state_dict()`` must be in ``state`` with the same shape, and ``state`` may
    hold nothing else except keys starting with a prefix in ``ignore_unexpected`` (e.g. a classifier the
    backbone does not use). Otherwise raises :class:`WeightsError` naming ``path`` and ``backbone`` with
    the number of missing, unexpected and mis-shaped tensors and a few of their names.
    """
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and not k.startswith(tuple(ignore_unexpected))]
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs backbone {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s) (e.g. {_examples(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) (e.g. {_examples(unexpected)})")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es) (e.g. {_examples(mismatched, 2)})")
        raise WeightsError(
            f"weights file {path} does not fit backbone {backbone}: {'; '.join(parts)} "
            f"(the backbone has {len(expected)} tensors, the file {len(state)}). Pass a checkpoint of this "
            "architecture, or pick the backbone the file belongs to (--backbone; `proteus list backbones`)"
        )
    module.load_state_dict({k: state[k] for k in expected}, strict=True)
