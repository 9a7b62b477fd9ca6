"""Server-side aggregation building blocks, shared by every algorithm."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raysim.privacy import clip_l2, gaussian_mechanism


def weighted_mean(updates: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor(np.asarray(weights, dtype=np.float64) / np.sum(weights), dtype=torch.float64)
    return (torch.stack(list(updates)).double() * w[:, None]).sum(0).float()


def noisy_sum(
    updates: Sequence[torch.Tensor],
    clip: float,
    sensitivity: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    dim: int,
) -> torch.Tensor:
    """Clip each update to `clip`, sum, add N(0, (sensitivity*z)^2) per coordinate (central DP).

    The sum is noised even when no update arrived (an empty cohort still releases noise)."""
    total = np.zeros(dim, dtype=np.float64)
    if updates:
        total = clip_l2(torch.stack(list(updates)).double().numpy(), clip).sum(0)
    return torch.from_numpy(gaussian_mechanism(total, sensitivity, noise_multiplier, rng)).float()
