"""Clustered linear regression, generated per client.

Construction (a d-dimensional version of RR-Cluster's appendix E.5, ``y = k x + b + eps`` with a
slope and intercept per cluster, and of the 2-cluster ``y = x^T theta_i + u`` of Galli et al.):

* cluster k has true parameters ``w_k = s * g_k`` and ``b_k = s * h_k`` with ``g_k ~ N(0, I_d)``,
  ``h_k ~ N(0, 1)`` and ``s = data.cluster_separation``; so
  ``E||(w_k, b_k) - (w_j, b_j)||^2 = 2 s^2 (d + 1)``: larger ``s`` means easier to cluster;
* every sample of a client in cluster k: ``x ~ N(0, I_d)``, ``y = x . w_k + b_k + e`` with
  ``e ~ N(0, noise_std^2)`` (raise ``noise_std`` for the paper's "hard to cluster" case);
* ``data.shift = "none"`` gives every cluster the parameters of cluster 0 (a no-heterogeneity
  control); any other shift keeps one ``(w_k, b_k)`` per cluster (the concept shift itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.config import DataConfig
from raysim.data.seeding import rng_for
from raysim.data.sources import BaseData

DEFAULT_SAMPLES_PER_CLIENT = 100


@dataclass(frozen=True)
class SyntheticLinear:
    """Generated samples, rows grouped by client (``samples_per_client`` each, client 0 first)."""

    data: BaseData
    weights: np.ndarray  # (K, d) true w_k per cluster
    bias: np.ndarray  # (K,) true b_k per cluster
    samples_per_client: int


def true_parameters(num_clusters: int, cfg: DataConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(w, b)`` of every cluster, shape (K, d) and (K,); see the module docstring."""
    rng = rng_for(seed, "synthetic_weights")
    s = cfg.cluster_separation
    w = (s * rng.standard_normal((num_clusters, cfg.dim))).astype(np.float32)
    b = (s * rng.standard_normal(num_clusters)).astype(np.float32)
    if cfg.shift == "none":
        w[:] = w[0]
        b[:] = b[0]
    return w, b


def make_synthetic_linear(clusters: np.ndarray, cfg: DataConfig, seed: int) -> SyntheticLinear:
    """Samples for every client; ``clusters[i]`` is the true cluster of client i."""
    clusters = np.asarray(clusters, dtype=np.int64)
    n = cfg.samples_per_client or DEFAULT_SAMPLES_PER_CLIENT
    w, b = true_parameters(int(clusters.max()) + 1, cfg, seed)
    rng = rng_for(seed, "synthetic_samples")
    x = rng.standard_normal((len(clusters) * n, cfg.dim), dtype=np.float32)
    noise = rng.standard_normal(len(x), dtype=np.float32) * np.float32(cfg.noise_std)
    row_cluster = np.repeat(clusters, n)
    y = np.einsum("nd,nd->n", x, w[row_cluster]) + b[row_cluster] + noise
    data = BaseData(x, y.astype(np.float32), 0, "regression")
    return SyntheticLinear(data, w, b, n)
