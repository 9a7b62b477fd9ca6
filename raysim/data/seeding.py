"""Named random streams for the data layer, on the run-wide seeding scheme (raysim.seeding).

Each step of building the population (allocation, Dirichlet draw, split, synthetic weights...)
has its own stream, so changing how one step uses randomness cannot shift another's.
"""

from __future__ import annotations

import numpy as np

from raysim.seeding import SERVER, numpy_rng


def rng_for(seed: int, purpose: str) -> np.random.Generator:
    """The generator of one data-building ``purpose`` of run ``seed`` (>= 0)."""
    if int(seed) < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return numpy_rng(int(seed), 0, SERVER, f"data/{purpose}")


def client_rng(seed: int, purpose: str, client: int) -> np.random.Generator:
    """Client ``client``'s own generator of one data-building ``purpose``: its rows are made from
    (seed, client) alone, without drawing any other client's (lazy populations)."""
    if int(seed) < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return numpy_rng(int(seed), 0, int(client), f"data/{purpose}")
