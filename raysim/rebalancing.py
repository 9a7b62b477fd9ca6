"""Random rebalancing of RR-Cluster (paper 001, Algorithm 1 lines 8-9, Algorithm 2 lines 10-12).

After the server has assigned the round's updates to clusters (from privatized identifiers),
updates are moved uniformly at random out of clusters larger than B into the smaller ones until
every cluster holds at least B; a moved update is never moved again. Pure numpy, so the
invariants and the sensitivity argument below can be tested without the engine.

How the randomness is drawn (and why): every update of the round gets an i.i.d. key in [0, 1);
the donors are visited in increasing key order and an update moves if its cluster still holds
more than B. The remaining eligible keys are always exchangeable, so each move takes an update
uniformly at random among those still movable (the paper's "sample uniformly"). The D moved
updates are then paired with the D missing slots of the small clusters by a uniformly random
bijection. When the cohort is smaller than k*B the small clusters are filled as far as the
donors' spare updates allow (every donor stops at B).

Sensitivity (the noise scale of the k cluster sums, released together), module decision:
the paper (appendix B.2) bounds each cluster sum by 2*C separately and then invokes parallel
composition over "disjoint" clusters. Across all k sums that is not a valid bound: adding a
client can also change which update is moved, so up to three cluster sums change at once. With
the keys above shared between neighbouring cohorts and the bijection coupled (a removed slot's
partner takes the slot freed by the dropped move: each target bijection has exactly D preimages,
so the coupled one is uniform), adding or removing one client x changes the membership of at
most x, one swapped-in update z and one dropped move u. Worst case (z and u from x's cluster):
x's cluster changes by x + u - z (<= 3C) and z's destination by z - u (<= 2C), so the L2 change
of the concatenated sums is at most sqrt(13)*C. Every coupled pair of outcomes is then a pair
of Gaussians at most that far apart, and hockey-stick and Renyi divergences are jointly convex
/ quasi-convex, so the mixture over the rebalancing randomness is dominated by that Gaussian
pair. Replace-one (fixed-size cohorts, Theorem 1) is a removal followed by an addition:
2*sqrt(13)*C. Without rebalancing (B = 0) only x's own cluster changes: C (add/remove), 2C
(replace-one). ``sensitivity(..., rule="paper")`` returns the paper's 2C for reproduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

SensitivityRule = Literal["sound", "paper"]
REBALANCE_FACTOR = math.sqrt(13.0)  # add/remove-one bound of the k sums, in units of C


@dataclass(frozen=True)
class Rebalanced:
    """The outcome of one rebalancing: final clusters, and which updates moved (and where)."""

    clusters: np.ndarray  # final cluster of each update
    moved: np.ndarray  # indices of the moved updates, in the order they were drawn


def deficits(sizes: np.ndarray, min_size: int) -> np.ndarray:
    return np.maximum(0, min_size - np.asarray(sizes, dtype=np.int64))


def select_moves(
    clusters: np.ndarray, num_clusters: int, min_size: int, keys: np.ndarray
) -> np.ndarray:
    """The updates to move: donors visited in key order, each taken while its cluster > B."""
    clusters = np.asarray(clusters, dtype=np.int64)
    sizes = np.bincount(clusters, minlength=num_clusters)
    need = int(deficits(sizes, min_size).sum())
    if need == 0:
        return np.zeros(0, dtype=np.int64)
    spare = np.maximum(0, sizes - min_size)
    moved: list[int] = []
    for i in np.argsort(keys, kind="stable"):
        c = clusters[i]
        if spare[c] > 0:
            spare[c] -= 1
            moved.append(int(i))
            if len(moved) == need:
                break
    return np.asarray(moved, dtype=np.int64)


def deficit_slots(clusters: np.ndarray, num_clusters: int, min_size: int) -> np.ndarray:
    """One entry per missing update: the small cluster it belongs to (cluster order)."""
    sizes = np.bincount(np.asarray(clusters, dtype=np.int64), minlength=num_clusters)
    return np.repeat(np.arange(num_clusters), deficits(sizes, min_size))


def rebalance(
    clusters: np.ndarray, num_clusters: int, min_size: int, rng: np.random.Generator
) -> Rebalanced:
    """Move updates uniformly at random from clusters > B into clusters < B (B = min_size)."""
    clusters = np.asarray(clusters, dtype=np.int64)
    if min_size < 0:
        raise ValueError(f"B must be >= 0, got {min_size}")
    if min_size == 0 or clusters.size == 0:
        return Rebalanced(clusters.copy(), np.zeros(0, dtype=np.int64))
    keys = rng.random(clusters.size)
    moved = select_moves(clusters, num_clusters, min_size, keys)
    slots = deficit_slots(clusters, num_clusters, min_size)
    order = rng.permutation(slots.size)[: moved.size]  # uniform injection of moves into slots
    return apply_moves(clusters, moved, slots[order])


def apply_moves(clusters: np.ndarray, moved: np.ndarray, targets: np.ndarray) -> Rebalanced:
    out = np.asarray(clusters, dtype=np.int64).copy()
    out[moved] = targets
    return Rebalanced(out, np.asarray(moved, dtype=np.int64))


def sensitivity(
    clip: float, min_size: int, replace_one: bool, rule: SensitivityRule = "sound"
) -> float:
    """L2 sensitivity of the k cluster sums (see the module docstring)."""
    if rule == "paper":
        return 2.0 * clip
    base = REBALANCE_FACTOR * clip if min_size > 0 else clip
    return 2.0 * base if replace_one else base
