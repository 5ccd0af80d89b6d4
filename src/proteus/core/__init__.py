"""The PROTEUS learner: :class:`~proteus.core.estimator.Proteus`, the scikit-learn face over its parts
(Algorithm 1 to learn a task, Algorithm 2 to predict), beside :mod:`proteus.baselines`, the other learners."""

from proteus.core import methods  # noqa: F401 - PROTEUS's method declarations
from proteus.core.estimator import Prediction, Proteus, TaskError

__all__ = ["Prediction", "Proteus", "TaskError"]
