"""What the clustered algorithms (rdpcfl, ifca, kmeans_cfl, oracle) share: one model per
cluster, a per-client assignment, per-cluster aggregation, and the clients' private
loss-based choice of a cluster (the exponential mechanism, charged to each client's ledger).

The private choice (utility and sensitivity):
- ``select_by="loss"``: utility = - mean over the client's n training samples of the
  per-sample loss clipped to [0, loss_clip]; sensitivity loss_clip / (n - 1), which bounds the
  change of that mean when one record is replaced (loss_clip / n), added (/(n + 1)) or removed
  (/(n - 1)).
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

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from algorithms.base import Environment, FederatedAlgorithm
from raysim.aggregation import weighted_mean
from raysim.clustering import cluster_sizes
from raysim.models import build_model, flat_params, load_flat_, model_kwargs
from raysim.planning import CentralPlan, SampleLevelPlan
from raysim.privacy import exponential_select, selection_event
from raysim.protocol import Charge, ClientContext, ClientReport, ClientTask, RoundPlan
from raysim.training.losses import as_tensor, per_sample_loss, targets


class SelectionParams(BaseModel):
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


@torch.no_grad()
def model_scores(
    trainer: Any, models: list[torch.Tensor], x: np.ndarray, y: np.ndarray, loss_clip: float
) -> tuple[np.ndarray, np.ndarray]:
    """Mean clipped per-sample loss and accuracy of each model on (x, y), on the worker's
    resident model (no copy of the data)."""
    model, dev = trainer.model, trainer.device
    xt = as_tensor(x).to(dev, torch.float32)
    yt = targets(trainer.task, as_tensor(y).to(dev))
    n = xt.shape[0]
    losses, accs = np.zeros(len(models)), np.zeros(len(models))
    model.eval()
    for k, w in enumerate(models):
        load_flat_(model, w)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        correct = 0
        for i in range(0, n, 1024):
            out = model(xt[i : i + 1024])
            loss = per_sample_loss(trainer.task, out, yt[i : i + 1024]).clamp(0, loss_clip)
            total += loss.sum(dtype=torch.float64)
            if trainer.task == "classification":
                correct += int((out.argmax(1) == yt[i : i + 1024]).sum())
        losses[k] = float(total) / n
        accs[k] = correct / n
    return losses, accs


def choose_cluster(
    params: SelectionParams,
    private: bool,
    losses: np.ndarray,
    accs: np.ndarray,
    n: int,
    rng: np.random.Generator,
) -> int:
    """The client's cluster: exponential mechanism under DP, else the exact best."""
    utility = -losses if params.select_by == "loss" else accs
    if not private:
        return int(np.argmax(utility))
    bound = params.loss_clip if params.select_by == "loss" else 1.0
    sensitivity = bound / max(n - 1, 1)
    return int(exponential_select(utility, params.eps_select, sensitivity, rng))


# ---------------------------------------------------------------------------- initialisation


_SHAPES = {  # (feature shape, classes) of the built-in datasets, when Environment lacks them
    "digits": ((1, 8, 8), 10),
    "mnist": ((1, 28, 28), 10),
    "fmnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10),
}


def random_models(env: Environment, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` independently initialised models (IFCA's random cluster initialisation)."""
    cfg = env.cfg
    shape = getattr(env, "feature_shape", None)
    classes = getattr(env, "num_classes", None)
    if shape is None or classes is None:
        if cfg.data.dataset == "synthetic_linear":
            shape, classes = (cfg.data.dim,), 0
        else:
            shape, classes = _SHAPES[cfg.data.dataset]
    kwargs = model_kwargs(cfg.model)
    out = []
    for m in range(count):
        model = build_model(cfg.model.name, shape, classes, seed=seed * 1000 + m, **kwargs)
        w = flat_params(model)
        if w.numel() != env.init_weights.numel():
            raise ValueError("random_models: the built model does not match init_weights")
        out.append(w)
    return out


# ------------------------------------------------------------------------------- the base


class ClusteredAlgorithm(FederatedAlgorithm):
    """One model per cluster; subclasses decide who trains which model in each round."""

    privacy_modes = ("none", "sample")

    @property
    def private(self) -> bool:
        return isinstance(self.plan, SampleLevelPlan)

    def default_num_clusters(self) -> int:
        m = self.cfg.algorithm.num_clusters
        return int(m) if m is not None else int(len(np.unique(self.env.true_clusters)))

    # -- privacy ---------------------------------------------------------------------------
    def reserved_selections(self) -> int:
        """Selections each client may make over the run (reserved in the calibration)."""
        return 0

    def make_privacy_plan(self) -> SampleLevelPlan | CentralPlan | None:
        count = self.reserved_selections()
        if self.cfg.privacy.mode == "sample" and count > 0:
            p = self.cfg.privacy
            eps = self.params.eps_select
            return SampleLevelPlan(p, self.env.train_sizes, self.dpsgd_schedule, (count, eps))
        return super().make_privacy_plan()

    def privacy_summary(self) -> dict[str, Any]:
        out = super().privacy_summary()
        if self.reserved_selections():
            out["reserved_selections"] = self.reserved_selections()
            out["eps_select"] = self.params.eps_select
        return out

    def may_select(self, round: int) -> bool:
        """Whether clients may choose privately in ``round`` (for the worst-case plan)."""
        return False

    def worst_case_charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        """The round's charges if every reporting client made every choice it may make: what
        the calibration reserved, for ``raysim privacy``."""
        if not self.may_select(round):
            return self.privacy_charges(round, reports)
        chose = [replace(r, extra={**r.extra, "selected": True}) for r in reports]
        return self.privacy_charges(round, reports) + self.selection_charges(chose)

    def selection_charges(self, reports: list[ClientReport]) -> list[Charge]:
        chose = [r.client_id for r in reports if r.extra.get("selected")]
        if not chose or not self.private:
            return []
        eps = self.params.eps_select
        event = selection_event(eps, 1)
        return [Charge("exponential_selection", event, chose, {"epsilon": eps})]

    # -- clients -----------------------------------------------------------------------------
    def selecting_task(self, client: int) -> ClientTask:
        return self.task(client, cluster=None, select=True)

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        if not task.extra.get("select"):
            return self.train_client(task, ctx, ctx.models[task.cluster or 0])
        x, y = ctx.train_data()
        losses, accs = model_scores(ctx.trainer, list(ctx.models), x, y, self.params.loss_clip)
        m = choose_cluster(self.params, self.private, losses, accs, len(x), ctx.rng("select"))
        report = self.train_client(task, ctx, ctx.models[m], selected=True)
        report.cluster = m
        return report

    # -- server ------------------------------------------------------------------------------
    def aggregate_clusters(
        self, models: list[torch.Tensor], reports: list[ClientReport], rng: np.random.Generator
    ) -> list[torch.Tensor]:
        """Each cluster model += the plain mean of its members' updates (weights 1/|cluster|,
        Algorithm 1 line 26); client-level plans defer to the base (noisy) aggregation."""
        out = []
        lr = self.cfg.algorithm.server_lr
        for m, model in enumerate(models):
            members = [r for r in reports if r.cluster == m and r.update is not None]
            if isinstance(self.plan, CentralPlan):
                out.append(self.aggregate(model, members, rng))
            elif members:
                mean = weighted_mean([r.update for r in members], [1.0] * len(members))
                out.append(model + lr * mean)
            else:
                out.append(model)
        return out

    def cluster_metrics(self, assigned: np.ndarray | None, num_clusters: int) -> dict[str, Any]:
        if assigned is None:
            return {}
        sizes = cluster_sizes(assigned, num_clusters)
        return {"clusters_nonempty": sum(s > 0 for s in sizes), "cluster_size_min": min(sizes)}

    # -- evaluation --------------------------------------------------------------------------
    def plan_evaluation(self, state: ClusterState) -> RoundPlan:
        assigned = state.assigned
        tasks = [
            self.task(c, cluster=0 if assigned is None else int(assigned[c]))
            for c in range(self.env.num_clients)
        ]
        return RoundPlan(tasks, state.models)

    def assignments(self, state: ClusterState) -> np.ndarray | None:
        return None if state.assigned is None else np.asarray(state.assigned)
