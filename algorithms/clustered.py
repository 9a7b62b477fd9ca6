"""What the clustered algorithms (rdpcfl, ifca, kmeans_cfl, oracle) share: one model per
cluster, a per-client assignment, per-cluster aggregation, and the clients' private
loss-based choice of a cluster (the exponential mechanism, charged to each client's ledger).

The private choice (utility and sensitivity):
- ``select_by="loss"``: utility = - mean over the client's n training samples of the
  per-sample loss clipped to [0, loss_clip]; sensitivity loss_clip / (n - 1), which bounds the
  change of that mean when one record is replaced (loss_clip / n), added (/(n + 1)) or removed
  (/(n - 1)).
  Under ``training.regression_loss=rmse`` the utility is minus the root of that mean (Eq. 14),
  and as |sqrt(a) - sqrt(b)| <= sqrt(|a - b|) its sensitivity is sqrt(loss_clip / (n - 1)).
- ``select_by="accuracy"``: utility = training accuracy; sensitivity 1 / (n - 1), likewise.
The mechanism picks cluster m with probability proportional to exp(eps * u_m / (2 * sens)),
which is eps-DP and eps-bounded-range (accounted as ``selection_event(eps, 1)``).

Accuracy is the default utility: early in DP training the cluster models' softmax outputs are
nearly flat, so train losses differ by ~0.1-0.2 nats (2.07 vs 2.30 measured on FMNIST after 6
rounds) while accuracies differ by 0.3-0.4, and with sensitivities loss_clip/n and 1/n the
accuracy gap is ~10x more informative per unit of eps. How sharp the choice is grows with
eps_select * n * gap: at n = 2666 (the paper's FMNIST clients) eps_select = 0.05 is enough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field

from algorithms.base import Environment, FederatedAlgorithm, broadcast_model
from raysim.config import ConfigModel
from raysim.models import build_from_spec, flat_params
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.view import Reports
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    EvalReport,
    RoundPlan,
)
from raysim.server.clustering import cluster_sizes


class SelectionParams(ConfigModel):
    """Config keys (``algorithm.*``) of the clients' private cluster choice."""

    model_config = ConfigDict(extra="forbid")
    eps_select: float = Field(0.05, gt=0)  # epsilon of each exponential-mechanism choice
    select_by: Literal["loss", "accuracy"] = "accuracy"
    loss_clip: float = Field(5.0, gt=0)  # per-sample loss bound for select_by="loss"
    # Fraction of the rounds in which clients choose (paper Fig. 6 "10%"); afterwards they keep
    # their last choice. 1.0: every round of the selection stage.
    selection_fraction: float = Field(1.0, gt=0, le=1)


@dataclass
class ClusterState:
    models: list[torch.Tensor]
    assigned: np.ndarray | None = None  # each client's current cluster
    info: dict[str, Any] = field(default_factory=dict)  # algorithm-specific (posteriors, E_c...)


# -------------------------------------------------------------------- client-side selection


def model_scores(
    trainer: Any, models: list[torch.Tensor], x: np.ndarray, y: np.ndarray, loss_clip: float
) -> tuple[np.ndarray, np.ndarray]:
    """Mean clipped per-sample loss and accuracy of each model on (x, y) (the trainer's)."""
    return trainer.scores(models, x, y, loss_clip)


def selection_utility(
    params: SelectionParams,
    losses: np.ndarray,
    accs: np.ndarray,
    n: int,
    regression_loss: str = "mse",
) -> tuple[np.ndarray, float]:
    """The client's utility of each cluster model and its sensitivity (module docstring);
    ``losses`` are the trainer's scores, root-mean under ``regression_loss="rmse"``."""
    utility = -losses if params.select_by == "loss" else accs
    bound = params.loss_clip if params.select_by == "loss" else 1.0
    sens = bound / max(n - 1, 1)
    if params.select_by == "loss" and regression_loss == "rmse":
        sens = math.sqrt(sens)
    return utility, sens


# ---------------------------------------------------------------------------- initialisation


def random_models(env: Environment, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` independently initialised models (IFCA's random cluster initialisation)."""
    shape, classes = env.feature_shape, env.num_classes
    out = []
    for m in range(count):
        model = build_from_spec(env.model_spec(), shape, classes, seed=seed * 1000 + m)
        w = flat_params(model)
        if w.numel() != env.init_weights.numel():
            raise ValueError("random_models: the built model does not match init_weights")
        out.append(w)
    return out


# ------------------------------------------------------------------------------- the base


class ClusteredAlgorithm(FederatedAlgorithm):
    """One model per cluster; subclasses decide who trains which model in each round."""

    privacy_modes = ("none", "sample")
    default_clusters = 4  # the papers' setups (R-DPCFL: 4 rotations; RR-Cluster: k in {2, 4})

    # -- privacy ---------------------------------------------------------------------------
    def reserved_selections(self) -> int:
        """Selections each client may make over the run (reserved in the calibration)."""
        return 0

    def privacy_needs(self) -> PrivacyNeeds:
        count = self.reserved_selections()
        eps = getattr(self.params, "eps_select", 0.0) if count else 0.0
        return PrivacyNeeds(self.dpsgd_schedule, (count, eps) if count else (0, 0.0))

    def selection_window(self) -> int:
        """How many rounds clients choose in (``selection_fraction`` of the run)."""
        return math.ceil(self.params.selection_fraction * self.cfg.rounds)

    # -- clients -----------------------------------------------------------------------------
    def selecting_task(self, client: int) -> ClientTask:
        return self.task(client, cluster=None, select=True)

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        return self.train_chosen([task], [ctx], [self.choose(task, ctx)])[0]

    def client_steps(
        self, tasks: list[ClientTask], ctxs: list[ClientContext]
    ) -> list[ClientReport]:
        """Each selecting client first chooses its model privately (its own scores and
        generator), then the group trains as one vectorized group, each client from the model
        it trains. The draws are per client and purpose, so choosing first changes no bit."""
        if not self.trains_in_groups():
            return [self.client_step(t, c) for t, c in zip(tasks, ctxs, strict=True)]
        choices = [self.choose(t, c) for t, c in zip(tasks, ctxs, strict=True)]
        return self.train_chosen(tasks, ctxs, choices)

    def trains_in_groups(self) -> bool:
        """Whether client_steps may choose, then train the group at once; a subclass with a
        client step of its own says when it may."""
        return type(self).client_step is ClusteredAlgorithm.client_step

    def train_chosen(
        self, tasks: list[ClientTask], ctxs: list[ClientContext], choices: list[tuple[int, Any]]
    ) -> list[ClientReport]:
        """Train each client on the model it chose (``choose``), as one group."""
        slots: list[int | None] = []
        extras: list[dict[str, Any]] = []
        for m, choice in choices:
            selected = choice is not None
            slots.append(m if selected else None)
            extras.append({"selected": True} if selected else {})  # the mode may drop it
        weights = [c.models[m] for c, (m, _) in zip(ctxs, choices, strict=True)]
        reports = self.train_clients(tasks, ctxs, weights, slots, extras)
        for report, ctx, (_, choice) in zip(reports, ctxs, choices, strict=True):
            if choice is not None:
                ctx.release.choice(report, choice)
        return reports

    def choose(self, task: ClientTask, ctx: ClientContext) -> tuple[int, Any]:
        """The model ``task`` trains, and the released choice (None: the server assigned it)."""
        if not task.extra.get("select"):
            return task.cluster or 0, None
        x, y = ctx.train_data()
        losses, accs = model_scores(ctx.trainer, list(ctx.models), x, y, self.params.loss_clip)
        utility, sens = selection_utility(
            self.params, losses, accs, len(x), self.cfg.training.regression_loss
        )
        choice = ctx.release.choose(utility, sens, self.params.eps_select, ctx.rng("select"))
        return int(getattr(choice, "value", choice)), choice

    # -- server ------------------------------------------------------------------------------
    def aggregate_clusters(
        self,
        models: list[torch.Tensor],
        reports: Reports,
        rng: np.random.Generator,
    ) -> list[torch.Tensor]:
        """Each cluster model += the mean of its members' updates, as the mode releases it
        (exactly: weights 1/|cluster|, Algorithm 1 line 26; each cluster a slot of the secure
        sums, or a noisy sum over the expected cohort)."""
        return [
            self.aggregate(
                model, reports, rng, m, [r for r in reports if r.cluster == m], equal_weights=True
            )
            for m, model in enumerate(models)
        ]

    def updated_assignments(self, state: ClusterState, reports: Reports) -> np.ndarray | None:
        """Last round's assignment, overwritten by the clusters the reporting clients trained.
        Where the server never learns them (secure aggregation: no message names a cluster) it
        keeps having none (None), not an assignment of everyone to one cluster, which would be
        scored (ARI 0) and planned by."""
        if state.assigned is None and all(r.cluster is None for r in reports):
            return state.assigned
        assigned = self.current_assignment(state)
        for r in reports:
            if r.cluster is not None:
                assigned[r.client_id] = r.cluster
        return assigned

    def current_assignment(self, state: ClusterState) -> np.ndarray:
        """A copy of the server's assignment; every client ``unassigned`` where it has none."""
        if state.assigned is None:
            return np.full(self.env.num_clients, self.unassigned, dtype=np.int64)
        return state.assigned.copy()

    unassigned = -1  # a client that never reported: the server has no cluster for it

    def cluster_metrics(self, assigned: np.ndarray | None, num_clusters: int) -> dict[str, Any]:
        if assigned is None:
            return {}
        sizes = cluster_sizes(assigned[assigned >= 0], num_clusters)
        return {"clusters_nonempty": sum(s > 0 for s in sizes), "cluster_size_min": min(sizes)}

    # -- evaluation --------------------------------------------------------------------------
    def evaluates_by_choice(self, state: ClusterState) -> bool:
        """Whether clients are judged on the model they would choose (IFCA's inference) rather
        than on the server's assignment: where the server does not know the choices, or the
        judged clients never train (``training.held_out_clients``: no assignment is theirs)."""
        return state.assigned is None or self.cfg.training.held_out_clients is not None

    def plan_evaluation(
        self, state: ClusterState, clients: Sequence[int] | None = None
    ) -> RoundPlan:
        """Each client on its assigned model; a client the server has no cluster for (never
        reported) on the model it would choose, as IFCA infers a new client's cluster."""
        by_choice = self.evaluates_by_choice(state)
        tasks = []
        for c in self.evaluated(clients):
            cluster = -1 if by_choice else int(state.assigned[c])
            if cluster < 0:
                tasks.append(self.task(c, cluster=0, select=True))
            else:
                tasks.append(self.task(c, cluster=cluster))
        return RoundPlan(tasks, state.models)

    def shared_evaluation_model(self, task: ClientTask) -> int | None:
        """A client that selects its model is judged alone (its choice needs its train data)."""
        overridden = type(self).client_evaluate is not ClusteredAlgorithm.client_evaluate
        return None if overridden or task.extra.get("select") else broadcast_model(task)

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        """With ``select``: on the cluster model with the lowest train loss."""
        if task.extra.get("select") and len(ctx.models) > 1:
            x, y = ctx.train_data()
            losses, _ = model_scores(ctx.trainer, list(ctx.models), x, y, self.params.loss_clip)
            task = ClientTask(task.client_id, cluster=int(np.argmin(losses)), train=task.train)
        return super().client_evaluate(task, ctx)

    def assignments(self, state: ClusterState) -> np.ndarray | None:
        """The server's assignment for the engine's ARI, a client it has none for counted in
        cluster 0 (the score needs a label for every client)."""
        return None if state.assigned is None else np.maximum(state.assigned, 0)

    @staticmethod
    def trained_cluster(assigned: np.ndarray, client: int) -> int:
        """The model a client trains after the selection window: its last choice, model 0
        where it never chose (a choice after the window would be a release the plan lacks)."""
        return max(int(assigned[client]), 0)
