"""NCM: the nearest class mean of the frozen backbone's features (a reference point beside Table 1).

No training and no task retrieval: task t adds the mean embedding of each of its classes, and an input
takes the class whose mean is closest in angle, ``argmax_c <h(x), m_c / ||m_c||>`` (dividing by
``||h(x)||`` does not change the argmax, so this is the cosine rule). Every class mean is computed from
its own task's data only, so nothing is forgotten: the accuracy on a task changes only because later
classes compete with it. This module is the whole method -- its learner and its declaration -- as any
baseline of :mod:`proteus.baselines` can be.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.learner import ContinualClassifier, NoOptions
from proteus.config import declare
from proteus.learners import LEARNERS
from proteus.streams import Task

__all__ = ["NCM"]


@LEARNERS.register("ncm", help="nearest class mean of frozen features (no training)")
class NCM(ContinualClassifier):
    """Nearest class mean of the frozen backbone's features, by angle (no training, no retrieval)."""

    name = "ncm"
    Options = NoOptions  # no training: none of the baseline.* settings applies
    resumes_legacy = True  # its heads are all a task reads

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        return self.backbone_.forward_suffix(z)

    @torch.no_grad()
    def learn_task(self, task: Task, k: int) -> dict[str, Any]:
        z, y = self.prefix_dataset(task.train, f"task {k + 1}: embedding training images")
        h = torch.cat([self.features(c.to(self.device_), False).float().cpu() for c in z.split(256)])
        classes = [int(c) for c in task.classes]
        means = torch.stack([h[y == c].mean(0) for c in classes])
        head = nn.Linear(self.embed_dim, len(classes)).to(self.device_).requires_grad_(False)
        head.weight.copy_(F.normalize(means, dim=1))
        head.bias.zero_()
        self.heads_.append(head)
        self.task_classes_.append(classes)
        self.labels_ += classes
        return {"steps": 0, "loss_first": None, "loss_last": None, "trainable_params": 0}


declare(
    "ncm",
    "NCM: nearest class mean of frozen-backbone features (no training, no retrieval)",
    base=None,
    learner="ncm",
)
