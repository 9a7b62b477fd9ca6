"""Noise calibration: the smallest noise multiplier whose accounted epsilon meets a target.

Calibration runs once per run (or per client schedule) before training, and before Ray starts,
so the user waits for it. It is a simple bracket-and-bisect that always returns a value checked
against the accountant: the result never exceeds the target, whatever the accountant's numerical
quirks. The bisection asks the accountant only where its answer is not already settled (below).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from dp_accounting import dp_event

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
    make_event: Callable[[float], dp_event.DpEvent],
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

    probe = _Probe(lambda z: epsilon(make_event(z), delta, accountant), target_epsilon)
    floor = probe.value(z_max)
    if floor > target_epsilon:
        raise BudgetError(
            f"epsilon={target_epsilon} at delta={delta} cannot be met: even noise multiplier "
            f"{z_max:g} gives epsilon={floor:.4g} ({accountant} accountant); raise the "
            "budget, or reduce the steps, sampling rate or fixed charges such as selections"
        )
    lo, hi = _bracket(
        probe.value,
        target_epsilon,
        _start(make_event, target_epsilon, delta, accountant),
        z_max,
        2.0 if accountant == "pld" else 4.0,
    )
    for _ in range(PREDICTIONS):  # settle the bisection's last step first (see _Probe)
        if (guess := probe.crossing(floor)) is None:
            break
        last_lo, last_hi = _bisect(lambda z, guess=guess: z >= guess, lo, hi, rel_tol)
        if probe.settles(last_lo, last_hi):
            break
    z = _bisect(probe.meets, lo, hi, rel_tol)[1]
    if probe.value(z) <= target_epsilon:
        return z
    # epsilon did not decrease in z somewhere: ask at every step, as before the guesses
    return _bisect(lambda z: probe.value(z) <= target_epsilon, lo, hi, rel_tol)[1]


# How many times to guess the bisection's last interval before it asks the accountant at each
# of its steps that earlier answers do not settle.
PREDICTIONS = 3


def _bisect(
    meets: Callable[[float], bool], lo: float, hi: float, rel_tol: float
) -> tuple[float, float]:
    """Geometric bisection of (lo, hi] down to ``rel_tol``: the last (miss, meet) pair."""
    while hi > lo * (1 + rel_tol):
        mid = math.sqrt(lo * hi)
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


class _Probe:
    """Whether noise multiplier z meets the target, from the accountant or, where epsilon's
    decrease in z settles it, from the answers so far: any z at or below one seen to miss
    misses, any z at or above one seen to meet meets. One RDP answer costs 0.1-0.6 s of
    pure Python (a PLD one more), and the bisection needed ~11 of them. So calibration first
    guesses where epsilon crosses the target (``crossing``), follows the bisection's path to
    its last interval under that guess, and asks the accountant about that interval's two ends
    only. If they miss and meet, every step of the real bisection is settled by them, and it
    returns the bits the bisection asking at every step returns: 6-9 answers in all instead of
    14-16 (tests/test_privacy_calibration.py)."""

    def __init__(self, eps: Callable[[float], float], target: float) -> None:
        self.eps, self.target = eps, target
        self.answers: dict[float, float] = {}
        self.miss = 0.0  # the largest z seen to miss the target
        self.meet = math.inf  # the smallest z seen to meet it

    def value(self, z: float) -> float:
        if z not in self.answers:
            e = self.answers[z] = self.eps(z)
            if e > self.target:
                self.miss = max(self.miss, z)
            else:
                self.meet = min(self.meet, z)
        return self.answers[z]

    def meets(self, z: float) -> bool:
        if z <= self.miss:
            return False
        if z >= self.meet:
            return True
        return self.value(z) <= self.target

    def settles(self, lo: float, hi: float) -> bool:
        """Asks about ``lo`` and ``hi`` where still unsettled: whether lo misses and hi meets."""
        return not self.meets(lo) and self.meets(hi)

    def crossing(self, floor: float) -> float | None:
        """Where epsilon crosses the target: the line through the two answers nearest to it, in
        log z against the log of epsilon above ``floor`` (its value at the largest z: what the
        noise cannot take away, such as selections), which falls about as a power of z. The
        nearest two rather than the nearest on either side: a far, steep answer on one side
        would hold every guess on the other."""
        if not (0 < self.miss < self.meet < math.inf) or not 0 <= floor < self.target:
            return None
        points = sorted(
            (abs(y), math.log(z), y)
            for z, e in self.answers.items()
            if e > floor and math.isfinite(e)
            for y in [math.log((e - floor) / (self.target - floor))]
        )
        if len(points) < 2 or points[0][2] == points[1][2]:
            return None
        (_, x1, y1), (_, x2, y2) = points[:2]
        guess = math.exp(x1 - y1 * (x2 - x1) / (y2 - y1))
        return guess if self.miss < guess < self.meet else math.sqrt(self.miss * self.meet)


def _start(
    make_event: Callable[[float], dp_event.DpEvent], target: float, delta: float, kind: str
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

    def make_event(z: float) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([dpsgd_event(phases, z), selection])

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

    def make_event(z: float) -> dp_event.DpEvent:
        z_id = None if id_noise_ratio is None else id_noise_ratio * z
        return central_event(rounds, sampling_rate, z, z_id, sampling, population, cohort)

    z = calibrate_noise(make_event, target_epsilon, delta, accountant, rel_tol)
    return CentralNoise(model=z, identifier=None if id_noise_ratio is None else id_noise_ratio * z)
