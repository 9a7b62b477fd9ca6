"""O-CDPFL: the oracle that knows the true clusters from round 1 (an upper reference for the
clustering algorithms): one model per true cluster, trained by that cluster's members."""

from __future__ import annotations

import numpy as np

from algorithms.clustered import ClusteredAlgorithm, ClusterState
from raysim.protocol import Message, RoundPlan, ServerResult


class Oracle(ClusteredAlgorithm):
    name = "oracle"
    uses_ground_truth = True  # the oracle is the one algorithm told the true clusters

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        truth = np.asarray(self.env.ground_truth, dtype=np.int64)
        m = int(truth.max()) + 1
        return ClusterState([self.env.init_weights.clone() for _ in range(m)], truth.copy())

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        tasks = [self.task(c, cluster=int(state.assigned[c])) for c in self.cohort(rng)]
        return RoundPlan(tasks, state.models)

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        models = self.aggregate_clusters(state.models, reports, rng)
        return ServerResult(ClusterState(models, state.assigned, state.info))
