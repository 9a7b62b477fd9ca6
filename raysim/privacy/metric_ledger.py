"""Per-client leakage under d-privacy (Galli et al.): a ledger beside the (epsilon, delta) one.

A release of Algorithm 2 is eps-d-private with ``eps = n / (nu * ||delta||)``: points within the
radius ``||delta||`` of the update are ``eps * ||delta|| = n / nu`` indistinguishable. That is not
a dp_accounting event (no neighbouring datasets, no delta), so it is kept here: one row per
(client, round) with n, nu and the leakage ``n / nu``. Independent releases compose by adding
their leakages (Theorem 3.1), so a client's total is their sum. The ledger is the server's
(it runs in the coordinator's process), so it never holds ``||delta||`` or eps: the exact norm
of a client's update is not part of what an untrusted server may see, and the leakage does not
depend on it.

What the numbers do not say: the noise scale ``nu * ||delta||`` depends on the update, so the
release reveals ``||delta||`` roughly, and which hypothesis the client trained is revealed by
design (the server clusters the releases). Totals are exact up to float rounding (they are
summed with ``math.fsum``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from raysim.privacy.errors import BudgetError, PrivacyConfigError
from raysim.privacy.mechanisms import d_privacy_epsilon

__all__ = ["MetricLedger", "MetricRelease"]

# Relative slack on the cap, so that k releases of exactly cap/k are allowed despite rounding.
CAP_RTOL = 1e-9


@dataclass(frozen=True)
class MetricRelease:
    """One sanitized release of one client."""

    client: int
    round: int
    dim: int  # n, the number of released parameters
    nu: float
    leakage: float  # eps * ||delta|| = n / nu (also its limit when ||delta|| -> 0)
    cluster: int | None = None  # the hypothesis the client trained (revealed to the server)


class MetricLedger:
    """Records d-privacy releases; totals per client; an optional per-client cap.

    ``cap``: no client's total may exceed it. :meth:`would_exceed` is the check a client makes
    before releasing (Galli et al., App. B.1: a client whose next release would cross the cap
    skips the round); :meth:`record` refuses (``BudgetError``) a release that would.
    """

    def __init__(self, cap: float | None = None) -> None:
        if cap is not None and not cap > 0:
            raise PrivacyConfigError(f"leakage cap must be > 0, got {cap!r}")
        self.cap = cap
        self._releases: list[MetricRelease] = []
        self._by_client: dict[int, list[float]] = defaultdict(list)

    @staticmethod
    def leakage(dim: int, nu: float) -> float:
        """Per-release leakage ``n / nu`` of Algorithm 2 (independent of ``||delta||``)."""
        d_privacy_epsilon(dim, nu, 1.0)  # validates dim >= 1 and nu > 0
        return dim / nu

    def total(self, client: int) -> float:
        return math.fsum(self._by_client.get(int(client), ()))

    def participations(self, client: int) -> int:
        return len(self._by_client.get(int(client), ()))

    def totals(self) -> dict[int, float]:
        """Total leakage of every client that released at least once."""
        return {c: math.fsum(v) for c, v in sorted(self._by_client.items())}

    def totals_of(self, num_clients: int) -> np.ndarray:
        """Total leakage of each client 0..num_clients-1 (0 for those that never released)."""
        out = np.zeros(num_clients, dtype=np.float64)
        for c, total in self.totals().items():
            out[c] = total
        return out

    def would_exceed(self, client: int, leakage: float) -> bool:
        """Whether releasing ``leakage`` more would take ``client`` past the cap."""
        if self.cap is None:
            return False
        return self.total(client) + leakage > self.cap * (1 + CAP_RTOL)

    def record(
        self, client: int, round: int, dim: int, nu: float, cluster: int | None = None
    ) -> MetricRelease:
        """Charge one release of Algorithm 2 (n = ``dim``, noise multiplier ``nu``)."""
        leak = self.leakage(dim, nu)
        if self.would_exceed(client, leak):
            raise BudgetError(
                f"client {client}: release {leak:g} on top of {self.total(client):g} would "
                f"exceed the leakage cap {self.cap:g} (the client should skip the round)"
            )
        rel = MetricRelease(int(client), int(round), int(dim), float(nu), leak, cluster)
        self._releases.append(rel)
        self._by_client[rel.client].append(leak)
        return rel

    def releases(self) -> list[MetricRelease]:
        return list(self._releases)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per release, with the client's running total, for a Parquet file."""
        running: dict[int, list[float]] = defaultdict(list)
        out = []
        for rel in self._releases:
            running[rel.client].append(rel.leakage)
            out.append({**asdict(rel), "total": math.fsum(running[rel.client])})
        return out

    def client_rows(self, clients: Iterable[int]) -> list[dict[str, Any]]:
        """Per-client columns for clients.parquet (zero for a client that never released)."""
        return [
            {
                "client_id": int(c),
                "leakage": self.total(c),
                "releases": self.participations(c),
            }
            for c in clients
        ]

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {"cap": self.cap, "releases": [asdict(r) for r in self._releases]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MetricLedger:
        ledger = cls(state["cap"])
        for r in state["releases"]:
            rel = MetricRelease(**r)
            ledger._releases.append(rel)
            ledger._by_client[rel.client].append(rel.leakage)
        return ledger
