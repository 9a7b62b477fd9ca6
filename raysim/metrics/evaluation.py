"""Per-round metrics from the clients' evaluation reports.

Definitions (used in result files, `raysim report` and the comparison tables):
- accuracy / loss: unweighted mean over clients of each client's test accuracy / loss (the
  papers average over clients, so a small client counts as much as a large one);
- accuracy_cluster_k: the same mean over the clients whose *true* cluster is k;
- accuracy_minority: over the smallest true cluster; accuracy_majority: over all the others
  (both absent when every cluster has the same size);
- accuracy_min: the worst client's accuracy;
- accuracy_disparity / loss_disparity: best minus worst client accuracy / loss;
- ari: adjusted Rand index of the algorithm's assignment against the true clusters, and
  clustered_correctly = (ari == 1), where the algorithm assigns clusters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sklearn.metrics import adjusted_rand_score

from raysim.protocol import EvalReport


def minority_cluster(true_clusters: np.ndarray) -> int | None:
    """The smallest true cluster, or None when all clusters have the same size."""
    ids, counts = np.unique(true_clusters, return_counts=True)
    if len(ids) < 2 or counts.min() == counts.max():
        return None
    return int(ids[np.argmin(counts)])


def clustering_metrics(true_clusters: np.ndarray, assigned: np.ndarray | None) -> dict[str, Any]:
    if assigned is None:
        return {}
    ari = float(adjusted_rand_score(true_clusters, assigned))
    return {"ari": ari, "clustered_correctly": bool(np.isclose(ari, 1.0))}


def clustering_accuracy(true: np.ndarray, assigned: np.ndarray) -> float:
    """Fraction of clients whose cluster matches the truth after the best one-to-one relabelling
    (Hungarian; with fewer clusters than true groups, unmatched groups count as wrong). Clients
    with a negative assignment (never chose) are left out."""
    from scipy.optimize import linear_sum_assignment

    true, assigned = np.asarray(true, dtype=np.int64), np.asarray(assigned, dtype=np.int64)
    seen = assigned >= 0
    true, assigned = true[seen], assigned[seen]
    if true.size == 0:
        return float("nan")
    overlap = np.zeros((int(assigned.max()) + 1, int(true.max()) + 1))
    np.add.at(overlap, (assigned, true), 1)
    rows, cols = linear_sum_assignment(-overlap)
    return float(overlap[rows, cols].sum() / true.size)


def round_metrics(
    reports: Sequence[EvalReport],
    true_clusters: np.ndarray,
    assigned: np.ndarray | None = None,
) -> dict[str, Any]:
    acc = np.array([r.accuracy for r in reports], dtype=float)
    loss = np.array([r.loss for r in reports], dtype=float)
    truth = true_clusters[[r.client_id for r in reports]]
    out: dict[str, Any] = {
        "accuracy": float(np.mean(acc)),
        "loss": float(np.mean(loss)),
        "accuracy_min": float(np.min(acc)),
        "accuracy_disparity": float(np.max(acc) - np.min(acc)),
        "loss_disparity": float(np.max(loss) - np.min(loss)),
    }
    for k in np.unique(truth):
        out[f"accuracy_cluster_{k}"] = float(np.mean(acc[truth == k]))
        out[f"loss_cluster_{k}"] = float(np.mean(loss[truth == k]))
    minority = minority_cluster(true_clusters)
    if minority is not None:
        out["accuracy_minority"] = float(np.mean(acc[truth == minority]))
        out["accuracy_majority"] = float(np.mean(acc[truth != minority]))
    out.update(clustering_metrics(true_clusters, assigned))
    return out
