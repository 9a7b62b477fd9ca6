"""KM-CDPFL: clustering by k-means on the clients' model updates in every round (the gradient
clustering of Werner et al. 2023, Alg. 1, with DP-SGD clients; the R-DPCFL paper's appendix B.4).

Updates are only comparable when computed from the same model, so in every round each client
trains every one of the M cluster models (M DP-SGD runs, all charged: the noise is calibrated
for M * E rounds of DP-SGD) and sends the M updates. The server runs k-means (k-means++,
sklearn) on the concatenated updates, relabels the groups to agree most with last round's
assignment (Hungarian matching), and moves cluster model k by the mean of its members'
updates computed at model k. All cluster models start from the shared initial model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from pydantic import ConfigDict, Field

from algorithms.clustered import ClusteredAlgorithm, ClusterState
from raysim.config import ConfigModel
from raysim.privacy import Phase
from raysim.privacy.planning import dpsgd_round_phase
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    Message,
    RoundPlan,
    ServerResult,
)
from raysim.server.clustering import kmeans, match_labels, prepare_features


class KMeansParams(ConfigModel):
    model_config = ConfigDict(extra="forbid")
    kmeans_n_init: int = Field(10, gt=0)


class KMeansCFL(ClusteredAlgorithm):
    name = "kmeans_cfl"
    Params = KMeansParams

    def dpsgd_schedule(self, n: int) -> list[Phase]:
        one = dpsgd_round_phase(n, self.base_train_config())
        m = self.num_clusters()
        return [Phase(one.sampling_rate, one.steps * m)] * self.cfg.rounds

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        m = self.num_clusters()
        return ClusterState([self.env.init_weights.clone() for _ in range(m)])

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        return RoundPlan([self.task(c, cluster=None) for c in self.cohort(rng)], state.models)

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        x, y = ctx.train_data()
        results = [
            ctx.trainer.train_one(w, x, y, task.train, ctx.generator(f"train_model{m}"))
            for m, w in enumerate(ctx.models)
        ]
        report = ClientReport(task.client_id, None, len(x), None, results[-1].train_loss)
        stacked = torch.stack([res.update for res in results])
        # M DP-SGD runs released together: their steps add up (one phase at the same rate)
        merged = replace(results[0], update=stacked, steps=sum(res.steps for res in results))
        ctx.release.update(report, task, merged)
        return report

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        m = len(state.models)
        assigned = self.current_assignment(state)
        if not reports:
            return ServerResult(state)
        seed = int(rng.integers(2**31 - 1))
        feats = prepare_features(np.stack([r.update.reshape(-1).double().numpy() for r in reports]))
        labels = kmeans(feats, m, seed, self.params.kmeans_n_init)
        ids = np.array([r.client_id for r in reports])
        # a client never reported (-1) counts as cluster 0 here, as it did before it was marked
        labels = match_labels(np.maximum(assigned[ids], 0), labels, m)
        assigned[ids] = labels
        models = []
        for k, model in enumerate(state.models):
            members = [r.update[k] for r, lab in zip(reports, labels, strict=True) if lab == k]
            mean = torch.stack(members).mean(0) if members else None
            models.append(model if mean is None else self.server_opt.move(k, model, mean))
        metrics = self.cluster_metrics(assigned, m)
        return ServerResult(ClusterState(models, assigned, state.info), metrics)
