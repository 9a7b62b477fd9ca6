"""Global: DP-FedAvg. One model for everyone; sample-level DP-SGD on the clients, or
client-level central DP (clip each update, Gaussian noise on the sum; McMahan et al. 2018)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from algorithms.base import FederatedAlgorithm
from raysim.protocol import Message, RoundPlan, ServerResult


@dataclass
class GlobalState:
    model: torch.Tensor


class FedAvg(FederatedAlgorithm):
    name = "fedavg"
    privacy_modes = ("none", "sample", "client", "distributed", "dprivacy")

    def init_state(self, rng: np.random.Generator) -> GlobalState:
        return GlobalState(self.env.init_weights.clone())

    def plan_round(self, state: GlobalState, round: int, rng: np.random.Generator) -> RoundPlan:
        return RoundPlan([self.task(c) for c in self.cohort(rng)], [state.model])

    def server_step(
        self,
        state: GlobalState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        return ServerResult(GlobalState(self.aggregate(state.model, reports, rng)))

    def plan_evaluation(
        self, state: GlobalState, clients: Sequence[int] | None = None
    ) -> RoundPlan:
        return RoundPlan([self.task(c) for c in self.evaluated(clients)], [state.model])
