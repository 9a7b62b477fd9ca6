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
from raysim.config import ConfigError
from raysim.privacy import Released, clip_l2, gaussian_mechanism, geometric_clip_update
from raysim.privacy import privatize_onehot as _privatize_onehot
from raysim.privacy.modes.base import PrivacyMode, TrustBoundaryError
from raysim.privacy.planning import CentralPlan
from raysim.privacy.view import NoisyReports
from raysim.protocol import Charge, ClientReport, Message, RoundPlan, SealedUpdate

ID_MECHANISMS = ("identifier_gaussian", "identifier_histogram")  # charged at plan.id_noise
# released beside the round's sum and composed with it: identifiers, or adaptive clipping's count
AUX_MECHANISMS = (*ID_MECHANISMS, "clip_count_gaussian")
UNACCOUNTED_WARNING = (
    "cluster identifiers not private: they are released without accounting; "
    "epsilon covers the model updates only"
)


class ClientLevel(PrivacyMode):
    name = "client"
    private = True

    def __init__(self, cfg, train_sizes, needs) -> None:
        super().__init__(cfg, train_sizes, needs)
        t = cfg.training
        ids = needs.id_noise_ratio is not None or needs.unaccounted_id_noise is not None
        if ids and t.sampling != "without_replacement":
            raise ConfigError(
                "training.sampling: client-level DP releases one cluster identifier per cohort "
                "member, accounted only for fixed-size cohorts; use without_replacement"
            )
        self.plan = CentralPlan(
            cfg.privacy,
            cfg.rounds,
            t.sampling_rate,
            t.sampling,
            self.num_clients,
            id_noise_ratio=needs.id_noise_ratio,
        )
        # the clip of the round to come: privacy.clip, or under adaptive clipping where the
        # last count moved it (state of the server's, checkpointed with the algorithm)
        self.clip = cfg.privacy.clip
        self._metrics: dict[str, float] = {}

    @property
    def replace_one(self) -> bool:
        return self.plan.sampling == "without_replacement"

    @property
    def adaptive(self) -> bool:
        return self.plan.count_noise is not None

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
        # adaptive clipping counts the updates under the clip by their norms, so the clients
        # send them whole and the (trusted) server clips them (noisy_sum)
        return {} if self.adaptive else {"update_clip": self.privacy.clip}

    def round_metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out

    def admit(
        self,
        algorithm: str,
        plan: RoundPlan,
        reports: list[ClientReport],
        rng: np.random.Generator,
        secure: Any = None,
    ) -> NoisyReports:
        """The messages with each update sealed: the server step can only add them up through
        ``noisy_sum``, so what it publishes is made of noisy sums (or of nothing)."""
        messages = super().admit(algorithm, plan, reports, rng, secure)
        for m in messages:
            if m.update is not None:
                m.update = SealedUpdate(m.update)
        return messages  # type: ignore[return-value]

    def view(self, messages: Sequence[Message] = ()) -> NoisyReports:
        return NoisyReports(messages, self)

    def noise(self) -> dict[str, Any]:
        """The multipliers of the round's sums and identifiers and the neighbouring relation,
        for an algorithm's diagnostics (``NoisyReports.noise``)."""
        return {
            "noise_multiplier": self.plan.noise,
            "id_noise_multiplier": self.plan.id_noise,
            "replace_one": self.replace_one,
        }

    # -- server-side mechanisms ----------------------------------------------------------------
    def sensitivity(self, clip: float | None = None) -> float:
        """Of one clipped sum: C under add/remove (Poisson), 2C under replace-one (fixed cohort)."""
        return self.plan.sensitivity(self.clip if clip is None else clip)

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
        opened = [u._open() if isinstance(u, SealedUpdate) else u for u in updates]
        rows = torch.stack(opened).double().numpy() if opened else np.zeros((0, dim))
        total = clip_l2(rows, self.clip).sum(0)
        noisy = gaussian_mechanism(total, sensitivity, self.plan.noise, rng)
        z = self.plan.noise
        rel = Released(torch.from_numpy(noisy).float(), "central_gaussian", None, {"z": z})
        if self.adaptive:
            self._count_under_clip(np.linalg.norm(rows, axis=1), rng)
        return self.record(rel)

    def _count_under_clip(self, norms: np.ndarray, rng: np.random.Generator) -> None:
        """Adaptive clipping (Andrew et al. 2021, Algorithm 1): release the noisy count of the
        round's updates at most the clip, as centred bits over the expected cohort, and move the
        clip toward ``privacy.clip_quantile`` for the next round (post-processing)."""
        if any(r.mechanism == "clip_count_gaussian" for r in self._server_releases):
            raise TrustBoundaryError(
                "adaptive clipping counts one model sum a round; this algorithm released two"
            )
        bits = np.where(norms <= self.clip, 0.5, -0.5).sum()  # a norm that is not finite: above
        z = self.plan.count_noise
        count = float(gaussian_mechanism(np.array([bits]), self.plan.count_sensitivity, z, rng)[0])
        self.record(Released(count, "clip_count_gaussian", None, {"z": z}))
        unclipped = count / self.plan.cohort + 0.5
        self._metrics = {"clip": self.clip, "unclipped_fraction": unclipped}
        p = self.privacy
        self.clip = geometric_clip_update(self.clip, unclipped, p.clip_quantile, p.clip_lr)

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
        aux = {r.params["z"] for r in released if r.mechanism in AUX_MECHANISMS}
        for r in released:
            if r.mechanism == "identifier_unaccounted" and (
                r.event is not None or r.params.get("accounted") is not False
            ):
                raise TrustBoundaryError("an unaccounted release must carry no event")
        if not sums:
            if aux:
                raise TrustBoundaryError("identifiers or a count released without a model sum")
            return []
        if len(sums) > 1 or len(aux) > 1:
            raise TrustBoundaryError(f"one round released sums at several noise levels: {sums}")
        return [self._charge(sums.pop(), aux.pop() if aux else None)]

    def _charge(self, z: float, z_aux: float | None) -> Charge:
        """The round's Gaussian sum composed with what was released beside it (identifiers, or
        adaptive clipping's count), on the same sampled clients."""
        p = self.plan
        event = privacy_lib.central_round_event(p.sampling_rate, z, z_aux, p.sampling, p.population)
        params: dict[str, Any] = {"z": z, "q": p.sampling_rate, "sampling": p.sampling}
        if z_aux is not None:  # the ledger names what was composed with the sum
            params["z_count" if self.adaptive else "z_ids"] = z_aux
        return Charge("central_gaussian", event, None, params)

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        return [self._charge(self.plan.noise, self.plan.aux_noise)]
