"""Privacy modes by the names configs use (``privacy.mode``): the trust boundary of a run.

The registry is open, as Opacus' accountants are (``register_accountant``): a mode of one's own
is a ``PrivacyMode`` subclass, named in a config as ``module:Name`` (imported where the run is
prepared, like an algorithm of one's own) or registered by name with ``register_mode``.
docs/architecture.md ("Adding a privacy mode") walks through one.
"""

from __future__ import annotations

import numpy as np

from raysim import config as config_module
from raysim.config import ConfigError, ExperimentConfig, import_named
from raysim.privacy.modes.base import PrivacyMode, TrustBoundaryError
from raysim.privacy.modes.client import ClientLevel
from raysim.privacy.modes.distributed import Distributed
from raysim.privacy.modes.dprivacy import MetricLocal
from raysim.privacy.modes.none import NoPrivacy
from raysim.privacy.modes.sample import SampleLevel
from raysim.privacy.needs import PrivacyNeeds

MODES: dict[str, type[PrivacyMode]] = {
    cls.name: cls for cls in (NoPrivacy, SampleLevel, ClientLevel, Distributed, MetricLocal)
}
BUILT_IN = tuple(MODES)


def register_mode(cls: type[PrivacyMode]) -> type[PrivacyMode]:
    """Make ``cls`` a mode configs may name (``privacy.mode: <cls.name>``) in this process; a
    decorator too. ``cls.serves_as`` names the built-in mode whose contract with algorithms it
    keeps: the algorithms that declare that mode run under it."""
    if not (isinstance(cls, type) and issubclass(cls, PrivacyMode)):
        raise TypeError(f"register_mode takes a PrivacyMode subclass, not {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a mode's name must be an identifier, got {name!r}")
    known = MODES.get(name, cls)
    same = (known.__module__, known.__qualname__) == (cls.__module__, cls.__qualname__)
    if known is not cls and not (same and name not in BUILT_IN):  # a module imported anew: same
        raise ValueError(f"privacy mode {name!r} is registered already ({MODES[name].__name__})")
    if cls.contract() not in BUILT_IN:
        raise ValueError(
            f"{cls.__name__}.serves_as must name a built-in mode ({', '.join(BUILT_IN)}), "
            f"got {cls.serves_as!r}"
        )
    MODES[name] = cls
    if name not in config_module.PRIVACY_MODES:
        config_module.PRIVACY_MODES.append(name)
    return cls


def mode_class(name: str) -> type[PrivacyMode]:
    """The class a ``privacy.mode`` value names: registered, or ``module:Name`` imported (and
    then registered under its own name)."""
    if ":" in name:
        cls = import_named(name, "privacy.mode")
        if not (isinstance(cls, type) and issubclass(cls, PrivacyMode)):
            raise ConfigError(f"privacy.mode: {name} is not a PrivacyMode subclass")
        try:
            return register_mode(cls)
        except ValueError as exc:
            raise ConfigError(f"privacy.mode: {exc}") from None
    try:
        return MODES[name]
    except KeyError:
        allowed = ", ".join(MODES)
        raise ConfigError(f"privacy.mode: unknown mode {name!r}; allowed: {allowed}") from None


def make_mode(cfg: ExperimentConfig, train_sizes: np.ndarray, needs: PrivacyNeeds) -> PrivacyMode:
    """The configured mode, calibrated (raises BudgetError when the request cannot be met)."""
    return mode_class(cfg.privacy.mode)(cfg, train_sizes, needs)


__all__ = [
    "MODES",
    "PrivacyMode",
    "PrivacyNeeds",
    "TrustBoundaryError",
    "make_mode",
    "mode_class",
    "register_mode",
]
