"""The mechanisms have the distributions they claim (fixed seeds, statistical tests at 1%)."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from raysim.privacy import (
    PrivacyConfigError,
    clip_l2,
    d_privacy_epsilon,
    exponential_select,
    gaussian_mechanism,
    laplace_euclidean,
    onehot_noise_multiplier,
    private_sketch,
    privatize_onehot,
)
from raysim.privacy import mechanisms as mech


def test_clip_l2_vector_and_rows():
    x = np.array([3.0, 4.0])
    np.testing.assert_allclose(clip_l2(x, 1.0), [0.6, 0.8])
    np.testing.assert_allclose(clip_l2(x, 10.0), x)
    rows = np.array([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]])
    out = clip_l2(rows, 1.0)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]])
    assert np.all(np.linalg.norm(out, axis=1) <= 1.0 + 1e-12)
    assert clip_l2(np.zeros(3), 1.0).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(PrivacyConfigError):
        clip_l2(x, 0.0)


def test_gaussian_mechanism_mean_and_variance():
    rng = np.random.default_rng(0)
    n, sens, z = 200_000, 2.0, 1.5
    out = gaussian_mechanism(np.full(n, 5.0), sens, z, rng)
    sd = sens * z
    assert abs(out.mean() - 5.0) < 4 * sd / math.sqrt(n)
    # the sample variance of n normals has relative sd sqrt(2/n)
    assert abs(out.var() / sd**2 - 1) < 4 * math.sqrt(2 / n)
    assert gaussian_mechanism(np.zeros(3, np.float32), 1.0, 1.0, rng).dtype == np.float32
    np.testing.assert_array_equal(gaussian_mechanism(np.ones(4), 1.0, 0.0, rng), np.ones(4))


def test_laplace_euclidean_norm_is_gamma_and_direction_uniform():
    rng = np.random.default_rng(1)
    dim, eps, n = 5, 2.0, 20_000
    x = laplace_euclidean(dim, eps, rng, size=n)
    assert x.shape == (n, dim)
    norms = np.linalg.norm(x, axis=1)
    assert stats.kstest(norms, stats.gamma(a=dim, scale=1 / eps).cdf).pvalue > 0.01
    # For a uniform direction u on S^{n-1}, (1 + <u, e>) / 2 ~ Beta((n-1)/2, (n-1)/2).
    e = np.ones(dim) / math.sqrt(dim)
    proj = (1 + (x @ e) / norms) / 2
    half = (dim - 1) / 2
    assert stats.kstest(proj, stats.beta(half, half).cdf).pvalue > 0.01
    # Galli et al. Prop. 3.1(3): each coordinate has variance (n + 1) / eps^2, mean 0.
    np.testing.assert_allclose(x.var(axis=0), (dim + 1) / eps**2, rtol=0.05)
    assert np.all(np.abs(x.mean(axis=0)) < 4 * math.sqrt((dim + 1) / eps**2 / n))
    assert laplace_euclidean(dim, eps, rng).shape == (dim,)
    assert not laplace_euclidean(dim, math.inf, rng).any()


def test_d_privacy_epsilon_follows_the_paper():
    n, nu, radius = 1000, 2.0, 0.5
    eps = d_privacy_epsilon(n, nu, radius)
    assert eps == pytest.approx(n / (nu * radius))
    assert eps * radius == pytest.approx(n / nu)  # the per-round leakage
    # expected noise norm n / eps = nu * ||delta||
    assert n / eps == pytest.approx(nu * radius)
    assert d_privacy_epsilon(n, nu, 0.0) == math.inf


def test_exponential_select_frequencies_match_exp_weights():
    rng = np.random.default_rng(2)
    u = np.array([0.0, 1.0, 2.0, 0.5])
    eps, sens, n = 1.0, 1.0, 20_000
    picks = exponential_select(np.tile(u, (n, 1)), eps, sens, rng)
    assert picks.shape == (n,)
    weights = np.exp(eps * u / (2 * sens))
    expected = n * weights / weights.sum()
    observed = np.bincount(picks, minlength=len(u))
    assert stats.chisquare(observed, expected).pvalue > 0.01
    one = exponential_select(u, eps, sens, rng)
    assert isinstance(one, int) and 0 <= one < len(u)


def _p_correct(num_clusters: int, signal: float, sd: float) -> float:
    """P(true coordinate has the largest noisy score): int phi(t) Phi(t + a/sd)^(k-1) dt."""
    f = lambda t: stats.norm.pdf(t) * stats.norm.cdf(t + signal / sd) ** (num_clusters - 1)  # noqa: E731
    return integrate.quad(f, -np.inf, np.inf)[0]


@pytest.mark.parametrize("num_clusters,clip,z", [(2, 0.5, 1.0), (2, 2.0, 0.4), (4, 1.0, 0.8)])
def test_privatize_onehot_accuracy_matches_closed_form(num_clusters, clip, z):
    rng = np.random.default_rng(3)
    n = 40_000
    ids = rng.integers(0, num_clusters, size=n)
    out = privatize_onehot(ids, num_clusters, clip, z, rng)
    assert out.shape == (n,) and out.min() >= 0 and out.max() < num_clusters
    signal, sd = min(1.0, clip), clip * z
    p = _p_correct(num_clusters, signal, sd)
    if num_clusters == 2:  # true minus other score ~ N(a, 2 sd^2)
        assert p == pytest.approx(stats.norm.cdf(signal / (math.sqrt(2) * sd)), rel=1e-8)
    observed = np.mean(out == ids)
    assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert onehot_noise_multiplier(clip, z) == pytest.approx(sd / signal)


def test_private_sketch_projection_is_seeded_and_clipped():
    rng = np.random.default_rng(4)
    update = rng.standard_normal(1000)
    a = private_sketch(update, 64, projection_seed=7, clip=100.0, noise_multiplier=0.0, rng=rng)
    b = private_sketch(update, 64, projection_seed=7, clip=100.0, noise_multiplier=0.0, rng=rng)
    c = private_sketch(update, 64, projection_seed=8, clip=100.0, noise_multiplier=0.0, rng=rng)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # JL scaling: ||P u|| is close to ||u|| for k = 64 (relative sd about 1/sqrt(2k))
    assert abs(np.linalg.norm(a) / np.linalg.norm(update) - 1) < 0.4
    clipped = private_sketch(update, 64, 7, clip=1.0, noise_multiplier=0.0, rng=rng)
    np.testing.assert_allclose(clipped, a / np.linalg.norm(a))
    rows = private_sketch(np.stack([update, 2 * update]), 64, 7, 100.0, 0.0, rng)
    np.testing.assert_allclose(rows[0], a)
    noisy = private_sketch(np.tile(update, (2000, 1)), 64, 7, 1.0, 2.0, rng)
    assert abs((noisy - clipped).std() / 2.0 - 1) < 0.02


def test_private_sketch_chunks_do_not_change_the_projection(monkeypatch):
    rng = np.random.default_rng(5)
    update = rng.standard_normal(300)
    whole = private_sketch(update, 8, 3, 1e6, 0.0, rng)
    monkeypatch.setattr(mech, "_SKETCH_CHUNK", 64)
    assert np.allclose(private_sketch(update, 8, 3, 1e6, 0.0, rng), whole)
