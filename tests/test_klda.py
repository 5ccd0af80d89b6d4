"""KLDA (proteus.baselines.klda) against the reference the paper's method reduces to: scikit-learn's
``RBFSampler`` + ``LinearDiscriminantAnalysis(solver="lsqr", shrinkage=a)`` on the same features; learned
task by task it equals that LDA fitted on every task's data at once, and a learner restored from its
state predicts and learns on as the one that wrote it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.kernel_approximation import RBFSampler

from proteus.baselines.klda import discriminants, random_features
from proteus.experiment.store import build_learner
from tiny import baseline_cfg, baseline_stream


def _reference(phi: np.ndarray, y: np.ndarray, shrinkage: float) -> LinearDiscriminantAnalysis:
    return LinearDiscriminantAnalysis(solver="lsqr", shrinkage=shrinkage).fit(phi, y)


@pytest.mark.parametrize("shrinkage", [0.1, 0.5])
def test_features_and_discriminants_equal_scikit_learns(shrinkage: float) -> None:
    """The random map is RBFSampler's, and the discriminants LDA's (lsqr, fixed shrinkage) to 1e-8."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 12)) + np.repeat(rng.normal(size=(6, 12)) * 2, 40, 0)
    y = np.repeat(np.arange(6), 40)
    sampler = RBFSampler(gamma=0.05, n_components=64, random_state=0).fit(X)
    W, b = torch.from_numpy(sampler.random_weights_), torch.from_numpy(sampler.random_offset_)
    phi = random_features(torch.from_numpy(X), W, b)
    np.testing.assert_allclose(phi.numpy(), sampler.transform(X), rtol=0, atol=1e-12)
    ref = _reference(phi.numpy(), y, shrinkage)
    means = torch.stack([phi[torch.from_numpy(y == c)].mean(0) for c in range(6)])
    centred = phi - means[torch.from_numpy(y)]
    counts = torch.full((6,), 40.0, dtype=torch.float64)
    coef, intercept = discriminants(means, counts, centred.T @ centred, shrinkage)
    np.testing.assert_allclose(coef.numpy(), ref.coef_, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(intercept.numpy(), ref.intercept_, rtol=1e-8, atol=1e-8)


def _cfg(**baseline: float) -> object:
    cfg = baseline_cfg("klda", "mobilenet_v2")
    cfg.backbone.adapt_last = 2
    cfg.baseline.update({"rff_dim": 96, **baseline})
    return cfg


@pytest.fixture(scope="module")
def stream():
    return baseline_stream()


def test_task_by_task_equals_lda_on_all_the_data(stream) -> None:
    """After two tasks the learner's logits are scikit-learn's LDA fitted on both tasks' random features at
    once (float32 heads: to 1e-4), and their argmax is the same on the test images."""
    clf = build_learner(_cfg(), progress=False)
    for t in stream.tasks:
        clf.fit_task(t, stream_tasks=2)
    feats, labels = [], []
    for t in stream.tasks:
        z, y = clf.prefix_dataset(t.train)
        feats.append(random_features(clf.backbone_.forward_suffix(z).float(), clf.W_, clf.b_))
        labels.append(y)
    ref = _reference(torch.cat(feats).numpy(), torch.cat(labels).numpy(), 0.1)
    assert list(ref.classes_) == sorted(clf.labels_)
    z_test = torch.cat([clf.prefix_dataset(t.test)[0] for t in stream.tasks])
    phi = random_features(clf.backbone_.forward_suffix(z_test).float(), clf.W_, clf.b_)
    ours = clf.logits_prefix(z_test)
    theirs = torch.from_numpy(ref.decision_function(phi.numpy()))
    order = [list(ref.classes_).index(c) for c in clf.labels_]
    torch.testing.assert_close(ours.double(), theirs[:, order], rtol=1e-4, atol=1e-4)
    predicted = torch.as_tensor(clf.labels_)[ours.argmax(1)]
    assert torch.equal(predicted, torch.from_numpy(ref.predict(phi.numpy())))


def test_a_restored_learner_predicts_and_learns_on_as_the_writer(stream) -> None:
    """``state`` -> ``restore`` after task 1 predicts bit for bit as the writer, and learning task 2 on both
    gives the same heads."""
    first = build_learner(_cfg(), progress=False)
    first.fit_task(stream.tasks[0], stream_tasks=2)
    back = build_learner(_cfg(), progress=False).restore(first.state())
    z = back.prefix_dataset(stream.tasks[0].test)[0]
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))
    for clf in (first, back):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    assert torch.equal(back.logits_prefix(z), first.logits_prefix(z))


def test_a_failed_task_leaves_the_learner_as_before(stream, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception inside task 2 (here: the discriminants' solve) leaves task 1's learner unchanged."""
    clf = build_learner(_cfg(), progress=False)
    clf.fit_task(stream.tasks[0], stream_tasks=2)
    z = clf.prefix_dataset(stream.tasks[0].test)[0]
    before, scatter = clf.logits_prefix(z), clf.scatter_.clone()

    def fail(*args: object) -> None:
        raise RuntimeError("solve failed")

    monkeypatch.setattr("proteus.baselines.klda.discriminants", fail)
    with pytest.raises(RuntimeError, match="solve failed"):
        clf.fit_task(stream.tasks[1], stream_tasks=2)
    monkeypatch.undo()
    assert clf.num_tasks == 1 and torch.equal(clf.scatter_, scatter)
    assert torch.equal(clf.logits_prefix(z), before)
