"""Property tests of the partitioners (pure numpy, no files)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.data.partition import (
    allocate_dirichlet,
    allocate_iid,
    apply_shift,
    cluster_assignment,
    num_train_for,
    sizes_from_ratios,
    split_train_test,
)
from raysim.data.seeding import rng_for
from raysim.metrics.evaluation import minority_cluster

FAST = settings(max_examples=40, deadline=None)


def test_paper_sizes() -> None:
    c = cluster_assignment(21, cluster_sizes=[3, 6, 6, 6])
    assert np.bincount(c).tolist() == [3, 6, 6, 6]
    assert c.tolist() == sorted(c.tolist())  # numbered cluster by cluster, cluster 0 first
    assert minority_cluster(c) == 0
    assert minority_cluster(cluster_assignment(8, cluster_sizes=[4, 2, 2])) == 1  # the first
    assert minority_cluster(cluster_assignment(8, cluster_sizes=[4, 4])) is None


def test_ratios_2_1_1_of_1000() -> None:
    assert sizes_from_ratios(1000, [2, 1, 1]) == [500, 250, 250]
    clusters = cluster_assignment(1000, cluster_ratios=[2, 1, 1])
    assert np.bincount(clusters).tolist() == [500, 250, 250]


def test_no_clusters_means_one() -> None:
    assert cluster_assignment(5).tolist() == [0] * 5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(cluster_sizes=[3, 6]),  # sums to 9, not 10
        dict(cluster_sizes=[10, 0]),
        dict(cluster_ratios=[100, 1]),  # second cluster rounds to nothing
        dict(cluster_sizes=[5, 5], cluster_ratios=[1, 1]),
    ],
)
def test_bad_cluster_requests_name_the_field(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="data.cluster_"):
        cluster_assignment(10, **kwargs)


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_sizes_exactly_as_given(sizes: list[int]) -> None:
    c = cluster_assignment(sum(sizes), cluster_sizes=sizes)
    assert np.bincount(c).tolist() == sizes
    assert np.all(np.diff(c) >= 0)


@FAST
@given(
    st.integers(1, 5000),
    st.lists(st.floats(0.01, 100, allow_nan=False), min_size=1, max_size=8),
)
def test_ratio_sizes_sum_and_stay_within_one(n: int, ratios: list[float]) -> None:
    sizes = sizes_from_ratios(n, ratios)
    assert sum(sizes) == n
    quota = n * np.asarray(ratios) / sum(ratios)
    assert np.all(np.abs(np.asarray(sizes) - quota) < 1)


@FAST
@given(st.integers(1, 40), st.integers(1, 30), st.integers(0, 2**32))
def test_iid_equal_and_disjoint_when_data_suffices(clients: int, n: int, seed: int) -> None:
    pool = clients * n + seed % 17
    alloc = allocate_iid(pool, clients, n, rng_for(seed, "allocate"))
    assert alloc.shape == (clients, n)
    assert len(np.unique(alloc)) == alloc.size  # no sample used twice
    assert alloc.min() >= 0 and alloc.max() < pool


def test_iid_default_divides_the_pool_evenly() -> None:
    alloc = allocate_iid(103, 10, None, rng_for(0, "allocate"))
    assert alloc.shape == (10, 10)
    assert len(np.unique(alloc)) == 100


def test_iid_reuses_across_clients_only_when_data_runs_out() -> None:
    with pytest.warns(UserWarning, match="reused"):
        alloc = allocate_iid(50, 10, 20, rng_for(0, "allocate"))
    assert alloc.shape == (10, 20)
    assert all(len(np.unique(row)) == 20 for row in alloc)  # never twice within a client
    with pytest.raises(ValueError, match="data.samples_per_client"):
        allocate_iid(50, 2, 51, rng_for(0, "allocate"))
    with pytest.raises(ValueError, match="data.num_clients"):
        allocate_iid(5, 10, None, rng_for(0, "allocate"))


@FAST
@given(
    st.integers(2, 20),
    st.integers(1, 20),
    st.floats(0.01, 100),
    st.integers(2, 10),
    st.integers(0, 2**32),
)
def test_dirichlet_equal_disjoint_in_pool(
    clients: int, n: int, alpha: float, classes: int, seed: int
) -> None:
    labels = np.random.default_rng(seed).integers(0, classes, clients * n + 7)
    alloc = allocate_dirichlet(labels, clients, n, alpha, rng_for(seed, "dirichlet"), classes)
    assert alloc.shape == (clients, n)
    assert len(np.unique(alloc)) == alloc.size
    assert alloc.min() >= 0 and alloc.max() < len(labels)


def _mean_tv_from_uniform(alpha: float) -> float:
    labels = np.repeat(np.arange(10), 1000)
    alloc = allocate_dirichlet(labels, 50, 100, alpha, rng_for(0, "dirichlet"), 10)
    hist = np.stack([np.bincount(labels[a], minlength=10) / 100 for a in alloc])
    return float(np.mean(0.5 * np.abs(hist - 0.1).sum(axis=1)))


def test_dirichlet_skew_follows_alpha() -> None:
    skewed, flat = _mean_tv_from_uniform(0.05), _mean_tv_from_uniform(1000.0)
    # alpha=0.05: most clients hold one or two classes; alpha=1000: multinomial noise only
    assert skewed > 0.6
    assert flat < 0.15


def test_dirichlet_refuses_to_reuse() -> None:
    with pytest.raises(ValueError, match="data.samples_per_client"):
        allocate_dirichlet(np.zeros(10, int), 3, 4, 1.0, rng_for(0, "dirichlet"), 2)


@FAST
@given(
    st.lists(st.integers(2, 60), min_size=1, max_size=10),
    st.floats(0.05, 0.95),
    st.integers(0, 2**32),
)
def test_split_sizes_and_order(sizes: list[int], frac: float, seed: int) -> None:
    start = np.concatenate([[0], np.cumsum(sizes)])
    alloc = [np.arange(a, a + s) for a, s in zip(start, sizes, strict=False)]
    rows, offsets, num_train = split_train_test(alloc, frac, rng_for(seed, "split"))
    assert offsets.tolist() == start.tolist()
    for i, a in enumerate(alloc):
        mine = rows[offsets[i] : offsets[i + 1]]
        assert sorted(mine.tolist()) == a.tolist()  # a permutation of the client's own samples
        assert 1 <= num_train[i] <= len(a) - 1
        assert abs(num_train[i] - frac * len(a)) <= 1  # rounding, clamped to keep a test row


def test_split_80_20() -> None:
    assert [num_train_for(n, 0.8) for n in (2, 5, 10, 17, 100)] == [1, 4, 8, 14, 80]
    with pytest.raises(ValueError, match="data.samples_per_client"):
        num_train_for(1, 0.8)


@FAST
@given(st.integers(0, 7), st.integers(0, 2**32))
def test_rotation_is_rot90_k(k: int, seed: int) -> None:
    x0 = np.random.default_rng(seed).random((3, 2, 5, 5)).astype(np.float32)
    x, y = x0.copy(), np.zeros(3, np.int64)
    apply_shift(x, y, np.full(3, k), "rotation", 10)
    np.testing.assert_array_equal(x, np.rot90(x0, k, axes=(2, 3)))
    assert not y.any()


@FAST
@given(st.integers(0, 12), st.integers(2, 10))
def test_label_flip_is_y_plus_k_mod_c(k: int, c: int) -> None:
    y0 = np.arange(3 * c) % c
    x0 = np.ones((len(y0), 1, 2, 2), np.float32)
    x, y = x0.copy(), y0.copy()
    apply_shift(x, y, np.full(len(y), k), "label_flip", c)
    np.testing.assert_array_equal(y, (y0 + k) % c)
    np.testing.assert_array_equal(x, x0)


def test_rotation_needs_square_images() -> None:
    with pytest.raises(ValueError, match="square"):
        apply_shift(np.zeros((2, 1, 3, 4)), np.zeros(2), np.ones(2, int), "rotation", 10)
