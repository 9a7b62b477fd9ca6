"""Accounting agrees with independent implementations (Opacus) and with closed forms."""

import math
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy import optimize, special, stats

from raysim.privacy import (
    BoundedRangeDpEvent,
    Phase,
    PrivacyConfigError,
    central_event,
    central_round_event,
    d_privacy_leakage,
    delta_for,
    dpsgd_event,
    epsilon,
    make_accountant,
    neighboring_relation,
    rdpcfl_phases,
    selection_event,
)

TWO_PHASE = [Phase(1.0, 2), Phase(32 / 2000, 63 * 20)]  # R-DPCFL: K=2 full-batch, then b=32


def opacus_epsilon(cls, phases, z, delta, **kwargs):
    acc = cls()
    for phase in phases:
        for _ in range(phase.steps):
            acc.step(noise_multiplier=z, sample_rate=phase.sampling_rate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # PRV at q=1 takes log(0) harmlessly
        return acc.get_epsilon(delta, **kwargs)


GRID = [
    (q, z, steps, delta)
    for q in (0.01, 0.1)
    for z in (0.8, 1.5)
    for steps in (100, 1000)
    for delta in (1e-5, 1e-3)
    if (q, z, steps) != (0.1, 0.8, 1000)  # epsilon ~35: see the test below
]


@pytest.mark.parametrize("q,z,steps,delta", GRID)
def test_rdp_matches_opacus_rdp(q, z, steps, delta):
    phases = [Phase(q, steps)]
    ours = epsilon(dpsgd_event(phases, z), delta, "rdp")
    # Opacus' default alphas lack 11 and 128..1024; with dp_accounting's orders both minimise
    # the same conversion (Balle et al. 2020) over the same grid.
    theirs = opacus_epsilon(RDPAccountant, phases, z, delta, alphas=DEFAULT_RDP_ORDERS)
    assert ours == pytest.approx(theirs, rel=0.01)


def test_rdp_extreme_regime_is_conservative():
    # At epsilon ~35 the best orders are just above 1, where dp_accounting's series for
    # fractional orders fails to converge and it drops those orders: its epsilon is then a
    # looser (still valid) upper bound than Opacus'. Never optimistic.
    phases = [Phase(0.1, 1000)]
    ours = epsilon(dpsgd_event(phases, 0.8), 1e-5)
    theirs = opacus_epsilon(RDPAccountant, phases, 0.8, 1e-5, alphas=DEFAULT_RDP_ORDERS)
    assert theirs < ours < 1.2 * theirs


def test_rdp_two_phase_schedule_matches_opacus_rdp():
    for z in (1.0, 2.0):
        ours = epsilon(dpsgd_event(TWO_PHASE, z), 1e-4)
        theirs = opacus_epsilon(RDPAccountant, TWO_PHASE, z, 1e-4, alphas=DEFAULT_RDP_ORDERS)
        assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize(
    "phases,z,delta",
    [([Phase(0.01, 1000)], 0.8, 1e-5), ([Phase(0.1, 100)], 1.5, 1e-3), (TWO_PHASE, 1.0, 1e-4)],
)
def test_pld_matches_opacus_prv(phases, z, delta):
    ours = epsilon(dpsgd_event(phases, z), delta, "pld")
    # Both discretise the privacy loss and report an upper bound: PLD (pessimistic rounding,
    # interval 1e-4) and PRV (estimate + eps_error). With eps_error=1e-3 they agree to ~0.1%
    # (measured); 1% leaves room for the two methods' different grids.
    theirs = opacus_epsilon(PRVAccountant, phases, z, delta, eps_error=1e-3)
    assert ours == pytest.approx(theirs, rel=0.01)


def test_gaussian_rdp_closed_form_and_conversion():
    z, steps, delta = 2.0, 50, 1e-5
    event = dpsgd_event([Phase(1.0, steps)], z)
    assert isinstance(event, dpa.SelfComposedDpEvent)
    assert isinstance(event.event, dpa.GaussianDpEvent)  # q = 1: no sampling event
    a = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    rdp = steps * a / (2 * z**2)  # Mironov 2017, Prop. 7 and composition
    # dp_accounting's conversion (Balle et al. 2020, Prop. 12), written independently:
    improved = np.min(rdp + np.log1p(-1 / a) - np.log(delta * a) / (a - 1))
    assert epsilon(event, delta) == pytest.approx(improved, rel=1e-9)
    classic = np.min(rdp + np.log(1 / delta) / (a - 1))  # Mironov 2017, Prop. 3
    assert improved < classic


def _analytic_gaussian_delta(eps: float, s: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with std/sensitivity s (Balle & Wang 2018)."""
    return stats.norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * stats.norm.cdf(
        -eps * s - 1 / (2 * s)
    )


@pytest.mark.parametrize("z,steps,delta", [(2.0, 50, 1e-5), (1.0, 4, 1e-3)])
def test_pld_matches_analytic_gaussian(z, steps, delta):
    event = dpsgd_event([Phase(1.0, steps)], z)
    s = z / math.sqrt(steps)  # T Gaussians with multiplier z are one with z / sqrt(T)
    exact = optimize.brentq(lambda e: _analytic_gaussian_delta(e, s) - delta, 1e-6, 100)
    ours = epsilon(event, delta, "pld")
    assert exact - 1e-9 <= ours <= exact * 1.005  # pessimistic, and tight
    assert delta_for(event, exact, "pld") == pytest.approx(delta, rel=0.01)
    assert epsilon(event, delta, "rdp") >= ours  # RDP is the looser upper bound


def _optimal_pure_dp_composition_delta(eps0: float, k: int, eps: float) -> float:
    """Exact delta(eps) of k-fold composed eps0-DP (Kairouz, Oh and Viswanath 2015)."""
    total = 0.0
    for i in range(k + 1):  # i coordinates report the "wrong" side
        gain = eps0 * (k - 2 * i)
        total += special.comb(k, i) * max(0.0, math.exp(gain) - math.exp(eps)) * math.exp(eps0 * i)
    return total / (1 + math.exp(eps0)) ** k


def test_selection_event_accounting():
    eps0, k, orders = 0.5, 10, np.array(DEFAULT_RDP_ORDERS)
    event = selection_event(eps0, k)
    rdp = make_accountant("rdp").compose(event).rdp
    np.testing.assert_allclose(rdp, k * np.minimum(orders * eps0**2 / 8, eps0))
    # PLD treats each selection as pure eps0-DP: matches the optimal composition theorem
    for target in (1.0, 2.0):
        assert delta_for(event, target, "pld") == pytest.approx(
            _optimal_pure_dp_composition_delta(eps0, k, target), rel=1e-3, abs=1e-12
        )
    assert epsilon(selection_event(eps0, 1), 1e-6, "pld") <= eps0 + 1e-3
    assert isinstance(selection_event(eps0, 0), dpa.NoOpDpEvent)
    assert make_accountant("rdp").supports(BoundedRangeDpEvent(1.0))


def test_central_round_poisson_equals_single_effective_gaussian():
    q, z_id, z_model, delta = 0.05, 3.0, 1.2, 1e-5
    z_eff = (z_id**-2 + z_model**-2) ** -0.5
    # Independent check of the reduction: the pair of releases is a Gaussian whose mean shift,
    # in units of each noise std, has norm sqrt(1/z_id^2 + 1/z_model^2) = 1/z_eff.
    assert math.hypot(1 / z_id, 1 / z_model) == pytest.approx(1 / z_eff)
    one = central_round_event(q, z_model, z_id)
    assert neighboring_relation(one) == dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    theirs = opacus_epsilon(RDPAccountant, [Phase(q, 1)], z_eff, delta, alphas=DEFAULT_RDP_ORDERS)
    assert epsilon(one, delta) == pytest.approx(theirs, rel=0.01)
    rounds = central_event(40, q, z_model, z_id)
    theirs = opacus_epsilon(RDPAccountant, [Phase(q, 40)], z_eff, delta, alphas=DEFAULT_RDP_ORDERS)
    assert epsilon(rounds, delta) == pytest.approx(theirs, rel=0.01)
    pld_theirs = opacus_epsilon(PRVAccountant, [Phase(q, 40)], z_eff, delta, eps_error=1e-3)
    assert epsilon(rounds, delta, "pld") == pytest.approx(pld_theirs, rel=0.01)
    # without identifiers the round is just the model Gaussian
    no_id = central_round_event(q, z_model)
    assert epsilon(no_id, delta) < epsilon(one, delta)


def test_central_without_replacement_uses_replace_one():
    event = central_event(20, 0.1, 1.5, 3.0, "without_replacement", population=1000)
    assert event.event.sample_size == 100
    assert neighboring_relation(event) == dpa.NeighboringRelation.REPLACE_ONE
    eps = epsilon(event, 1e-5)
    assert 0 < eps < math.inf
    # a cohort of everyone is no sampling: the plain (effective) Gaussian
    full = central_event(20, 1.0, 1.5, None, "without_replacement", population=50, cohort=50)
    plain = dpsgd_event([Phase(1.0, 20)], 1.5)
    assert epsilon(full, 1e-5) == pytest.approx(epsilon(plain, 1e-5), rel=1e-9)
    with pytest.raises(PrivacyConfigError, match="pld accountant"):
        epsilon(event, 1e-5, "pld")  # dp_accounting's PLD has no sampling without replacement
    with pytest.raises(PrivacyConfigError):
        central_round_event(0.1, 1.0, sampling="without_replacement")  # population missing
    mixed = dpa.ComposedDpEvent([event, central_round_event(0.1, 1.0)])
    with pytest.raises(PrivacyConfigError, match="mixes"):
        epsilon(mixed, 1e-5)


def test_rdpcfl_phases_and_validation():
    phases = rdpcfl_phases(dataset_size=2000, batch_size=32, local_epochs=2, rounds=10)
    assert phases == [Phase(1.0, 2), Phase(0.016, 2 * 63 * 9)]
    assert rdpcfl_phases(2000, 32, 1, 5, full_first_round=False) == [Phase(0.016, 5 * 63)]
    assert isinstance(dpsgd_event([Phase(0.5, 0)], 1.0), dpa.NoOpDpEvent)
    for bad in (lambda: Phase(0.0, 1), lambda: Phase(1.5, 1), lambda: Phase(0.5, -1)):
        with pytest.raises(PrivacyConfigError):
            bad()
    with pytest.raises(PrivacyConfigError):
        dpsgd_event([Phase(0.5, 1)], 0.0)
    with pytest.raises(PrivacyConfigError):
        epsilon(selection_event(1.0, 1), 1.5)


def test_d_privacy_leakage():
    assert d_privacy_leakage(2.0, 0.5, 3) == pytest.approx(3.0)
    assert d_privacy_leakage(2.0, 0.5, 0) == 0.0


def test_epsilon_is_remembered_by_value_and_never_confused():
    """The same event, built anew, is answered from memory with the accountant's own number;
    events that differ in any field (a multiplier, a count, a class, a relation) are not."""
    from raysim.privacy import accounting

    def event(z=1.3, steps=40, q=0.07):
        return dpa.ComposedDpEvent([dpsgd_event([Phase(q, steps)], z), selection_event(0.05, 2)])

    fresh = accounting.make_accountant("rdp").compose(event()).get_epsilon(1e-5)
    before = accounting._epsilon.cache_info()
    assert epsilon(event(), 1e-5) == fresh
    assert epsilon(event(), 1e-5) == fresh  # a new but equal tree: from memory
    after = accounting._epsilon.cache_info()
    assert after.hits - before.hits >= 1
    others = [
        event(z=1.3000001),
        event(steps=41),
        event(q=0.0700001),
        dpa.ComposedDpEvent([dpsgd_event([Phase(0.07, 40)], 1.3)]),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.07, dpa.GaussianDpEvent(1.3)), 40),
        dpa.SampledWithoutReplacementDpEvent(1000, 70, dpa.GaussianDpEvent(1.3)),
    ]
    for other in others:
        direct = make_accountant("rdp", neighboring_relation(other)).compose(other)
        assert epsilon(other, 1e-5) == direct.get_epsilon(1e-5) != fresh
    assert epsilon(event(), 1e-6) > fresh  # delta is part of the question
    assert epsilon(event(), 1e-5, "pld") != fresh  # and so is the accountant


def test_an_event_whose_contents_do_not_hash_is_asked_anew():
    import attr

    @attr.define(frozen=True)
    class Tagged(dpa.DpEvent):
        event: dpa.DpEvent
        tags: dict  # does not hash

    inner = dpsgd_event([Phase(0.07, 40)], 1.3)
    with pytest.raises(PrivacyConfigError, match="cannot account"):  # not a TypeError
        epsilon(Tagged(inner, {"a": 1}), 1e-5)
