"""Per-client ledger of metric (d-privacy) leakage: eps_t * ||delta_t|| per release, additive
over releases (Galli et al., Theorem 3.1). Kept beside the dp_accounting ledger."""

from __future__ import annotations

from collections import defaultdict


class MetricLedger:
    def __init__(self, cap: float | None = None) -> None:
        self.cap = cap
        self._totals: dict[int, float] = defaultdict(float)
        self._rows: list[dict] = []

    def would_exceed(self, client: int, leakage: float) -> bool:
        return self.cap is not None and self._totals[client] + leakage > self.cap * (1 + 1e-12)

    def record(self, round: int, client: int, dim: int, radius: float, epsilon: float) -> None:
        leakage = epsilon * radius
        self._totals[client] += leakage
        self._rows.append(
            {
                "round": round,
                "client": client,
                "dim": dim,
                "radius": radius,
                "epsilon": epsilon,
                "leakage": leakage,
                "total": self._totals[client],
            }
        )

    def total(self, client: int) -> float:
        return float(self._totals.get(client, 0.0))

    def rows(self) -> list[dict]:
        return list(self._rows)
