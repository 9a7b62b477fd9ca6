"""Client-side local training: plain SGD or DP-SGD (Opacus), on flat weight vectors."""

from raysim.training.config import (
    GRAD_SAMPLE_MODES,
    EvalResult,
    SamplingPlan,
    TrainConfig,
    TrainResult,
    sampling_plan,
)
from raysim.training.losses import REGRESSION_LOSSES, TASKS, per_sample_loss
from raysim.training.trainer import LocalTrainer, float32_kernels

__all__ = [
    "GRAD_SAMPLE_MODES",
    "REGRESSION_LOSSES",
    "TASKS",
    "EvalResult",
    "LocalTrainer",
    "SamplingPlan",
    "TrainConfig",
    "TrainResult",
    "float32_kernels",
    "per_sample_loss",
    "sampling_plan",
]
