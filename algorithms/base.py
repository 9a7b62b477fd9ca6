"""The algorithm protocol (docs/architecture.md, "Adding an algorithm"): plan a round, run a
client step, run a server step, evaluate. Algorithms are plain Python: they never import Ray,
and the engine never imports them; the runtime calls these methods wherever it places the work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import ConfigDict, ValidationError

from raysim.config import ConfigError, ConfigModel, ExperimentConfig, format_validation_error
from raysim.models import ModelSpec, model_spec
from raysim.privacy import Phase
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.planning import dpsgd_round_phase
from raysim.privacy.sampling import sample_cohort
from raysim.privacy.view import Reports
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    EvalReport,
    Message,
    RoundPlan,
    ServerResult,
)
from raysim.server.aggregation import ServerOptimizer
from raysim.training import TrainConfig


class NoParams(ConfigModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class Environment:
    """What an algorithm may know about the population before the run: no data, no Ray, and no
    ground truth (``ground_truth`` is given only to an algorithm that declares
    ``uses_ground_truth``, i.e. the oracle)."""

    cfg: ExperimentConfig
    train_sizes: np.ndarray
    init_weights: torch.Tensor
    feature_shape: tuple[int, ...] = ()
    num_classes: int = 0
    ground_truth: np.ndarray | None = None
    model: ModelSpec | None = None  # the engine's spec of the model (None: from ``cfg``)

    @property
    def num_clients(self) -> int:
        return len(self.train_sizes)

    def model_spec(self) -> ModelSpec:
        """What to build for a model of the run's kind. The engine gives it, made where the
        data config is held: under an untrusted server ``cfg`` has none, and a model pretrained
        on the public slice needs that slice's name (public, unlike the data config)."""
        return self.model if self.model is not None else model_spec(self.cfg)


class Algorithm(ABC):
    name: ClassVar[str]
    privacy_modes: ClassVar[tuple[str, ...]] = ("none", "sample", "client")
    Params: ClassVar[type[ConfigModel]] = NoParams
    uses_ground_truth: ClassVar[bool] = False  # only an oracle may
    # Default of ``algorithm.num_clusters`` for algorithms with several models (None: one model,
    # or the algorithm chooses)
    default_clusters: ClassVar[int | None] = None
    # False: the server keeps no model it moves by the clients' updates (local; dp_group, whose
    # models are means of released points), so the algorithm.server_* optimizer has no use
    moves_models: ClassVar[bool] = True

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.cfg = env.cfg
        m = self.cfg.algorithm.num_clusters
        if m is not None and m > env.num_clients:
            raise ConfigError(
                f"algorithm.num_clusters={m} is more than the {env.num_clients} clients "
                f"(data.num_clients): at most {env.num_clients}, or leave it out"
            )
        extra = self.cfg.algorithm.model_extra or {}
        try:
            self.params = self.Params(**extra)
        except ValidationError as exc:  # re-worded like every config error, keys prefixed
            msg = format_validation_error(exc, self.Params, prefix="algorithm")
            raise ConfigError(
                msg.replace("unknown field", f"{self.name} takes no such key")
            ) from None
        self.server_opt = ServerOptimizer(self.cfg.algorithm)
        if not self.moves_models and (keys := self.cfg.algorithm.server_keys_set()):
            raise ConfigError(
                f"{', '.join(keys)}: algorithm {self.name!r} has no server model to move; "
                "leave them out"
            )

    # -- privacy -----------------------------------------------------------------------------
    def privacy_needs(self) -> PrivacyNeeds:
        """What the engine's privacy mode must calibrate for this algorithm's schedule."""
        return PrivacyNeeds(lambda n: [])

    def privacy_summary(self, view: Reports) -> dict[str, Any]:
        """What the algorithm adds to the mode's calibrated summary (``raysim privacy``, the
        run summary), asked of an empty ``view`` of the mode (what its releases carry)."""
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
        self,
        state: Any,
        plan: RoundPlan,
        reports: Reports,
        rng: np.random.Generator,
    ) -> ServerResult:
        """``reports``: what the privacy mode lets the server see (its ``admit``): its
        messages and the aggregations it releases (``raysim.privacy.view``)."""

    # -- evaluation ----------------------------------------------------------------------------
    @abstractmethod
    def plan_evaluation(self, state: Any, clients: Sequence[int] | None = None) -> RoundPlan:
        """One task per client of ``clients`` (the engine's evaluation cohort, sorted; None:
        every client): which model (task.cluster) or personal state it is judged on."""

    def evaluated(self, clients: Sequence[int] | None) -> Sequence[int]:
        """The clients an evaluation plans for: the engine's cohort, or the whole population."""
        return range(self.env.num_clients) if clients is None else [int(c) for c in clients]

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        model = broadcast_model(task)
        weights = task.state if model is None else ctx.models[model]
        x, y = ctx.test_data()
        return _report(task, ctx.trainer.evaluate(weights, x, y))

    def client_evaluations(
        self, tasks: list[ClientTask], ctxs: list[ClientContext]
    ) -> list[EvalReport]:
        """A fixed group of clients' evaluations, decided by the engine from client ids. The
        clients judged on the same broadcast model share its forward passes
        (``trainer.evaluate_many``); the others are judged one at a time by client_evaluate."""
        out: list[EvalReport | None] = [None] * len(tasks)
        shared: dict[int, list[int]] = {}
        for i, (task, ctx) in enumerate(zip(tasks, ctxs, strict=True)):
            model = self.shared_evaluation_model(task)
            if model is None:
                out[i] = self.client_evaluate(task, ctx)
            else:
                shared.setdefault(model, []).append(i)
        for model, members in shared.items():
            trainer, weights = ctxs[members[0]].trainer, ctxs[members[0]].models[model]
            results = trainer.evaluate_many(weights, [ctxs[i].test_data() for i in members])
            for i, res in zip(members, results, strict=True):
                out[i] = _report(tasks[i], res)
        return out  # type: ignore[return-value]

    def shared_evaluation_model(self, task: ClientTask) -> int | None:
        """The broadcast model ``task`` is judged on, where client_evaluate would judge it on that
        model alone (so clients may share forward passes); None: client_evaluate judges it."""
        if type(self).client_evaluate is not Algorithm.client_evaluate:
            return None
        return broadcast_model(task)

    def assignments(self, state: Any) -> np.ndarray | None:
        """The cluster each client is currently assigned to (None: not a clustering method)."""
        return None

    def round_grouping(self, state: Any) -> Any:
        """The last round's grouping of the cohort (``raysim.server.rebalancing.Grouping``: the ids
        the server grouped by and the final groups), for the engine's diagnostics; None: none."""
        return None

    def choices(self, state: Any) -> np.ndarray | None:
        """Where clients choose their cluster: each one's last choice (-1: none yet), for the
        engine's clustering accuracy (None: not reported)."""
        return None


class FederatedAlgorithm(Algorithm):
    """The pieces most algorithms share: per-client training configs, the privacy schedule
    the engine's mode calibrates for, cohort sampling and aggregation."""

    # -- privacy ---------------------------------------------------------------------------------
    def dpsgd_schedule(self, n: int) -> list[Phase]:
        """The client's DP-SGD phases, one per round (override for heterogeneous schedules)."""
        return [dpsgd_round_phase(n, self.base_train_config())] * self.cfg.rounds

    def privacy_needs(self) -> PrivacyNeeds:
        return PrivacyNeeds(self.dpsgd_schedule)

    def broadcast_width(self, round: int, dim: int) -> int:
        """The width of the models training round ``round`` broadcasts, for a client model of
        ``dim`` weights: the clients take no other
        (the devices' ``check_broadcast``). An algorithm whose rounds send something
        else says so here, from its plan alone."""
        return dim

    def may_select(self, round: int) -> bool:
        """Whether clients may make a private choice in ``round`` (the plan's worst case)."""
        return False

    def num_clusters(self) -> int:
        """``algorithm.num_clusters``, or the algorithm's stated default (never the truth)."""
        m = self.cfg.algorithm.num_clusters
        return int(m if m is not None else (self.default_clusters or 1))

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
        """The client's training config: the base one with the algorithm's ``overrides``
        (what the privacy mode requires, the engine stamps on the round's tasks)."""
        return replace(self.base_train_config(), **overrides)

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
        self,
        task: ClientTask,
        ctx: ClientContext,
        weights: torch.Tensor,
        slot: int | None = None,
        **extra: Any,
    ) -> ClientReport:
        """Train from ``weights``; the update goes on the report as the privacy mode releases it
        (``slot``: the model trained, where a secure aggregation adds it)."""
        return self.train_clients([task], [ctx], [weights], [slot], [extra])[0]

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
        self,
        tasks: list[ClientTask],
        ctxs: list[ClientContext],
        weights: list[torch.Tensor],
        slots: list[int | None] | None = None,
        extras: list[dict[str, Any]] | None = None,
        keep: bool = False,
    ) -> list[ClientReport]:
        """train_client for a group, through trainer.train_many (one vectorized group where the
        trainer can), each update released by the privacy mode (``keep``: kept on the client
        as its personal model, ``state`` = weights + update, and charged as the mode says)."""
        if not tasks:
            return []
        slots = slots or [None] * len(tasks)
        extras = extras or [{} for _ in tasks]
        results = ctxs[0].trainer.train_many(
            weights,
            [c.train_data() for c in ctxs],
            [t.train for t in tasks],
            [c.generator("train") for c in ctxs],
        )
        reports = []
        for t, c, w, r, slot, extra in zip(
            tasks, ctxs, weights, results, slots, extras, strict=True
        ):
            report = ClientReport(
                t.client_id, None, r.num_samples, t.cluster, r.train_loss, extra=extra
            )
            if keep:
                report.state = w + c.release.keep(report, t, r)
            else:
                c.release.update(report, t, r, slot)
            reports.append(report)
        return reports

    # -- server ----------------------------------------------------------------------------------
    def aggregate(
        self,
        model: torch.Tensor,
        reports: Reports,
        rng: np.random.Generator,
        slot: int = 0,
        members: list[Message] | None = None,
        **how: Any,
    ) -> torch.Tensor:
        """One model's new weights from its members' updates (default: every message), as the
        privacy mode releases their mean (``Reports.mean``: exact, noisy or secure; ``how``
        its options), moved by the server's optimizer; unchanged where nothing was released."""
        step = reports.mean(members, rng, like=model, slot=slot, **how)
        return model if step is None else self.server_opt.move(slot, model, step)


def broadcast_model(task: ClientTask) -> int | None:
    """The broadcast model a task is judged on; None: its own (``task.state``, a personal
    model)."""
    return None if task.state is not None else task.cluster or 0


def _report(task: ClientTask, res: Any) -> EvalReport:
    acc = float("nan") if res.accuracy is None else res.accuracy
    return EvalReport(task.client_id, res.loss, acc, res.n)
