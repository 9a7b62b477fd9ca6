"""O-CDPFL: the oracle that knows the true clusters from round 1 (an upper reference for the
clustering algorithms): one model per true cluster, trained by that cluster's members."""

from __future__ import annotations

import numpy as np

from algorithms.clustered import ClusteredAlgorithm, ClusterState
from raysim.protocol import ClientReport, RoundPlan, ServerResult


class Oracle(ClusteredAlgorithm):
    name = "oracle"

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        truth = np.asarray(self.env.true_clusters, dtype=np.int64)
        m = int(truth.max()) + 1
        return ClusterState([self.env.init_weights.clone() for _ in range(m)], truth.copy())

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        tasks = [self.task(c, cluster=int(state.assigned[c])) for c in self.cohort(rng)]
        return RoundPlan(tasks, state.models)

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[ClientReport],
        rng: np.random.Generator,
    ) -> ServerResult:
        models = self.aggregate_clusters(state.models, reports, rng)
        new = ClusterState(models, state.assigned, state.info)
        return ServerResult(new, self.privacy_charges(plan.round, reports))
