"""FedCAM in the client-level DP family of RR-Cluster: each cluster model is a shared global
model plus a cluster part (additive), theta_j = g + r_j.

A sampled client picks the cluster with the lowest train loss of g + r_j (as IFCA) and trains
it; the server moves the global part by a share ``global_share`` of the noisy mean of every
update and the cluster part by the rest of its group's noisy mean. Two sums leave the round, the
global one (sensitivity 2*C_theta, replace-one, no rebalancing involved) and the k cluster sums
(``raysim.server.rebalancing.sensitivity``): drawn with one multiplier z at the std of their joint
sensitivity sqrt(s_g^2 + s_c^2), they are one Gaussian mechanism on the concatenation, so the
accountant's single model Gaussian per round stays exact. This is the "larger privacy noise"
of DP-FedCAM the paper reports (sec. 5.2). Used as ``algorithm.base=fedcam`` (``AdditiveMoves``);
B = 0 is DP-FedCAM.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from algorithms.ifca import LossChoice
from raysim.config import ConfigError
from raysim.privacy.view import Reports

if TYPE_CHECKING:
    from algorithms.clustered import ClusterState


def joint_sensitivity(global_sens: float, cluster_sens: float) -> float:
    return math.hypot(global_sens, cluster_sens)


class AdditiveMoves(LossChoice):
    """FedCAM as RR-Cluster's base: the clients choose as in IFCA; the server moves the global
    part (kept in ``state.info["global"]``) and the cluster parts, both sums at their joint
    sensitivity."""

    name = "fedcam"

    def check(self) -> None:
        if not self.rr.server_opt.plain:
            raise ConfigError(
                "algorithm.server_optimizer: base fedcam moves each model's global and cluster "
                "parts together, by plain sgd only (server_momentum 0); FedOpt runs with base "
                "ifca or fesem"
            )
        if self.rr.params.small_clusters == "global":
            raise ConfigError(
                "algorithm.small_clusters: global (GMFSC) gives a small cluster the global "
                "model, and base fedcam keeps a global part of its own that it moves every "
                "round; use small_clusters=rebalance with base fedcam, or base ifca or fesem"
            )

    def sum_sensitivity(self, cluster: float) -> float:
        return joint_sensitivity(self.rr.group_sensitivity(0), cluster)

    def move(
        self,
        state: ClusterState,
        reports: Reports,
        groups: np.ndarray,
        rng: np.random.Generator,
        counts: np.ndarray | None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """New cluster models and global model (theta_j = g + r_j) after one round; the global
        model starts as the mean of the initial cluster models."""
        rr, models = self.rr, state.models
        global_model = state.info.get("global", torch.stack(models).mean(0))
        share, lr = rr.params.global_share, rr.cfg.algorithm.server_lr
        n = max(len(reports), 1)
        sens = rr.sum_sensitivity(reports)
        total = reports.sum(list(reports), rng, like=global_model, sensitivity=sens)
        new_global = global_model + lr * share * total / n
        moved = rr.cluster_moves(models, reports, groups, rng, counts)  # theta_j + lr * mean
        out = [
            new_global + (m - global_model) + (1 - share) * (mv - m)
            for m, mv in zip(models, moved, strict=True)
        ]
        return out, {"global": new_global}
