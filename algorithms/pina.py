"""PINA (arXiv 2604.20596): DP clustered FL against an untrusted server, in two stages.

Only the abstract and section openings of the paper are available; the choices below are ours
and documented (docs/results/pina.md).

Stage 1, cluster model initialisation (``init``):

* ``"kmeans"`` (default). Round 1: a ``sketch_rate`` share of the clients trains its adapter from
  the (pretrained, frozen) base and releases ONE local-DP sketch of the update: a public seeded
  Gaussian projection to ``sketch_dim`` coordinates, clipped to S, Gaussian noise z_l * S
  (``Distributed.release_sketch``; z_l calibrated to ``sketch_epsilon_share`` of epsilon and
  charged to that client). The server runs k-means (sklearn) on the noisy sketches; the label of
  each sketching client is sent back to it in the next plan.
* ``"lloyd"``: DP federated Lloyd's through the secure sum, for when local noise swamps the
  separation. Clients never release a sketch: round 1 securely sums everyone's clean (clipped)
  sketch into one slot (the mean); C centroids start at the mean plus public random directions;
  each of the next ``lloyd_iters - 1`` rounds every client adds its clean sketch to the slot of
  its nearest centroid (hidden) and the centroids become the slot means. Each round is one
  secure-sum release (population-level, noise-cohort convention), far less noisy per cluster
  than a local release, at the price of rounds.

Then one initialisation round: every client of the cohort adds its clipped adapter update (from
the base) to the slot of its label (the server's k-means label, or for a client without one, the
centroid nearest to its own clean sketch, computed locally and hidden), and cluster model c
starts at base + slot mean c.

Stage 2, clustered training: each client evaluates the C cluster models on its training data,
picks the lowest loss (hidden: it is only the slot of its contribution), trains, clips and
contributes; cluster mean = slot sum / max(noisy count, 1); then the normality step
(``raysim.server.normality``): a Shapiro-Wilk test of each cluster's noisy mean decides its weight
(``gate``: not applied when indistinguishable from the DP noise; ``sw_weight``; ``off``). W_c,
p_c and the weight are recorded per round. Post-processing: no privacy cost.

Every round releases exactly one secure sum except the k-means sketch round, and the mode's
calibration covers all of them plus the one sketch before the run starts (``privacy_needs``).

``reselect=False`` with ``normality="off"`` is the k-means CFL baseline that is sound under
distributed DP (``KMeansSketchCFL``): per-round k-means on individual updates (``kmeans_cfl``)
needs the server to see each update, which secure aggregation forbids; here clients keep the
cluster of the one-shot k-means on private sketches and train it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, field_validator

from algorithms.base import FederatedAlgorithm
from algorithms.clustered import model_scores
from raysim.config import ConfigError, ConfigModel
from raysim.privacy import SKETCH_DIM
from raysim.privacy.mechanisms import sketch_projection
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.view import Reports
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    EvalReport,
    RoundPlan,
    ServerResult,
)
from raysim.seeding import SERVER, numpy_rng, public_seed
from raysim.server.clustering import kmeans
from raysim.server.normality import normality_weight

Phase = Literal["sketch", "lloyd", "init", "train"]


class PinaParams(ConfigModel):
    model_config = ConfigDict(extra="forbid")
    init: Literal["kmeans", "lloyd"] = "kmeans"
    sketch_dim: int = Field(SKETCH_DIM, ge=2)
    sketch_rate: float = Field(1.0, gt=0, le=1)  # share of clients that sketch (kmeans)
    sketch_epsilon_share: float = Field(0.5, gt=0, lt=1)  # of privacy.epsilon, for the sketch
    lloyd_iters: int = Field(4, ge=2)  # secure-sum rounds of stage 1 under init=lloyd
    kmeans_n_init: int = Field(10, gt=0)
    normality: Literal["gate", "sw_weight", "off"] = "gate"
    normality_alpha: float = Field(0.05, gt=0, lt=1)
    reselect: bool = True  # stage 2: lowest-loss choice every round (False: keep the label)
    loss_clip: float = Field(5.0, gt=0)  # per-sample loss bound of the (local) choice

    @field_validator("normality", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false


@dataclass
class PinaState:
    models: list[torch.Tensor]  # the C cluster models (before initialisation: the base)
    centroids: np.ndarray | None = None  # (C, sketch_dim), public (post-processing)
    labels: np.ndarray | None = None  # server's k-means label of each sketching client, -1 else
    info: dict[str, Any] = field(default_factory=dict)


class PINA(FederatedAlgorithm):
    name = "pina"
    Params = PinaParams
    privacy_modes = ("none", "distributed")
    default_clusters = 2  # the paper's rotated CIFAR-10 / FMNIST (C = 2)

    def __init__(self, env) -> None:
        super().__init__(env)
        if self.cfg.privacy.clip_quantile is not None:
            raise ConfigError(
                "privacy.clip_quantile: adaptive clipping learns the clip from update norms, "
                "and PINA's stage 1 sums sketches and centroid vectors under the same clip; use "
                "it with fedavg or ifca, or give PINA a fixed privacy.clip"
            )
        if self.cfg.rounds <= self.init_round():
            raise ConfigError(
                f"rounds: PINA needs more than {self.init_round()} rounds (stage 1 and the "
                f"initialisation round for algorithm.init={self.params.init!r}), got "
                f"{self.cfg.rounds}"
            )
        self.projection_seed = public_seed(self.cfg.seed, 1, "sketch_projection")

    # -- schedule and privacy ----------------------------------------------------------------
    def init_round(self) -> int:
        """The round whose secure sums initialise the cluster models."""
        return 2 if self.params.init == "kmeans" else self.params.lloyd_iters + 1

    def broadcast_width(self, round: int, dim: int) -> int:
        """Lloyd's rounds send the centroids of the clients' sketches, not models."""
        return self.params.sketch_dim if self.phase(round) == "lloyd" else dim

    def phase(self, round: int) -> Phase:
        if round < self.init_round():
            return "sketch" if self.params.init == "kmeans" else "lloyd"
        return "init" if round == self.init_round() else "train"

    def privacy_needs(self) -> PrivacyNeeds:
        kmeans_init = self.params.init == "kmeans"
        return PrivacyNeeds(
            self.dpsgd_schedule,
            secure_releases=self.cfg.rounds - (1 if kmeans_init else 0),
            local_release_share=self.params.sketch_epsilon_share if kmeans_init else 0.0,
            local_round=1 if kmeans_init else None,
            local_dim=self.params.sketch_dim if kmeans_init else None,
        )

    # -- the round ---------------------------------------------------------------------------
    def init_state(self, rng: np.random.Generator) -> PinaState:
        c = self.num_clusters()
        return PinaState([self.env.init_weights.clone() for _ in range(c)])

    def plan_round(self, state: PinaState, round: int, rng: np.random.Generator) -> RoundPlan:
        phase = self.phase(round)
        c = self.num_clusters()
        if phase == "sketch":
            rate = self.params.sketch_rate
            n = self.env.num_clients
            cohort = np.arange(n) if rate >= 1 else np.flatnonzero(rng.random(n) < rate)
            tasks = [self.task(i, phase=phase) for i in cohort]
            return RoundPlan(tasks, [self.env.init_weights], {"secure_sum": False})
        cohort = self.cohort(rng)
        if phase == "lloyd":
            mean_round = state.centroids is None
            models = (
                [torch.zeros(self.params.sketch_dim)]
                if mean_round
                else [torch.from_numpy(x).float() for x in state.centroids]
            )
            tasks = [self.task(i, phase=phase, mean_round=mean_round) for i in cohort]
            return RoundPlan(tasks, models)
        tasks = [self.client_task(state, i, phase) for i in cohort]
        models = [self.env.init_weights] * c if phase == "init" else state.models
        return RoundPlan(tasks, list(models))

    def client_task(self, state: PinaState, client: int, phase: Phase) -> ClientTask:
        """A task carrying what the client needs to find its stage-1 cluster: its k-means label
        (sent by the server) and the public centroids."""
        label = -1 if state.labels is None else int(state.labels[client])
        return self.task(client, phase=phase, label=label, centroids=state.centroids)

    # -- clients -----------------------------------------------------------------------------
    def base_update(self, task: ClientTask, ctx: ClientContext) -> tuple[torch.Tensor, int, dict]:
        """The client's adapter update trained from the base, computed once and kept on the
        client (its state) for the rest of stage 1."""
        state = dict(task.state) if isinstance(task.state, dict) else {}
        if "update" not in state:
            x, y = ctx.train_data()
            res = ctx.trainer.train_one(
                self.env.init_weights, x, y, task.train, ctx.generator("base")
            )
            state["update"], state["n"] = res.update.detach().clone(), res.num_samples
        return state["update"], int(state["n"]), state

    def clean_sketch(self, update: torch.Tensor) -> np.ndarray:
        """The projection of the update, clipped to S, without noise (never leaves the client
        except inside a secure sum)."""
        u = update.double().numpy()
        return sketch_projection(u, self.params.sketch_dim, self.projection_seed, self.clip)

    @property
    def clip(self) -> float:
        return float(self.cfg.privacy.clip)

    def contribute(
        self, report: ClientReport, task: ClientTask, ctx: ClientContext, v: torch.Tensor, slot: int
    ) -> None:
        """``v`` into ``slot``: the mode's release (clipped secure contribution under
        distributed; the plain vector and its cluster under mode none)."""
        ctx.release.update(report, task, SimpleNamespace(update=v), slot)
        ctx.release.choice(report, slot)

    def stage1_slot(self, task: ClientTask, update: torch.Tensor) -> int:
        label = int(task.extra.get("label", -1))
        if label >= 0:
            return label
        centroids = task.extra.get("centroids")
        if centroids is None:
            return 0
        d = ((np.asarray(centroids) - self.clean_sketch(update)) ** 2).sum(1)
        return int(np.argmin(d))

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        phase = task.extra["phase"]
        if phase == "train":
            return self.train_step(task, ctx)
        u, n, state = self.base_update(task, ctx)
        report = ClientReport(task.client_id, None, n, state=state)  # the mode may drop n
        if phase == "sketch":
            k, rng = self.params.sketch_dim, ctx.rng("sketch_noise")
            ctx.release.sketch(report, u.double().numpy(), k, self.projection_seed, rng)
            return report
        if phase == "lloyd":
            sketch = self.clean_sketch(u)
            slot = 0
            if not task.extra["mean_round"]:
                centroids = np.stack([m.double().numpy() for m in ctx.models])
                slot = int(np.argmin(((centroids - sketch) ** 2).sum(1)))
            self.contribute(report, task, ctx, torch.from_numpy(sketch).float(), slot)
            return report
        slot = self.stage1_slot(task, u)  # init
        state["slot"] = slot
        self.contribute(report, task, ctx, u, slot)
        return report

    def train_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        state = dict(task.state) if isinstance(task.state, dict) else {}
        x, y = ctx.train_data()
        if not self.params.reselect and "slot" not in state:
            u, _, state = self.base_update(task, ctx)
            state["slot"] = self.stage1_slot(task, u)
        if self.params.reselect:
            losses, _ = model_scores(ctx.trainer, list(ctx.models), x, y, self.params.loss_clip)
            slot = int(np.argmin(losses))
        else:
            slot = int(state["slot"])
        state.pop("update", None)  # stage 1 is over: the base update is no longer needed
        res = ctx.trainer.train_one(ctx.models[slot], x, y, task.train, ctx.generator("train"))
        report = ClientReport(task.client_id, None, res.num_samples, None, res.train_loss)
        report.state = {**state, "slot": slot}
        ctx.release.update(report, task, res, slot)
        ctx.release.choice(report, slot)
        return report

    # -- server ------------------------------------------------------------------------------
    def server_step(
        self,
        state: PinaState,
        plan: RoundPlan,
        view: Reports,
        rng: np.random.Generator,
    ) -> ServerResult:
        phase = self.phase(plan.round)
        c = self.num_clusters()
        if phase == "sketch":
            return self.cluster_sketches(state, view, rng)
        means, counts = view.slot_means(len(plan.models))
        metrics: dict[str, float] = {f"count_{s}": float(n) for s, n in enumerate(counts)}
        if phase == "lloyd":
            return ServerResult(self.lloyd_step(state, plan.round, means, counts), metrics)
        models = []
        for s in range(c):
            base = self.env.init_weights if phase == "init" else state.models[s]
            if means[s] is None or counts[s] < 0.5:  # empty slot: keep (post-processing)
                models.append(base.clone())
                continue
            weight = 1.0
            if phase == "train":
                rng_s = numpy_rng(self.cfg.seed, plan.round, SERVER, f"normality_{s}")
                res = normality_weight(
                    means[s].double().numpy(),
                    rng_s,
                    self.params.normality,
                    self.params.normality_alpha,
                )
                metrics.update({f"sw_W_{s}": res.statistic, f"sw_p_{s}": res.pvalue})
                weight = res.weight
            metrics[f"weight_{s}"] = weight
            models.append(self.server_opt.move(s, base, weight * means[s]))
        new = PinaState(models, state.centroids, state.labels, state.info)
        return ServerResult(new, metrics)

    def cluster_sketches(
        self, state: PinaState, view: Reports, rng: np.random.Generator
    ) -> ServerResult:
        """k-means on the released (noisy) sketches; the labels go back in the next plan."""
        sketches = [m for m in view if m.cluster is None and m.update is not None]
        c = self.num_clusters()
        labels = np.full(self.env.num_clients, -1, dtype=np.int64)
        if len(sketches) < c:
            return ServerResult(PinaState(state.models, None, labels, state.info))
        x = np.stack([m.update.double().numpy() for m in sketches])
        got = kmeans(x, c, int(rng.integers(2**31 - 1)), self.params.kmeans_n_init)
        ids = np.array([m.client_id for m in sketches])
        labels[ids] = got
        centroids = np.stack([x[got == k].mean(0) for k in range(c)])
        metrics = {
            "sketches": float(len(sketches)),
            "sketch_cluster_min": float(np.bincount(got, minlength=c).min()),
        }
        return ServerResult(PinaState(state.models, centroids, labels, state.info), metrics)

    def lloyd_step(self, state: PinaState, round: int, means: list, counts: list) -> PinaState:
        """DP Lloyd's on secure sums: the first round gives the mean, the centroids start there
        plus public random directions (scale-free: nearest-centroid picks the largest
        projection), then each round moves every non-empty centroid to its slot mean."""
        c, k = self.num_clusters(), self.params.sketch_dim
        if state.centroids is None:
            mean = means[0].double().numpy() if means[0] is not None else np.zeros(k)
            dirs = np.random.default_rng(public_seed(self.cfg.seed, round, "lloyd_init"))
            v = dirs.standard_normal((c, k))
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            centroids = mean + 0.01 * self.clip * v
        else:
            centroids = state.centroids.copy()
            for s in range(c):
                if means[s] is not None and counts[s] >= 0.5:
                    centroids[s] = means[s].double().numpy()
        return PinaState(state.models, centroids, state.labels, state.info)

    # -- evaluation --------------------------------------------------------------------------
    def plan_evaluation(self, state: PinaState, clients: Sequence[int] | None = None) -> RoundPlan:
        tasks = [self.client_task(state, i, "eval") for i in self.evaluated(clients)]
        return RoundPlan(tasks, list(state.models))

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        """On the cluster model the client would train: its lowest-loss model (PINA), or its
        stage-1 cluster when it keeps it (``reselect=False``) and knows it."""
        slot = task.state.get("slot") if isinstance(task.state, dict) else None
        if slot is None and not self.params.reselect and int(task.extra.get("label", -1)) >= 0:
            slot = int(task.extra["label"])
        if (slot is None or self.params.reselect) and len(ctx.models) > 1:
            x, y = ctx.train_data()
            losses, _ = model_scores(ctx.trainer, list(ctx.models), x, y, self.params.loss_clip)
            slot = int(np.argmin(losses))
        slot = int(slot or 0)
        x, y = ctx.test_data()
        res = ctx.trainer.evaluate(ctx.models[slot], x, y)
        acc = float("nan") if res.accuracy is None else res.accuracy
        return EvalReport(task.client_id, res.loss, acc, res.n)

    def choices(self, state: PinaState) -> np.ndarray | None:
        """The server's k-means labels (kmeans init; -1: client did not sketch)."""
        return state.labels


class KMeansSketchParams(PinaParams):
    reselect: bool = False
    normality: Literal["gate", "sw_weight", "off"] = "off"


class KMeansSketchCFL(PINA):
    """k-means CFL under distributed DP: one-shot k-means on the local-DP sketches, then each
    client keeps its cluster (no loss-based re-selection, no normality step). See the module
    docstring for why per-round k-means on updates is not possible against this server."""

    name = "kmeans_cfl_sketch"
    Params = KMeansSketchParams
