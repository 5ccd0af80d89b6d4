"""Table 1's trained-classifier baselines on PROTEUS's streams, seeds and metrics.

InfLoRA and SD-LoRA (:mod:`proteus.baselines.lora_methods`) run on every backbone (LoRA on the adaptable
maps); L2P, DualPrompt and CODA-Prompt (:mod:`proteus.baselines.prompts`) on the timm ViTs. Each is a
:class:`~proteus.baselines.learner.ContinualClassifier` registered in :data:`BASELINES` under the name its
method declaration (:mod:`proteus.methods`) gives as ``learner``; ``proteus run`` / ``proteus compare``
run them through :func:`proteus.experiment.baselines.run_baseline`.
"""

from __future__ import annotations

from proteus.baselines.learner import ContinualClassifier
from proteus.baselines.lora_methods import InfLoRA, SDLoRA
from proteus.baselines.prompts import L2P, CodaPrompt, DualPrompt
from proteus.registry import Registry

__all__ = ["BASELINES", "ContinualClassifier", "build_baseline"]

#: learner name -> class
BASELINES: Registry[type[ContinualClassifier]] = Registry("baseline learner")
for _cls in (InfLoRA, SDLoRA, L2P, DualPrompt, CodaPrompt):
    BASELINES.register(_cls.name, help=(_cls.__doc__ or "").strip().splitlines()[0])(_cls)


def build_baseline(config, *, progress: bool = True) -> ContinualClassifier:  # noqa: ANN001
    """The baseline learner of ``config.method`` (a method declared with ``learner=...``)."""
    from proteus.methods import METHODS

    return BASELINES.get(METHODS.get(config.method).learner)(config, progress=progress)
