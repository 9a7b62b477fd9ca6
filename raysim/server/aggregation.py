"""Server-side aggregation building blocks, shared by every algorithm (the noisy sums of
client-level DP belong to its privacy mode: ``raysim.privacy.modes.client``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def weighted_mean(updates: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """In float64. Scaled in place: the same products and sum as ``(stacked * w).sum(0)``, the
    same bits, without a second [clients, params] float64 copy (W's server step: 25 to 9 ms)."""
    w = torch.tensor(np.asarray(weights, dtype=np.float64) / np.sum(weights), dtype=torch.float64)
    stacked = torch.stack(list(updates)).double()
    return stacked.mul_(w[:, None]).sum(0).float()


class ServerOptimizer:
    """The server's step on each of its models (FedOpt: Reddi et al., "Adaptive Federated
    Optimization", ICLR 2021): a model's aggregated update is a pseudo-gradient, its negative fed
    to a torch optimizer of the model's own, at learning rate ``algorithm.server_lr``: ``sgd``
    (with ``server_momentum``: FedAvgM), ``adam`` (FedAdam) or ``adagrad`` (FedAdagrad), with
    adaptivity ``server_tau`` (torch's eps). torch's Adam corrects its moments' bias and its
    Adagrad keeps no first moment, where the paper's boxes do neither.

    It only post-processes what the privacy mode released, so it costs no privacy. Its state (a
    momentum, moments) is the server's, kept per model slot, and checkpointed with the
    algorithm. A slot's state starts at its first move: the algorithms that build their models
    in a round (rdpcfl's GMM round, PINA's initialisation) move none before. Plain SGD, the
    default, is ``model + server_lr * update``: the bits of FedAvg."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the run's AlgorithmConfig
        self.saved: dict[int, dict[str, Any]] = {}

    @property
    def plain(self) -> bool:
        return self.cfg.server_optimizer == "sgd" and self.cfg.server_momentum == 0

    def move(self, slot: int, model: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return model + self.cfg.server_lr * update
        param = torch.nn.Parameter(model.detach().clone())
        opt = self._optimizer(param)
        if slot in self.saved:
            opt.load_state_dict(self.saved[slot])
        param.grad = -update.to(param.dtype)
        opt.step()
        self.saved[slot] = opt.state_dict()
        return param.detach()

    def _optimizer(self, param: torch.nn.Parameter) -> torch.optim.Optimizer:
        c = self.cfg
        if c.server_optimizer == "sgd":
            return torch.optim.SGD([param], lr=c.server_lr, momentum=c.server_momentum)
        if c.server_optimizer == "adam":
            return torch.optim.Adam(
                [param], lr=c.server_lr, betas=tuple(c.server_betas), eps=c.server_tau
            )
        return torch.optim.Adagrad([param], lr=c.server_lr, eps=c.server_tau)
