"""Retrieval keys: what a task leaves behind to be found again, and how an input finds it (Sec. 3.1).

A key strategy (``signature.keys``, registry :data:`~proteus.engine.keys.base.KEYS`; one module per
strategy, each registering its kinds) owns its fitted state, its share of the
knowledge base (per-task and global tensors), and its rollback (:meth:`RetrievalKeys.truncate`):

* ``adapter`` -- the paper (Eq. 18): a DP-GMM signature of ``h_k(x)`` under task k's own adapter;
  ``(k*, t*) = argmin_{k, t} S_k(h_k(x); m_k^t, Lambda_k^t)``.
* ``frozen`` / ``adapter+frozen`` -- signatures of the frozen backbone's features (one space for all
  tasks), alone or summed with the adapter keys. The adapter signature is still fitted (the theory
  checks of Sec. 3.2 are about it).
* ``frozen-lda`` / ``first-adapter-lda`` -- beyond the paper (docs/retrieval.md): an LDA (ridge) head
  over all classes accumulated like G, on the frozen features or under the first task's adapter (which
  never changes after task 1); a task's score is minus the log of its average class probability
  (``signature.task_score``, default) or minus its best class score. ``first-adapter-lda`` is the default.

Scores are "lower is better" everywhere (:class:`~proteus.signatures.RetrievalResult`).

Keys in one space (:attr:`RetrievalKeys.space`, :mod:`proteus.engine.keys.space`: ``frozen``, ``frozen-lda``,
``first-adapter-lda``) retrieve from a single embedding per input (:meth:`RetrievalKeys.retrieve_space`), so
prediction needs one forward in that space and one under the retrieved adapter, whatever m is (each key owns
its route: :meth:`RetrievalKeys.predict`). The paper's per-adapter keys can shortlist: with
``retrieval.candidates = c`` a task also leaves an LDA key in one space (accumulated like G, no old data, no
training), and only the c best tasks by it are scored with the exact Gaussian keys
(:meth:`GaussianKeys.shortlist`).
"""

from proteus.engine.keys.base import KEYS, KeyFit, KeyKind, NewHead, NoKeys, RetrievalKeys, Under
from proteus.engine.keys.gaussian import GaussianKeys
from proteus.engine.keys.lda import TASK_SCORES, LDAKeys, task_scores
from proteus.engine.keys.space import FIRST_ADAPTER, FROZEN, SPACES, KeySpace

__all__ = [
    "FIRST_ADAPTER", "FROZEN", "KEYS", "SPACES", "TASK_SCORES", "GaussianKeys", "KeyFit", "KeyKind",
    "KeySpace", "LDAKeys", "NewHead", "NoKeys", "RetrievalKeys", "Under", "task_scores",
]  # fmt: skip
