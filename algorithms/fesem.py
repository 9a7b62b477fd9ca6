"""FeSEM (Long et al. 2023) in the client-level DP family of RR-Cluster: assignment by the L2
distance of the client's local model to the cluster centres.

Clients keep no state here (1000 clients, q = 0.1: most take part a few times), so a sampled
client trains a local model from the mean of the k centres, picks the nearest centre j, and
reports theta_local - theta_j: with server learning rate 1 the centre becomes the mean of its
members' local models, FeSEM's centre update. The choice leaves the client as an identifier that
the server privatizes and rebalances exactly as for IFCA (``algorithms.rr_cluster``); B = 0 is
DP-FeSEM. Used as ``algorithm.name=rr_cluster`` with ``algorithm.base=fesem``
(``NearestCentre``).
"""

from __future__ import annotations

import torch

from algorithms.ifca import LossChoice
from raysim.privacy import postprocess
from raysim.protocol import ClientContext, ClientReport, ClientTask


def nearest_centre(local: torch.Tensor, centres: list[torch.Tensor]) -> int:
    return int(torch.argmin(torch.stack([torch.linalg.vector_norm(local - c) for c in centres])))


class NearestCentre(LossChoice):
    """FeSEM as RR-Cluster's base: a selecting client trains from the centres' mean and reports
    the move of the centre nearest its local model; each client trains from a model of its own,
    so the cohort does not train as one group. A client that keeps its last choice (after the
    selection window) trains that centre, and the server moves the centres as for IFCA."""

    name = "fesem"
    trains_in_groups = False

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        if not task.extra.get("select"):
            return super().client_step(task, ctx)
        models = list(ctx.models)
        start = torch.stack(models).mean(0)
        report = self.rr.train_client(task, ctx, start, selected=True)
        local = start + getattr(report.update, "value", report.update)
        j = nearest_centre(local, models)
        report.update = postprocess(report.update, lambda _: local - models[j])
        report.cluster = j
        return report
