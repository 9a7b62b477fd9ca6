"""Differential privacy in raysim. This package's own modules are the library: mechanisms,
accounting, calibration and a ledger, plain numpy and ``dp_accounting``, knowing nothing about
Ray, the config or the algorithms. Above them, in this folder: the plans (``planning``), the
algorithm's side of the contract (``needs``: what it declares; ``view``: what the server step
receives), the privacy modes that apply them at the trust boundary (``modes``, which no
algorithm imports) and the planned spend of a run (``report``); import-linter contracts keep
that order.

Accounting, calibration and the ledger load on first use (PEP 562): the accountant pulls in
scipy (~0.3 s), which a client worker of a run without DP never needs. dp_accounting's own
``__init__``, which loads scipy.stats and scipy.signal (~1.2 s and ~50 MiB per process), runs
only where a name it defines is used (``raysim.privacy.on_demand``). The mechanisms and the
release types load at once.
"""

from importlib import import_module
from typing import Any

from raysim.privacy.errors import BudgetError, PrivacyConfigError, check_sample_level_delta
from raysim.privacy.mechanisms import (
    SKETCH_DIM,
    clip_l2,
    d_privacy_epsilon,
    exponential_select,
    gaussian_mechanism,
    geometric_clip_update,
    laplace_euclidean,
    onehot_noise_multiplier,
    private_sketch,
    privatize_onehot,
)
from raysim.privacy.metric_ledger import MetricLedger, MetricRelease
from raysim.privacy.on_demand import package_on_demand
from raysim.privacy.phase import Phase
from raysim.privacy.release import MetricLeakage, Released, postprocess

package_on_demand("dp_accounting")  # before the modules below import from it

_LAZY = {
    **dict.fromkeys(
        (
            "AccountantKind",
            "central_event",
            "central_round_event",
            "d_privacy_leakage",
            "delta_for",
            "epsilon",
            "make_accountant",
            "neighboring_relation",
            "rdpcfl_phases",
        ),
        "accounting",
    ),
    **dict.fromkeys(("BoundedRangeDpEvent", "dpsgd_event", "selection_event"), "events"),
    **dict.fromkeys(
        (
            "CentralNoise",
            "calibrate_central",
            "calibrate_dpsgd",
            "calibrate_noise",
        ),
        "calibration",
    ),
    **dict.fromkeys(
        ("NoiseCohort", "cohort_caveat", "noise_share", "server_noise", "unamplified_epsilon"),
        "distributed",
    ),
    "PrivacyLedger": "ledger",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raysim.privacy' has no attribute {name!r}")
    value = getattr(import_module(f"raysim.privacy.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "SKETCH_DIM",
    "AccountantKind",
    "BoundedRangeDpEvent",
    "BudgetError",
    "CentralNoise",
    "NoiseCohort",
    "MetricLedger",
    "MetricRelease",
    "Phase",
    "PrivacyConfigError",
    "PrivacyLedger",
    "MetricLeakage",
    "Released",
    "calibrate_central",
    "calibrate_dpsgd",
    "calibrate_noise",
    "central_event",
    "central_round_event",
    "check_sample_level_delta",
    "clip_l2",
    "cohort_caveat",
    "d_privacy_epsilon",
    "d_privacy_leakage",
    "delta_for",
    "dpsgd_event",
    "epsilon",
    "exponential_select",
    "gaussian_mechanism",
    "geometric_clip_update",
    "laplace_euclidean",
    "make_accountant",
    "neighboring_relation",
    "noise_share",
    "onehot_noise_multiplier",
    "private_sketch",
    "privatize_onehot",
    "postprocess",
    "rdpcfl_phases",
    "selection_event",
    "server_noise",
]
