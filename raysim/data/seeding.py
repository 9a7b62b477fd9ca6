"""Named random streams for the data layer.

Every random choice draws from ``default_rng([DATA_DOMAIN, seed, purpose])``, so one run seed gives
the same population bit for bit, and changing how one step uses randomness (say the Dirichlet
draw) cannot shift the stream of another (say the train/test split). No global state is touched.
"""

from __future__ import annotations

import numpy as np

DATA_DOMAIN = 0xDA7A  # keeps data streams apart from other components seeding with [seed, code]

PURPOSES: dict[str, int] = {
    "allocate": 1,
    "dirichlet": 2,
    "split": 3,
    "synthetic_weights": 4,
    "synthetic_samples": 5,
}


def rng_for(seed: int, purpose: str) -> np.random.Generator:
    """The generator for one ``purpose`` (a key of ``PURPOSES``) of run ``seed`` (>= 0)."""
    if int(seed) < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return np.random.default_rng([DATA_DOMAIN, int(seed), PURPOSES[purpose]])
