"""Server-side aggregation building blocks, shared by every algorithm (the noisy sums of
client-level DP belong to its privacy mode: ``raysim.modes.client``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def weighted_mean(updates: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """In float64. Scaled in place: the same products and sum as ``(stacked * w).sum(0)``, the
    same bits, without a second [clients, params] float64 copy (W's server step: 25 to 9 ms)."""
    w = torch.tensor(np.asarray(weights, dtype=np.float64) / np.sum(weights), dtype=torch.float64)
    stacked = torch.stack(list(updates)).double()
    return stacked.mul_(w[:, None]).sum(0).float()
