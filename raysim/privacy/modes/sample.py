"""``privacy.mode: sample``: each client runs DP-SGD and is accounted on its own (R-DPCFL).

Everything a client sends is a release charged to its own ledger: its update (the DP-SGD output,
event from the steps that actually ran) and any cluster choice it made (the exponential
mechanism). A cluster index equal to the one the server assigned is the server's own knowledge.

Adjacency: zero-out (one of the client's samples replaced by one whose gradient is zero), under
which the Poisson-sampled Gaussian bounds Opacus and dp_accounting compute for add/remove-one
hold for DP-SGD with its fixed denominator q * n (Kairouz et al. 2021, DP-FTRL; Ponomareva et al.
2023, "How to DP-fy ML"). A client's dataset size n is the same in neighbouring datasets: the
calibration's noise per train size, and the ``num_samples`` a report carries, release nothing
about any sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np

from raysim import privacy as privacy_lib
from raysim.privacy import Phase, Released, exponential_select
from raysim.privacy.modes.base import (
    PrivacyMode,
    client_releases,
    group_releases,
    refuse,
    released_fields,
)
from raysim.privacy.planning import SampleLevelPlan
from raysim.protocol import Charge, ClientReport
from raysim.training import sampling_plan


class SampleLevel(PrivacyMode):
    name = "sample"
    private = True
    trusted_server = False  # DP-SGD protects each sample from the server too
    release_mechanisms = {"dpsgd": "event", "exponential_selection": "event"}

    def __init__(self, cfg, train_sizes, needs) -> None:
        super().__init__(cfg, train_sizes, needs)
        count, eps = needs.selections
        self.plan = SampleLevelPlan(
            cfg.privacy, self.train_sizes, needs.dpsgd_schedule, (count, eps) if count else (0, 0.0)
        )

    def summary(self) -> dict[str, Any]:
        out = {**super().summary(), **self.plan.summary()}
        count, eps = self.needs.selections
        if count:
            out.update(reserved_selections=count, eps_select=eps)
        return out

    def train_overrides(self, client: int) -> dict[str, Any]:
        return {
            "dp_noise_multiplier": self.plan.noise_multiplier(client),
            "dp_clip": self.privacy.clip,
        }

    def release_update(
        self, report: ClientReport, task: Any, result: Any, ctx: Any, slot: int | None = None
    ) -> None:
        report.update = release_dpsgd(result.update, task.train, result.num_samples, result.steps)

    def release_choice(
        self, utility: np.ndarray, sensitivity: float, eps: float, rng: np.random.Generator
    ) -> Released:
        choice = int(exponential_select(utility, eps, sensitivity, rng))
        return Released(
            choice, "exponential_selection", privacy_lib.selection_event(eps, 1), {"epsilon": eps}
        )

    def check(self, algorithm: str, report: ClientReport, task: Any) -> None:
        super().check(algorithm, report, task)
        if report.update is not None and not isinstance(report.update, Released):
            refuse(algorithm, "update", "sample-level DP sends only DP-SGD outputs (Released)")
        for name, rel in released_fields(report):
            why = self.release_problem(rel)
            if why is not None:
                refuse(algorithm, name, why)
            planned = self._planned_param(report.client_id, rel)
            if planned is None:
                continue
            key, want = planned
            got = rel.params.get(key)
            if not isinstance(got, Real) or not math.isclose(got, want, rel_tol=1e-9):
                refuse(algorithm, name, f"{rel.mechanism} must run at the plan's {key} = {want}")
        assigned = None if task is None else task.cluster
        if report.cluster is not None and not isinstance(report.cluster, Released):
            if report.cluster != assigned:
                refuse(algorithm, "cluster", "a client's own choice must be released privately")

    def _planned_param(self, client: int, rel: Released) -> tuple[str, float] | None:
        """The parameter a release's charge is computed from and the value the plan calibrated
        for it: a release that claims more noise (or a smaller epsilon) would be charged less
        than what ran, and nobody but the client could tell."""
        if rel.mechanism == "dpsgd":
            return "z", float(self.plan.noise_multiplier(client))
        if rel.mechanism == "exponential_selection":
            return "epsilon", float(self.needs.selections[1])
        return None

    def charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        return group_releases(client_releases(reports))

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        groups: dict[int, list[int]] = {}
        for c in participants:
            groups.setdefault(int(self.train_sizes[c]), []).append(int(c))
        out = []
        for n, clients in groups.items():
            phase = self.needs.dpsgd_schedule(n)[round - 1]
            params = {"z": self.plan.noise[n], "q": phase.sampling_rate, "steps": phase.steps}
            out.append(Charge("dpsgd", self.plan.round_event(clients[0], round), clients, params))
        eps = self.needs.selections[1]
        if selecting and eps:
            event = privacy_lib.selection_event(eps, 1)
            out.append(Charge("exponential_selection", event, list(selecting), {"epsilon": eps}))
        return out


def release_dpsgd(update: Any, train: Any, n: int, steps: int) -> Released:
    """A DP-SGD output and its cost: ``steps`` steps at the rate the trainer sampled with."""
    z = train.dp_noise_multiplier
    q = sampling_plan(n, train).q
    event = privacy_lib.dpsgd_event([Phase(q, steps)], z)
    return Released(update, "dpsgd", event, {"z": z, "q": q, "steps": steps})
