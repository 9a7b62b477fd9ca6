"""Calibration inverts accounting: never above the target, and not needlessly noisy."""

import dp_accounting as dpa
import pytest

from raysim.privacy import (
    BudgetError,
    Phase,
    PrivacyConfigError,
    calibrate_central,
    calibrate_dpsgd,
    calibrate_noise,
    central_event,
    check_sample_level_delta,
    dpsgd_event,
    epsilon,
    rdpcfl_phases,
    selection_event,
)

PHASES = rdpcfl_phases(dataset_size=2000, batch_size=32, local_epochs=1, rounds=20)
REL_TOL = 1e-3


@pytest.mark.parametrize("target", [2.0, 5.0, 10.0])
def test_calibrate_dpsgd_inverts_rdp_accounting(target):
    z = calibrate_dpsgd(PHASES, target, 1e-4, rel_tol=REL_TOL)
    assert epsilon(dpsgd_event(PHASES, z), 1e-4) <= target
    # minimal: a slightly smaller multiplier overspends
    assert epsilon(dpsgd_event(PHASES, z * (1 - 2 * REL_TOL)), 1e-4) > target
    assert epsilon(dpsgd_event(PHASES, z), 1e-4) == pytest.approx(target, rel=0.01)


def test_selections_are_reserved_inside_the_budget():
    plain = calibrate_dpsgd(PHASES, 5.0, 1e-4)
    z = calibrate_dpsgd(PHASES, 5.0, 1e-4, selection_epsilon=0.2, selections=15)
    assert z > plain
    total = dpa.ComposedDpEvent([dpsgd_event(PHASES, z), selection_event(0.2, 15)])
    assert epsilon(total, 1e-4) <= 5.0
    assert epsilon(total, 1e-4) == pytest.approx(5.0, rel=0.01)


def test_calibrate_with_pld_is_below_target_and_below_rdp_noise():
    phases = [Phase(1.0, 1), Phase(0.05, 200)]
    z = calibrate_dpsgd(phases, 3.0, 1e-5, accountant="pld")
    assert epsilon(dpsgd_event(phases, z), 1e-5, "pld") <= 3.0
    assert z < calibrate_dpsgd(phases, 3.0, 1e-5)  # PLD is tighter: less noise for the same eps


@pytest.mark.parametrize("sampling", ["poisson", "without_replacement"])
def test_calibrate_central(sampling):
    noise = calibrate_central(
        30, 0.1, 3.0, 1e-3, id_noise_ratio=2.0, sampling=sampling, population=500
    )
    assert noise.identifier == pytest.approx(2.0 * noise.model)
    event = central_event(30, 0.1, noise.model, noise.identifier, sampling, population=500)
    assert 3.0 * (1 - 0.01) <= epsilon(event, 1e-3) <= 3.0
    assert calibrate_central(30, 0.1, 3.0, 1e-3).identifier is None


def test_unreachable_budget_raises_budget_error():
    # 50 selections at eps 0.5 alone spend more than epsilon=1, whatever the DP-SGD noise
    with pytest.raises(BudgetError, match="cannot be met"):
        calibrate_dpsgd(PHASES, 1.0, 1e-4, selection_epsilon=0.5, selections=50)
    assert issubclass(BudgetError, ValueError)


@pytest.mark.parametrize("eps,delta", [(0.0, 1e-5), (-1.0, 1e-5), (1.0, 0.0), (1.0, 1.0)])
def test_invalid_targets_are_refused(eps, delta):
    with pytest.raises(PrivacyConfigError):
        calibrate_noise(lambda z: dpsgd_event(PHASES, z), eps, delta)


def test_no_steps_needs_no_noise():
    assert calibrate_dpsgd([Phase(0.5, 0)], 1.0, 1e-5) == pytest.approx(1e-2)


def test_sample_level_delta_must_be_below_one_over_n():
    check_sample_level_delta(1e-4, 5000)
    with pytest.raises(PrivacyConfigError, match=r"privacy\.delta.*5e-05") as err:
        check_sample_level_delta(1e-4, 20_000)
    assert "20000" in str(err.value)
