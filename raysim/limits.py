"""Resource limits checked before anything runs: the size of a run's schedule against the memory
of the machine it starts on.

A run keeps records from every round to its end: a metrics row, the noise schedule's phase per
train size, and the privacy ledger's charges, one per client and charge under an accountant per
client (sample-level DP, d-privacy), one per round for the population under client-level DP.
``rounds`` is bounded in the config (``raysim.config.MAX_ROUNDS``); within that bound, a schedule
whose records would not fit in half the memory available now is refused with the numbers, in
under a second, instead of growing for minutes until the machine swaps or kills it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from raysim.config import ConfigError, ExperimentConfig

BYTES_PER_ROUND = 4096  # a metrics row (a few dozen values), a schedule phase, the round's state
BYTES_PER_CHARGE = 1024  # a ledger row held in memory, and again as a row of ledger.parquet
MEMORY_SHARE = 0.5  # of the memory available: the rest is the data, the models, Ray, the system


@dataclass(frozen=True)
class ScheduleSize:
    """The records a run keeps: ``rounds`` x (a row + ``cohort`` x ``models`` ledger charges)."""

    rounds: int
    cohort: int  # clients charged one by one each round (1: the population as one account)
    models: int  # values a client may release in a round: an update per model, or a choice

    @property
    def bytes(self) -> int:
        return self.rounds * (BYTES_PER_ROUND + self.cohort * self.models * BYTES_PER_CHARGE)


def schedule_size(cfg: ExperimentConfig) -> ScheduleSize:
    """An upper estimate of what ``cfg``'s run keeps, from the config alone (nothing built)."""
    q, n = cfg.training.sampling_rate, cfg.data.num_clients
    if cfg.privacy.mode in ("sample", "dprivacy"):  # an account per client
        cohort = max(1, math.ceil(q * n))
    else:  # one account for the population (client, distributed), or no ledger (none)
        cohort = 1
    models = cfg.algorithm.num_clusters or cfg.data.num_clusters
    return ScheduleSize(cfg.rounds, cohort, max(1, models))


def available_memory() -> int | None:
    """Bytes of memory available to a new process now (``MemAvailable`` of /proc/meminfo, else
    the physical memory); None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**20:,.1f} MiB"


def check_schedule(cfg: ExperimentConfig) -> None:
    """Refuse (ConfigError naming ``rounds``) a run whose records would not fit in memory."""
    size = schedule_size(cfg)
    memory = available_memory()
    if memory is None or size.bytes <= MEMORY_SHARE * memory:
        return
    per = "clients charged a round" if size.cohort > 1 else "account charged a round"
    raise ConfigError(
        f"rounds={size.rounds}: the run would keep about {_gb(size.bytes)} of records to its end "
        f"({size.rounds} rounds x {size.cohort} {per} x {size.models} model(s): the metrics, "
        f"the noise schedule and the privacy ledger), more than {MEMORY_SHARE:.0%} of the "
        f"{_gb(memory)} of memory available now: lower rounds, data.num_clients or "
        "training.sampling_rate, or run on a machine with more memory"
    )
