"""The learner's working parts, each a strategy or a step the :class:`~proteus.Proteus` estimator
composes: embedding passes (:mod:`.embedder`), adapter training with S-update strategies
(:mod:`.trainer`, Eq. 15), retrieval-key strategies (:mod:`.keys`, Eq. 18 and beyond), which adapters
train and which composition embeds (:mod:`.compositions`), and typed records (:mod:`.records`)."""

from proteus.engine.errors import TaskError
from proteus.engine.records import Prediction, TaskRecord, TaskStats, TrainStats

__all__ = ["Prediction", "TaskError", "TaskRecord", "TaskStats", "TrainStats"]
