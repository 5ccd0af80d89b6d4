"""Key spaces: which embedding of an input a retrieval key reads (Sec. 3.1 and beyond the paper).

The paper's keys (Eq. 18) read each task's own adapter, ``h_k(x)``: retrieval needs every task's
forward. Keys in *one* space read a single embedding of an input for every task -- the frozen backbone's
features, or the embedding under the first task's adapter (which never changes after task 1) -- so
prediction takes one forward there and one under the retrieved adapter (:mod:`proteus.engine.keys.base`).
A :class:`KeySpace` knows how to embed prefix outputs there, which stored embedding it is (to reuse it
under the retrieved adapter) and what it needs of the learner; :data:`SPACES` registers them
(``retrieval.candidate_space`` names one for the candidate shortlist). A new fixed space is one
:class:`KeySpace` and one registry line.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from proteus.engine.embedder import Embedder
from proteus.engine.errors import TaskError
from proteus.registry import Registry
from proteus.signatures import options as signature_options

__all__ = ["FIRST_ADAPTER", "FROZEN", "SPACES", "KeySpace"]


@dataclass(frozen=True)
class KeySpace:
    """One embedding per input that a key reads: under the adapter of task ``adapter`` (0-based), or the
    frozen backbone's features when ``adapter`` is None."""

    name: str
    adapter: int | None

    @property
    def needs_frozen(self) -> bool:
        """The space is the frozen backbone's feature space (the F of :meth:`Proteus.embed`)."""
        return self.adapter is None

    def embed(self, embedder: Embedder, z: Tensor, shard: bool = True) -> Tensor:
        """(N, d): prefix outputs ``z`` embedded in this space."""
        return embedder.embed_prefix(z, None if self.adapter is None else [self.adapter], shard=shard)[0]

    def select(self, H: Tensor, F: Tensor | None) -> Tensor:
        """(N, d): this space's embeddings out of ``H`` (m, N, d, under each adapter) and ``F`` (frozen)."""
        X = F if self.adapter is None else H[self.adapter]
        if X is None:
            raise ValueError(f"keys in the {self.name} space need the frozen-backbone features F")
        return X

    def known(self, X: Tensor) -> dict[int, Tensor]:
        """Embeddings under adapters that ``X`` (this space's) already is: reused, not recomputed."""
        return {} if self.adapter is None else {self.adapter: X}

    def available(self, num_adapters: int) -> bool:
        """Inputs can be embedded here once the learner holds ``num_adapters`` adapters."""
        return self.adapter is None or num_adapters > self.adapter

    def check(self, num_adapters: int, who: str) -> None:
        """Raise when the learner has no adapter for this space yet."""
        if not self.available(num_adapters):
            assert self.adapter is not None  # available without one
            raise TaskError(
                f"{who} read inputs under task {self.adapter + 1}'s adapter, which was not trained: "
                "the first task must train an adapter"
            )


#: the frozen backbone's features
FROZEN = KeySpace("frozen", None)
#: the embedding under the first task's adapter (which never changes after task 1)
FIRST_ADAPTER = KeySpace("first-adapter", 0)

SPACES: Registry[KeySpace] = signature_options.SPACES
SPACES.register("first-adapter", help="under the first task's adapter (frozen after task 1)")(FIRST_ADAPTER)
SPACES.register("frozen", help="the frozen backbone's features")(FROZEN)
