"""The DpEvents a client releases with its output (DP-SGD steps, private cluster selections).

Clients build these in every worker, on every release; the accountant reads them only in the
coordinator. The event classes come from ``dp_accounting.dp_event`` alone, which needs only the
standard library and ``attr``: the rest of dp_accounting does not load with them
(``raysim.privacy.on_demand``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attr
from dp_accounting import dp_event

from raysim.privacy.errors import PrivacyConfigError
from raysim.privacy.phase import Phase


@attr.s(frozen=True, slots=True, auto_attribs=True)
class BoundedRangeDpEvent(dp_event.DpEvent):
    """One run of the exponential mechanism with parameter ``epsilon`` (it is epsilon-BR).

    RDP: epsilon-bounded-range implies (epsilon^2/8)-zCDP (Cesar and Rogers 2021), and pure
    epsilon-DP caps every Renyi divergence at epsilon, so RDP(alpha) = min(alpha*eps^2/8, eps).
    PLD: the dominating pair of pure epsilon-DP (randomized response), which is valid but ignores
    the bounded-range refinement. A custom event because the stock ``ZCDpEvent`` has no PLD.
    """

    epsilon: float


def gaussian(noise_multiplier: float) -> dp_event.GaussianDpEvent:
    if not noise_multiplier > 0:
        raise PrivacyConfigError(f"noise multiplier must be > 0, got {noise_multiplier}")
    return dp_event.GaussianDpEvent(float(noise_multiplier))


def dpsgd_event(phases: Sequence[Phase], noise_multiplier: float) -> dp_event.DpEvent:
    """Sample-level DP-SGD: each phase is ``steps`` Poisson-sampled Gaussian steps.

    A phase at rate 1 (full batch, R-DPCFL round 1) is plain Gaussian steps: no amplification.
    """
    step_noise = gaussian(noise_multiplier)
    parts: list[dp_event.DpEvent] = []
    for phase in phases:
        if phase.steps == 0:
            continue
        step = (
            step_noise
            if phase.sampling_rate == 1
            else dp_event.PoissonSampledDpEvent(float(phase.sampling_rate), step_noise)
        )
        parts.append(dp_event.SelfComposedDpEvent(step, int(phase.steps)))
    if not parts:
        return dp_event.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_event.ComposedDpEvent(parts)


def selection_event(epsilon: float, count: int) -> dp_event.DpEvent:
    """``count`` exponential-mechanism selections at ``epsilon`` each (see BoundedRangeDpEvent)."""
    if count < 0:
        raise PrivacyConfigError(f"count must be >= 0, got {count}")
    if count == 0:
        return dp_event.NoOpDpEvent()
    if not epsilon > 0:
        raise PrivacyConfigError(f"selection epsilon must be > 0, got {epsilon}")
    return dp_event.SelfComposedDpEvent(BoundedRangeDpEvent(float(epsilon)), int(count))
