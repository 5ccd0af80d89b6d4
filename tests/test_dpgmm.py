"""The torch DP-GMM (Eq. 18's learner) against scikit-learn's BayesianGaussianMixture (DP prior, full)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import BayesianGaussianMixture

from proteus.signatures import DPGMM, SignatureFitError
from proteus.signatures.dpgmm import kmeans


def _clusters(d: int, n: int, k: int, seed: int = 0, sep: float = 6.0) -> tuple[np.ndarray, np.ndarray]:
    """k well-separated anisotropic Gaussian clusters in d dims; returns (X, labels)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d)) * sep
    labels = rng.integers(0, k, n)
    mix = rng.normal(size=(k, d, d)) / np.sqrt(d)
    X = centres[labels] + np.einsum("nd,nde->ne", rng.normal(size=(n, d)), mix[labels])
    return X, labels


def _sklearn(X: np.ndarray, T: int, seed: int = 0, **kw: object) -> BayesianGaussianMixture:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return BayesianGaussianMixture(n_components=T, random_state=seed, **kw).fit(X)


def _sklearn_init_resp(X: np.ndarray, T: int, seed: int = 0) -> np.ndarray:
    """scikit-learn's exact initial responsibilities (one k-means run with the same random state)."""
    labels = KMeans(n_clusters=T, n_init=1, random_state=np.random.RandomState(seed)).fit(X).labels_
    resp = np.zeros((X.shape[0], T))
    resp[np.arange(X.shape[0]), labels] = 1.0
    return resp


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize(
    ("d", "n", "k", "T"),
    [
        (8, 400, 3, 6),  # wide supports: dense Cholesky path, soft responsibilities, many iterations
        (64, 300, 3, 10),  # supports narrower than d: Woodbury path
        (64, 600, 4, 5),  # mixed
    ],
)
def test_matches_sklearn_given_same_init(d: int, n: int, k: int, T: int) -> None:
    X, _ = _clusters(d, n + 200, k)
    Xtr, Xte = X[:n], X[n:]
    ref = _sklearn(Xtr, T)
    ours = DPGMM(n_components=T)._fit(Xtr, _sklearn_init_resp(Xtr, T))
    assert ours.n_iter_ == ref.n_iter_
    assert ours.converged_ == ref.converged_
    assert ours.lower_bound_ == pytest.approx(ref.lower_bound_, rel=1e-9, abs=1e-6)
    np.testing.assert_allclose(ours.weights_.numpy(), ref.weights_, atol=1e-9)
    assert _rel(ours.means_.numpy(), ref.means_) < 1e-9
    assert _rel(ours.covariances_.numpy(), ref.covariances_) < 1e-8
    assert _rel(ours.precisions_cholesky_.numpy(), ref.precisions_cholesky_) < 1e-8
    np.testing.assert_allclose(ours.score_samples(Xte).numpy(), ref.score_samples(Xte), rtol=1e-9, atol=1e-8)
    assert (ours.predict(Xte).numpy() == ref.predict(Xte)).mean() > 0.99


def test_own_kmeans_init_reproduces_sklearn_fit() -> None:
    """Same random_state -> the same k-means++ draws as scikit-learn, hence the same model."""
    X, _ = _clusters(32, 700, 4, seed=1)
    Xtr, Xte = X[:500], X[500:]
    for seed in (0, 3):
        ref = _sklearn(Xtr, 8, seed)
        ours = DPGMM(n_components=8, random_state=seed).fit(torch.from_numpy(Xtr))
        a, b = ours.score(Xte), ref.score(Xte)
        assert abs(a - b) <= 0.01 * abs(b)  # the benchmark's criterion; in practice equal to ~1e-12
        assert a == pytest.approx(b, rel=1e-8)


def test_kmeans_matches_sklearn_labels() -> None:
    X, _ = _clusters(16, 300, 5, seed=2, sep=3.0)
    Xc = X - X.mean(0)
    ref = KMeans(n_clusters=7, n_init=1, random_state=4).fit(X)
    labels, centres, n_iter = kmeans(torch.from_numpy(Xc), 7, 4)
    assert np.array_equal(labels.numpy(), ref.labels_)
    np.testing.assert_allclose(centres.numpy() + X.mean(0), ref.cluster_centers_, rtol=1e-9, atol=1e-9)
    assert n_iter >= 1


def test_fewer_samples_than_components_reduces_truncation() -> None:
    X, _ = _clusters(3, 6, 2, seed=3)
    gm = DPGMM(n_components=20).fit(X)
    assert gm.n_components_ == 6
    assert gm.weights_.shape == (6,)
    assert float(gm.weights_.sum()) == pytest.approx(1.0)
    assert torch.isfinite(gm.score_samples(X)).all()
    assert gm.covariances_.shape == (6, 3, 3)


def test_failures_raise_signature_fit_error() -> None:
    X, _ = _clusters(4, 50, 2)
    bad = X.copy()
    bad[[1, 7, 9], 0] = np.nan
    with pytest.raises(SignatureFitError, match="3 NaN rows"):
        DPGMM(3).fit(bad)
    bad = X.copy()
    bad[2, 1] = np.inf
    with pytest.raises(SignatureFitError, match="inf"):
        DPGMM(3).fit(bad)
    with pytest.raises(SignatureFitError, match="at least 2"):
        DPGMM(3).fit(X[:1])
    with pytest.raises(SignatureFitError, match="singular covariance prior"):
        DPGMM(3).fit(np.ones((30, 4)))
    with pytest.raises(SignatureFitError, match="singular covariance prior"):
        DPGMM(3).fit(np.random.default_rng(0).normal(size=(10, 20)))  # N <= d
    with pytest.raises(SignatureFitError, match="\\(N, d\\)"):
        DPGMM(3).fit(np.zeros(5))


def test_float32_and_explicit_priors() -> None:
    X, _ = _clusters(6, 300, 3)
    prior = np.cov(X.T) + 0.1 * np.eye(6)
    gm = DPGMM(
        5,
        covariance_prior=prior,
        mean_precision_prior=0.5,
        weight_concentration_prior=0.1,
        degrees_of_freedom_prior=8.0,
        dtype=torch.float32,
        device="cpu",
    ).fit(torch.from_numpy(X))
    ref = _sklearn(
        X,
        5,
        covariance_prior=prior,
        mean_precision_prior=0.5,
        weight_concentration_prior=0.1,
        degrees_of_freedom_prior=8.0,
    )
    assert gm.means_.dtype == torch.float32
    assert torch.isfinite(gm.score_samples(X)).all()
    assert gm.score(X) == pytest.approx(ref.score(X), rel=1e-3)


def test_predict_proba_rows_sum_to_one() -> None:
    X, labels = _clusters(5, 300, 3, sep=10.0)
    gm = DPGMM(6).fit(X)
    P = gm.predict_proba(X)
    torch.testing.assert_close(P.sum(1), torch.ones(300, dtype=P.dtype))
    pred = gm.fit_predict(X).numpy()
    # the DP-GMM may split clusters, but never merges two of the true ones
    for c in np.unique(pred):
        assert len(np.unique(labels[pred == c])) == 1


@pytest.mark.parametrize(
    ("marginal_max", "stage"), [(1.0, "bfloat16"), (1.0, "marginal"), (0.0, "float32"), (-1.0, "plain")]
)
def test_screened_e_step_matches_sklearn(
    monkeypatch: pytest.MonkeyPatch, marginal_max: float, stage: str
) -> None:
    """The screening stages of the E-step (used for large problems) give scikit-learn's fit."""
    import proteus.signatures.dpgmm as mod

    if stage == "bfloat16" and not mod.bf16_is_fast(torch.device("cpu")):
        pytest.skip("bfloat16 products are not native on this CPU")
    monkeypatch.setattr(mod, "_SCREEN_MIN_WORK", 0)
    monkeypatch.setattr(mod, "_MARGINAL_DIM", 8)
    monkeypatch.setattr(mod, "_MARGINAL_MAX_FRACTION", marginal_max)
    if stage == "plain":
        monkeypatch.setattr(mod, "_SCREEN_MAX_FRACTION", -1.0)
    X, _ = _clusters(64, 500, 4, seed=5)
    Xtr, Xte = X[:300], X[300:]
    ref = _sklearn(Xtr, 10)
    ours = DPGMM(n_components=10)
    ours.screen_bf16 = stage == "bfloat16"
    ours._fit(Xtr, _sklearn_init_resp(Xtr, 10))
    if stage == "bfloat16":
        assert 0.0 < ours._bf16_hits <= mod._BF16_MAX_FRACTION
        assert ours._marg_hits == 0.0 and ours._screen_hits == 0.0
    elif stage == "marginal":
        assert 0.0 < ours._marg_hits <= 1.0 and ours._screen_hits == 0.0
    elif stage == "float32":
        assert 0.0 < ours._screen_hits <= mod._SCREEN_MAX_FRACTION
    assert ours.n_iter_ == ref.n_iter_
    assert ours.lower_bound_ == pytest.approx(ref.lower_bound_, rel=1e-9)
    assert _rel(ours.covariances_.numpy(), ref.covariances_) < 1e-8
    np.testing.assert_allclose(ours.score_samples(Xte).numpy(), ref.score_samples(Xte), rtol=1e-9)
    assert np.array_equal(ours.predict(Xte).numpy(), ref.predict(Xte))


def test_bf16_screening_error_within_its_assumed_bound() -> None:
    """The bfloat16 pass's error stays well inside the bound the screening assumes (``_BF16_REL_ERR`` of
    the magnitude), also for far-apart, tight clusters (large inputs, small Mahalanobis terms)."""
    from proteus.signatures.dpgmm import _BF16_REL_ERR
    from proteus.signatures.woodbury import augment_bf16, maha_bf16, maha_over_dof

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    for d, n, k, sep in [(64, 600, 4, 6.0), (64, 600, 4, 300.0), (96, 900, 5, 2.0)]:
        X, _ = _clusters(d, n, k, seed=1, sep=sep)
        gm = DPGMM(n_components=10, max_iter=1)
        gm.screen = False
        gm.fit(X)
        Xr, f = gm._rotate(X), gm._factors
        exact, _ = maha_over_dof(f, gm._means_r, Xr, None, False, 1 << 24)
        approx, mag = maha_bf16(f, gm._means_r, Xr, augment_bf16(Xr), None, 1 << 20)
        assert float(((approx - exact).abs() / mag).max()) < _BF16_REL_ERR / 4
