"""Noise calibration: the smallest noise multiplier whose accounted epsilon meets a target.

Calibration runs once per run (or per client schedule) before training, so it favours a simple
bracket-and-bisect that always returns a value checked against the accountant: the result never
exceeds the target, whatever the accountant's numerical quirks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import dp_accounting as dpa

from raysim.privacy.accounting import (
    AccountantKind,
    Phase,
    central_event,
    dpsgd_event,
    epsilon,
    selection_event,
)
from raysim.privacy.errors import BudgetError, PrivacyConfigError, check_sample_level_delta

__all__ = [
    "CentralNoise",
    "calibrate_central",
    "calibrate_dpsgd",
    "calibrate_noise",
    "check_sample_level_delta",
]

Z_MIN = 1e-2
Z_MAX = 1e4


def _check_target(target_epsilon: float, delta: float) -> None:
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise PrivacyConfigError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    if not 0 < delta < 1:
        raise PrivacyConfigError(f"delta must be in (0, 1), got {delta}")


def calibrate_noise(
    make_event: Callable[[float], dpa.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: AccountantKind = "rdp",
    rel_tol: float = 1e-3,
    z_max: float = Z_MAX,
) -> float:
    """Smallest noise multiplier z (to ``rel_tol``) with ``epsilon(make_event(z)) <= target``.

    Assumes epsilon decreases in z. Raises :class:`BudgetError` if even ``z_max`` is not enough
    (e.g. the fixed, noise-independent part of the event already spends the budget).
    """
    _check_target(target_epsilon, delta)
    if not 0 < rel_tol < 1:
        raise PrivacyConfigError(f"rel_tol must be in (0, 1), got {rel_tol}")

    def eps(z: float) -> float:
        return epsilon(make_event(z), delta, accountant)

    floor = eps(z_max)
    if floor > target_epsilon:
        raise BudgetError(
            f"epsilon={target_epsilon} at delta={delta} cannot be met: even noise multiplier "
            f"{z_max:g} gives epsilon={floor:.4g} ({accountant} accountant); raise the "
            "budget, or reduce the steps, sampling rate or fixed charges such as selections"
        )
    lo, hi = _bracket(
        eps,
        target_epsilon,
        _start(make_event, target_epsilon, delta, accountant),
        z_max,
        2.0 if accountant == "pld" else 4.0,
    )
    while hi > lo * (1 + rel_tol):
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def _start(
    make_event: Callable[[float], dpa.DpEvent], target: float, delta: float, kind: str
) -> float:
    """Where to start bracketing. PLD starts from the (cheap) RDP answer, which lies close
    above it: PLD at very small z is slow and needs gigabytes, so it must never be probed there.
    """
    if kind != "pld":
        return 1.0
    try:
        return calibrate_noise(make_event, target, delta, "rdp", rel_tol=1e-2)
    except BudgetError:
        return 1.0


def _bracket(
    eps: Callable[[float], float], target: float, z: float, z_max: float, factor: float
) -> tuple[float, float]:
    """(lo, hi) with eps(hi) <= target < eps(lo), found geometrically from z (needs
    eps(z_max) <= target). lo is Z_MIN when even Z_MIN meets the target."""
    z = min(max(z, Z_MIN), z_max)
    if eps(z) <= target:
        hi = z
        while hi > Z_MIN:
            z = max(hi / factor, Z_MIN)
            if eps(z) > target:
                return z, hi
            hi = z
        return Z_MIN, Z_MIN
    lo = z
    while lo * factor < z_max:
        z = lo * factor
        if eps(z) <= target:
            return lo, z
        lo = z
    return lo, z_max


def calibrate_dpsgd(
    phases: Sequence[Phase],
    target_epsilon: float,
    delta: float,
    selection_epsilon: float = 0.0,
    selections: int = 0,
    accountant: AccountantKind = "rdp",
    rel_tol: float = 1e-3,
) -> float:
    """DP-SGD noise multiplier for a whole client schedule, after reserving the selections.

    The ``selections`` exponential-mechanism charges (R-DPCFL stage 3) are composed with the
    DP-SGD steps, so the total, not the training alone, meets ``target_epsilon``.
    """
    if selections and not selection_epsilon > 0:
        raise PrivacyConfigError("selections > 0 need selection_epsilon > 0")
    selection = selection_event(selection_epsilon, selections)

    def make_event(z: float) -> dpa.DpEvent:
        return dpa.ComposedDpEvent([dpsgd_event(phases, z), selection])

    return calibrate_noise(make_event, target_epsilon, delta, accountant, rel_tol)


@dataclass(frozen=True)
class CentralNoise:
    """Noise multipliers (std / sensitivity) of one central-DP round."""

    model: float
    identifier: float | None


def calibrate_central(
    rounds: int,
    sampling_rate: float,
    target_epsilon: float,
    delta: float,
    id_noise_ratio: float | None = None,
    sampling: Literal["poisson", "without_replacement"] = "poisson",
    population: int | None = None,
    cohort: int | None = None,
    accountant: AccountantKind = "rdp",
    rel_tol: float = 1e-3,
) -> CentralNoise:
    """Client-level multipliers for ``rounds`` rounds of :func:`central_round_event`.

    ``id_noise_ratio`` fixes the identifier multiplier as ``id_noise_ratio * model`` (None: no
    identifier release); only their common scale is searched.
    """
    if id_noise_ratio is not None and not id_noise_ratio > 0:
        raise PrivacyConfigError(f"id_noise_ratio must be > 0, got {id_noise_ratio}")

    def make_event(z: float) -> dpa.DpEvent:
        z_id = None if id_noise_ratio is None else id_noise_ratio * z
        return central_event(rounds, sampling_rate, z, z_id, sampling, population, cohort)

    z = calibrate_noise(make_event, target_epsilon, delta, accountant, rel_tol)
    return CentralNoise(model=z, identifier=None if id_noise_ratio is None else id_noise_ratio * z)
