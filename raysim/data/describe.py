"""Human-readable summary of a population (``raysim data describe CONFIG``)."""

from __future__ import annotations

import numpy as np

from raysim.data.federated import FederatedDataset
from raysim.data.lazy import LazyPopulation


def _mmm(v: np.ndarray) -> str:
    return f"{int(v.min())}/{int(np.median(v))}/{int(v.max())}" if len(v) else "-"


def describe(fd: FederatedDataset | LazyPopulation) -> str:
    """Clients per cluster, train/test sizes (min/median/max) and per-cluster label histograms."""
    counts = np.bincount(fd.true_cluster, minlength=fd.num_clusters)
    extras = ", ".join(f"{k}={v}" for k, v in fd.meta.items() if np.ndim(v) == 0)
    lines = [
        f"dataset {fd.dataset}: {fd.task}"
        + (f", {fd.num_classes} classes" if fd.num_classes else "")
        + f", features {fd.feature_shape}, {int(fd.sizes.sum())} rows"
        + (" made per client when needed" if isinstance(fd, LazyPopulation) else "")
        + f", {fd.nbytes / 2**20:.1f} MiB",
        f"{fd.num_clients} clients in {fd.num_clusters} clusters {counts.tolist()}"
        # a minority exists only when the clusters differ in size (as in metrics/evaluation.py)
        + (f" (minority: cluster {int(np.argmin(counts))})" if counts.min() < counts.max() else "")
        + (f"; {extras}" if extras else ""),
        f"train samples per client min/median/max {_mmm(fd.train_sizes)}, "
        f"test {_mmm(fd.test_sizes)}",
    ]
    header = "labels (train+test)" if fd.num_classes else "y mean/std"
    lines.append(f"{'cluster':>7} {'clients':>7} {'train':>14} {'test':>14}  {header}")
    for k in range(fd.num_clusters):
        ids = fd.clients_of_cluster(k)
        y, sampled = fd.cluster_labels(k)
        if fd.num_classes:
            summary = str(np.bincount(y, minlength=fd.num_classes).tolist())
        else:
            summary = f"{float(y.mean()):.3f}/{float(y.std()):.3f}"
        if sampled is not None:
            summary += f" (of {sampled} clients drawn at random)"
        lines.append(
            f"{k:>7} {len(ids):>7} {_mmm(fd.train_sizes[ids]):>14} "
            f"{_mmm(fd.test_sizes[ids]):>14}  {summary}"
        )
    return "\n".join(lines)
