"""The algorithm protocol (DESIGN.md, "Algorithms"): plan a round, run a client step, run a server
step, evaluate. Algorithms are plain Python: they never import Ray, and the engine never imports
them; the runtime calls these methods wherever it places the work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from raysim.aggregation import noisy_sum, weighted_mean
from raysim.config import ConfigError, ExperimentConfig
from raysim.planning import CentralPlan, SampleLevelPlan, dpsgd_round_phase
from raysim.privacy import Phase
from raysim.protocol import (
    Charge,
    ClientContext,
    ClientReport,
    ClientTask,
    EvalReport,
    RoundPlan,
    ServerResult,
)
from raysim.sampling import sample_cohort
from raysim.training import TrainConfig


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class Environment:
    """What an algorithm may know about the population before the run (no data, no Ray)."""

    cfg: ExperimentConfig
    train_sizes: np.ndarray
    true_clusters: np.ndarray
    init_weights: torch.Tensor

    @property
    def num_clients(self) -> int:
        return len(self.train_sizes)


class Algorithm(ABC):
    name: ClassVar[str]
    privacy_modes: ClassVar[tuple[str, ...]] = ("none", "sample", "client")
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.cfg = env.cfg
        mode = self.cfg.privacy.mode
        if mode not in self.privacy_modes:
            raise ConfigError(
                f"privacy.mode: algorithm {self.name!r} does not support {mode!r}; "
                f"allowed: {', '.join(self.privacy_modes)}"
            )
        extra = self.cfg.algorithm.model_extra or {}
        try:
            self.params = self.Params(**extra)
        except Exception as exc:  # pydantic.ValidationError: re-worded with the config prefix
            raise ConfigError(f"algorithm: {exc}") from None

    # -- privacy -----------------------------------------------------------------------------
    def privacy_summary(self) -> dict[str, Any]:
        """Calibrated noise and planned spend, for `raysim privacy` and the run summary."""
        return {}

    # -- the round -----------------------------------------------------------------------------
    @abstractmethod
    def init_state(self, rng: np.random.Generator) -> Any: ...

    @abstractmethod
    def plan_round(self, state: Any, round: int, rng: np.random.Generator) -> RoundPlan: ...

    @abstractmethod
    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport: ...

    @abstractmethod
    def server_step(
        self, state: Any, plan: RoundPlan, reports: list[ClientReport], rng: np.random.Generator
    ) -> ServerResult: ...

    # -- evaluation ----------------------------------------------------------------------------
    @abstractmethod
    def plan_evaluation(self, state: Any) -> RoundPlan:
        """One task per client: which model (task.cluster) or personal state it is judged on."""

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        weights = task.state if task.state is not None else ctx.models[task.cluster or 0]
        x, y = ctx.test_data()
        res = ctx.trainer.evaluate(weights, x, y)
        acc = float("nan") if res.accuracy is None else res.accuracy
        return EvalReport(task.client_id, res.loss, acc, res.n, task.cluster)

    def assignments(self, state: Any) -> np.ndarray | None:
        """The cluster each client is currently assigned to (None: not a clustering method)."""
        return None


class FederatedAlgorithm(Algorithm):
    """The pieces most algorithms share: per-client training configs, the privacy plan of the
    configured mode, cohort sampling and the per-round privacy charges."""

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        self.plan = self.make_privacy_plan()

    # -- privacy ---------------------------------------------------------------------------------
    def dpsgd_schedule(self, n: int) -> list[Phase]:
        """The client's DP-SGD phases, one per round (override for heterogeneous schedules)."""
        return [dpsgd_round_phase(n, self.base_train_config())] * self.cfg.rounds

    def make_privacy_plan(self) -> SampleLevelPlan | CentralPlan | None:
        p, t = self.cfg.privacy, self.cfg.training
        if p.mode == "sample":
            return SampleLevelPlan(p, self.env.train_sizes, self.dpsgd_schedule)
        if p.mode == "client":
            return CentralPlan(
                p, self.cfg.rounds, t.sampling_rate, t.sampling, self.env.num_clients
            )
        return None

    def privacy_summary(self) -> dict[str, Any]:
        return self.plan.summary() if self.plan is not None else {}

    def privacy_charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        """Sample-level: each participant pays its round of DP-SGD (grouped by train size, as
        clients of one size share an event); client-level: the population pays one round."""
        if isinstance(self.plan, SampleLevelPlan):
            groups: dict[int, list[int]] = {}
            for rep in reports:
                groups.setdefault(int(self.env.train_sizes[rep.client_id]), []).append(
                    rep.client_id
                )
            charges = []
            for n, clients in groups.items():
                phase = self.dpsgd_schedule(n)[round - 1]
                charges.append(
                    Charge(
                        "dpsgd",
                        self.plan.round_event(clients[0], round),
                        clients,
                        {"z": self.plan.noise[n], "q": phase.sampling_rate, "steps": phase.steps},
                    )
                )
            return charges
        if isinstance(self.plan, CentralPlan):
            params = {
                "z": self.plan.noise,
                "q": self.plan.sampling_rate,
                "sampling": self.plan.sampling,
            }
            return [Charge("central_gaussian", self.plan.round_event(), None, params)]
        return []

    # -- clients ---------------------------------------------------------------------------------
    def base_train_config(self) -> TrainConfig:
        t = self.cfg.training
        return TrainConfig(
            lr=t.lr,
            batch_size=t.batch_size,
            local_epochs=t.local_epochs,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            physical_batch_size=t.physical_batch_size,
        )

    def train_config(self, client: int, **overrides: Any) -> TrainConfig:
        """The client's training config: the base one plus its DP noise / update clip."""
        p = self.cfg.privacy
        kwargs: dict[str, Any] = {}
        if isinstance(self.plan, SampleLevelPlan):
            kwargs.update(dp_noise_multiplier=self.plan.noise_multiplier(client), dp_clip=p.clip)
        elif isinstance(self.plan, CentralPlan):
            kwargs.update(update_clip=p.clip)
        kwargs.update(overrides)
        return replace(self.base_train_config(), **kwargs)

    def cohort(self, rng: np.random.Generator) -> np.ndarray:
        t = self.cfg.training
        return sample_cohort(self.env.num_clients, t.sampling_rate, t.sampling, rng)

    def task(self, client: int, cluster: int | None = 0, **extra: Any) -> ClientTask:
        return ClientTask(
            int(client),
            cluster=cluster,
            train=self.train_config(int(client)),
            extra=extra,
            weight=int(self.env.train_sizes[client]),
        )

    def train_client(
        self, task: ClientTask, ctx: ClientContext, weights: torch.Tensor, **extra: Any
    ) -> ClientReport:
        x, y = ctx.train_data()
        res = ctx.trainer.train(weights, x, y, task.train, ctx.generator("train"))
        return ClientReport(
            task.client_id, res.update, res.num_samples, task.cluster, res.train_loss, extra=extra
        )

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        return self.train_client(task, ctx, ctx.models[task.cluster or 0])

    def client_steps(
        self, tasks: list[ClientTask], ctxs: list[ClientContext]
    ) -> list[ClientReport]:
        """A fixed group of clients, decided by the engine from the cohort. Plain local training
        (this class's client_step) runs as one vectorized group; an algorithm with its own
        client_step gets it called once per client (override this to vectorize it too)."""
        if type(self).client_step is not FederatedAlgorithm.client_step:
            return [self.client_step(t, c) for t, c in zip(tasks, ctxs, strict=True)]
        return self.train_clients(
            tasks, ctxs, [c.models[t.cluster or 0] for t, c in zip(tasks, ctxs, strict=True)]
        )

    def train_clients(
        self, tasks: list[ClientTask], ctxs: list[ClientContext], weights: list[torch.Tensor]
    ) -> list[ClientReport]:
        """train_client for a group: the same reports, through trainer.train_many."""
        if not tasks:
            return []
        results = ctxs[0].trainer.train_many(
            weights,
            [c.train_data() for c in ctxs],
            [t.train for t in tasks],
            [c.generator("train") for c in ctxs],
        )
        return [
            ClientReport(t.client_id, r.update, r.num_samples, t.cluster, r.train_loss)
            for t, r in zip(tasks, results, strict=True)
        ]

    # -- server ----------------------------------------------------------------------------------
    def aggregate(
        self, model: torch.Tensor, reports: list[ClientReport], rng: np.random.Generator
    ) -> torch.Tensor:
        """One model's new weights from its members' updates: the weighted mean (no DP or
        sample-level DP), or the clipped, noised sum over the expected cohort (client-level)."""
        updates = [r.update for r in reports if r.update is not None]
        lr = self.cfg.algorithm.server_lr
        if isinstance(self.plan, CentralPlan):
            clip = self.cfg.privacy.clip
            sens = self.plan.sensitivity(clip)
            total = noisy_sum(updates, clip, sens, self.plan.noise, rng, model.numel())
            expected = self.cfg.training.sampling_rate * self.env.num_clients
            return model + lr * total / expected
        if not updates:
            return model
        return model + lr * weighted_mean(updates, [r.num_samples for r in reports])
