"""The trust boundary: one object per privacy mode (who is trusted, what a client must do to its
output, what the server may receive, what each release costs).

The engine calls a mode at four points of a round: the client asks it to release its update and
its cluster choice (``release_update`` / ``release_choice``); the coordinator asks it to admit the
reports (``admit``: checks each is sanitized as the mode requires and returns the only view the
server step gets); the server step asks it for central mechanisms (``noisy_sum``,
``privatize_ids``); and the coordinator charges the ledger with ``charges``, derived from the
values that were released. Calibration happens in the constructor, before the run, and refuses a
request that cannot be met (BudgetError).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any, ClassVar

import numpy as np
import torch

from raysim.config import ExperimentConfig
from raysim.privacy import Phase, Released
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.view import Reports
from raysim.protocol import (
    Charge,
    ClientReport,
    Message,
    RoundPlan,
    TrustBoundaryError,
)


@dataclass(frozen=True)
class ExtraField:
    """One field a mode lets cross in a report's ``extra``. Declared with its exact type, the
    values it may take (a constant carries nothing about the client's data) and the task key
    that must have asked for it, so the field says only what the server already knows."""

    kind: type
    values: tuple[Any, ...] = ()  # the only values allowed; empty: any of ``kind`` in bounds
    low: float | None = None
    high: float | None = None
    asked_by: str | None = None  # the task's extra key that must be truthy for it to be sent


# "selected": the client made its own cluster choice, as its task asked (clustered algorithms)
SELECTED = ExtraField(bool, (True,), asked_by="select")


def _event_of(mechanism: str, params: Mapping[str, Any]) -> Any:
    """The DpEvent a built-in release's parameters determine (None: not a mechanism with one)."""
    from raysim import privacy as privacy_lib
    from raysim.privacy.distributed import local_gaussian_event

    if mechanism == "dpsgd":
        q, steps, z = params["q"], params["steps"], params["z"]
        return privacy_lib.dpsgd_event([Phase(q, steps)], z)
    if mechanism == "exponential_selection":
        return privacy_lib.selection_event(params["epsilon"], 1)
    if mechanism == "local_gaussian_sketch":
        return local_gaussian_event(params["z"])
    return None


EVENT_PARAMS = {
    "dpsgd": ("z", "q", "steps"),
    "exponential_selection": ("epsilon",),
    "local_gaussian_sketch": ("z",),
}


class PrivacyMode:
    """``none``: nothing is private; the server sees everything. Subclasses narrow it."""

    name: ClassVar[str] = "none"
    # the built-in mode whose contract with algorithms this one keeps (None: its own name, for
    # the built-in modes): the algorithms that declare that mode in privacy_modes run under it
    serves_as: ClassVar[str | None] = None
    trusted_server: ClassVar[bool] = True
    private: ClassVar[bool] = False
    # whether the run is (eps, delta)-DP and its ledger's epsilon means something (none: no DP;
    # dprivacy: metric DP, kept in its own ledger): else eps is written as missing, never as 0
    accounts_epsilon: ClassVar[bool] = True
    # the ledger is a metric-DP one (d-privacy leakage, ``raysim.privacy.metric_ledger``)
    metric: ClassVar[bool] = False
    # the mechanisms a client's ``Released`` may name under this mode, and what must carry its
    # cost: "event" (a DpEvent, the one its parameters determine) or "leakage" (metric DP)
    release_mechanisms: ClassVar[Mapping[str, str]] = {}
    # the only ``extra`` fields that cross to the server, and how many of them at most
    extra_fields: ClassVar[Mapping[str, ExtraField]] = {"selected": SELECTED}
    max_extra: ClassVar[int] = 1

    @classmethod
    def contract(cls) -> str:
        """The mode name algorithms declare to run under this one (``serves_as``)."""
        return cls.serves_as or cls.name

    def __init__(self, cfg: ExperimentConfig, train_sizes: np.ndarray, needs: PrivacyNeeds):
        self.cfg, self.privacy = cfg, cfg.privacy
        self.train_sizes = np.asarray(train_sizes)
        self.num_clients = len(self.train_sizes)
        self.needs = needs
        self._server_releases: list[Released] = []

    # -- before the run ------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Calibrated noise and the trust model, for `raysim privacy` and the run summary."""
        return {"trusted_server": self.trusted_server, "accounts_epsilon": self.accounts_epsilon}

    def stamp(self, plan: RoundPlan) -> None:
        """The engine's part of a round's tasks, set after the algorithm planned it: what each
        client's local training must do under this mode (``train_overrides``), and the round's
        update clip under adaptive clipping behind secure aggregation."""
        for task in plan.tasks:
            overrides = self.train_overrides(task.client_id)
            if overrides and task.train is not None:
                task.train = replace(task.train, **overrides)

    def view(self, messages: Sequence[Message] = ()) -> Reports:
        """The server's view of admitted messages (empty: to ask it what it releases)."""
        return Reports(messages)

    # -- client side ---------------------------------------------------------------------------
    def train_overrides(self, client: int) -> dict[str, Any]:
        """What the client's local training must do (DP-SGD noise, update clipping)."""
        return {}

    def release_update(
        self, report: ClientReport, task: Any, result: Any, ctx: Any, slot: int | None = None
    ) -> None:
        """Put the client's trained update on its report, in the form this mode sends (``slot``:
        where a secure aggregation adds it; default the task's cluster)."""
        report.update = result.update

    def keep_update(self, report: ClientReport, task: Any, result: Any, ctx: Any) -> Any:
        """The client keeps its update (a personal model): released as this mode requires but
        withheld, so its cost is still charged; returns the value kept."""
        self.release_update(report, task, result, ctx)
        return report.withhold_update()

    def release_sketch(
        self,
        report: ClientReport,
        update: np.ndarray,
        k: int,
        projection_seed: int,
        rng: np.random.Generator,
    ) -> None:
        """The client's update as a ``k``-dim random projection (public ``projection_seed``),
        clipped to ``privacy.clip``, on its report: exact where the mode adds no local noise."""
        from raysim.privacy.mechanisms import sketch_projection

        value = sketch_projection(update, k, projection_seed, self.privacy.clip)
        report.update = torch.from_numpy(value).float()

    def report_choice(self, report: ClientReport, choice: Any) -> None:
        """Put the client's cluster choice on its report (hidden in the slot under secure
        aggregation)."""
        report.cluster = choice

    def release_choice(
        self, utility: np.ndarray, sensitivity: float, eps: float, rng: np.random.Generator
    ) -> Any:
        """The client's choice of a cluster: the exact best outside sample-level DP."""
        return int(np.argmax(utility))

    # -- the boundary --------------------------------------------------------------------------
    def admit(
        self,
        algorithm: str,
        plan: RoundPlan,
        reports: list[ClientReport],
        rng: np.random.Generator,
        secure: Any = None,
    ) -> Reports | Any:
        """Check every report and return the server's view of the round (``secure``: where the
        clients' secure inputs are summed, for a mode with secure aggregation)."""
        tasks = {t.client_id: t for t in plan.tasks}
        for rep in reports:
            task = tasks.get(rep.client_id)
            self.check(algorithm, rep, task)
            self.check_fields(algorithm, rep, task, len(plan.models))
        return self.view([to_message(r, self.extra_fields) for r in reports])

    def check(self, algorithm: str, report: ClientReport, task: Any) -> None:
        if report.contribution is not None or report.deposited:
            refuse(algorithm, "contribution", f"secure aggregation is not part of mode {self.name}")

    def check_fields(
        self, algorithm: str, report: ClientReport, task: Any, num_models: int
    ) -> None:
        """What every mode that hands the server messages checks: each release is one of the
        mode's mechanisms with its cost attached, the cluster is an index of the round's
        models, the size is the client's own and ``extra`` holds only declared fields. Where
        the mode declares release mechanisms, an update crosses only as one of them."""
        u = report.update
        if self.release_mechanisms and u is not None and not isinstance(u, Released):
            allowed = ", ".join(self.release_mechanisms)
            refuse(algorithm, "update", f"mode {self.name} sends updates only as {allowed}")
        for name, rel in released_fields(report):
            why = self.release_problem(rel)
            if why is not None:
                refuse(algorithm, name, why)
        cluster = value(report.cluster)
        if cluster is not None:
            if not _index(cluster) or not 0 <= int(cluster) < max(num_models, 1):
                refuse(algorithm, "cluster", f"not an index of the round's {num_models} models")
        n = report.num_samples
        if not _index(n) or self.private and n not in (0, int(self.train_sizes[report.client_id])):
            refuse(algorithm, "num_samples", "a client reports its own train size or nothing")
        why = self.extra_problem(report.extra, task)
        if why is not None:
            refuse(algorithm, "extra", why)

    def release_problem(self, rel: Released) -> str | None:
        """Why ``rel`` may not cross under this mode (None: it may): an undeclared mechanism,
        a missing cost, or an event other than the one its parameters determine."""
        kind = self.release_mechanisms.get(rel.mechanism)
        if kind is None:
            allowed = ", ".join(self.release_mechanisms) or "none"
            return f"mechanism {rel.mechanism!r} is not one of mode {self.name}'s ({allowed})"
        if kind == "leakage":
            if rel.leakage is None:
                return f"a {rel.mechanism} release must carry its leakage record"
            return self.leakage_problem(rel)
        if rel.event is None:
            return f"a {rel.mechanism} release carries no event: it would cross uncharged"
        names = self.event_params.get(rel.mechanism, ())
        if not all(isinstance(rel.params.get(k), Real) for k in names):
            return f"a {rel.mechanism} release must give {', '.join(names)} as numbers"
        if repr(rel.event) != repr(self.expected_event(rel.mechanism, rel.params)):
            return f"its event is not the one its parameters {rel.params} determine"
        return None

    # the numeric parameters each mechanism's event is built from (``expected_event``)
    event_params: ClassVar[Mapping[str, tuple[str, ...]]] = EVENT_PARAMS

    def expected_event(self, mechanism: str, params: Mapping[str, Any]) -> Any:
        """The DpEvent a release of ``mechanism`` with ``params`` must carry: a mode with
        mechanisms of its own says theirs (and their ``event_params``)."""
        return _event_of(mechanism, params)

    def leakage_problem(self, rel: Released) -> str | None:
        """Why a metric release's leakage record is not what it costs (``dprivacy``)."""
        return None

    def extra_problem(self, extra: Any, task: Any) -> str | None:
        """Why a report's ``extra`` may not cross (None: it may); ``task`` None skips the check
        that the task asked for a field (the clients' vetting has no task)."""
        if type(extra) is not dict:
            return "must be a dict"
        unknown = sorted(set(extra) - set(self.extra_fields))
        if unknown:
            allowed = ", ".join(self.extra_fields) or "none"
            return f"fields {unknown} are not declared by mode {self.name} (allowed: {allowed})"
        if len(extra) > self.max_extra:
            return f"at most {self.max_extra} fields cross under mode {self.name}"
        for key, v in extra.items():
            spec = self.extra_fields[key]
            if type(v) is not spec.kind:
                return f"{key!r} must be a {spec.kind.__name__}, not {type(v).__name__}"
            if spec.values and v not in spec.values:
                return f"{key!r} may only be {spec.values}"
            if spec.low is not None and not v >= spec.low:
                return f"{key!r} must be at least {spec.low}"
            if spec.high is not None and not v <= spec.high:
                return f"{key!r} must be at most {spec.high}"
            if spec.asked_by and task is not None:
                asked = getattr(task, "extra", {}) or {}
                if not asked.get(spec.asked_by):
                    return f"{key!r} is sent only where the task set {spec.asked_by!r}"
        return None

    # -- server side ---------------------------------------------------------------------------
    def expected_cohort(self) -> float:
        """The public count a noisy sum is divided by: the expected number of clients a round
        samples (``training.sampling_rate`` times the population)."""
        return self.cfg.training.sampling_rate * self.num_clients

    def noisy_sum(
        self,
        updates: Sequence[torch.Tensor],
        sensitivity: float,
        rng: np.random.Generator,
        dim: int,
    ) -> torch.Tensor:
        raise TrustBoundaryError(f"privacy mode {self.name!r} has no central noisy sum")

    def privatize_ids(
        self, ids: np.ndarray, k: int, clip: float, rng: np.random.Generator
    ) -> np.ndarray:
        raise TrustBoundaryError(f"privacy mode {self.name!r} has no identifier mechanism")

    def round_metrics(self) -> dict[str, float]:
        """What the mode's own server-side state did this round, for the round's metrics row
        (client-level adaptive clipping: the clip and the noisy share of updates under it)."""
        return {}

    def record(self, released: Released) -> Any:
        """Keep a server-side release for this round's charge; returns its value."""
        self._server_releases.append(released)
        return released.value

    # -- accounting ----------------------------------------------------------------------------
    def release_leakage(self, dim: int) -> float:
        """Metric (d-privacy) leakage of one release (0: this mode's costs are DpEvents)."""
        return 0.0

    def releases_per_client(self, dim: int) -> int | None:
        """How many rounds a client may release in, at most (None: every round of the run)."""
        return None

    def leakages(self, reports: list[ClientReport]) -> list[tuple[ClientReport, Any]]:
        """The metric leakage records on the reports (``dprivacy``)."""
        return []

    def charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        """The charges for what the round's clients released (and a secure sum of theirs):
        made before the server step gets any of it."""
        return []

    def server_charges(self, round: int) -> list[Charge]:
        """The charges for what the server step itself released (``record``: client-level
        DP's noisy sums), made after it."""
        self._server_releases.clear()
        return []

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        """The calibrated schedule's charges for a round (``raysim privacy``; tests compare it with
        ``charges``)."""
        return []

    def other_epsilons(self, ledger: Any) -> dict[str, float]:
        """Epsilons beside the ledger's, for the round's metrics row: where the ledger's holds
        only under an assumption (distributed: participation hidden), what holds without it.
        Read from the ledger (checkpointed), so a resumed run counts the same."""
        return {}


# ------------------------------------------------------------------------------------ helpers


def refuse(algorithm: str, field: str, why: str) -> None:
    raise TrustBoundaryError(f"algorithm {algorithm!r}: report field {field!r}: {why}")


def value(x: Any) -> Any:
    return x.value if isinstance(x, Released) else x


def to_message(r: ClientReport, fields: Mapping[str, ExtraField]) -> Message:
    """The server's copy of an admitted report: of ``extra``, only the declared ``fields``."""
    cluster = value(r.cluster)
    return Message(
        r.client_id,
        value(r.update),
        int(r.num_samples),
        None if cluster is None else int(cluster),
        {k: v for k, v in r.extra.items() if k in fields},
    )


def _index(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def released_fields(report: ClientReport) -> list[tuple[str, Released]]:
    """Every ``Released`` on a report, by field, with or without an event."""
    out = [("update", report.update), *(("withheld", w) for w in report.withheld)]
    out.append(("cluster", report.cluster))
    return [(name, rel) for name, rel in out if isinstance(rel, Released)]


def group_releases(releases: Sequence[tuple[int, Released]]) -> list[Charge]:
    """One charge per distinct (mechanism, event, params), to every client that released it, in
    order of first appearance (clients of one train size share one ledger history)."""
    groups: dict[tuple[str, str, str], Charge] = {}
    for client, rel in releases:
        key = (rel.mechanism, repr(rel.event), json.dumps(rel.params, sort_keys=True, default=str))
        if key not in groups:
            groups[key] = Charge(rel.mechanism, rel.event, [], dict(rel.params))
        groups[key].clients.append(client)  # type: ignore[union-attr]
    return list(groups.values())


def client_releases(reports: Sequence[ClientReport]) -> list[tuple[int, Released]]:
    """Every accounted release on the reports: updates (sent or withheld) first, then choices."""
    out = []
    for r in reports:
        for rel in [r.update, *r.withheld]:
            if isinstance(rel, Released) and rel.event is not None:
                out.append((r.client_id, rel))
    for r in reports:
        if isinstance(r.cluster, Released) and r.cluster.event is not None:
            out.append((r.client_id, r.cluster))
    return out
