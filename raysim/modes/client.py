"""``privacy.mode: client``: client-level DP with a trusted server (DP-FedAvg, RR-Cluster).

Clients clip their updates and send them as they are; the server releases only noisy sums
(Gaussian, amplified by client sampling) and, where an algorithm groups clients by their
reported cluster, noisy identifiers. The round's charge is derived from those releases: one
population-wide event, the model Gaussian composed with the identifier Gaussian if ids were
released. Sums over disjoint groups (one per cluster) compose in parallel.

Identifiers come in three forms (RR-Cluster's ``algorithm.identifiers``): per-client noisy ids
(``privatize_ids``, charged), one noisy count per cluster (``noisy_histogram``, charged with the
same identifier multiplier), or ids released WITHOUT accounting (``release_ids_unaccounted``):
a ``Released`` with no event, flagged ``accounted: False``, allowed only when the algorithm
declared it before calibration (``PrivacyNeeds.unaccounted_id_noise``), and then named in every
summary as "cluster identifiers not private".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raysim import privacy as privacy_lib
from raysim.modes.base import PrivacyMode, TrustBoundaryError
from raysim.planning import CentralPlan
from raysim.privacy import Released, clip_l2, gaussian_mechanism
from raysim.privacy import privatize_onehot as _privatize_onehot
from raysim.protocol import Charge

ID_MECHANISMS = ("identifier_gaussian", "identifier_histogram")  # charged at plan.id_noise
UNACCOUNTED_WARNING = (
    "cluster identifiers not private: they are released without accounting; "
    "epsilon covers the model updates only"
)


class ClientLevel(PrivacyMode):
    name = "client"
    private = True
    central_noise = True  # the (trusted) server sees raw updates and noises their sums

    def __init__(self, cfg, train_sizes, needs) -> None:
        super().__init__(cfg, train_sizes, needs)
        t = cfg.training
        self.plan = CentralPlan(
            cfg.privacy,
            cfg.rounds,
            t.sampling_rate,
            t.sampling,
            self.num_clients,
            id_noise_ratio=needs.id_noise_ratio,
        )

    @property
    def replace_one(self) -> bool:
        return self.plan.sampling == "without_replacement"

    @property
    def ids_unaccounted(self) -> bool:
        return self.needs.unaccounted_id_noise is not None

    def summary(self) -> dict[str, Any]:
        out = {**super().summary(), **self.plan.summary()}
        if self.ids_unaccounted:
            out["identifiers_warning"] = UNACCOUNTED_WARNING
            out["identifiers_accounted"] = False
        return out

    def train_overrides(self, client: int) -> dict[str, Any]:
        return {"update_clip": self.privacy.clip}

    # -- server-side mechanisms ----------------------------------------------------------------
    def sensitivity(self, clip: float | None = None) -> float:
        """Of one clipped sum: C under add/remove (Poisson), 2C under replace-one (fixed cohort)."""
        return self.plan.sensitivity(self.privacy.clip if clip is None else clip)

    def noisy_sum(
        self,
        updates: Sequence[torch.Tensor],
        sensitivity: float,
        rng: np.random.Generator,
        dim: int,
    ) -> torch.Tensor:
        """Clip each update, sum, add N(0, (sensitivity * z)^2) per coordinate. An empty group
        still releases noise.

        All of a round's sums are parts of ONE Gaussian mechanism, charged once: ``sensitivity``
        must bound the change of all of them together (sums over disjoint groups, such as one per
        cluster: the sensitivity of one sum; overlapping sums, such as FedCAM's global and cluster
        sums: their joint sensitivity)."""
        total = np.zeros(dim, dtype=np.float64)
        if updates:
            total = clip_l2(torch.stack(list(updates)).double().numpy(), self.privacy.clip).sum(0)
        noisy = gaussian_mechanism(total, sensitivity, self.plan.noise, rng)
        z = self.plan.noise
        rel = Released(torch.from_numpy(noisy).float(), "central_gaussian", None, {"z": z})
        return self.record(rel)

    def privatize_ids(
        self, ids: np.ndarray, k: int, clip: float, rng: np.random.Generator
    ) -> np.ndarray:
        """RR-Cluster's noisy identifiers (Algorithm 2, l. 8-9) at the plan's identifier noise:
        the plan's multiplier is std / sensitivity, the one-hot's sensitivity min(1, C_s), times
        sqrt(2) under replace-one."""
        if self.plan.id_noise is None:
            raise TrustBoundaryError("identifiers were not planned (needs.id_noise_ratio)")
        factor = math.sqrt(2.0) if self.replace_one else 1.0
        z = self.plan.id_noise * min(1.0, clip) * factor / clip
        noisy = _privatize_onehot(ids, k, clip, z, rng)
        return self.record(Released(noisy, "identifier_gaussian", None, {"z": self.plan.id_noise}))

    def noisy_histogram(self, ids: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """One noisy count per cluster of the exact ids (instead of per-client noisy ids): the
        count vector's sensitivity is 1 (add/remove) or sqrt(2) (replace-one: one count -1,
        another +1), the std that times the plan's identifier multiplier."""
        if self.plan.id_noise is None:
            raise TrustBoundaryError("identifiers were not planned (needs.id_noise_ratio)")
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=k).astype(np.float64)
        sens = math.sqrt(2.0) if self.replace_one else 1.0
        noisy = gaussian_mechanism(counts, sens, self.plan.id_noise, rng)
        z = self.plan.id_noise
        return self.record(Released(noisy, "identifier_histogram", None, {"z": z}))

    def release_ids_unaccounted(
        self, ids: np.ndarray, k: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Noisy ids at the declared noise-to-signal s (0: the exact ids), NOT charged: the
        release carries no event and ``accounted: False``; refused unless declared."""
        s = self.needs.unaccounted_id_noise
        if s is None:
            raise TrustBoundaryError(
                "unaccounted identifiers were not declared (needs.unaccounted_id_noise)"
            )
        noisy = _privatize_onehot(ids, k, 1.0, s, rng)  # one-hot height 1, noise std s
        params = {"s": s, "accounted": False}
        return self.record(Released(noisy, "identifier_unaccounted", None, params))

    # -- accounting ----------------------------------------------------------------------------
    def server_charges(self, round: int) -> list[Charge]:
        released = list(self._server_releases)
        super().server_charges(round)
        sums = {r.params["z"] for r in released if r.mechanism == "central_gaussian"}
        ids = {r.params["z"] for r in released if r.mechanism in ID_MECHANISMS}
        for r in released:
            if r.mechanism == "identifier_unaccounted" and (
                r.event is not None or r.params.get("accounted") is not False
            ):
                raise TrustBoundaryError("an unaccounted release must carry no event")
        if not sums:
            if ids:
                raise TrustBoundaryError("identifiers released without a model sum")
            return []
        if len(sums) > 1 or len(ids) > 1:
            raise TrustBoundaryError(f"one round released sums at several noise levels: {sums}")
        return [self._charge(sums.pop(), ids.pop() if ids else None)]

    def _charge(self, z: float, z_id: float | None) -> Charge:
        p = self.plan
        event = privacy_lib.central_round_event(p.sampling_rate, z, z_id, p.sampling, p.population)
        return Charge(
            "central_gaussian", event, None, {"z": z, "q": p.sampling_rate, "sampling": p.sampling}
        )

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        return [self._charge(self.plan.noise, self.plan.id_noise)]
