"""Privacy modes by the names configs use (``privacy.mode``): the trust boundary of a run.

Adding a mode: a file here with one ``PrivacyMode`` subclass, an entry in ``MODES`` and the
name in ``raysim.config.PRIVACY_MODES``.
"""

from __future__ import annotations

import numpy as np

from raysim.config import ConfigError, ExperimentConfig
from raysim.modes.base import PrivacyMode, PrivacyNeeds, TrustBoundaryError
from raysim.modes.client import ClientLevel
from raysim.modes.distributed import Distributed
from raysim.modes.dprivacy import MetricLocal
from raysim.modes.none import NoPrivacy
from raysim.modes.sample import SampleLevel

MODES: dict[str, type[PrivacyMode]] = {
    cls.name: cls for cls in (NoPrivacy, SampleLevel, ClientLevel, Distributed, MetricLocal)
}


def make_mode(cfg: ExperimentConfig, train_sizes: np.ndarray, needs: PrivacyNeeds) -> PrivacyMode:
    """The configured mode, calibrated (raises BudgetError when the request cannot be met)."""
    try:
        cls = MODES[cfg.privacy.mode]
    except KeyError:
        allowed = ", ".join(MODES)
        raise ConfigError(
            f"privacy.mode: unknown mode {cfg.privacy.mode!r}; allowed: {allowed}"
        ) from None
    return cls(cfg, train_sizes, needs)


__all__ = ["MODES", "PrivacyMode", "PrivacyNeeds", "TrustBoundaryError", "make_mode"]
