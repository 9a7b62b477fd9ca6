"""The data that flows between the engine and an algorithm (see DESIGN.md, "One round").

The engine (runtime) moves these objects around; algorithms create and consume them. They are
plain dataclasses so an algorithm can be unit-tested without Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raysim.seeding import numpy_rng, torch_generator


@dataclass
class ClientTask:
    """What one virtual client is asked to do this round."""

    client_id: int
    cluster: int | None = None  # index into the round's broadcast models, if assigned
    train: Any = None  # a training.TrainConfig (per client: R-DPCFL calibrates z per client)
    state: Any = None  # the client's persistent state, held by the coordinator
    extra: dict[str, Any] = field(default_factory=dict)
    weight: int = 1  # relative cost, for balancing shards (the client's train size)


@dataclass
class ClientReport:
    client_id: int
    update: torch.Tensor | None = None
    num_samples: int = 0
    cluster: int | None = None  # the cluster the client trained / chose
    loss: float = float("nan")
    state: Any = None  # new persistent state; None keeps the old one
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalReport:
    client_id: int
    loss: float
    accuracy: float
    num_samples: int
    cluster: int | None = None


@dataclass
class RoundPlan:
    tasks: list[ClientTask]
    models: list[torch.Tensor]  # broadcast once per round (ray.put), indexed by ClientTask.cluster
    info: dict[str, Any] = field(default_factory=dict)
    round: int = 0  # set by the coordinator


@dataclass
class Charge:
    """A privacy cost: `event` (a dp_accounting DpEvent) charged to `clients` (None: all)."""

    mechanism: str
    event: Any
    clients: Sequence[int] | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerResult:
    state: Any
    charges: list[Charge] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientContext:
    """What a client step sees inside a worker: its data, the round's models, its generators."""

    client_id: int
    round: int
    seed: int
    trainer: Any  # training.LocalTrainer, resident in the worker
    dataset: Any  # data.FederatedDataset, zero-copy from the object store
    models: Sequence[torch.Tensor]

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dataset.client_train(self.client_id)

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dataset.client_test(self.client_id)

    def generator(self, purpose: str) -> torch.Generator:
        return torch_generator(self.seed, self.round, self.client_id, purpose)

    def rng(self, purpose: str) -> np.random.Generator:
        return numpy_rng(self.seed, self.round, self.client_id, purpose)
