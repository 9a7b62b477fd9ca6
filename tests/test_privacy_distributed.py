"""Distributed DP under the noise-cohort convention: calibration (checked with an independent
dp_accounting computation) and the two noise paths (server draw vs summed client shares)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from scipy import optimize, stats

from raysim.privacy import PrivacyConfigError
from raysim.privacy.distributed import (
    SHARE_PURPOSE,
    NoiseCohort,
    cohort_caveat,
    local_gaussian_event,
    noise_share,
    server_noise,
    unamplified_epsilon,
)
from raysim.seeding import SERVER, numpy_rng

COHORT = NoiseCohort(population=1_000_000, noise_cohort=10_000)  # q = 0.01
DELTA = 2.51e-7


def _independent_epsilon(z: float, rounds: int) -> float:
    """Plain dp_accounting, none of raysim's accounting code."""
    acc = RdpAccountant()
    acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(z)), rounds))
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize(
    "rounds, eps, expected", [(500, 2, 1.032), (500, 8, 0.620), (100, 2, 0.933), (100, 8, 0.551)]
)
def test_calibration_matches_the_pina_issue_and_dp_accounting(rounds, eps, expected):
    assert COHORT.sampling_rate == 0.01
    assert abs(COHORT.default_delta - DELTA) / DELTA < 1e-3  # population^-1.1
    z = COHORT.calibrate(rounds, eps, DELTA, rel_tol=1e-4)
    assert abs(z - expected) / expected < 0.005
    # independently: z meets the budget, and 0.2% less noise would not
    assert _independent_epsilon(z, rounds) <= eps
    assert _independent_epsilon(z * 0.998, rounds) > eps
    assert COHORT.calibrate(rounds, eps, rel_tol=1e-4) == pytest.approx(z, rel=1e-3)


def test_server_noise_and_client_shares_have_the_cohort_scaled_std():
    z, clip, m, d, seed, rnd = 1.032, 0.5, 50, 100_000, 3, 7
    std = COHORT.noise_std(z, clip, m)
    assert std == pytest.approx(z * clip * m / 10_000)
    once = server_noise(std, d, numpy_rng(seed, rnd, SERVER, "dp_noise"))
    summed = np.zeros(d)
    for client in range(m):  # each client draws its share from its own seeded stream
        summed += noise_share(std, m, d, numpy_rng(seed, rnd, client, SHARE_PURPOSE))
    for noise in (once, summed):
        assert abs(noise.std() / std - 1) < 0.02
        assert abs(noise.mean()) < 5 * std / np.sqrt(d)
        assert stats.kstest(noise / std, "norm").pvalue > 1e-3
    again = noise_share(std, m, d, numpy_rng(seed, rnd, 0, SHARE_PURPOSE))
    assert np.array_equal(again, noise_share(std, m, d, numpy_rng(seed, rnd, 0, SHARE_PURPOSE)))


def test_bad_cohorts_and_the_caveat():
    with pytest.raises(PrivacyConfigError, match="privacy.population"):
        NoiseCohort(population=100, noise_cohort=10_000)
    with pytest.raises(PrivacyConfigError, match="noise_cohort_size"):
        NoiseCohort(population=100, noise_cohort=0)
    with pytest.raises(PrivacyConfigError, match="cohort"):
        COHORT.noise_std(1.0, 1.0, 0)
    text = cohort_caveat(10_000, 50)
    assert "10000 clients per round" in text and "50 per round" in text


def _analytic_gaussian_epsilon(z: float, releases: int, delta: float) -> float:
    """Balle & Wang 2018 (Theorem 8): T Gaussians of multiplier z compose to one of z/sqrt(T);
    eps solves delta = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), mu = sqrt(T)/z."""
    mu = math.sqrt(releases) / z

    def gap(eps: float) -> float:
        norm = stats.norm
        tail = math.exp(eps + norm.logcdf(-mu / 2 - eps / mu))  # e^eps Phi(.), without overflow
        return norm.cdf(mu / 2 - eps / mu) - tail - delta

    return optimize.brentq(gap, 0.0, 1e4, xtol=1e-12)


def _rdp_closed_form_epsilon(z: float, releases: int, delta: float) -> float:
    """RDP of T Gaussians, T * alpha / (2 z^2), through the RDP -> (eps, delta) conversion of
    Canonne, Kamath & Steinke 2020 (Prop. 12), minimised over dp_accounting's orders."""
    best = math.inf
    for a in DEFAULT_RDP_ORDERS:
        if a <= 1:
            continue
        rdp = releases * a / (2 * z**2)
        eps = rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return max(best, 0.0)


@pytest.mark.parametrize("z, releases", [(1.0, 1), (1.032, 100), (0.8, 50), (5.0, 20)])
def test_unamplified_epsilon_is_the_composed_gaussian(z, releases):
    rdp = unamplified_epsilon(z, releases, DELTA, "rdp")
    assert rdp == pytest.approx(_rdp_closed_form_epsilon(z, releases, DELTA), rel=1e-9)
    exact = _analytic_gaussian_epsilon(z, releases, DELTA)
    pld = unamplified_epsilon(z, releases, DELTA, "pld")
    assert exact * (1 - 1e-9) <= pld <= exact * 1.01 + 1e-3  # PLD: pessimistic, discretised
    assert pld <= rdp  # RDP's conversion is the looser bound
    # no amplification costs at least what the noise-cohort account says, and far more at q=0.01
    amplified = _independent_epsilon(z, releases)
    assert rdp >= amplified
    assert rdp > 3 * amplified


def test_unamplified_epsilon_composes_a_fixed_release_and_refuses_bad_counts():
    z, zl = 1.0, 3.0
    alone = unamplified_epsilon(zl, 1, DELTA, "pld")
    assert unamplified_epsilon(z, 0, DELTA) == 0.0
    with_sketch = unamplified_epsilon(z, 0, DELTA, "pld", fixed=local_gaussian_event(zl))
    assert with_sketch == pytest.approx(alone, rel=1e-9)
    both = unamplified_epsilon(z, 10, DELTA, "pld", fixed=local_gaussian_event(zl))
    exact = _analytic_gaussian_epsilon(1 / math.sqrt(10 / z**2 + 1 / zl**2), 1, DELTA)
    assert (
        exact * (1 - 1e-9) <= both <= exact * 1.01 + 1e-3
    )  # Gaussians compose as one of 1/z^2 summed
    with pytest.raises(PrivacyConfigError, match="releases must be >= 0"):
        unamplified_epsilon(z, -1, DELTA)
