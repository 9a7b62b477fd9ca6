"""Differential-privacy library of raysim: mechanisms, accounting, calibration and a ledger.

Plain numpy and ``dp_accounting``: nothing here knows about Ray, the config or the algorithms.
"""

from raysim.privacy.accounting import (
    AccountantKind,
    BoundedRangeDpEvent,
    Phase,
    central_event,
    central_round_event,
    d_privacy_leakage,
    delta_for,
    dpsgd_event,
    epsilon,
    make_accountant,
    neighboring_relation,
    rdpcfl_phases,
    selection_event,
)
from raysim.privacy.calibration import (
    CentralNoise,
    calibrate_central,
    calibrate_dpsgd,
    calibrate_noise,
    check_sample_level_delta,
)
from raysim.privacy.distributed import NoiseCohort, cohort_caveat, noise_share, server_noise
from raysim.privacy.errors import BudgetError, PrivacyConfigError
from raysim.privacy.ledger import PrivacyLedger
from raysim.privacy.mechanisms import (
    SKETCH_DIM,
    clip_l2,
    d_privacy_epsilon,
    exponential_select,
    gaussian_mechanism,
    laplace_euclidean,
    onehot_noise_multiplier,
    private_sketch,
    privatize_onehot,
)
from raysim.privacy.metric_ledger import MetricLedger, MetricRelease
from raysim.privacy.release import MetricLeakage, Released, postprocess

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
