"""Random rebalancing of RR-Cluster (its paper's Algorithm 1 lines 8-9, Algorithm 2 lines 10-12).

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

1. Privatized identifiers (RR-Cluster as the paper runs it): 2*C under replace-one, C under
   add/remove, whatever B. The identifiers are released (noised, accounted) FIRST, so the model
   release is analysed conditionally on the noisy identifiers y~ (adaptive composition: the
   round's RDP is the ids' plus the worst case over y~ of the model release's). Under replace-one
   in a fixed cohort the replaced slot has the same y~ in both worlds; rebalancing is a function
   of y~ and independent randomness R only, so for the same R the final assignment and all group
   sizes are identical in both worlds, and the k sums differ in exactly one block, by
   Delta - Delta' (norm <= 2C). Averaging over R keeps the bound (Renyi and hockey-stick
   divergences are jointly (quasi-)convex, so a mixture of pairs at distance <= 2C is no worse
   than one such pair). So the paper's 2*C_theta is right for this pipeline, although its
   appendix B.2 argument (add/remove, max over clusters, "disjoint" parallel composition) is not.
   The same holds when the identifiers are public inputs of the model release
   (``identifiers: unaccounted``): the guarantee is then conditional on them.
2. Exact identifiers drive the rebalancing (``identifiers: histogram``): one client's id moves
   updates. With the move keys shared between neighbouring cohorts and the bijection coupled (a
   removed slot's partner takes the slot freed by the dropped move: each target bijection has
   exactly D preimages, so the coupled one is uniform), adding x to a donor cluster a changes
   the membership of at most x, one newly moved update z of a and one dropped move u (from
   another cluster b): a changes by x - z, u's old target by z - u, b by u, so the L2 change of
   the concatenated sums is at most sqrt(4 + 4 + 1) * C = 3C (when a is a small cluster, less).
   ``scripts/rebalancing_sensitivity.py`` measures it by brute force over small adjacent cohorts
   (all key orders, all bijections, the best coupling per key order, adversarial updates): 3C
   add/remove, and replace-one (remove then add, the triangle bound 6C) as reported there.
   Without rebalancing (B = 0) only x's own cluster changes: C (add/remove), 2C (replace-one).

``sensitivity(..., rule="paper")`` returns the paper's 2C whatever the identifiers, for
reproduction (not sound with exact identifiers and B > 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

SensitivityRule = Literal["sound", "paper"]
EXACT_ID_FACTOR = 3.0  # add/remove-one bound of the k sums with exact ids and B > 0, units of C


@dataclass(frozen=True)
class Rebalanced:
    """The outcome of one rebalancing: final clusters, and which updates moved (and where)."""

    clusters: np.ndarray  # final cluster of each update
    moved: np.ndarray  # indices of the moved updates, in the order they were drawn


@dataclass(frozen=True)
class Grouping:
    """One round's grouping of the cohort, for the engine's diagnostics (``raysim.metrics``):
    the ids the server grouped by (noisy, or exact under ``histogram``) and the final groups."""

    clients: np.ndarray  # cohort members, in report order
    before: np.ndarray  # the ids the rebalancing started from
    after: np.ndarray  # final group of each member


def expected_sizes(counts: np.ndarray, min_size: int) -> np.ndarray:
    """Group sizes after rebalancing as predicted from (noisy) counts, >= 1: small groups are
    filled towards B, donors give up moves in proportion to their spare updates. Post-processing
    of released counts: the denominators of ``identifiers: histogram``, which must not be the
    exact sizes."""
    c = np.maximum(np.asarray(counts, dtype=np.float64), 0.0)
    need, spare = np.maximum(0.0, min_size - c), np.maximum(0.0, c - min_size)
    moves = min(need.sum(), spare.sum())
    out = c.copy()
    if moves > 0:
        out += need * moves / need.sum() - spare * moves / spare.sum()
    return np.maximum(out, 1.0)


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
    clip: float,
    min_size: int,
    replace_one: bool,
    rule: SensitivityRule = "sound",
    exact_ids: bool = False,
) -> float:
    """L2 sensitivity of the k cluster sums (see the module docstring): ``exact_ids`` when the
    rebalancing runs on the clients' exact identifiers rather than on released noisy ones."""
    if rule == "paper":
        return 2.0 * clip
    if not replace_one and not exact_ids and min_size > 0:
        # a client's presence changes the group sizes, and so which updates rebalancing moves
        raise ValueError(
            "rebalancing sensitivity under add/remove (training.sampling: poisson) with private "
            "identifiers is not bounded by C; use training.sampling: without_replacement or "
            "algorithm.identifiers: histogram"
        )
    base = EXACT_ID_FACTOR * clip if (exact_ids and min_size > 0) else clip
    return 2.0 * base if replace_one else base
