"""Every random draw comes from a generator keyed by (run seed, round, client, purpose).

That key, not the worker or node a computation lands on, decides the bits: a shard re-run
elsewhere, or split differently over workers, gives the same result.

Where the server is untrusted (``sample``, ``distributed``, ``dprivacy``) the clients' draws, and
the secure sum's noise, are keyed by the clients' seed in place of the run's
(``privacy.client_seed``; by default 128 bits from the OS, recorded in the run's config.yaml): the
server's process holds the run's seed, and could otherwise draw the clients' noise again and take it
off their releases.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch loads where a torch generator is made: `raysim run`'s driver never does
    import torch

SERVER = -1  # the "client" index of draws made by the server / coordinator


def _purpose_code(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def seed_sequence(seed: int, round: int, client: int, purpose: str) -> np.random.SeedSequence:
    # SeedSequence entropy must be non-negative: shift the client index (SERVER = -1 -> 0).
    return np.random.SeedSequence([seed, round, client + 1, _purpose_code(purpose)])


def numpy_rng(seed: int, round: int, client: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(seed_sequence(seed, round, client, purpose))


def torch_generator(seed: int, round: int, client: int, purpose: str) -> torch.Generator:
    import torch

    state = seed_sequence(seed, round, client, purpose).generate_state(1, dtype=np.uint64)[0]
    gen = torch.Generator()
    gen.manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def public_seed(seed: int, round: int, purpose: str) -> int:
    """A seed every client of a round shares (e.g. PINA's sketch projection, "sketch_projection").

    Drawn from the server's stream of the round, so it depends on no client; it is public and
    so costs no privacy.
    """
    return int(seed_sequence(seed, round, SERVER, purpose).generate_state(1, dtype=np.uint64)[0])
