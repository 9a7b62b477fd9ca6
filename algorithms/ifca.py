"""DP-IFCA (f-CDPFL; Ghosh et al. 2020 with DP-SGD clients, Liu et al. 2022): M randomly
initialised cluster models; in every round each client picks the model that fits its training
data best (accuracy, or clipped loss: ``select_by``) — privately, with the exponential
mechanism, charged to its ledger — trains it, and each cluster model moves by the mean of its
members' updates.

Two pieces serve RR-Cluster (``algorithms.rr_cluster``) as well: ``SelectionRounds``, IFCA's
round plan (random initial models, clients choose in the selection window and keep their last
choice after it), which both algorithms hold; and ``LossChoice``, IFCA as RR-Cluster's base
(``algorithm.base=ifca``): the client picks and trains the model that fits it best, and each
cluster model moves by its rebalanced group's mean.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from algorithms.base import Environment
from algorithms.clustered import (
    ClusteredAlgorithm,
    ClusterState,
    SelectionParams,
    random_models,
)
from algorithms.rr_base import ClusterBase
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.view import Reports
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    Message,
    RoundPlan,
    ServerResult,
)


class IFCAParams(SelectionParams):
    random_init: bool = True  # False: every cluster starts from the shared initial model


class SelectionRounds:
    """IFCA's round plan, held by IFCA and RR-Cluster: the cluster models start random
    (``random_init``), the cohort's clients choose their model in the first
    ``selection_fraction`` of the rounds and train their last choice after that."""

    def __init__(self, algo: ClusteredAlgorithm) -> None:
        self.algo = algo

    def may_select(self, round: int) -> bool:
        return round <= self.algo.selection_window()

    def selections(self) -> int:
        """The choices each client may make over the run, where it makes them privately."""
        return min(self.algo.cfg.rounds, self.algo.selection_window())

    def needs(self, needs: PrivacyNeeds) -> PrivacyNeeds:
        """After the selection window the server keeps each client's last choice: a mode that
        hides the choices from it (secure aggregation) refuses that plan."""
        fraction = self.algo.params.selection_fraction
        if fraction < 1:
            return replace(needs, server_knows_choices=f"algorithm.selection_fraction={fraction}")
        return needs

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        algo = self.algo
        m = algo.num_clusters()
        if algo.params.random_init:
            models = random_models(algo.env, m, int(rng.integers(2**31 - 1)))
        else:
            models = [algo.env.init_weights.clone() for _ in range(m)]
        return ClusterState(models)

    def plan(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        algo = self.algo
        cohort = algo.cohort(rng)
        if self.may_select(round) or state.assigned is None:
            tasks = [algo.selecting_task(c) for c in cohort]
        else:  # after the selection window: keep the last choice
            tasks = [algo.task(c, cluster=algo.trained_cluster(state.assigned, c)) for c in cohort]
        return RoundPlan(tasks, state.models)


class IFCA(ClusteredAlgorithm):
    name = "ifca"
    Params = IFCAParams
    privacy_modes = ("none", "sample", "distributed", "dprivacy")

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        self.rounds = SelectionRounds(self)

    def privacy_needs(self) -> PrivacyNeeds:
        return self.rounds.needs(super().privacy_needs())

    def reserved_selections(self) -> int:
        return self.rounds.selections()

    def may_select(self, round: int) -> bool:
        return self.rounds.may_select(round)

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        return self.rounds.init_state(rng)

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        return self.rounds.plan(state, round, rng)

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


class LossChoice(ClusterBase):
    """IFCA as RR-Cluster's base: a selecting client picks the model that fits its training
    data best (``ClusteredAlgorithm.choose``; exact under the client mode, whose trusted server
    privatizes the identifiers), and the cohort trains as one group; each cluster model moves by
    its group's released mean (``small_clusters=global``: GMFSC)."""

    name = "ifca"

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        return self.rr.train_chosen([task], [ctx], [self.rr.choose(task, ctx)])[0]

    def move(
        self,
        state: ClusterState,
        reports: Reports,
        groups: np.ndarray,
        rng: np.random.Generator,
        counts: np.ndarray | None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return self.rr.aggregate_groups(state.models, reports, groups, rng, counts), {}
