"""A phase of DP-SGD steps: what the accountant composes, in a module that needs no accountant."""

from __future__ import annotations

from dataclasses import dataclass

from raysim.privacy.errors import PrivacyConfigError


@dataclass(frozen=True)
class Phase:
    """A stretch of ``steps`` DP-SGD steps at Poisson rate ``sampling_rate`` (1 = full batch)."""

    sampling_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not 0 < self.sampling_rate <= 1:
            raise PrivacyConfigError(f"sampling_rate must be in (0, 1], got {self.sampling_rate}")
        if self.steps < 0 or int(self.steps) != self.steps:
            raise PrivacyConfigError(f"steps must be a non-negative integer, got {self.steps}")
