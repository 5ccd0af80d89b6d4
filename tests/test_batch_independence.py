"""Answers that do not depend on the batch: the same inputs predicted one at a time, in batches of 7 and in
one batch of 64 get scores equal to float round-off (merged and factored adapter kernels differ by ~1e-8
between a batch and a single image), hence the same classes and the same retrieved tasks, but where two
scores tie to round-off: there the tie is broken by round-off, whatever the batch (docs/predict.md states
the guarantee). Every method that predicts per input is covered: PROTEUS's prediction routes (one space,
all adapters, a candidate shortlist), ``ranpac`` and ``frozen``; the baselines in
``test_baseline_load.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from proteus import Proteus
from proteus.streams import build_benchmark
from tiny import TINY_SETS

SHARED_WEIGHTS = (
    Path(__file__).resolve().parents[1].parent / "shared" / "weights" / "mobilenet_v2-b0353104.pth"
)
#: the tiny settings on MobileNetV2's real ImageNet weights: a random network's heads tie on most inputs,
#: and ties say nothing about the batch
SETS = {k: v for k, v in (s.split("=", 1) for s in TINY_SETS) if k != "backbone.pretrained"}
#: method -> extra settings (the shortlist route needs the Gaussian keys and a candidate count)
METHODS = {
    "proteus": {},
    "proteus-hard": {},
    "proteus-paper": {},
    "proteus-dpgmm": {"retrieval.candidates": "1"},
    "ranpac": {},
    "frozen": {},
}


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_WEIGHTS.is_file(), reason=f"MobileNetV2 weights not at {SHARED_WEIGHTS}")
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_same_answer_at_batch_sizes_1_7_and_64(method: str) -> None:
    import yaml

    sets = {k: yaml.safe_load(v) for k, v in {**SETS, **METHODS[method]}.items()}
    sets["backbone.weights"] = str(SHARED_WEIGHTS)
    clf = Proteus.from_method(method, progress=False, **sets, **{"benchmark.max_train_per_class": 20})
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:3]:
        clf.fit_task(task)
    images = [img for t in stream.tasks[:3] for img, _ in t.test][:64]
    x = clf.transform_images(images)
    whole = clf.predict(x)
    top2 = torch.topk(whole.logits.double(), 2, dim=1).values
    tied = (top2[:, 0] - top2[:, 1]).abs() <= 1e-4 * top2[:, 0].abs().clamp_min(1.0)
    for bs in (1, 7):
        parts = [clf.predict(x[i : i + bs]) for i in range(0, len(x), bs)]
        logits = torch.cat([p.logits for p in parts])
        finite = torch.isfinite(whole.logits)
        assert torch.equal(finite, torch.isfinite(logits))
        # float32 through a deep network: kernels chosen per batch differ by ~1e-7 per operation
        torch.testing.assert_close(logits[finite], whole.logits[finite], rtol=1e-4, atol=1e-4)
        moved = torch.cat([p.label for p in parts]) != whole.label
        assert not (moved & ~tied).any(), (method, bs, moved.nonzero().flatten().tolist())
        if whole.task is not None:
            task = torch.cat([p.task for p in parts])
            assert not ((task != whole.task) & ~tied).any(), (method, bs)
    assert tied.float().mean() < 0.1  # ties are rare: the comparison above says something
