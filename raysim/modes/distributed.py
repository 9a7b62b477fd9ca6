"""``privacy.mode: distributed``: an untrusted server behind secure aggregation (PINA).

Clients clip their update to S (``privacy.clip``) and hand it, in the slot of their (hidden)
cluster, to the engine's ``SecureAggregator``; the server step receives only the noisy per-slot
sums and counts, never a report. Noise follows the noise-cohort convention (McMahan et al. 2018,
pfl-research): accounting assumes a cohort of ``noise_cohort_size`` Poisson-sampled from
``population`` (q = noise_cohort / population), and the real cohort of m clients gets noise std
z * sensitivity * m / noise_cohort, so its mean is as noisy as the big cohort's mean would be.
The numbers hold only for a run with the noise cohort: every output says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raysim.modes.base import PrivacyMode, refuse
from raysim.modes.secure import SecureAggregator, client_noise_share, contribution_sensitivity
from raysim.planning import CentralPlan
from raysim.privacy import clip_l2
from raysim.protocol import Charge, ClientReport, RoundPlan, SecureContribution, SecureSums

CLIP_TOLERANCE = 1e-5  # float32 rounding of a clipped vector's norm


class Distributed(PrivacyMode):
    name = "distributed"
    trusted_server = False
    private = True
    secure_aggregation = True

    def __init__(self, cfg, train_sizes, needs) -> None:
        super().__init__(cfg, train_sizes, needs)
        p = cfg.privacy
        self.population = p.population or self.num_clients
        self.noise_rate = p.noise_cohort_size / self.population
        self.plan = CentralPlan(p, cfg.rounds, self.noise_rate, "poisson", self.population)
        self.cohort = cfg.training.sampling_rate * self.num_clients  # expected real cohort m
        self._released = False

    @property
    def std(self) -> float:
        """Per-coordinate noise std on the real cohort's slot sums."""
        scale = self.cohort / self.privacy.noise_cohort_size
        return self.plan.noise * contribution_sensitivity(self.privacy.clip) * scale

    def summary(self) -> dict[str, Any]:
        p = self.privacy
        return {
            **super().summary(),
            **self.plan.summary(),
            "noise_cohort_size": p.noise_cohort_size,
            "population": self.population,
            "noise_std": self.std,
            "caveat": (
                f"accounted for a cohort of {p.noise_cohort_size} out of {self.population}; the "
                "guarantee holds only for a run with that cohort (noise-cohort convention)"
            ),
        }

    # -- client side ---------------------------------------------------------------------------
    def release_update(
        self, report: ClientReport, task: Any, result: Any, ctx: Any, slot: int | None = None
    ) -> None:
        vector = torch.from_numpy(clip_l2(result.update.double().numpy(), self.privacy.clip))
        slot = int(task.cluster or 0) if slot is None else int(slot)
        share = None
        if self.privacy.noise_source == "clients":
            gen = ctx.generator("noise_share")
            share = client_noise_share(len(ctx.models), vector.numel(), self.std, self.cohort, gen)
        report.contribution = SecureContribution(slot, vector.float(), share)
        report.update = report.cluster = None  # nothing else leaves the client

    def report_choice(self, report: ClientReport, choice: Any) -> None:
        """The choice is the contribution's slot: hidden inside the secure sum."""
        if report.contribution is not None:
            report.contribution.slot = int(choice)

    # -- the boundary --------------------------------------------------------------------------
    def check(self, algorithm: str, report: ClientReport, task: Any) -> None:
        for field in ("update", "cluster"):
            if getattr(report, field, None) is not None:
                refuse(algorithm, field, "under distributed DP only the secure contribution leaves")
        if report.extra:
            refuse(algorithm, "extra", "under distributed DP only the secure contribution leaves")
        c = report.contribution
        if c is None:
            return
        if float(c.vector.double().norm()) > self.privacy.clip * (1 + CLIP_TOLERANCE):
            refuse(algorithm, "contribution", f"not clipped to privacy.clip={self.privacy.clip}")

    def admit(
        self, algorithm: str, plan: RoundPlan, reports: list[ClientReport], rng: np.random.Generator
    ) -> SecureSums:
        tasks = {t.client_id: t for t in plan.tasks}
        for rep in reports:
            self.check(algorithm, rep, tasks.get(rep.client_id))
        contributions = [r.contribution for r in reports if r.contribution is not None]
        dim = int(plan.models[0].numel()) if plan.models else 0
        agg = SecureAggregator(len(plan.models), dim, self.privacy.clip, self.std)
        server_draws = self.privacy.noise_source == "server"
        self._released = True
        return agg.aggregate(contributions, rng if server_draws else None)

    # -- accounting ----------------------------------------------------------------------------
    def charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        super().charges(round, reports)
        released, self._released = self._released, False
        return self.planned_charges(round, [], []) if released else []

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        params = {"z": self.plan.noise, "q": self.noise_rate, "sampling": "poisson"}
        return [Charge("secure_gaussian", self.plan.round_event(), None, params)]
