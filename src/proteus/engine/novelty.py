"""Inputs from no learned task: a per-task threshold on the retrieval key's score (beyond the paper).

Retrieval (Sec. 3.1) always names a task; an input from no learned task still gets one. With
``retrieval.reject = true`` each task keeps a fraction ``retrieval.calibration_holdout`` of its training
inputs out of its key fit, scores them with its own key after the fit, and stores the sorted scores
(quantiles, at most :data:`MAX_STORED`) in its record. The threshold is the score that the chosen
true-positive rate ``retrieval.reject_tpr`` of those held-out inputs stays under (key scores are "lower
is better"); an input is *known* when its retrieved task's score is at most that task's threshold, and its
*novelty* is the score minus the threshold (> 0: rejected). Recalibrating at another rate needs no data:
the stored scores suffice (``proteus kb calibrate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from proteus.config import ConfigError

__all__ = ["MAX_STORED", "Calibration", "holdout_split"]

#: held-out scores kept per task (as evenly spaced quantiles when there are more)
MAX_STORED = 256


@dataclass
class Calibration:
    """A task's held-out key scores (sorted) and the threshold at ``tpr``."""

    scores: list[float]
    tpr: float
    threshold: float

    @classmethod
    def from_scores(cls, scores: torch.Tensor, tpr: float) -> Calibration:
        s = scores.double().flatten().sort().values
        if len(s) > MAX_STORED:
            s = torch.quantile(s, torch.linspace(0, 1, MAX_STORED, dtype=torch.float64))
        return cls([float(v) for v in s], tpr, threshold_at(s, tpr))

    def at(self, tpr: float) -> Calibration:
        """The same scores with the threshold of another true-positive rate."""
        return Calibration(
            self.scores, tpr, threshold_at(torch.tensor(self.scores, dtype=torch.float64), tpr)
        )

    def to_dict(self) -> dict[str, object]:
        return {"scores": self.scores, "tpr": self.tpr, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls([float(v) for v in d["scores"]], float(d["tpr"]), float(d["threshold"]))


def threshold_at(sorted_scores: torch.Tensor, tpr: float) -> float:
    """The smallest score that a fraction ``tpr`` of the held-out scores is at or under."""
    if not 0.0 < tpr <= 1.0:
        raise ConfigError(f"the true-positive rate must be in (0, 1], got {tpr}")
    s = sorted_scores.double().sort().values
    return float(s[max(0, math.ceil(tpr * len(s) - 1e-9) - 1)])


def holdout_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held-out) indices of n training inputs: a seeded ``fraction`` held out (at least 1 and at
    most n - 2, so that a key can still be fitted)."""
    n_out = min(max(1, int(round(fraction * n))), max(0, n - 2))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_out:].sort().values, perm[:n_out].sort().values
