"""Distributed DP with a simulated noise cohort (McMahan et al. 2018; FLAIR; pfl-research).

A cross-device deployment samples a cohort of, say, 10,000 clients per round out of a population
of millions, and the noise on the secure sum is calibrated to that cohort. Simulating 10,000
clients per round is too slow, so the convention is to run a smaller real cohort ``m`` and give
its sum the noise that makes the *mean* as noisy as the large cohort's mean would be:

* account with sampling rate ``q = noise_cohort / population`` (Poisson-sampled Gaussian,
  ``rounds`` compositions, RDP via dp_accounting: :func:`calibrate_central`);
* add to the real cohort's sum of clipped updates (clip ``S``) Gaussian noise of per-coordinate
  std ``z * S * m / noise_cohort`` (the cohort-scaled std), drawn either once by the server or
  as per-client shares ``N(0, std^2 / m)`` from each client's own seeded stream, whose sum under
  secure aggregation has exactly the same distribution.

The epsilon reported holds for a run *with* ``noise_cohort`` clients per round, not for the
simulated one (whose noise multiplier relative to its own sum is only ``z * m / noise_cohort``):
every output must say so (:func:`cohort_caveat`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from dp_accounting import dp_event

from raysim import privacy as privacy_lib
from raysim.privacy.errors import PrivacyConfigError

if TYPE_CHECKING:  # the accountant loads on first use (raysim/privacy/__init__.py)
    from raysim.privacy.accounting import AccountantKind

DEFAULT_NOISE_COHORT = 10_000
SHARE_PURPOSE = "dp_noise_share"  # purpose of each client's noise-share stream (raysim.seeding)


def noise_cohort_of(
    noise_cohort_size: int | None, population: int, num_clients: int, sampling_rate: float
) -> float:
    """The cohort the noise is sized for (``privacy.noise_cohort_size``): as given; else the
    real expected cohort where the population is simulated in full, so that the noise on the
    sum is z * S and the epsilon is the simulated run's own; else the convention's 10,000."""
    if noise_cohort_size is not None:
        return noise_cohort_size
    if population == num_clients:
        return min(sampling_rate, 1.0) * num_clients
    return min(DEFAULT_NOISE_COHORT, population)


def is_real_cohort(noise_cohort: float, cohort: float) -> bool:
    """Whether the noise is sized for the cohort the run really samples (no convention)."""
    return math.isclose(noise_cohort, cohort, rel_tol=1e-12)


@dataclass(frozen=True)
class NoiseCohort:
    """The population the accounting assumes and the cohort size the noise is calibrated for."""

    population: int
    noise_cohort: float = DEFAULT_NOISE_COHORT  # a real expected cohort need not be whole

    def __post_init__(self) -> None:
        if self.noise_cohort < 1:
            raise PrivacyConfigError(
                f"privacy.noise_cohort_size must be >= 1, got {self.noise_cohort}"
            )
        if self.population < self.noise_cohort:
            raise PrivacyConfigError(
                f"privacy.population={self.population} must be >= privacy.noise_cohort_size="
                f"{self.noise_cohort}"
            )

    @property
    def sampling_rate(self) -> float:
        return self.noise_cohort / self.population

    @property
    def default_delta(self) -> float:
        """delta = population^-1.1 (the PINA paper's choice, after McMahan et al. 2018)."""
        return float(self.population) ** -1.1

    def event(self, rounds: int, noise_multiplier: float) -> dp_event.DpEvent:
        """``rounds`` Poisson-sampled Gaussian releases at rate ``q`` (one per round)."""
        return privacy_lib.central_event(rounds, self.sampling_rate, noise_multiplier)

    def round_event(self, noise_multiplier: float) -> dp_event.DpEvent:
        """One secure-sum release: the Poisson-sampled Gaussian charged to the population."""
        return privacy_lib.central_round_event(self.sampling_rate, noise_multiplier)

    def calibrate(
        self,
        rounds: int,
        target_epsilon: float,
        delta: float | None = None,
        accountant: AccountantKind = "rdp",
        rel_tol: float = 1e-3,
        fixed: dp_event.DpEvent | None = None,
    ) -> float:
        """Smallest noise multiplier ``z`` meeting ``(target_epsilon, delta)`` over ``rounds``.

        ``fixed``: releases of the run whose noise is already set (PINA's local sketch), composed
        with the ``rounds`` secure sums, so the whole run meets the target."""
        d = self.default_delta if delta is None else delta
        if fixed is None:
            q = self.sampling_rate
            return privacy_lib.calibrate_central(
                rounds, q, target_epsilon, d, accountant=accountant, rel_tol=rel_tol
            ).model

        def make_event(z: float) -> dp_event.DpEvent:
            return dp_event.ComposedDpEvent([fixed, self.event(rounds, z)])

        return privacy_lib.calibrate_noise(make_event, target_epsilon, d, accountant, rel_tol)

    def noise_std(self, noise_multiplier: float, clip: float, cohort: float) -> float:
        """Per-coordinate std of the noise on the real cohort's sum: ``z * S * m / noise_cohort``.

        ``m`` is the real cohort size (pfl-research scales by the configured cohort size; the
        engine passes the expected cohort, sampling rate times clients)."""
        if not cohort >= 1:
            raise PrivacyConfigError(f"cohort must be >= 1, got {cohort}")
        if not clip > 0 or not noise_multiplier >= 0:
            raise PrivacyConfigError("need clip > 0 and noise_multiplier >= 0")
        return noise_multiplier * clip * cohort / self.noise_cohort


def server_noise(std: float, shape: int | tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The whole noise drawn once (by a trusted noise source, or the server in simulation)."""
    return rng.normal(0.0, std, size=shape)


def noise_share(
    std: float, cohort: float, shape: int | tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """One client's share ``N(0, std^2 / cohort)``: the shares of ``cohort`` clients sum to
    ``N(0, std^2)`` under secure aggregation, so no single party knows the total noise. Pass
    ``numpy_rng(seed, round, client, SHARE_PURPOSE)`` as ``rng``."""
    if not cohort >= 1:
        raise PrivacyConfigError(f"cohort must be >= 1, got {cohort}")
    return rng.normal(0.0, std / math.sqrt(cohort), size=shape)


def local_gaussian_event(noise_multiplier: float) -> dp_event.DpEvent:
    """One client's local Gaussian release (PINA's sketch), not amplified: the server sees who
    sent it. Multiplier = std / sensitivity under zero-out adjacency (sensitivity = the clip)."""
    return dp_event.GaussianDpEvent(noise_multiplier)


def calibrate_local(
    target_epsilon: float, delta: float, accountant: AccountantKind = "rdp", rel_tol: float = 1e-3
) -> float:
    """Smallest multiplier of one local Gaussian release spending ``target_epsilon`` alone."""
    return privacy_lib.calibrate_noise(
        local_gaussian_event, target_epsilon, delta, accountant, rel_tol
    )


def unamplified_epsilon(
    noise_multiplier: float,
    releases: int,
    delta: float,
    accountant: AccountantKind = "rdp",
    fixed: dp_event.DpEvent | None = None,
) -> float:
    """Epsilon of ``releases`` secure sums at ``noise_multiplier`` with no amplification by
    sampling (rate 1: every release composes), after ``fixed`` (e.g. PINA's local sketch).

    The noise-cohort epsilon holds only where who took part is hidden from the server; a server
    that sees the cohort gets this one instead, for the same noise. Same events and accountant
    as the amplified account, with the sampling left out."""
    if releases < 0:
        raise PrivacyConfigError(f"releases must be >= 0, got {releases}")
    events = [] if fixed is None else [fixed]
    if releases:
        events.append(privacy_lib.central_event(releases, 1.0, noise_multiplier))
    if not events:
        return 0.0
    event = events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events)
    return privacy_lib.epsilon(event, delta, accountant)


def cohort_caveat(noise_cohort: float, cohort: float) -> str:
    """The sentence every output of a noise-cohort run must carry."""
    return (
        f"privacy numbers assume {noise_cohort} clients per round (noise-cohort convention, "
        f"McMahan et al. 2018); this simulation ran {cohort} per round with the noise scaled by "
        f"{cohort}/{noise_cohort}, so the epsilon holds only for a run with the full cohort, "
        "and only where who took part is hidden from the server (amplification by sampling: "
        "e.g. the clients sample themselves); a server that picks and sees the cohort gets no "
        "such amplification"
    )
