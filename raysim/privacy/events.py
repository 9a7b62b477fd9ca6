"""The DpEvents a client releases with its output (DP-SGD steps, private cluster selections).

Clients build these in every worker, on every release; the accountant reads them only in the
coordinator. ``import dp_accounting`` runs the package's ``__init__``, which loads its PLD and
calibration code and through them scipy.signal, scipy.stats and scipy.optimize: ~1.2 CPU-s and
~50 MiB in every worker, paid in round 1 while the run waits. The event classes themselves live
in ``dp_accounting.dp_event``, which needs only the standard library and ``attr``. So this module
loads that one file as ``dp_accounting.dp_event`` when the package is not loaded yet; when the
package loads later (the coordinator's accountant), its ``__init__`` finds the module already in
``sys.modules`` and uses it: one set of classes per process either way
(tests/test_imports.py). Where the package is loaded already, this is a plain import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

import attr

from raysim.privacy.errors import PrivacyConfigError
from raysim.privacy.phase import Phase

_NAME = "dp_accounting.dp_event"


def _dp_event() -> ModuleType:
    if _NAME in sys.modules or "dp_accounting" in sys.modules:
        return importlib.import_module(_NAME)
    package = importlib.util.find_spec("dp_accounting")  # finds it; runs none of it
    locations = package.submodule_search_locations if package else None
    spec = (
        importlib.util.spec_from_file_location(_NAME, f"{locations[0]}/dp_event.py")
        if locations
        else None
    )
    if spec is None or spec.loader is None:  # an unusual install: the plain import
        return importlib.import_module(_NAME)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module


dp_event = _dp_event()


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
