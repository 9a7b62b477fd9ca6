"""A released value and what releasing it costs, in one object.

Mechanisms hand back a :class:`Released`: the array (or choice) that leaves its owner together
with the dp_accounting event (or, for metric DP, the leakage record) that releasing it costs.
The engine charges the ledger from the releases it sees, so a value cannot be released without
its charge, nor charged without being released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MetricLeakage:
    """What one d-privacy release (Galli et al., Algorithm 2) costs: eps * ||delta|| = n / nu,
    adding up over releases (Theorem 3.1). Not ||delta|| itself: the record crosses to the
    server with the release, and the exact norm of the client's update is not part of what it
    may see."""

    dim: int  # n, the number of released parameters
    nu: float

    @property
    def leakage(self) -> float:
        return self.dim / self.nu


@dataclass(frozen=True)
class Released:
    """``value`` as released by ``mechanism``; ``event`` (a DpEvent) or ``leakage`` is its cost.

    ``shared_by``: releases with the same key in one round act on disjoint groups of clients
    (e.g. one noisy sum per cluster) and compose in parallel: they are charged once.
    """

    value: Any
    mechanism: str
    event: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    leakage: MetricLeakage | None = None
    shared_by: str | None = None


def postprocess(x: Any, fn: Any) -> Any:
    """``fn`` applied to a value, keeping its release (post-processing costs no privacy)."""
    if isinstance(x, Released):
        return Released(fn(x.value), x.mechanism, x.event, x.params, x.leakage, x.shared_by)
    return fn(x)
