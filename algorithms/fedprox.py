"""FedProx (Li et al. 2020): FedAvg whose clients add (mu/2)||w - w_global||^2 to the local loss,
so heterogeneous clients drift less. The proximal term lives in the trainer (``prox_mu``, centred
on the weights received); privacy and aggregation are DP-FedAvg's."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from algorithms.fedavg import FedAvg
from raysim.config import ConfigModel
from raysim.protocol import ClientTask


class FedProxParams(ConfigModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(0.01, ge=0)


class FedProx(FedAvg):
    name = "fedprox"
    privacy_modes = ("none", "sample", "client")
    Params = FedProxParams

    def task(self, client: int, cluster: int | None = 0, **extra: object) -> ClientTask:
        t = super().task(client, cluster, **extra)
        t.train = self.train_config(int(client), prox_mu=self.params.mu)
        return t
