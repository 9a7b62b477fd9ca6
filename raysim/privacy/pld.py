"""dp_accounting's PLD accountant, extended for raysim's events. A module of its own because
dp_accounting's PLD code loads scipy.signal and scipy.stats (~0.8 CPU-s): only a run that asks
for ``accountant: pld`` loads it (``raysim.privacy.accounting.make_accountant``)."""

from __future__ import annotations

import math

from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from raysim.privacy.events import BoundedRangeDpEvent, dp_event


def _gaussian_composition_multiplier(event: dp_event.DpEvent) -> float | None:
    """Noise multiplier of the single Gaussian equivalent to a composition of Gaussians.

    Gaussians with multipliers z_i released on the same data are one Gaussian with
    1/z^2 = sum 1/z_i^2 (McMahan et al. 2018, sec. 3). None if the tree holds anything else.
    """
    if isinstance(event, dp_event.GaussianDpEvent):
        return event.noise_multiplier
    if isinstance(event, dp_event.SelfComposedDpEvent):
        z = _gaussian_composition_multiplier(event.event)
        return None if z is None else z / math.sqrt(event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        zs = [_gaussian_composition_multiplier(e) for e in event.events]
        if any(z is None for z in zs):
            return None
        return sum(z**-2 for z in zs) ** -0.5
    return None


class PldAccountant(pld_privacy_accountant.PLDAccountant):
    """dp_accounting's PLD accountant plus bounded-range events and sampled Gaussian groups."""

    def privacy_loss_distribution(self) -> pld_lib.PrivacyLossDistribution | None:
        """The composed PLD; None once a non-private event was composed (epsilon = inf)."""
        return None if self._contains_non_dp_event else self._pld

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, BoundedRangeDpEvent):
            if do_compose:
                params = pld_common.DifferentialPrivacyParameters(event.epsilon, 0.0)
                pld = pld_lib.from_privacy_parameters(params, self._value_discretization_interval)
                self._pld = self._pld.compose(pld.self_compose(count))
            return None
        if isinstance(event, dp_event.PoissonSampledDpEvent) and not isinstance(
            event.event, dp_event.GaussianDpEvent
        ):
            z = _gaussian_composition_multiplier(event.event)
            if z is not None:
                flat = dp_event.PoissonSampledDpEvent(
                    event.sampling_probability, dp_event.GaussianDpEvent(z)
                )
                return super()._maybe_compose(flat, count, do_compose)
        return super()._maybe_compose(event, count, do_compose)
