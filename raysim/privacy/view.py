"""The server step's view of a round, made by the privacy mode that admitted it.

An algorithm's server step gets a ``Reports``: the per-client messages its mode shows (a list:
none under secure aggregation but the released local sketches) and the aggregations its mode
releases. The aggregation ladder is written once per mode, here, and never in an algorithm:

- ``Reports`` (``none``, ``sample``, ``dprivacy``): exact weighted means and sums;
- ``NoisyReports`` (``client``): clipped sums with Gaussian noise, over a public count;
- ``SecureReports`` (``distributed``): the secure sums' per-slot means, nothing per client.

So an algorithm is written once and runs under every mode it declares, as Flower's DP strategy
wrappers and pfl-research's postprocessors give every strategy DP with no code of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raysim.protocol import Message, SecureSums, TrustBoundaryError
from raysim.server.aggregation import weighted_mean


class Reports(list):
    """The admitted messages, in client order; aggregations are exact (the server is trusted
    with them, or they are already private: DP-SGD outputs, d-private points)."""

    def mean(
        self,
        members: Sequence[Message] | None = None,
        rng: np.random.Generator | None = None,
        *,
        like: torch.Tensor,
        slot: int = 0,
        equal_weights: bool = False,
        sensitivity: float | None = None,
        denominator: float | None = None,
        release_empty: bool = True,
    ) -> torch.Tensor | None:
        """The released mean update of ``members`` (default: every message), the model slot
        ``slot``'s (``like``: a tensor of the model's shape); None where there is nothing to
        move it by. Exact: weighted by the members' sizes (equally where ``equal_weights`` or
        where no size was sent). ``sensitivity``, ``denominator`` and ``release_empty`` are
        for the modes that noise a sum (``NoisyReports``)."""
        sent = [m for m in (self if members is None else members) if m.update is not None]
        if not sent:
            return None
        weights = [1.0] * len(sent) if equal_weights else [m.num_samples for m in sent]
        if not any(weights):  # sizes not sent (dprivacy): members count equally
            weights = [1] * len(sent)
        return weighted_mean([m.update for m in sent], weights)

    def sum(
        self,
        members: Sequence[Message],
        rng: np.random.Generator,
        *,
        like: torch.Tensor,
        sensitivity: float | None = None,
    ) -> torch.Tensor:
        """The released sum of the members' updates (exact here)."""
        updates = [m.update for m in members if m.update is not None]
        return torch.stack(updates).sum(0) if updates else torch.zeros_like(like)

    def slot_means(self, slots: int) -> tuple[list[torch.Tensor | None], list[float]]:
        """Per model slot (a message's ``cluster``), the mean of its members and their count."""
        means, counts = [], []
        for s in range(slots):
            members = [m for m in self if m.cluster == s and m.update is not None]
            counts.append(float(len(members)))
            means.append(self.mean(members, like=torch.zeros(0), equal_weights=True))
        return means, counts

    def cluster_ids(
        self, ids: np.ndarray, k: int, how: str, clip: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The clusters the server may group the messages by (RR-Cluster): the ids as sent, and
        noisy counts per cluster where ``how`` releases those instead (None here)."""
        return ids, None

    def noise(self) -> dict[str, Any]:
        """What noise this view's releases carry (empty: none, they are exact), for an
        algorithm's diagnostics: the multipliers and the neighbouring relation."""
        return {}


class NoisyReports(Reports):
    """``client``: the messages' updates are sealed; only the mode's noisy sums open them."""

    def __init__(self, messages: Sequence[Message], mode: Any) -> None:
        super().__init__(messages)
        self._mode = mode

    def mean(
        self,
        members: Sequence[Message] | None = None,
        rng: np.random.Generator | None = None,
        *,
        like: torch.Tensor,
        slot: int = 0,
        equal_weights: bool = False,
        sensitivity: float | None = None,
        denominator: float | None = None,
        release_empty: bool = True,
    ) -> torch.Tensor | None:
        """The noisy sum over a public count: ``denominator``, by default the expected cohort
        (DP-FedAvg). An empty group still releases noise unless ``release_empty`` is False (its
        emptiness is then itself public, as RR-Cluster's group sizes are)."""
        sent = [m for m in (self if members is None else members) if m.update is not None]
        if not sent and not release_empty:
            return None
        total = self.sum(sent, rng, like=like, sensitivity=sensitivity)  # type: ignore[arg-type]
        if denominator is None:
            denominator = self._mode.expected_cohort()
        return total / denominator

    def sum(
        self,
        members: Sequence[Message],
        rng: np.random.Generator,
        *,
        like: torch.Tensor,
        sensitivity: float | None = None,
    ) -> torch.Tensor:
        """Clipped sum plus N(0, (sensitivity * z)^2): ``sensitivity`` at least the mode's own
        (an algorithm may only raise it, e.g. where rebalancing moves updates between sums)."""
        own = self._mode.sensitivity()
        if sensitivity is None:
            sensitivity = own
        elif not sensitivity >= own:
            raise TrustBoundaryError(
                f"a noisy sum's sensitivity {sensitivity} is below the mode's {own}: "
                "less noise than one client's update calls for"
            )
        updates = [m.update for m in members if m.update is not None]
        return self._mode.noisy_sum(updates, sensitivity, rng, like.numel())

    def slot_means(self, slots: int) -> tuple[list[torch.Tensor | None], list[float]]:
        raise TrustBoundaryError("client-level DP releases noisy sums only: use mean or sum")

    def cluster_ids(
        self, ids: np.ndarray, k: int, how: str, clip: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Identifiers through the mode: per-client noisy ids (``private``), ids released
        without accounting (``unaccounted``), or the exact ids kept in the server's process and
        only a noisy count per cluster released (``histogram``)."""
        if not ids.size:
            return ids, None
        if how == "private":
            return self._mode.privatize_ids(ids, k, clip, rng), None
        if how == "unaccounted":
            return self._mode.release_ids_unaccounted(ids, k, rng), None
        if how == "histogram":
            return ids, self._mode.noisy_histogram(ids, k, rng)
        raise ValueError(f"unknown identifier release {how!r}")

    def noise(self) -> dict[str, Any]:
        return self._mode.noise()


class SecureReports(Reports):
    """``distributed``: per slot, the secure noisy sum and member count; the only per-client
    messages are values released in the clear beside them (PINA's local-DP sketches)."""

    def __init__(self, sums: SecureSums | None, released: Sequence[Message] = ()) -> None:
        super().__init__(released)
        self._sums = sums

    def mean(
        self,
        members: Sequence[Message] | None = None,
        rng: np.random.Generator | None = None,
        *,
        like: torch.Tensor,
        slot: int = 0,
        equal_weights: bool = False,
        sensitivity: float | None = None,
        denominator: float | None = None,
        release_empty: bool = True,
    ) -> torch.Tensor | None:
        """The slot's secure mean (sum / max(noisy count, 1)). A slot whose noisy count is
        below one half gives None (its model stays): post-processing of the released count,
        and an empty slot's sum is pure noise that would random-walk the model."""
        if self._sums is None or self._sums.counts[slot] < 0.5:
            return None
        return self._sums.means()[slot]

    def sum(self, members, rng, *, like, sensitivity=None) -> torch.Tensor:  # type: ignore[override]
        raise TrustBoundaryError("under secure aggregation the server gets per-slot sums only")

    def slot_means(self, slots: int) -> tuple[list[torch.Tensor | None], list[float]]:
        if self._sums is None:
            return [None] * slots, [0.0] * slots
        return list(self._sums.means()), list(self._sums.counts)

    @property
    def sums(self) -> SecureSums | None:
        """The released secure sums (None: the round planned none)."""
        return self._sums
