"""FedCAM in the client-level DP family of RR-Cluster: each cluster model is a shared global
model plus a cluster part (additive), theta_j = g + r_j.

A sampled client picks the cluster with the lowest train loss of g + r_j (as IFCA) and trains
it; the server moves the global part by a share ``global_share`` of the noisy mean of every
update and the cluster part by the rest of its group's noisy mean. Two sums leave the round, the
global one (sensitivity 2*C_theta, replace-one, no rebalancing involved) and the k cluster sums
(``raysim.server.rebalancing.sensitivity``): drawn with one multiplier z at the std of their joint
sensitivity sqrt(s_g^2 + s_c^2), they are one Gaussian mechanism on the concatenation, so the
accountant's single model Gaussian per round stays exact. This is the "larger privacy noise"
of DP-FedCAM the paper reports (sec. 5.2). Used as ``algorithm.base=fedcam``; B = 0 is DP-FedCAM.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from raysim.privacy.modes.view import Reports


def joint_sensitivity(global_sens: float, cluster_sens: float) -> float:
    return math.hypot(global_sens, cluster_sens)


def fedcam_moves(
    algo: Any,
    models: list[torch.Tensor],
    global_model: torch.Tensor,
    reports: Reports,
    groups: np.ndarray,
    rng: np.random.Generator,
    counts: np.ndarray | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """New cluster models and global model (theta_j = g + r_j) after one round."""
    share, lr = algo.params.global_share, algo.cfg.algorithm.server_lr
    n = max(len(reports), 1)
    sens = algo.sum_sensitivity(reports)
    total = reports.sum(list(reports), rng, like=global_model, sensitivity=sens)
    new_global = global_model + lr * share * total / n
    moved = algo.cluster_moves(models, reports, groups, rng, counts)  # theta_j + lr * mean
    out = [
        new_global + (m - global_model) + (1 - share) * (mv - m)
        for m, mv in zip(models, moved, strict=True)
    ]
    return out, new_global
