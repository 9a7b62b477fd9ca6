"""The data that flows between the engine and an algorithm (docs/architecture.md, "One round").

The engine (runtime) moves these objects around; algorithms create and consume them. They are
plain dataclasses so an algorithm can be unit-tested without Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.seeding import numpy_rng, torch_generator

if TYPE_CHECKING:  # annotations only: `raysim run`'s driver reads these reports without torch
    import torch


class TrustBoundaryError(RuntimeError):
    """A report crossed to the server in a form its privacy mode forbids (a bug in an algorithm,
    never a user mistake)."""


class SealedUpdate:
    """A client's update as a trusted server's process holds it under client-level DP: only the
    mode's noisy sum opens it, so a server step cannot publish the exact update or mean. It has
    no arithmetic, no array view and refuses to be pickled (into a checkpoint or a message).
    Within one Python process this stops an algorithm that uses the protocol, not one that
    digs into private attributes."""

    __slots__ = ("__value",)

    def __init__(self, value: Any) -> None:
        self.__value = value

    def _open(self) -> Any:
        """The value, for ``PrivacyMode.noisy_sum`` only."""
        return self.__value

    def __repr__(self) -> str:
        return "SealedUpdate(<client update>)"

    def __reduce__(self) -> Any:
        raise TrustBoundaryError("a sealed client update never leaves the round it crossed in")


@dataclass
class ClientTask:
    """What one virtual client is asked to do this round."""

    client_id: int
    cluster: int | None = None  # index into the round's broadcast models, if assigned
    train: Any = None  # a training.TrainConfig (per client: R-DPCFL calibrates z per client)
    # the client's persistent state: held by the round loop where the server is trusted, by the
    # clients' side (runtime.client_side) where it is not; never given to the server step
    state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    weight: int = 1  # relative cost, for balancing shards (the client's train size)
    # the round's update clip where it is learnt behind secure aggregation (adaptive clipping
    # under privacy.mode distributed): stamped by the engine, never by the algorithm
    clip: float | None = None


@dataclass
class SecureContribution:
    """A client's input to the engine's secure aggregator: its clipped vector in one slot (e.g.
    its cluster), and optionally its share of the noise. The server never sees one of these:
    only the per-slot sums (``SecureSums``)."""

    slot: int
    vector: torch.Tensor
    noise_share: torch.Tensor | None = None
    # adaptive clipping: whether the update's norm was at most the round's clip
    under_clip: bool | None = None


@dataclass
class ClientReport:
    """What a client step returns. ``update``, ``num_samples``, ``cluster``, ``extra`` and
    ``contribution`` are for the server, in the form the privacy mode requires (``Released``
    where it must be sanitized); ``loss``, ``state`` and ``withheld`` stay with the client."""

    client_id: int
    update: Any = None  # torch.Tensor, or a privacy.Released tensor
    num_samples: int = 0
    cluster: Any = None  # the cluster the client trained / chose: int, or a Released choice
    loss: float = float("nan")  # stays with the client
    state: Any = None  # new persistent state; None keeps the old one (stays with the client)
    extra: dict[str, Any] = field(default_factory=dict)
    contribution: SecureContribution | None = None  # under secure aggregation
    # the contribution went to the secure aggregator of the clients' side (runtime.client_side)
    deposited: bool = False
    withheld: list[Any] = field(default_factory=list)  # Released values the client kept

    def withhold_update(self) -> Any:
        """Keep the update on the client (e.g. a personal model): still charged, never sent."""
        if self.update is not None:
            self.withheld.append(self.update)
        value = getattr(self.update, "value", self.update)
        self.update = None
        return value


@dataclass
class Message:
    """What crosses to the server from one client, once its privacy mode admitted it: plain
    values (sanitized as the mode requires); no loss, no client state."""

    client_id: int
    update: torch.Tensor | SealedUpdate | None = None  # SealedUpdate under client-level DP
    num_samples: int = 0
    cluster: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SecureSums:
    """All the server receives from a round under secure aggregation: per slot, the noisy sum
    of the members' clipped vectors and a noisy member count."""

    sums: list[torch.Tensor]
    counts: list[float]
    # adaptive clipping: per slot, the noisy sum of the members' centred clip bits (+-1/2)
    under_clip: list[float] | None = None

    def means(self) -> list[torch.Tensor]:
        return [s / max(c, 1.0) for s, c in zip(self.sums, self.counts, strict=True)]


@dataclass(frozen=True)
class Aborted:
    """A round whose secure aggregation released nothing (``privacy.shortfall: abort``): fewer
    members than the clients' noise shares were sized for. The server step does not run."""

    members: int
    needed: float


@dataclass
class EvalReport:
    """A client's score on its test data, for the engine's metrics against the truth. It names
    no model choice: under secure aggregation the choice stays hidden in the client's slot, and
    the evaluation must not carry it to the server's process."""

    client_id: int
    loss: float
    accuracy: float
    num_samples: int


@dataclass
class RoundPlan:
    tasks: list[ClientTask]
    models: list[torch.Tensor]  # broadcast once per round (ray.put), indexed by ClientTask.cluster
    info: dict[str, Any] = field(default_factory=dict)
    round: int = 0  # set by the coordinator
    # the server waits for every planned client (R-DPCFL's clustering round needs them all):
    # training.client_dropout makes none of them unavailable
    waits_for_all: bool = False


@dataclass
class Charge:
    """A privacy cost: `event` (a dp_accounting DpEvent) charged to `clients` (None: all)."""

    mechanism: str
    event: Any
    clients: Sequence[int] | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerResult:
    """The server's new state and its metrics. There is no way to charge privacy here: the engine
    charges from what was released (``raysim.privacy.Released``)."""

    state: Any
    metrics: dict[str, float] = field(default_factory=dict)


class HiddenData:
    """What an untrusted server's algorithm holds in place of ``cfg.data``: reading any field
    (dataset, root, partition) is refused, so ``build_federated_dataset(cfg.data, cfg.seed)``
    cannot rebuild the population in the server's process."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy and pickle probe for dunders: not the data config
            raise AttributeError(name)
        raise TrustBoundaryError(
            f"data.{name}: the data config stays with the experimenter under an untrusted server"
        )

    def __repr__(self) -> str:
        return "HiddenData()"


class OwnRows:
    """A client's view of the population: its own train and test rows, and the shape of the
    task. No other client's rows, no true cluster and no provenance (``meta``): a client step
    that asks for them gets a TrustBoundaryError or an AttributeError."""

    __slots__ = ("__rows", "client_id")

    def __init__(self, dataset: Any, client_id: int) -> None:
        self.__rows = dataset
        self.client_id = int(client_id)

    def _own(self, i: int) -> None:
        if int(i) != self.client_id:
            raise TrustBoundaryError(
                f"client {self.client_id} asked for client {i}'s rows: a client sees its own only"
            )

    def client_train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self._own(i)
        return self.__rows.client_train(self.client_id)

    def client_test(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self._own(i)
        return self.__rows.client_test(self.client_id)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.__rows.feature_shape

    @property
    def num_classes(self) -> int:
        return self.__rows.num_classes

    @property
    def task(self) -> str:
        return self.__rows.task


@dataclass
class ClientContext:
    """What a client step sees inside a worker: its data, the round's models, its generators."""

    client_id: int
    round: int
    seed: int
    trainer: Any  # training.LocalTrainer, resident in the worker
    dataset: Any  # the client's own rows (OwnRows over the zero-copy FederatedDataset)
    models: Sequence[torch.Tensor]
    # the client's side of the privacy mode (``raysim.privacy.modes.releaser``), given by the engine
    release: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, OwnRows) or self.dataset.client_id != self.client_id:
            self.dataset = OwnRows(self.dataset, self.client_id)
        if self.release is not None:
            self.release = self.release.for_client(self)

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dataset.client_train(self.client_id)

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dataset.client_test(self.client_id)

    def generator(self, purpose: str) -> torch.Generator:
        return torch_generator(self.seed, self.round, self.client_id, purpose)

    def rng(self, purpose: str) -> np.random.Generator:
        return numpy_rng(self.seed, self.round, self.client_id, purpose)
