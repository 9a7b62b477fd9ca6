"""Brute-force sensitivity of RR-Cluster's k cluster sums when rebalancing runs on EXACT ids.

    python scripts/rebalancing_sensitivity.py [--samples N] [--seed S]

For small adjacent cohorts (add/remove one client, and replace one client in a fixed cohort)
this enumerates, per key order of ``raysim.server.rebalancing`` (keys shared between the two
worlds), every bijection of moved updates into deficit slots in both worlds (each world uniform over
them), and finds the BEST coupling of the two uniform distributions: the smallest D such that a
transport plan exists whose every coupled pair of outcomes has its k sums within D (a max-flow
feasibility test, scipy). Updates are adversarial, norm <= C = 1:
- ``upper``: sqrt(sum_j (sum_i |M_ji|)^2), the triangle bound of a pair (always sound);
- ``lower``: max over collinear +-1 updates of ||M s|| (attained by real updates).
The sensitivity the coupling argument can certify is max over cohorts of the bottleneck under
``upper``; the bottleneck under ``lower`` is what no shared-key coupling can beat.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from raysim.server.rebalancing import deficit_slots, select_moves


def outcomes(ids: np.ndarray, k: int, B: int, keys: np.ndarray) -> list[np.ndarray]:
    """Every final assignment (one per injection of moves into slots; equally likely)."""
    moved = select_moves(ids, k, B, keys)
    slots = deficit_slots(ids, k, B)
    out = []
    for perm in itertools.permutations(range(slots.size), moved.size):
        final = ids.copy()
        final[moved] = slots[list(perm)]
        out.append(final)
    return out


def pair_distance(a: np.ndarray, a_items: np.ndarray, b: np.ndarray, b_items: np.ndarray, k: int):
    """(upper, lower) L2 change of the k sums between outcome a (world A's items) and b."""
    n_items = int(max(a_items.max(), b_items.max())) + 1
    m = np.zeros((k, n_items))
    np.add.at(m, (b, b_items), 1.0)
    np.add.at(m, (a, a_items), -1.0)
    cols = np.flatnonzero(np.abs(m).sum(0) > 0)
    if cols.size == 0:
        return 0.0, 0.0
    m = m[:, cols]
    upper = math.sqrt(float((np.abs(m).sum(1) ** 2).sum()))
    lower = max(
        float(np.linalg.norm(m @ np.array(s)))
        for s in itertools.product((-1.0, 1.0), repeat=cols.size)
    )
    return upper, lower


def bottleneck(dist: np.ndarray) -> float:
    """Smallest D such that the uniform distributions on rows and columns can be coupled using
    only pairs with dist <= D (max-flow: source -> rows (cap m_B) -> cols (cap m_A) -> sink)."""
    ma, mb = dist.shape
    for d in np.unique(dist):
        n = ma + mb + 2
        src, sink = n - 2, n - 1
        rows, cols, caps = [], [], []
        for i in range(ma):
            rows.append(src), cols.append(i), caps.append(mb)
        for j in range(mb):
            rows.append(ma + j), cols.append(sink), caps.append(ma)
        ii, jj = np.nonzero(dist <= d + 1e-12)
        for i, j in zip(ii, jj, strict=True):
            rows.append(int(i)), cols.append(ma + int(j)), caps.append(ma * mb)
        graph = csr_matrix((np.array(caps, dtype=np.int32), (rows, cols)), shape=(n, n))
        if maximum_flow(graph, src, sink).flow_value == ma * mb:
            return float(d)
    return float(dist.max())


@dataclass
class Worst:
    upper: float = 0.0
    lower: float = 0.0
    example: str = ""


def neighbour_bound(ids, k, B, keys_a, ids_b, keys_b, items_a, items_b) -> tuple[float, float]:
    oa, ob = outcomes(ids, k, B, keys_a), outcomes(ids_b, k, B, keys_b)
    up = np.zeros((len(oa), len(ob)))
    lo = np.zeros_like(up)
    for i, a in enumerate(oa):
        for j, b in enumerate(ob):
            up[i, j], lo[i, j] = pair_distance(a, items_a, b, items_b, k)
    return bottleneck(up), bottleneck(lo)


def measure(kind: str, samples: int, seed: int) -> Worst:
    """Random small cohorts (k in {2, 3, 4}, B in {1, 2}, n <= k*B + 3), random key orders."""
    rng = np.random.default_rng(seed)
    worst = Worst()
    for _ in range(samples):
        k, B = int(rng.integers(2, 5)), int(rng.integers(1, 3))
        n = int(rng.integers(max(2, k * B - 1), k * B + 4))
        ids = rng.integers(k, size=n)
        keys = rng.permutation(n + 1).astype(float)
        c = int(rng.integers(k))
        if kind == "add":
            ids_b, keys_a, keys_b = np.append(ids, c), keys[:n], keys
            items_a, items_b = np.arange(n), np.arange(n + 1)
        else:  # replace slot i (same key) by a new client x in cluster c
            i = int(rng.integers(n))
            ids_b, keys_a = ids.copy(), keys[:n]
            ids_b[i], keys_b = c, keys[:n]
            items_a = np.arange(n)
            items_b = np.arange(n)
            items_b[i] = n  # x is a different identity (a different update)
        if math.perm(int(deficit_slots(ids_b, k, B).size)) > 720:
            continue
        up, lo = neighbour_bound(ids, k, B, keys_a, ids_b, keys_b, items_a, items_b)
        if up > worst.upper or lo > worst.lower:
            ex = f"k={k} B={B} ids={ids.tolist()} -> {ids_b.tolist()} keys={keys.tolist()}"
            worst = Worst(max(worst.upper, up), max(worst.lower, lo), ex)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for kind in ("add", "replace"):
        w = measure(kind, args.samples, args.seed)
        print(f"{kind}: certified (triangle) {w.upper:.4f} C, attained {w.lower:.4f} C")
        print(f"  worst case: {w.example}")


if __name__ == "__main__":
    main()
