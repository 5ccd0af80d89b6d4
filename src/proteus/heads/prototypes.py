"""The class prototypes ``e(c)`` of Eq. 23 (``head.prototypes``, registry :data:`PROTOTYPES`).

Eq. 23 predicts ``c* = argmax_c phi(h*)^T (G + gamma I)^{-1} e(c)``. Algorithm 1 line 11 accumulates
``e_S(z) += m^{-1} |D_k|^{-1} h_S(x)``:

* ``"sum"`` (:class:`ClassSums`, RanPAC's code): the plain class sums, i.e. the head's ``Q_`` itself;
  nothing else is kept;
* ``"task-mean"`` (:class:`TaskMeans`, Algorithm 1 line 11): each update's sums divided by its size
  ``|D_k|``, held in the head's ``P_`` (the uniform ``m^{-1}`` is left out: it scales every score alike).

A strategy with ``stored = True`` keeps its own (m, C) matrix, saved as the head tensor ``"P"``.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor

from proteus.devices import index_add
from proteus.registry import Registry

__all__ = ["PROTOTYPES", "ClassSums", "Prototypes", "TaskMeans"]


class Prototypes(Protocol):
    """How the prototypes ``e(c)`` follow the updates: ``add`` one update's features ``phi`` (N, m) with
    labels ``y`` to the kept matrix ``P`` (None: nothing kept yet) for ``total`` classes, ``subtract``
    one (its ``classes`` become exactly 0). Both return the new matrix, or None when none is kept (the
    head then uses ``Q_``)."""

    stored: ClassVar[bool]

    def add(self, P: Tensor | None, phi: Tensor, y: Tensor, total: int) -> Tensor | None: ...

    def subtract(self, P: Tensor | None, phi: Tensor, y: Tensor, classes: Tensor) -> Tensor | None: ...


class ClassSums:
    """RanPAC's class sums ``e_S(c)``: the head's ``Q_``."""

    stored: ClassVar[bool] = False

    def add(self, P: Tensor | None, phi: Tensor, y: Tensor, total: int) -> Tensor | None:
        return None

    def subtract(self, P: Tensor | None, phi: Tensor, y: Tensor, classes: Tensor) -> Tensor | None:
        return None


class TaskMeans:
    """Algorithm 1 line 11: ``e_S(z) += |D_k|^{-1} h_S(x)``, each update's sums over its size."""

    stored: ClassVar[bool] = True

    def add(self, P: Tensor | None, phi: Tensor, y: Tensor, total: int) -> Tensor | None:
        m = phi.shape[1]
        P_old = phi.new_zeros(m, 0) if P is None else P
        P_new = torch.cat([P_old, P_old.new_zeros(m, total - P_old.shape[1])], dim=1)
        index_add(P_new, 1, y, phi.T / phi.shape[0])  # e_S(c) += |D_k|^{-1} h_S(x)
        return P_new

    def subtract(self, P: Tensor | None, phi: Tensor, y: Tensor, classes: Tensor) -> Tensor | None:
        if P is None:
            raise RuntimeError("task-mean prototypes: nothing accumulated to subtract from")
        P = P.clone()
        index_add(P, 1, y, -phi.T / phi.shape[0])
        P[:, classes] = 0.0
        return P


#: ``head.prototypes``: the class prototypes e(c) of Eq. 23
PROTOTYPES: Registry[Prototypes] = Registry("head.prototypes")
PROTOTYPES.register("sum")(ClassSums())
PROTOTYPES.register("task-mean")(TaskMeans())
