"""Simulated secure aggregation, owned by the engine: the server receives per-slot sums only.

Each client contributes its clipped vector to one slot (its cluster, hidden from the server) and
a count of one in the same slot, weighted by ``COUNT_WEIGHT * clip`` so the whole contribution
has norm at most ``clip * sqrt(1 + COUNT_WEIGHT^2)``: one Gaussian on the stacked slots covers
sums and counts together. The noise is drawn once (the protocol's stream, ``secure_noise_rng``)
or as per-client shares (each client's stream, N(0, std^2 / m) per coordinate, adding up to
N(0, std^2) over a cohort of m); the two have the same distribution (tests/test_modes.py). Both
streams come from the clients' seed, which the server never holds (raysim.seeding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from raysim.privacy.distributed import noise_share, server_noise
from raysim.protocol import SecureContribution, SecureSums
from raysim.seeding import SERVER, numpy_rng

CLIP_TOLERANCE = 1e-5  # float32 rounding of a clipped vector's norm

# Weight of the member count beside the clipped vector: small, so the count costs the vector only
# 0.5% more noise; the count's own noise is then 1/COUNT_WEIGHT times larger (in members), which
# is small next to a cohort's size under the noise-cohort convention.
COUNT_WEIGHT = 0.1


def secure_noise_rng(client_seed: int, round: int) -> np.random.Generator:
    """The generator of a round's secure-sum noise (and of the top-up of too few shares)."""
    return numpy_rng(client_seed, round, SERVER, "secure")


def contribution_sensitivity(clip: float) -> float:
    return clip * math.sqrt(1.0 + COUNT_WEIGHT**2)


def client_noise_share(
    num_slots: int, dim: int, std: float, cohort: float, rng: np.random.Generator
) -> torch.Tensor:
    """One client's share of the noise on every slot (vector and count), from its own stream
    (``raysim.privacy.distributed.noise_share``: the one implementation of the shares)."""
    return torch.from_numpy(noise_share(std, cohort, (num_slots, dim + 1), rng))


@dataclass(frozen=True)
class SecureSpec:
    """What the clients agreed to before the run: the clip their inputs are checked against, the
    calibrated noise std of a sum (``share_cohort``: the cohort the clients' noise shares were
    drawn for; None: the aggregator draws the whole noise), what a round short of shares does
    (``shortfall``: top_up or abort) and how many sums may be released. The clients' side holds
    its own copy, from the driver, so the server cannot make a sum less noisy (a std of its
    choosing) or release more of them."""

    clip: float
    std: float
    share_cohort: float | None
    releases: int
    shortfall: str = "top_up"

    def aggregator(self, num_slots: int, dim: int, algorithm: str = "?") -> SecureAggregator:
        return SecureAggregator(
            num_slots, dim, self.clip, self.std, algorithm, self.share_cohort, self.shortfall
        )


class SecureAggregator:
    """Sums contributions slot by slot and adds the Gaussian noise; only ``SecureSums`` leave.
    It runs where the contributions are: in the clients' side actor on Ray
    (``raysim.runtime.client_side``), in the round loop's process in one-process runs. It
    refuses an input that is not clipped to ``clip`` or names no slot (the input validation a
    real protocol does with proofs), naming ``algorithm``."""

    def __init__(
        self,
        num_slots: int,
        dim: int,
        clip: float,
        std: float,
        algorithm: str = "?",
        share_cohort: float | None = None,
        shortfall: str = "top_up",
    ) -> None:
        """``share_cohort``: None, the aggregator draws the whole noise; m, the clients carry
        shares of N(0, std^2 / m) and, with fewer than m shares, the aggregator adds what they
        lack (``shortfall`` top_up) or sums nothing (abort)."""
        self.num_slots, self.dim, self.clip, self.std = num_slots, dim, clip, std
        self.algorithm = algorithm
        self.share_cohort = share_cohort
        self.shortfall = shortfall

    def missing_share(self, members: int) -> float:
        """The share of the calibrated noise variance that ``members`` contributions lack and
        the aggregator adds (0: their noise shares carry it all, or more)."""
        if self.share_cohort is None:
            return 1.0
        return max(0.0, 1.0 - members / self.share_cohort)

    def aborts(self, members: int) -> bool:
        """Whether a round of ``members`` releases nothing: its shares fall short and no party
        may add the rest (``privacy.shortfall: abort``)."""
        return self.shortfall == "abort" and self.missing_share(members) > 0

    def check(self, c: SecureContribution) -> None:
        from raysim.modes.base import refuse

        if not 0 <= c.slot < self.num_slots:
            refuse(self.algorithm, "contribution", f"slot {c.slot} of {self.num_slots}")
        if tuple(c.vector.shape) != (self.dim,):
            refuse(self.algorithm, "contribution", f"not a vector of dimension {self.dim}")
        if not float(c.vector.double().norm()) <= self.clip * (1 + CLIP_TOLERANCE):  # NaN too
            refuse(self.algorithm, "contribution", f"not clipped to privacy.clip={self.clip}")

    def aggregate(
        self, contributions: Sequence[SecureContribution], rng: np.random.Generator
    ) -> SecureSums:
        """``rng``: the aggregator's own draws (the whole noise, or the shares' shortfall)."""
        for c in contributions:
            self.check(c)
        if self.aborts(len(contributions)):
            raise PermissionError(
                f"{len(contributions)} members' noise shares fall short of the "
                f"{self.share_cohort:.4g} they were sized for: under privacy.shortfall=abort "
                "the round releases nothing"
            )
        shares = sum(c.noise_share is not None for c in contributions)
        if shares != (len(contributions) if self.share_cohort is not None else 0):
            raise ValueError("noise shares must come with every contribution, or with none")
        total = torch.zeros((self.num_slots, self.dim + 1), dtype=torch.float64)
        for c in contributions:
            total[c.slot, : self.dim] += c.vector.double()
            total[c.slot, self.dim] += COUNT_WEIGHT * self.clip
            if c.noise_share is not None:
                total += c.noise_share
        # K shares of variance std^2 / m add up to std^2 K / m: a round with fewer members than
        # the m they were drawn for would be under-noised, so the aggregator adds the rest
        missing = self.missing_share(shares)
        if missing > 0:
            std = self.std * math.sqrt(missing)
            total += torch.from_numpy(server_noise(std, tuple(total.shape), rng))
        sums = [row[: self.dim].float() for row in total]
        counts = [float(row[self.dim]) / (COUNT_WEIGHT * self.clip) for row in total]
        return SecureSums(sums, counts)
