"""Privacy plans: what each client's (or the population's) mechanism schedule will be, with the
noise calibrated so the whole run spends exactly the requested (eps, delta) — decided before the
run starts, refused (BudgetError) when it cannot be met.

The arithmetic is in raysim.privacy; this module only turns an experiment's schedule (batch
size, local epochs, rounds, client sampling) into privacy phases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raysim import privacy as privacy_lib
from raysim.config import PrivacyConfig
from raysim.privacy import BudgetError, Phase
from raysim.privacy.events import dp_event  # raysim.privacy registers dp_accounting first
from raysim.training import TrainConfig, sampling_plan


def refuse_over_budget(planned_epsilon: Callable[[], float], privacy: PrivacyConfig) -> None:
    """With a fixed noise multiplier, the plan must still fit the budget (privacy.epsilon). The
    planned spend is computed only where there is a budget: it loads the accountant (with scipy,
    in the start-up's serial part), which a run without a budget needs only at its first charge."""
    if privacy.epsilon is None:
        return
    planned = planned_epsilon()
    if planned > privacy.epsilon * (1 + 1e-9):
        raise BudgetError(
            f"privacy.noise_multiplier={privacy.noise_multiplier} spends eps={planned:.3f} over "
            f"the planned schedule, above the budget privacy.epsilon={privacy.epsilon}: raise the "
            "noise, lower rounds or epochs, or raise the budget"
        )


def dpsgd_round_phase(n: int, train: TrainConfig) -> Phase:
    """One round of local DP-SGD, with the very batch schedule the trainer follows."""
    plan = sampling_plan(n, train)
    return Phase(sampling_rate=plan.q, steps=plan.total_steps)


@dataclass
class SampleLevelPlan:
    """Per-client DP-SGD noise: each client is accounted on its own (sample-level DP).

    `schedule(n)` lists the client's phases, one per round; clients with the same train size
    share one calibration. `selections` reserves exponential-mechanism choices (count, eps each)
    inside the same budget.
    """

    privacy: PrivacyConfig
    train_sizes: np.ndarray
    schedule: Callable[[int], Sequence[Phase]]
    selections: tuple[int, float] = (0, 0.0)
    noise: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count, sel_eps = self.selections
        fixed = self.privacy.noise_multiplier is not None
        for n in sorted(set(int(s) for s in self.train_sizes)):
            if fixed:
                self.noise[n] = self.privacy.noise_multiplier
            else:
                self.noise[n] = privacy_lib.calibrate_dpsgd(
                    list(self.schedule(n)),
                    self.privacy.epsilon,
                    self.privacy.delta,
                    selection_epsilon=sel_eps,
                    selections=count,
                    accountant=self.privacy.accountant,
                )
        if fixed:
            refuse_over_budget(self.planned_epsilon, self.privacy)

    def noise_multiplier(self, client: int) -> float:
        return self.noise[int(self.train_sizes[client])]

    def round_event(self, client: int, round: int) -> Any:
        n = int(self.train_sizes[client])
        return privacy_lib.dpsgd_event([self.schedule(n)[round - 1]], self.noise[n])

    def planned_event(self, n: int) -> Any:
        count, sel_eps = self.selections
        return dp_event.ComposedDpEvent(
            [
                privacy_lib.dpsgd_event(list(self.schedule(n)), self.noise[n]),
                privacy_lib.selection_event(sel_eps, count),
            ]
        )

    def planned_epsilon(self) -> float:
        """The worst client's eps over the whole planned schedule, selections included."""
        p = self.privacy
        return max(
            privacy_lib.epsilon(self.planned_event(n), p.delta, p.accountant) for n in self.noise
        )

    def summary(self) -> dict[str, Any]:
        zs = list(self.noise.values())
        return {
            "noise_multiplier": max(zs),
            "noise_multiplier_min": min(zs),
            "noise_by_train_size": {str(n): z for n, z in self.noise.items()},
        }


@dataclass
class CentralPlan:
    """Client-level DP with a trusted server: Gaussian noise on the sum of clipped updates (and,
    where the algorithm sends cluster identifiers, on those), amplified by client sampling.

    Poisson sampling is accounted under add/remove-one (sensitivity of a sum: C); a fixed-size
    cohort without replacement under replace-one (sensitivity 2C), the only relation the
    accountant has for it. `sensitivity(clip)` gives the scale the noise must be drawn at.
    """

    privacy: PrivacyConfig
    rounds: int
    sampling_rate: float
    sampling: str
    population: int
    id_noise_ratio: float | None = None  # sigma_s / sigma_theta; None: no identifier mechanism
    noise: float = field(init=False)
    id_noise: float | None = field(init=False)
    # adaptive clipping: the multiplier of the count of updates under the clip (None: fixed clip)
    count_noise: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        p = self.privacy
        if p.noise_multiplier is not None:
            self.noise = ratio = p.noise_multiplier
            self.id_noise = None if self.id_noise_ratio is None else ratio * self.id_noise_ratio
            self._split_for_count()

            def planned() -> float:
                event = dp_event.SelfComposedDpEvent(self.round_event(), self.rounds)
                return privacy_lib.epsilon(event, p.delta, p.accountant)

            refuse_over_budget(planned, p)
            return
        calibrated = privacy_lib.calibrate_central(
            self.rounds,
            self.sampling_rate,
            p.epsilon,
            p.delta,
            id_noise_ratio=self.id_noise_ratio,
            sampling=self.sampling,
            population=self.population,
            accountant=p.accountant,
        )
        self.noise, self.id_noise = calibrated.model, calibrated.identifier
        self._split_for_count()

    @property
    def cohort(self) -> float:
        """The expected number of clients a round samples (the fixed size without replacement)."""
        if self.sampling == "poisson":
            return self.sampling_rate * self.population
        return float(max(1, round(self.sampling_rate * self.population)))

    @property
    def count_sensitivity(self) -> float:
        """Of the sum of centred bits b - 1/2 (b: an update under the clip): 1/2 when a client is
        added or removed (Poisson), 1 when one is replaced (a fixed cohort)."""
        return 0.5 if self.sampling == "poisson" else 1.0

    def _split_for_count(self) -> None:
        """Adaptive clipping (Andrew et al. 2021, Theorem 1): the sum and the count are one
        Gaussian mechanism on the same sampled clients, with 1/z^2 = 1/z_sum^2 + 1/z_count^2.
        The calibrated z is that whole; the count takes its fixed share (its std, default
        cohort / 20, over its sensitivity) and the sum the rest, so the run spends what a fixed
        clip at z would."""
        p = self.privacy
        if p.clip_quantile is None:
            return
        if self.id_noise is not None:  # algorithms releasing identifiers refuse clip_quantile
            raise BudgetError("adaptive clipping is planned for a model sum without identifiers")
        std = p.clip_count_noise if p.clip_count_noise is not None else self.cohort / 20
        self.count_noise = std / self.count_sensitivity
        if not self.count_noise > self.noise:
            raise BudgetError(
                f"privacy.clip_count_noise: the count's noise (std {std:g}, multiplier "
                f"{self.count_noise:.4g}) must exceed the whole round's multiplier "
                f"{self.noise:.4g}: raise its std above {self.noise * self.count_sensitivity:.4g}, "
                "or raise the sampling rate"
            )
        self.noise = (self.noise**-2 - self.count_noise**-2) ** -0.5

    def sensitivity(self, clip: float) -> float:
        return clip if self.sampling == "poisson" else 2 * clip

    @property
    def aux_noise(self) -> float | None:
        """The multiplier of what a round releases beside its sum, composed with it: the
        identifiers, or adaptive clipping's count (never both)."""
        return self.count_noise if self.count_noise is not None else self.id_noise

    def round_event(self) -> Any:
        return privacy_lib.central_round_event(
            self.sampling_rate,
            self.noise,
            self.aux_noise,
            sampling=self.sampling,
            population=self.population,
        )

    def summary(self) -> dict[str, Any]:
        out = {"noise_multiplier": self.noise, "id_noise_multiplier": self.id_noise}
        if self.count_noise is not None:
            p = self.privacy
            out.update(clip_quantile=p.clip_quantile, clip_lr=p.clip_lr)
            out["clip_count_noise_multiplier"] = self.count_noise
        return out
