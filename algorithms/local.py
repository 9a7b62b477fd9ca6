"""Local: every client trains its own model on its own data, with no communication (the
baseline that clustering must beat on the majority clusters). Personal models are client state:
held by the coordinator, travelling with the task."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from algorithms.base import FederatedAlgorithm
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    Message,
    RoundPlan,
    ServerResult,
)


class Local(FederatedAlgorithm):
    name = "local"
    # distributed: nothing leaves the client, so no secure sum is planned and nothing is charged
    privacy_modes = ("none", "sample", "distributed")
    moves_models = False

    def init_state(self, rng: np.random.Generator) -> None:
        return None

    def plan_round(self, state: None, round: int, rng: np.random.Generator) -> RoundPlan:
        # no round sums anything: a secure aggregation plans no sum and charges none
        info = {"secure_sum": False}
        return RoundPlan(
            [self.task(c, cluster=None) for c in self.cohort(rng)], [self.env.init_weights], info
        )

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        return self.client_steps([task], [ctx])[0]

    def client_steps(
        self, tasks: list[ClientTask], ctxs: list[ClientContext]
    ) -> list[ClientReport]:
        """Each client trains its personal model through the vectorized trainer and keeps it
        (``keep``: its DP-SGD is still charged where the mode charges local training)."""
        starts = [
            t.state if t.state is not None else c.models[0]
            for t, c in zip(tasks, ctxs, strict=True)
        ]
        return self.train_clients(tasks, ctxs, starts, keep=True)

    def server_step(
        self, state: None, plan: RoundPlan, reports: list[Message], rng: np.random.Generator
    ) -> ServerResult:
        return ServerResult(None)

    def plan_evaluation(self, state: None, clients: Sequence[int] | None = None) -> RoundPlan:
        # Clients that never trained are judged on the initial model (broadcast as model 0).
        tasks = [self.task(c, cluster=None) for c in self.evaluated(clients)]
        return RoundPlan(tasks, [self.env.init_weights])
