"""Content keys of the objects a knowledge base writes (commits that stay flat on a long stream).

A learner commits its whole state at every commit; :meth:`~proteus.kb.store.KnowledgeBase.write_object`
looks each object's :func:`content_key` up among the objects it already wrote before serialising it. The key
is the sha256 of the object's kind and, per tensor in name order, its name, dtype, shape and the sha256 of its
raw bytes. Those per-tensor digests are kept (:class:`TensorDigests`) for as long as the tensor object lives
and is not modified in place (torch's version counter), so a tensor that a learner hands over unchanged at
every commit -- a stored task's adapter directions (:meth:`proteus.adapters.lora.LoRAUnit.task_tensors`) --
is hashed once, not once per commit. A tensor that requires a gradient is live training state (an optimiser
may write it through ``.data``, which the version counter does not see): it is hashed every time.
:class:`ContentKeys` also keeps each object's key while the same tensor objects, unmodified, come back under
the same kind: a commit then checks an unchanged object's tensors by identity instead of rebuilding its key.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

#: dtypes whose tensors hash through ``Tensor.numpy()`` directly (the others as raw bytes)
_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    }
)


def tensor_digest(t: torch.Tensor) -> bytes:
    """sha256 of a contiguous CPU tensor's raw bytes."""
    t = t.detach()
    return hashlib.sha256(
        # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12 (it has the buffer protocol)
        t.numpy() if t.dtype in _NUMPY_DTYPES else t.reshape(-1).view(torch.uint8).numpy()  # type: ignore[arg-type]
    ).digest()


def _stable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be recognised later by identity and version: a contiguous CPU tensor that requires
    no gradient (an optimiser may write a parameter through ``.data``, unseen by the version counter)."""
    return not t.requires_grad and t.device.type == "cpu" and t.is_contiguous()


class TensorDigests:
    """``tensor_digest`` of tensor objects, remembered while each object lives and keeps its version."""

    def __init__(self) -> None:
        #: id(tensor) -> (a weak reference to it, its version when hashed, its digest)
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, bytes]] = {}

    def __call__(self, t: torch.Tensor) -> bytes:
        if not _stable(t):
            return tensor_digest(t.contiguous().cpu())
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        digest = tensor_digest(t)
        key = id(t)

        def forget(_: weakref.ref[torch.Tensor], key: int = key) -> None:
            self._seen.pop(key, None)

        self._seen[key] = (weakref.ref(t, forget), t._version, digest)
        return digest


def content_key(kind: str, tensors: dict[str, torch.Tensor], digest: TensorDigests | None = None) -> str:
    """sha256 of an object's content: its kind, then per tensor (in name order) its name, dtype, shape and
    the sha256 of its raw bytes. Equal keys mean equal safetensors files, found without serialising the
    tensors; ``digest`` (a :class:`TensorDigests`) hashes each unchanged tensor object once."""
    h = hashlib.sha256(kind.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(repr((name, str(t.dtype), tuple(t.shape))).encode())
        h.update(tensor_digest(t) if digest is None else digest(t))
    return h.hexdigest()


class ContentKeys:
    """:func:`content_key` of the objects one store writes, each kept while its kind comes back with the
    same tensor objects (same names, each alive, the same object and the same version) and rebuilt
    otherwise; an object with a tensor that is not stable (:func:`_stable`: hashed every time) never is."""

    def __init__(self) -> None:
        self.digests = TensorDigests()
        #: kind -> ((name, weak reference, version) per tensor in name order, its key)
        self._kept: dict[str, tuple[tuple[tuple[str, weakref.ref[torch.Tensor], int], ...], str]] = {}
        self._live = 32  # the kinds kept after the last pruning (at least 32)

    def __call__(self, kind: str, tensors: dict[str, torch.Tensor]) -> str:
        kept = self._kept.get(kind)
        names = sorted(tensors)
        if kept is not None and len(kept[0]) == len(names):
            if all(
                n == name and ref() is tensors[n] and version == tensors[n]._version
                for n, (name, ref, version) in zip(names, kept[0], strict=True)
            ):
                return kept[1]
        key = content_key(kind, tensors, self.digests)
        if all(_stable(t) for t in tensors.values()):
            self._kept[kind] = (tuple((n, weakref.ref(tensors[n]), tensors[n]._version) for n in names), key)
        else:
            self._kept.pop(kind, None)
        if len(self._kept) > 2 * self._live:  # (one kind per task: forget those whose tensors are gone)
            self._kept = {k: v for k, v in self._kept.items() if all(ref() is not None for _, ref, _ in v[0])}
            self._live = max(len(self._kept), 32)
        return key
