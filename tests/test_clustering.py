"""raysim.server.clustering: GMM confidence (MSS / MPO) on mixtures of known separation, the E_c
rule, the choice of M, soft-assignment sampling and k-means relabelling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import adjusted_rand_score

from raysim.server.clustering import (
    cluster_sizes,
    fit_gmm,
    kmeans,
    match_labels,
    max_pairwise_overlap,
    prepare_features,
    sample_assignments,
    select_num_clusters,
    separation_scores,
    switch_round,
)


def mixture(sizes, dim, separation, sigma, seed=0):
    """Spherical clusters with orthogonal centres at pairwise distance `separation`, so the
    true separation score is separation / (2 sigma) for every pair."""
    rng = np.random.default_rng(seed)
    centres = np.eye(len(sizes), dim) * separation / math.sqrt(2)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[labels] + rng.normal(0, sigma, (len(labels), dim))
    return x, labels


def test_separation_scores_closed_form():
    means = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 10.0]])
    stds = np.array([1.0, 1.5, 0.5])
    ss = separation_scores(means, stds)
    assert ss[0, 1] == pytest.approx(5 / 2.5)
    assert ss[0, 2] == pytest.approx(10 / 1.5)
    assert ss[1, 2] == pytest.approx(math.hypot(3, 6) / 2.0)
    assert np.allclose(ss, ss.T) and np.all(np.isinf(np.diag(ss)))


def test_mpo_is_twice_the_normal_tail():
    assert max_pairwise_overlap(0.0) == pytest.approx(1.0)
    assert max_pairwise_overlap(3.0) == pytest.approx(2 * norm.sf(3.0))
    assert max_pairwise_overlap(math.inf) == 0.0


@pytest.mark.parametrize("true_ss", [1.5, 4.0])
def test_gmm_recovers_known_separation(true_ss):
    sigma = 0.5
    x, labels = mixture([300, 300, 300], dim=10, separation=2 * sigma * true_ss, sigma=sigma)
    fit = fit_gmm(x, 3, seed=1)
    assert fit.mss == pytest.approx(true_ss, rel=0.1)
    assert fit.mpo == pytest.approx(2 * norm.sf(fit.mss))
    assert np.allclose(fit.stds, sigma, rtol=0.1)
    if true_ss >= 4:  # overlap 2Q(4) ~ 6e-5 per pair: at most a point or two astray
        assert adjusted_rand_score(labels, fit.labels) > 0.99
    assert np.allclose(fit.posteriors.sum(1), 1.0)


def test_mss_grows_as_noise_shrinks():
    mss = []
    for sigma in (2.0, 1.0, 0.5, 0.25):
        x, _ = mixture([100, 100], dim=5, separation=4.0, sigma=sigma, seed=3)
        mss.append(fit_gmm(x, 2, seed=0).mss)
    assert all(a < b for a, b in zip(mss, mss[1:], strict=False))


def test_scaling_does_not_change_the_fit():
    """DP updates are ~1e-5 in size: the fit must not depend on that (reg_covar)."""
    x, labels = mixture([3, 6, 6, 6], dim=500, separation=60.0, sigma=1.0, seed=4)
    a = fit_gmm(prepare_features(x), 4, seed=0)
    b = fit_gmm(prepare_features(x * 1e-6), 4, seed=0)
    assert a.mss == pytest.approx(b.mss, rel=1e-6)
    assert adjusted_rand_score(labels, b.labels) == 1.0
    # unscaled, sklearn's reg_covar swamps the tiny variance: the confidence is meaningless
    assert fit_gmm(x * 1e-6, 4, seed=0, covariance="spherical").mss < 0.5 * b.mss


def test_pca_projection_keeps_the_clusters():
    x, labels = mixture([3, 6, 6, 6], dim=2000, separation=80.0, sigma=1.0, seed=5)
    assert prepare_features(x, "pca", seed=0).shape == (21, 20)  # default: n - 1 directions
    f = prepare_features(x, "pca", components=3, seed=0)
    assert f.shape == (21, 3)
    assert adjusted_rand_score(labels, fit_gmm(f, 4, seed=0).labels) == 1.0
    with pytest.raises(ValueError, match="projection"):
        prepare_features(x, "umap")


def test_argmax_mss_finds_the_true_number_of_clusters():
    """Round-1-like data: 21 clients {3, 6, 6, 6} in high dimension, well separated."""
    for seed in range(3):
        x, labels = mixture([3, 6, 6, 6], dim=3000, separation=400.0, sigma=1.0, seed=seed)
        m, fits = select_num_clusters(prepare_features(x), range(2, 9), seed=seed)
        assert m == 4, {k: round(f.mss, 1) for k, f in fits.items()}
        assert adjusted_rand_score(labels, fits[4].labels) == 1.0
        assert set(fits) == set(range(2, 9))


def test_argmax_mss_needs_the_signal_directions_when_clusters_come_in_pairs():
    """Why R-DPCFL chooses M on PCA directions (algorithms/rdpcfl.py): four clusters in two
    pairs, as FMNIST's rotations are. In p = 2e4 dimensions merging a pair widens a component
    by only near^2 / p per coordinate, so the 2-fit looks most confident; on the signal
    directions the merged component is visibly wide and argmax MSS finds the four."""
    rng = np.random.default_rng(0)
    centres = np.zeros((4, 20_000))
    centres[:, 0] = [60.0, 60.0, -60.0, -60.0]  # the pairs are far apart
    centres[:, 1] = [30.0, -30.0, 30.0, -30.0]  # the clusters of a pair are nearer
    labels = np.repeat(np.arange(4), [3, 6, 6, 6])
    x = centres[labels] + rng.normal(0.0, 1.0, (21, 20_000))
    full, _ = select_num_clusters(prepare_features(x), range(2, 9), seed=0)
    m, fits = select_num_clusters(prepare_features(x, "pca", "auto", seed=0), range(2, 9), seed=0)
    assert (full, m) == (2, 4)
    assert adjusted_rand_score(labels, fits[4].labels) == 1.0


def test_candidates_are_clipped_to_the_data():
    x, _ = mixture([3, 3], dim=5, separation=20.0, sigma=1.0)
    _, fits = select_num_clusters(x, [1, 2, 3, 50], seed=0)
    assert set(fits) == {2, 3}
    with pytest.raises(ValueError, match="candidate"):
        select_num_clusters(x, [1, 50])


@pytest.mark.parametrize(
    ("mpo", "rounds", "expected"),
    [(0.0, 200, 100), (1.0, 200, 0), (0.5, 200, 50), (0.25, 30, 11), (0.0, 7, 3)],
)
def test_switch_round_rule(mpo, rounds, expected):
    assert switch_round(mpo, rounds) == expected


def test_switch_round_rejects_bad_mpo():
    with pytest.raises(ValueError):
        switch_round(1.5, 10)


def test_soft_assignments_follow_the_posteriors():
    rng = np.random.default_rng(0)
    pi = np.array([[0.7, 0.2, 0.1], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    draws = np.stack([sample_assignments(pi, rng) for _ in range(20000)])
    freq = np.stack([np.bincount(draws[:, i], minlength=3) / len(draws) for i in range(3)])
    assert np.allclose(freq, pi, atol=0.015)
    assert np.all(draws[:, 1] == 2)  # a certain client never moves
    with pytest.raises(ValueError):
        sample_assignments(np.array([0.5, 0.5]), rng)


def test_soft_assignments_are_seeded():
    pi = np.full((50, 4), 0.25)
    a = sample_assignments(pi, np.random.default_rng(7))
    b = sample_assignments(pi, np.random.default_rng(7))
    assert np.array_equal(a, b)


def test_kmeans_and_label_matching():
    x, labels = mixture([5, 5, 5], dim=20, separation=30.0, sigma=1.0, seed=2)
    found = kmeans(x, 3, seed=0)
    assert adjusted_rand_score(labels, found) == 1.0
    matched = match_labels(labels, found, 3)
    assert np.array_equal(matched, labels)  # same partition, same ids as the reference
    assert cluster_sizes(matched, 4) == [5, 5, 5, 0]


def test_split_cluster_scores_low_only_with_bias_correction():
    """Two halves of one cluster in p dims sit ~sqrt(p) sigma apart: the plug-in score calls
    that confident, the bias-corrected one does not; true clusters keep their score."""
    x, _ = mixture([6, 6], dim=5000, separation=300.0, sigma=1.0, seed=6)
    f = prepare_features(x)
    plug, fair = fit_gmm(f, 3, seed=0, bias_correction=False), fit_gmm(f, 3, seed=0)
    assert plug.mss > 20 and fair.mss < 0.3 * plug.mss
    assert fit_gmm(f, 2, seed=0).mss == pytest.approx(150.0, rel=0.1)
    assert fit_gmm(f, 2, seed=0).mss > fair.mss


@pytest.mark.parametrize("covariance", ["shared", "spherical"])
def test_singleton_components_have_no_confidence(covariance):
    x, _ = mixture([4, 4], dim=50, separation=40.0, sigma=1.0, seed=8)
    f = prepare_features(x)
    over = fit_gmm(f, 7, seed=0, covariance=covariance)
    assert over.mss < 0.2 * fit_gmm(f, 2, seed=0, covariance=covariance).mss
    if covariance == "spherical":  # a one-client component has no spread to estimate
        assert np.isinf(over.stds).any() and over.mss == 0.0


def test_shared_fit_finds_what_free_variances_miss():
    """High dimension, few clients per cluster (the round-1 regime): sklearn's free
    spherical variances chase near-empty components; the shared variance of the paper's
    model (eq. 4) recovers the clusters."""
    x, labels = mixture([3, 6, 6, 6], dim=20000, separation=400.0, sigma=1.0, seed=11)
    f = prepare_features(x)
    shared = [adjusted_rand_score(labels, fit_gmm(f, 4, seed=s).labels) for s in range(4)]
    assert min(shared) == 1.0
    with pytest.raises(ValueError, match="covariance"):
        fit_gmm(f, 4, covariance="full")
