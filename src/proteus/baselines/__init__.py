"""Table 1's trained-classifier baselines on PROTEUS's streams, seeds and metrics.

InfLoRA and SD-LoRA (:mod:`proteus.baselines.lora_methods`) run on every backbone (LoRA on the adaptable
maps); L2P, DualPrompt and CODA-Prompt (:mod:`proteus.baselines.prompts`) on the timm ViTs. Each is a
:class:`~proteus.baselines.learner.ContinualClassifier` registered in the one learner registry
(:data:`proteus.learners.LEARNERS`) under the name its method declaration (:mod:`proteus.methods`)
gives as ``learner``; ``proteus run`` / ``proteus compare`` run them through the shared loop
(:func:`proteus.experiment.loop.run`), as PROTEUS.
"""

from __future__ import annotations

import importlib
import pkgutil

from proteus.baselines.learner import ContinualClassifier
from proteus.learners import LEARNERS

__all__ = ["BASELINES", "ContinualClassifier"]

# each baseline module registers its learner and declares its method itself (proteus.baselines.ncm is the
# smallest): every module of the package is imported, so a new baseline is one new file
for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

#: the baselines' learner classes by name (each registered in :data:`LEARNERS`)
BASELINES: dict[str, type[ContinualClassifier]] = {
    n: c
    for n in LEARNERS.loaded()
    if isinstance(c := LEARNERS.get(n), type) and issubclass(c, ContinualClassifier)
}
