"""DP-IFCA (f-CDPFL; Ghosh et al. 2020 with DP-SGD clients, Liu et al. 2022): M randomly
initialised cluster models; in every round each client picks the model that fits its training
data best (accuracy, or clipped loss: ``select_by``) — privately, with the exponential
mechanism, charged to its ledger — trains it, and each cluster model moves by the mean of its
members' updates.

Extension point for client-level DP (RR-Cluster): the choice lives in ``client_step`` (client
side, released through the privacy mode) and the aggregation in
``ClusteredAlgorithm.aggregate_clusters``, which defers to the base's central noisy sum under
client-level DP. A client-level variant adds "client" to ``privacy_modes``, lets the client
report its exact choice to the trusted server and privatizes the identifiers there
(``privacy.privatize_ids``), with the identifier noise planned through ``id_noise_ratio``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from algorithms.clustered import (
    ClusteredAlgorithm,
    ClusterState,
    SelectionParams,
    random_models,
)
from raysim.privacy.modes.base import PrivacyNeeds
from raysim.protocol import Message, RoundPlan, ServerResult


class IFCAParams(SelectionParams):
    random_init: bool = True  # False: every cluster starts from the shared initial model


class IFCA(ClusteredAlgorithm):
    name = "ifca"
    Params = IFCAParams
    privacy_modes = ("none", "sample", "distributed", "dprivacy")

    def privacy_needs(self) -> PrivacyNeeds:
        """After the selection window the server keeps each client's last choice: a mode that
        hides the choices from it (secure aggregation) refuses that plan."""
        needs = super().privacy_needs()
        if self.params.selection_fraction < 1:
            key = f"algorithm.selection_fraction={self.params.selection_fraction}"
            return replace(needs, server_knows_choices=key)
        return needs

    def reserved_selections(self) -> int:
        return min(self.cfg.rounds, self.selection_window())

    def may_select(self, round: int) -> bool:
        return round <= self.selection_window()

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        m = self.num_clusters()
        if self.params.random_init:
            models = random_models(self.env, m, int(rng.integers(2**31 - 1)))
        else:
            models = [self.env.init_weights.clone() for _ in range(m)]
        return ClusterState(models)

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        cohort = self.cohort(rng)
        if round <= self.selection_window() or state.assigned is None:
            tasks = [self.selecting_task(c) for c in cohort]
        else:  # after the selection window: keep the last choice
            tasks = [self.task(c, cluster=int(state.assigned[c])) for c in cohort]
        return RoundPlan(tasks, state.models)

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        models = self.aggregate_clusters(state.models, reports, rng)
        assigned = self.updated_assignments(state, reports)
        metrics = self.cluster_metrics(assigned, len(models))
        return ServerResult(ClusterState(models, assigned, state.info), metrics)
