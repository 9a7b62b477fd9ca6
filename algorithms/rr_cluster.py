"""RR-Cluster (paper 001, Algorithms 1-2): client-level DP federated clustering with random
rebalancing, as a plug-in over a base clustering algorithm (``algorithm.base``).

One round (trusted server, client-level central DP, fixed-size cohort of q*M clients):
the base decides each sampled client's cluster on the client (IFCA: lowest train loss; FeSEM:
nearest centre to the local model), the server privatizes the one-hot identifiers (Algorithm 2
line 8, ``privatize_onehot``), groups the updates by the noisy argmax, rebalances the groups so
that each holds at least B updates (``raysim.rebalancing``), and moves every cluster model by
its clipped, noised sum over |S_j|. B = 0 is the base algorithm directly privatized (the paper's
DP-IFCA / DP-FeSEM baselines); ``small_clusters="global"`` is the GMFSC baseline of appendix
E.4 (no rebalancing; a cluster with fewer than B updates takes the global model).

Privacy decisions (module docstring of ``raysim.rebalancing`` for the sensitivity):
- Only fixed-size cohorts without replacement are allowed in client mode. The identifiers are
  released per cohort member; under Poisson sampling (add/remove-one) the number of released
  rows itself changes with one client, which a Gaussian on a fixed-length vector does not
  cover. With a fixed cohort (replace-one, Theorem 1's amplification of Wang et al. 2019) the
  ids are one Gaussian mechanism on the cohort's stacked one-hots, sensitivity sqrt(2)*min(1,
  C_s), and |S_j| (hence dividing by it) is post-processing of them.
- An empty cluster (possible only without rebalancing) releases nothing and keeps its model:
  emptiness is a function of the released ids.
- Clustering accuracy (``raysim.metrics``) is measured on the clients' own choices, matched to
  the true clusters by the Hungarian method; the algorithm itself never sees the truth.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from algorithms.base import Environment
from algorithms.clustered import ClusterState
from algorithms.fedcam import fedcam_moves, joint_sensitivity
from algorithms.fesem import fesem_step
from algorithms.ifca import IFCA, IFCAParams
from raysim.config import ConfigError
from raysim.modes import PrivacyNeeds
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    Message,
    RoundPlan,
    ServerResult,
)
from raysim.rebalancing import SensitivityRule, rebalance, sensitivity


class RRParams(IFCAParams):
    """``algorithm.*`` keys of RR-Cluster and its client-level bases."""

    base: Literal["ifca", "fesem", "fedcam"] = "ifca"
    global_share: float = Field(0.5, ge=0, le=1)  # fedcam: the global part's share of a move
    B: int = Field(8, ge=0)  # minimum cluster size after rebalancing (0: the base alone)
    id_clip: float = Field(0.1, gt=0)  # C_s (appendix D: 0.1; argmax does not depend on it)
    id_noise_ratio: float = Field(1.0, gt=0)  # sigma_s / sigma_theta
    sensitivity: SensitivityRule = "sound"  # "paper": 2*C_theta per cluster sum (appendix B.2)
    small_clusters: Literal["rebalance", "global"] = "rebalance"  # "global": GMFSC (E.4)


class RRCluster(IFCA):
    """RR-Cluster over IFCA (Algorithm 2), FeSEM (``algorithms.fesem``: how a client chooses)
    or FedCAM (``algorithms.fedcam``: how the server moves additive models)."""

    name = "rr_cluster"
    Params = RRParams
    privacy_modes = ("none", "client")

    def __init__(self, env: Environment) -> None:
        if env.cfg.privacy.mode == "client" and env.cfg.training.sampling != "without_replacement":
            raise ConfigError(
                "training.sampling: client-level RR-Cluster releases one identifier per cohort "
                "member, accounted only for fixed-size cohorts; use without_replacement"
            )
        super().__init__(env)
        k = self.num_clusters()
        cohort = self.cfg.training.sampling_rate * env.num_clients
        if self.params.B * k > cohort:
            raise ConfigError(f"algorithm.B: need B <= qM/k = {cohort / k:g}, got {self.params.B}")

    # -- privacy ---------------------------------------------------------------------------
    def privacy_needs(self) -> PrivacyNeeds:
        return PrivacyNeeds(self.dpsgd_schedule, id_noise_ratio=self.params.id_noise_ratio)

    def reserved_selections(self) -> int:
        return 0  # no exponential-mechanism choices: ids are privatized on the server

    @property
    def rebalancing_B(self) -> int:
        return self.params.B if self.params.small_clusters == "rebalance" else 0

    def model_sensitivity(self) -> float:
        """Std / z of every model sum; fedcam adds its global sum (``algorithms.fedcam``)."""
        replace_one = self.cfg.training.sampling == "without_replacement"
        rule, clip = self.params.sensitivity, self.cfg.privacy.clip
        cluster = sensitivity(clip, self.rebalancing_B, replace_one, rule)
        if self.params.base != "fedcam":
            return cluster
        return joint_sensitivity(sensitivity(clip, 0, replace_one, rule), cluster)

    def privacy_summary(self) -> dict[str, Any]:
        out = super().privacy_summary()
        if self.privacy.central_noise:
            out["model_sensitivity"] = self.model_sensitivity()
        return out

    # -- clients ---------------------------------------------------------------------------
    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        if self.params.base == "fesem" and task.extra.get("select"):
            return fesem_step(self, task, ctx)
        return super().client_step(task, ctx)

    # -- server ----------------------------------------------------------------------------
    def group(self, reports: list[Message], k: int, rng: np.random.Generator) -> np.ndarray:
        """Each report's cluster for aggregation: noisy ids (client mode), then rebalancing."""
        chosen = np.array([r.cluster for r in reports], dtype=np.int64)
        if self.privacy.central_noise and chosen.size:
            chosen = self.privacy.privatize_ids(chosen, k, self.params.id_clip, rng)
        return rebalance(chosen, k, self.rebalancing_B, rng).clusters

    def aggregate_groups(
        self,
        models: list[torch.Tensor],
        reports: list[Message],
        groups: np.ndarray,
        rng: np.random.Generator,
    ) -> list[torch.Tensor]:
        out = self.cluster_moves(models, reports, groups, rng)
        if self.params.small_clusters == "global":
            out = self.global_for_small(models, out, groups, len(reports))
        return out

    def cluster_moves(
        self,
        models: list[torch.Tensor],
        reports: list[Message],
        groups: np.ndarray,
        rng: np.random.Generator,
    ) -> list[torch.Tensor]:
        """Each cluster model after its group's update: the base's plain means without DP, the
        clipped sum + N(0, (sens * z)^2) over |S_j| with client-level DP (Algorithm 1 l. 11)."""
        if not self.privacy.central_noise:
            regrouped = [
                Message(r.client_id, r.update, r.num_samples, int(g))
                for r, g in zip(reports, groups, strict=True)
            ]
            return self.aggregate_clusters(models, regrouped, rng)
        lr, sens = self.cfg.algorithm.server_lr, self.model_sensitivity()
        out = []
        for j, model in enumerate(models):
            members = [r.update for r, g in zip(reports, groups, strict=True) if g == j]
            if not members:
                out.append(model)
                continue
            total = self.privacy.noisy_sum(members, sens, rng, model.numel())
            out.append(model + lr * total / len(members))
        return out

    def global_for_small(
        self, old: list[torch.Tensor], new: list[torch.Tensor], groups: np.ndarray, n: int
    ) -> list[torch.Tensor]:
        """GMFSC: the global model (post-processing: the sum of the noisy cluster moves) replaces
        every cluster model that had fewer than B updates this round."""
        sizes = np.bincount(groups, minlength=len(old))
        step = sum(((nw - od) * s for od, nw, s in zip(old, new, sizes, strict=True)), 0)
        global_model = torch.stack(old).mean(0) + step / max(n, 1)
        return [
            global_model.clone() if s < self.params.B else m
            for m, s in zip(new, sizes, strict=True)
        ]

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        k = len(state.models)
        groups = self.group(reports, k, rng)
        info = dict(state.info)
        if self.params.base == "fedcam":
            g = info.get("global", torch.stack(state.models).mean(0))
            models, info["global"] = fedcam_moves(self, state.models, g, reports, groups, rng)
        else:
            models = self.aggregate_groups(state.models, reports, groups, rng)
        assigned = self.updated_assignments(state, reports)
        metrics = self.cluster_metrics(np.maximum(assigned, 0), k)
        sizes = np.bincount(groups, minlength=k) if groups.size else np.zeros(k, dtype=np.int64)
        metrics["round_cluster_size_min"] = int(sizes.min())
        return ServerResult(ClusterState(models, assigned, info), metrics)

    unassigned = -1  # never sampled: no cluster yet (left out of clustering accuracy)

    def evaluates_by_choice(self) -> bool:
        return True  # most clients were never sampled: the server has no assignment for them

    def assignments(self, state: ClusterState) -> np.ndarray | None:
        return None if state.assigned is None else np.maximum(state.assigned, 0)

    def choices(self, state: ClusterState) -> np.ndarray | None:
        """The clients' own last choices, -1 for clients never sampled (clustering accuracy)."""
        return state.assigned
