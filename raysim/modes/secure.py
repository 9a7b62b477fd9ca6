"""Simulated secure aggregation, owned by the engine: the server receives per-slot sums only.

Each client contributes its clipped vector to one slot (its cluster, hidden from the server) and
a count of one in the same slot, weighted by ``COUNT_WEIGHT * clip`` so the whole contribution
has norm at most ``clip * sqrt(1 + COUNT_WEIGHT^2)``: one Gaussian on the stacked slots covers
sums and counts together. The noise is drawn once (the server's stream) or as per-client shares
(each client's stream, N(0, std^2 / m) per coordinate, adding up to N(0, std^2) over a cohort of
m); the two have the same distribution (tests/test_modes.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from raysim.privacy.distributed import noise_share, server_noise
from raysim.protocol import SecureContribution, SecureSums

# Weight of the member count beside the clipped vector: small, so the count costs the vector only
# 0.5% more noise; the count's own noise is then 1/COUNT_WEIGHT times larger (in members), which
# is small next to a cohort's size under the noise-cohort convention.
COUNT_WEIGHT = 0.1


def contribution_sensitivity(clip: float) -> float:
    return clip * math.sqrt(1.0 + COUNT_WEIGHT**2)


def client_noise_share(
    num_slots: int, dim: int, std: float, cohort: float, rng: np.random.Generator
) -> torch.Tensor:
    """One client's share of the noise on every slot (vector and count), from its own stream
    (``raysim.privacy.distributed.noise_share``: the one implementation of the shares)."""
    return torch.from_numpy(noise_share(std, cohort, (num_slots, dim + 1), rng))


class SecureAggregator:
    """Sums contributions slot by slot and adds the Gaussian noise; only ``SecureSums`` leave."""

    def __init__(self, num_slots: int, dim: int, clip: float, std: float) -> None:
        self.num_slots, self.dim, self.clip, self.std = num_slots, dim, clip, std

    def aggregate(
        self, contributions: Sequence[SecureContribution], rng: np.random.Generator | None
    ) -> SecureSums:
        """``rng``: the server draws the noise; None: the clients' shares carry it."""
        total = torch.zeros((self.num_slots, self.dim + 1), dtype=torch.float64)
        for c in contributions:
            total[c.slot, : self.dim] += c.vector.double()
            total[c.slot, self.dim] += COUNT_WEIGHT * self.clip
            if c.noise_share is not None:
                total += c.noise_share
        if rng is not None:
            total += torch.from_numpy(server_noise(self.std, tuple(total.shape), rng))
        sums = [row[: self.dim].float() for row in total]
        counts = [float(row[self.dim]) / (COUNT_WEIGHT * self.clip) for row in total]
        return SecureSums(sums, counts)
