"""Simulated secure aggregation, owned by the engine: the server receives per-slot sums only.

Each client contributes its clipped vector to one slot (its cluster, hidden from the server) and
a count of one in the same slot, weighted by ``COUNT_WEIGHT * clip`` so the whole contribution
has norm at most ``clip * sqrt(1 + COUNT_WEIGHT^2)``: one Gaussian on the stacked slots covers
sums and counts together. The noise is drawn once (the protocol's stream, ``secure_noise_rng``)
or as per-client shares (each client's stream, N(0, std^2 / m) per coordinate, adding up to
N(0, std^2) over a cohort of m); the two have the same distribution (tests/test_modes.py). Both
streams come from the clients' seed, which the server never holds (raysim.seeding).

Under adaptive clipping (``privacy.clip_quantile``) each contribution carries one more
coordinate, its centred bit (+1/2 if the update's norm was at most the round's clip, else -1/2)
weighted by ``BIT_WEIGHT * clip``: the same Gaussian then releases the noisy count of updates
under the clip that Andrew et al. (2021) move the clip by, with no second mechanism to charge.
The clip is the round's (the server's choice, learnt from earlier sums) and the noise std
follows it, so the noise multiplier, and the privacy, do not depend on it.
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
# Weight of the centred clip bit (+-1/2): its sum's noise is then std / (BIT_WEIGHT * clip) in
# updates, 5 for a cohort of 100 at the noise-cohort size (Andrew et al.'s sigma_b = m / 20), at
# another 0.5% of the vector's noise.
BIT_WEIGHT = 0.2


def secure_noise_rng(client_seed: int, round: int) -> np.random.Generator:
    """The generator of a round's secure-sum noise (and of the top-up of too few shares)."""
    return numpy_rng(client_seed, round, SERVER, "secure")


def contribution_sensitivity(clip: float, adaptive: bool = False) -> float:
    """The norm bound of one contribution: the vector, its count and (adaptive) its bit."""
    return clip * math.sqrt(1.0 + COUNT_WEIGHT**2 + (BIT_WEIGHT / 2) ** 2 * adaptive)


def columns(dim: int, adaptive: bool) -> int:
    """A slot's width: the vector, the member count, and the clip bit under adaptive clipping."""
    return dim + 1 + int(adaptive)


def client_noise_share(
    num_slots: int,
    dim: int,
    std: float,
    cohort: float,
    rng: np.random.Generator,
    adaptive: bool = False,
) -> torch.Tensor:
    """One client's share of the noise on every slot (every column), from its own stream
    (``raysim.privacy.distributed.noise_share``: the one implementation of the shares)."""
    shape = (num_slots, columns(dim, adaptive))
    return torch.from_numpy(noise_share(std, cohort, shape, rng))


@dataclass(frozen=True)
class SecureSpec:
    """What the clients agreed to before the run: the clip their inputs are checked against, the
    calibrated noise std of a sum (``share_cohort``: the cohort the clients' noise shares were
    drawn for; None: the aggregator draws the whole noise), what a round short of shares does
    (``shortfall``: top_up or abort) and how many sums may be released; ``adaptive``: the clip
    is the round's and ``std`` is the noise at ``clip``, scaled with it. The clients' side holds
    its own copy, from the driver, so the server cannot make a sum less noisy (a std of its
    choosing, or a noise-to-clip ratio) or release more of them."""

    clip: float
    std: float
    share_cohort: float | None
    releases: int
    shortfall: str = "top_up"
    adaptive: bool = False

    def aggregator(
        self, num_slots: int, dim: int, algorithm: str = "?", clip: float | None = None
    ) -> SecureAggregator:
        """The round's aggregator. ``clip``: the round's, taken only under adaptive clipping
        (else the spec's own), with the noise std scaled to it."""
        clip = clip if self.adaptive and clip is not None else self.clip
        std = self.std * clip / self.clip
        return SecureAggregator(
            num_slots, dim, clip, std, algorithm, self.share_cohort, self.shortfall, self.adaptive
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
        adaptive: bool = False,
    ) -> None:
        """``share_cohort``: None, the aggregator draws the whole noise; m, the clients carry
        shares of N(0, std^2 / m) and, with fewer than m shares, the aggregator adds what they
        lack (``shortfall`` top_up) or sums nothing (abort). ``adaptive``: every contribution
        carries its clip bit."""
        self.num_slots, self.dim, self.clip, self.std = num_slots, dim, clip, std
        self.algorithm = algorithm
        self.share_cohort = share_cohort
        self.shortfall = shortfall
        self.adaptive = adaptive

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
        from raysim.privacy.modes.base import refuse

        if not 0 <= c.slot < self.num_slots:
            refuse(self.algorithm, "contribution", f"slot {c.slot} of {self.num_slots}")
        if tuple(c.vector.shape) != (self.dim,):
            refuse(self.algorithm, "contribution", f"not a vector of dimension {self.dim}")
        if not float(c.vector.double().norm()) <= self.clip * (1 + CLIP_TOLERANCE):  # NaN too
            refuse(self.algorithm, "contribution", f"not clipped to the round's clip {self.clip}")
        if (c.under_clip is not None) != self.adaptive:
            why = "a clip bit is what adaptive clipping adds, and only it"
            refuse(self.algorithm, "contribution", why)

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
        width = columns(self.dim, self.adaptive)
        total = torch.zeros((self.num_slots, width), dtype=torch.float64)
        bit = BIT_WEIGHT * self.clip
        for c in contributions:
            total[c.slot, : self.dim] += c.vector.double()
            total[c.slot, self.dim] += COUNT_WEIGHT * self.clip
            if self.adaptive:
                total[c.slot, self.dim + 1] += bit / 2 if c.under_clip else -bit / 2
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
        bits = [float(row[self.dim + 1]) / bit for row in total] if self.adaptive else None
        return SecureSums(sums, counts, under_clip=bits)
