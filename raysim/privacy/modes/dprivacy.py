"""``privacy.mode: dprivacy``: local metric DP against an untrusted server (Galli et al.).

Each client sanitizes what it sends with the generalized Laplace mechanism of d-privacy
(Algorithm 2): delta = theta_client - theta_received, eps = n / (nu * ||delta||), the release is
delta + rho with rho ~ L_eps (density proportional to exp(-eps ||rho||)). The server receives
only sanitized vectors, plus the cluster the client chose (revealed by design in Algorithm 1).

What this mode leaks, plainly: the noise scale is a function of ||delta||, so the release's
norm tells the server roughly how far the client moved; and the cluster choice is public. The
leakage is metric, not (eps, delta)-DP: each release is (eps * d)-indistinguishable for inputs at
distance d, and eps * ||delta|| = n / nu adds up over releases (Theorem 3.1). It is kept in a
metric ledger beside the dp_accounting one; ``privacy.leakage_cap`` makes a client whose next
release would cross the cap skip the round (App. B.1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raysim.privacy import MetricLeakage, Released, d_privacy_epsilon, laplace_euclidean
from raysim.privacy.metric_ledger import MetricLedger
from raysim.privacy.modes.base import PrivacyMode, refuse
from raysim.protocol import ClientReport


class MetricLocal(PrivacyMode):
    name = "dprivacy"
    trusted_server = False
    private = True
    accounts_epsilon = False  # metric DP: its leakage is in the metric ledger
    metric = True
    release_mechanisms = {"d_privacy": "leakage"}

    def summary(self) -> dict[str, Any]:
        p = self.privacy
        return {**super().summary(), "nu": p.nu, "leakage_cap": p.leakage_cap}

    def release_leakage(self, dim: int) -> float:
        """What one release costs, known before it happens: eps * ||delta|| = n / nu."""
        return dim / self.privacy.nu

    def releases_per_client(self, dim: int) -> int | None:
        """Under ``privacy.leakage_cap``, the releases a client makes before its next would
        cross the cap, added up as the metric ledger adds them (the clients' own count,
        ``modes.device``)."""
        if self.privacy.leakage_cap is None:
            return None
        ledger, count = MetricLedger(self.privacy.leakage_cap), 0
        while count < self.cfg.rounds and not ledger.would_exceed(0, self.release_leakage(dim)):
            count += 1
            ledger.record(0, count, dim, self.privacy.nu)
        return count

    def release_update(
        self, report: ClientReport, task: Any, result: Any, ctx: Any, slot: int | None = None
    ) -> None:
        delta = result.update.double().numpy()
        if not np.isfinite(delta).all():  # training overflowed on the broadcast: nothing moved
            delta = np.zeros_like(delta)
        dim, radius = delta.size, float(np.linalg.norm(delta))
        if radius == 0.0:  # nothing moved: nothing to hide, and eps would be infinite
            released, eps = delta, float("inf")
        else:
            eps = d_privacy_epsilon(dim, self.privacy.nu, radius)
            released = delta + laplace_euclidean(dim, eps, ctx.rng("d_privacy"))
        leak = MetricLeakage(dim, self.privacy.nu)  # what it costs, without the radius
        value = torch.from_numpy(released).float()
        report.update = Released(value, "d_privacy", None, {"nu": self.privacy.nu}, leak)
        report.num_samples = 0  # n stays on the client (Algorithm 1 averages members equally)

    def check(self, algorithm: str, report: ClientReport, task: Any) -> None:
        super().check(algorithm, report, task)
        u = report.update
        if u is not None and not (isinstance(u, Released) and u.leakage is not None):
            refuse(algorithm, "update", "under dprivacy only d-private (sanitized) vectors leave")
        if report.num_samples:
            refuse(algorithm, "num_samples", "the client's dataset size is not sanitized")

    def leakage_problem(self, rel: Released) -> str | None:
        """The record must be what the release costs under this run's nu: a larger nu or a
        shorter dimension would record less leakage than the noise allows."""
        leak, nu = rel.leakage, self.privacy.nu
        dim = int(torch.as_tensor(rel.value).numel()) if rel.value is not None else leak.dim
        if type(leak) is not MetricLeakage or leak.nu != nu or rel.params.get("nu") != nu:
            return f"its leakage record must be at the run's privacy.nu = {nu}"
        if type(leak.dim) is not int or leak.dim != dim:
            return f"its leakage record must count the {dim} released parameters"
        return None

    def leakages(self, reports: list[ClientReport]) -> list[tuple[ClientReport, MetricLeakage]]:
        return [
            (r, r.update.leakage)
            for r in reports
            if isinstance(r.update, Released) and r.update.leakage is not None
        ]
