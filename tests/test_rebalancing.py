"""Random rebalancing (raysim.server.rebalancing): invariants, uniformity, and the sensitivity
bound of the k cluster sums on adversarial neighbouring cohorts under the coupling of its
docstring."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from raysim.server.rebalancing import (
    EXACT_ID_FACTOR,
    apply_moves,
    deficit_slots,
    rebalance,
    select_moves,
    sensitivity,
)


def test_every_cluster_reaches_B_and_moves_once():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k, B = int(rng.integers(2, 6)), int(rng.integers(1, 6))
        n = int(rng.integers(k * B, k * B + 30))
        p = rng.dirichlet(np.full(k, 0.3))  # very uneven groups, some empty
        ids = rng.choice(k, size=n, p=p)
        out = rebalance(ids, k, B, rng)
        sizes = np.bincount(out.clusters, minlength=k)
        assert sizes.min() >= B
        assert len(set(out.moved.tolist())) == out.moved.size  # each update at most once
        changed = np.flatnonzero(out.clusters != ids)
        assert set(changed.tolist()) == set(out.moved.tolist())
        before = np.bincount(ids, minlength=k)
        assert np.all(before[ids[out.moved]] > B)  # moved only out of large clusters
        assert np.all(before[out.clusters[out.moved]] < B)  # into small ones
        assert out.moved.size == np.maximum(0, B - before).sum()  # no more moves than needed


def test_B_zero_and_small_cohorts():
    ids = np.array([0, 0, 0, 1])
    assert np.array_equal(rebalance(ids, 3, 0, np.random.default_rng(0)).clusters, ids)
    out = rebalance(ids, 3, 2, np.random.default_rng(0))  # cohort < k*B: fill what is possible
    assert np.bincount(out.clusters, minlength=3).tolist() in ([2, 1, 1], [2, 2, 0])
    with pytest.raises(ValueError):
        rebalance(ids, 3, -1, np.random.default_rng(0))


def test_moves_are_uniform_over_large_clusters_chi_square():
    """Clusters of 30 and 12 donate 6 updates to an empty third (B = 6): every donor update is
    equally likely to move (donors never reach B, so the draw is uniform over all 42)."""
    ids = np.array([0] * 30 + [1] * 12)
    rng = np.random.default_rng(1)
    counts = np.zeros(ids.size)
    trials = 4000
    dest = np.zeros(3)
    for _ in range(trials):
        out = rebalance(ids, 3, 6, rng)
        counts[out.moved] += 1
        dest += np.bincount(out.clusters[out.moved], minlength=3)
    assert dest[2] == 6 * trials
    assert chisquare(counts).pvalue > 1e-3
    assert abs(counts[:30].sum() / (6 * trials) - 30 / 42) < 0.02


def _sums(ids: np.ndarray, upd: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros((k, upd.shape[1]))
    np.add.at(out, ids, upd)
    return out


def _outcome(ids, k, B, keys, rng):
    moved = select_moves(ids, k, B, keys)
    slots = deficit_slots(ids, k, B)
    return apply_moves(ids, moved, slots[rng.permutation(slots.size)[: moved.size]]), slots


def _coupled_add(ids, k, B, keys, rng, c, key_x):
    """D and D + x (x last, in cluster c, key key_x) under the docstring's coupling."""
    d, _ = _outcome(ids, k, B, keys, rng)
    ids2, keys2 = np.append(ids, c), np.append(keys, key_x)
    moved2 = select_moves(ids2, k, B, keys2)
    slots2 = deficit_slots(ids2, k, B)
    # couple the bijection: moves shared with D keep their slot's cluster where it still exists
    target = {int(m): int(t) for m, t in zip(d.moved, d.clusters[d.moved], strict=True)}
    free = list(slots2)
    out = np.full(moved2.size, -1)
    for i, m in enumerate(moved2):  # same update, same destination if that slot still exists
        t = target.get(int(m))
        if t is not None and t in free:
            free.remove(t)
            out[i] = t
    for i in np.flatnonzero(out < 0):
        out[i] = free.pop(0)
    return d.clusters, apply_moves(ids2, moved2, out).clusters


@pytest.mark.parametrize("B", [1, 3])
def test_sensitivity_bound_on_adversarial_neighbours(B):
    """Exact ids: adding one client x, the L2 change of all k sums stays within 3*C for updates
    chosen adversarially (x and the others at +-C along one axis, or orthogonal)."""
    rng = np.random.default_rng(2)
    clip, worst = 1.0, 0.0
    for _ in range(1500):
        k = int(rng.integers(2, 5))
        n = int(rng.integers(k * B, k * B + 8))
        ids = rng.choice(k, size=n, p=rng.dirichlet(np.full(k, 0.5)))
        keys = rng.random(n)
        c, key_x = int(rng.integers(k)), float(rng.random())
        dim = 3
        upd = np.zeros((n, dim))
        upd[np.arange(n), rng.integers(dim, size=n)] = rng.choice([-clip, clip], size=n)
        x = np.zeros(dim)
        x[0] = clip * rng.choice([-1, 1])
        a, b = _coupled_add(ids, k, B, keys, rng, c, key_x)
        diff = _sums(b, np.vstack([upd, x]), k) - _sums(a, upd, k)
        worst = max(worst, float(np.linalg.norm(diff)))
    assert worst <= EXACT_ID_FACTOR * clip + 1e-9
    assert worst > clip  # rebalancing does make neighbours differ in more than x's cluster


def test_sensitivity_values():
    assert sensitivity(0.1, 0, replace_one=False) == pytest.approx(0.1)
    assert sensitivity(0.1, 0, replace_one=True) == pytest.approx(0.2)
    # privatized ids: the model release is conditioned on them, 2C under replace-one for any B
    assert sensitivity(0.1, 8, replace_one=True) == pytest.approx(0.2)
    # rebalancing on exact ids: 3C add/remove (coupling), 6C replace-one (remove, then add)
    assert sensitivity(0.1, 8, replace_one=False, exact_ids=True) == pytest.approx(0.3)
    assert sensitivity(0.1, 8, replace_one=True, exact_ids=True) == pytest.approx(0.6)
    assert sensitivity(0.1, 0, replace_one=True, exact_ids=True) == pytest.approx(0.2)
    assert sensitivity(0.1, 8, replace_one=True, rule="paper") == pytest.approx(0.2)
