"""Galli et al.'s Fig. 2: the largest total d-privacy leakage among a cluster's clients, per round.

Input is :meth:`raysim.privacy.MetricLedger.rows` (or the Parquet file written from it); the
curve of a cluster is flat in rounds where none of its most exposed clients took part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def max_leakage_per_cluster(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame,
    clusters: Sequence[int] | np.ndarray,
    rounds: int | None = None,
) -> pd.DataFrame:
    """Columns round, cluster, max_leakage: max over the cluster's clients of their total so far.

    ``clusters[c]`` is client c's cluster (the true one, or the one the run assigned). Clients
    that never released count as 0; rounds run from 1 to ``rounds`` (default: the last one seen).
    """
    df = pd.DataFrame(rows, columns=None if len(rows) else ["client", "round", "leakage"])
    clusters = np.asarray(clusters, dtype=np.int64)
    last = int(rounds if rounds is not None else (df["round"].max() if len(df) else 0))
    per = np.zeros((last + 1, len(clusters)))  # leakage of client c released in round t
    for c, t, leak in zip(df["client"], df["round"], df["leakage"], strict=True):
        if t <= last:
            per[int(t), int(c)] += leak
    cumulative = np.cumsum(per, axis=0)[1:]  # totals after rounds 1..last
    out = [
        {
            "round": t,
            "cluster": int(k),
            "max_leakage": float(cumulative[t - 1][clusters == k].max()),
        }
        for t in range(1, last + 1)
        for k in np.unique(clusters)
    ]
    return pd.DataFrame(out, columns=["round", "cluster", "max_leakage"])


def plot_max_leakage(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame,
    clusters: Sequence[int] | np.ndarray,
    path: Path,
    rounds: int | None = None,
    title: str = "max privacy leakage among clients",
) -> pd.DataFrame:
    """Write the Fig.-2 step plot to ``path``; returns the plotted table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = max_leakage_per_cluster(rows, clusters, rounds)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for k, sub in table.groupby("cluster"):
        ax.step(sub["round"], sub["max_leakage"], where="post", label=f"cluster {k}")
    ax.set_xlabel("round")
    ax.set_ylabel("max total ε·‖δ‖ (n/ν per release)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return table
