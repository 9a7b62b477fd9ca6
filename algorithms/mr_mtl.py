"""MR-MTL (mean-regularized multi-task learning; Evgeniou & Pontil 2004, in FL by Liu et al.
2022): every client keeps a personal model w_i, trained by (DP-)SGD on
f_i(w_i) + lam/2 ||w_i - w_bar||^2, where w_bar, the mean of the personal models, is the
server's model. The proximal gradient touches no data, so under DP-SGD it is added after the
noise and costs nothing. Clients are judged on their personal models.

Round: the server broadcasts w_bar; a client starts from its personal model (w_bar the first
time), trains with the pull towards w_bar, keeps the result and sends w_i - w_bar (a DP-SGD
output minus a public model: post-processing); w_bar += mean of those, i.e. the participants'
mean personal model. lam = 0 is local training with a shared start; large lam approaches FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from pydantic import ConfigDict, Field

from algorithms.base import FederatedAlgorithm
from algorithms.fedavg import GlobalState
from raysim.config import ConfigModel
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    Message,
    RoundPlan,
    ServerResult,
)
from raysim.server.aggregation import weighted_mean


class MRMTLParams(ConfigModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(1.0, ge=0)  # the mean-regularisation strength lambda


class MRMTL(FederatedAlgorithm):
    name = "mr_mtl"
    privacy_modes = ("none", "sample")
    Params = MRMTLParams

    def init_state(self, rng: np.random.Generator) -> GlobalState:
        return GlobalState(self.env.init_weights.clone())

    def plan_round(self, state: GlobalState, round: int, rng: np.random.Generator) -> RoundPlan:
        tasks = []
        for c in self.cohort(rng):
            t = self.task(c)
            t.train = replace(t.train, prox_mu=self.params.lam)
            tasks.append(t)
        return RoundPlan(tasks, [state.model])

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        mean = ctx.models[0]
        start = task.state if task.state is not None else mean
        x, y = ctx.train_data()
        res = ctx.trainer.train(start, x, y, task.train, ctx.generator("train"), prox_center=mean)
        personal = start + res.update
        report = ClientReport(task.client_id, None, res.num_samples, 0, res.train_loss)
        report.state = personal
        # a DP-SGD output minus a public model: post-processing of the same release
        ctx.release.update(report, task, replace(res, update=personal - mean))
        return report

    def server_step(
        self, state: GlobalState, plan: RoundPlan, reports: list[Message], rng
    ) -> ServerResult:
        model = state.model
        if reports:
            mean = weighted_mean([r.update for r in reports], [1.0] * len(reports))
            model = self.server_opt.move(0, model, mean)
        return ServerResult(GlobalState(model))

    def plan_evaluation(
        self, state: GlobalState, clients: Sequence[int] | None = None
    ) -> RoundPlan:
        # personal models travel as client state; clients that never trained use w_bar
        return RoundPlan([self.task(c) for c in self.evaluated(clients)], [state.model])
