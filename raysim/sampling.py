"""Client sampling for a round: Poisson (each client independently with rate q) or a fixed-size
cohort of round(q*N) drawn without replacement. The accountant charges the matching
amplification (privacy.accounting), so the scheme here and there must agree."""

from __future__ import annotations

import numpy as np


def sample_cohort(
    num_clients: int, rate: float, scheme: str, rng: np.random.Generator
) -> np.ndarray:
    if rate >= 1.0:
        return np.arange(num_clients)
    if scheme == "poisson":
        return np.flatnonzero(rng.random(num_clients) < rate)
    if scheme == "without_replacement":
        return np.sort(rng.choice(num_clients, size=cohort_size(num_clients, rate), replace=False))
    raise ValueError(f"training.sampling: unknown scheme {scheme!r}")


def cohort_size(num_clients: int, rate: float) -> int:
    return max(1, round(rate * num_clients))
