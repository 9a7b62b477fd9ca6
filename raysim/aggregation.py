"""Server-side aggregation building blocks, shared by every algorithm (the noisy sums of
client-level DP belong to its privacy mode: ``raysim.modes.client``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def weighted_mean(updates: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor(np.asarray(weights, dtype=np.float64) / np.sum(weights), dtype=torch.float64)
    return (torch.stack(list(updates)).double() * w[:, None]).sum(0).float()
