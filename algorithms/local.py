"""Local: every client trains its own model on its own data, with no communication (the
baseline that clustering must beat on the majority clusters). Personal models are client state:
held by the coordinator, travelling with the task."""

from __future__ import annotations

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
        info = {"secure_sum": False} if self.privacy.secure_aggregation else {}
        return RoundPlan(
            [self.task(c, cluster=None) for c in self.cohort(rng)], [self.env.init_weights], info
        )

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        start = task.state if task.state is not None else ctx.models[0]
        if self.privacy.secure_aggregation:  # train, keep, send nothing
            x, y = ctx.train_data()
            res = ctx.trainer.train_one(start, x, y, task.train, ctx.generator("train"))
            return ClientReport(task.client_id, state=start + res.update)
        report = self.train_client(task, ctx, start)
        # the personal model stays on the client (its DP-SGD is still charged)
        report.state = start + report.withhold_update()
        return report

    def client_steps(
        self, tasks: list[ClientTask], ctxs: list[ClientContext]
    ) -> list[ClientReport]:
        """client_step for a group, through the vectorized trainer."""
        if self.privacy.secure_aggregation:  # nothing is released: the per-client path
            return [self.client_step(t, c) for t, c in zip(tasks, ctxs, strict=True)]
        starts = [
            t.state if t.state is not None else c.models[0]
            for t, c in zip(tasks, ctxs, strict=True)
        ]
        reports = self.train_clients(tasks, ctxs, starts)
        for report, start in zip(reports, starts, strict=True):
            # the personal model stays on the client (its DP-SGD is still charged)
            report.state = start + report.withhold_update()
        return reports

    def server_step(
        self, state: None, plan: RoundPlan, reports: list[Message], rng: np.random.Generator
    ) -> ServerResult:
        return ServerResult(None)

    def plan_evaluation(self, state: None) -> RoundPlan:
        # Clients that never trained are judged on the initial model (broadcast as model 0).
        tasks = [self.task(c, cluster=None) for c in range(self.env.num_clients)]
        return RoundPlan(tasks, [self.env.init_weights])
