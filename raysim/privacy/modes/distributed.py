"""``privacy.mode: distributed``: an untrusted server behind secure aggregation (PINA).

Clients clip their update to S (``privacy.clip``) and hand it, in the slot of their (hidden)
cluster, to the engine's ``SecureAggregator``; the server step receives only the noisy per-slot
sums and counts, never a report. Noise is sized as in ``raysim.privacy.distributed.NoiseCohort``:
accounting assumes a cohort of ``noise_cohort`` Poisson-sampled from ``population`` (q =
noise_cohort / population), and the real cohort of m clients gets noise std
z * sensitivity * m / noise_cohort, so its mean is as noisy as that cohort's mean would be. By
default the noise cohort is the real expected cohort (std z * sensitivity: the run's own
epsilon); a larger one is the noise-cohort convention (McMahan et al. 2018, pfl-research), whose
numbers hold only for a run with that cohort: every output then says so.

Local releases beside the secure sum (PINA's stage-1 sketch). An algorithm that declares
``PrivacyNeeds.local_release_share = f`` may have each client release ONE vector in the clear,
privatized on the client by the Gaussian mechanism (``release_sketch``: project, clip to S, add
N(0, (z_l S)^2)). Accounting, under zero-out adjacency (a client's data replaced by none, its
vector by zero: the sensitivity of the sketch is S, and the same relation under which the
Poisson-sampled secure sum is analysed as add/remove-one):

* z_l is calibrated so that one such release alone spends ``f * epsilon`` at delta; it is a
  plain Gaussian, not amplified by sampling (the server sees who sent it), charged to that client;
* the secure-sum multiplier z is then calibrated so that the COMPOSITION of that local release
  with all the run's secure sums (``secure_releases`` Poisson-sampled Gaussians at rate q,
  charged to the whole population) meets (epsilon, delta): the clients that sketched are the
  worst case and end exactly at the budget; the others spend less.

Sequential composition of the two is valid because both bound the same neighbouring relation
of the same client; it is conservative (the population-level secure-sum bound holds for every
client whether or not it sketched). Caveat: the secure-sum part inherits the noise-cohort
convention, the sketch does not (its noise is the real per-client noise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from raysim import privacy as privacy_lib
from raysim.privacy import (
    BudgetError,
    PrivacyConfigError,
    Released,
    clip_l2,
    geometric_clip_update,
    private_sketch,
)
from raysim.privacy.distributed import (
    SHARE_PURPOSE,
    NoiseCohort,
    calibrate_local,
    cohort_caveat,
    is_real_cohort,
    local_gaussian_event,
    noise_cohort_of,
    unamplified_epsilon,
)
from raysim.privacy.events import dp_event
from raysim.privacy.modes.base import (
    ExtraField,
    PrivacyMode,
    client_releases,
    group_releases,
    refuse,
)
from raysim.privacy.modes.secure import (
    SecureAggregator,
    SecureSpec,
    client_noise_share,
    contribution_sensitivity,
)
from raysim.privacy.planning import refuse_over_budget
from raysim.privacy.view import SecureReports
from raysim.protocol import (
    Aborted,
    Charge,
    ClientReport,
    Message,
    RoundPlan,
    SecureContribution,
    SecureSums,
)

SKETCH_MECHANISM = "local_gaussian_sketch"
SECURE_MECHANISM = "secure_gaussian"

# (round, members, aggregator) -> the sums, computed (and noised) where the contributions are
SecureSumsOf = Callable[[int, list[int], SecureAggregator], SecureSums]


@dataclass(frozen=True)
class SecurePlan:
    """The calibrated multipliers: secure sums (z, ``releases`` of them) and the local sketch."""

    noise: float
    releases: int
    local_noise: float | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise,
            "secure_releases": self.releases,
            "local_noise_multiplier": self.local_noise,
        }


class Distributed(PrivacyMode):
    name = "distributed"
    trusted_server = False
    private = True
    release_mechanisms = {SKETCH_MECHANISM: "event"}
    extra_fields: ClassVar[Mapping[str, ExtraField]] = {}  # only the secure contribution leaves
    max_extra = 0

    def __init__(self, cfg, train_sizes, needs) -> None:
        if needs.server_knows_choices:
            raise PrivacyConfigError(
                f"{needs.server_knows_choices}: under privacy.mode {self.name} the server never "
                "learns the clients' choices, so it cannot hold them after the selection window; "
                "the clients choose every round: leave it at 1"
            )
        super().__init__(cfg, train_sizes, needs)
        p = cfg.privacy
        self.population = p.population or self.num_clients
        rate = cfg.training.sampling_rate
        sized_for = noise_cohort_of(p.noise_cohort_size, self.population, self.num_clients, rate)
        self.noise_cohort = NoiseCohort(self.population, sized_for)
        self.noise_rate = self.noise_cohort.sampling_rate
        self.cohort = rate * self.num_clients  # expected real cohort m
        self.plan = self._calibrate(needs)
        if p.noise_source == "clients" and self.share_cohort < 1:
            raise PrivacyConfigError(
                f"privacy.dropout_tolerance={p.dropout_tolerance} leaves "
                f"{self.share_cohort:.3g} of the expected cohort of {self.cohort:.3g} to carry "
                "the noise shares: at least 1 must; lower it, or sample more clients"
            )
        self._released = False
        self._metrics: dict[str, float] = {}
        # the clip of the round to come: privacy.clip, or under adaptive clipping where the
        # last secure sum's clip bits moved it (server state, checkpointed with the algorithm)
        self.clip = p.clip
        self._sketched: set[int] = set()  # the clients whose one local release is spent

    def _calibrate(self, needs) -> SecurePlan:
        p = self.privacy
        releases = int(needs.secure_releases if needs.secure_releases is not None else 0)
        releases = releases or self.cfg.rounds
        share = float(needs.local_release_share)
        fixed, local = None, None
        if share > 0:
            if p.epsilon is None:
                raise BudgetError(
                    "privacy.epsilon is required: the local sketch's noise is calibrated to a "
                    "share of it (privacy.noise_multiplier alone cannot set it)"
                )
            local = calibrate_local(share * p.epsilon, p.delta, p.accountant)
            fixed = local_gaussian_event(local)
        if p.noise_multiplier is not None:
            z = p.noise_multiplier
            event = self.noise_cohort.event(releases, z)

            def planned() -> float:
                total = event if fixed is None else dp_event.ComposedDpEvent([fixed, event])
                return privacy_lib.epsilon(total, p.delta, p.accountant)

            refuse_over_budget(planned, p)
        else:
            z = self.noise_cohort.calibrate(releases, p.epsilon, p.delta, p.accountant, fixed=fixed)
        return SecurePlan(z, releases, local)

    @property
    def share_cohort(self) -> float:
        """The members whose noise shares alone add up to the calibrated noise: the expected
        cohort less the dropouts tolerated (``privacy.dropout_tolerance``). A real secure
        aggregation has no party to add what missing shares lack, so clients over-provision:
        a round with more members is noisier than calibrated, never less."""
        return self.cohort * (1.0 - self.privacy.dropout_tolerance)

    @property
    def adaptive(self) -> bool:
        """Adaptive clipping (``privacy.clip_quantile``), its bits inside the secure sum."""
        return self.privacy.clip_quantile is not None

    @property
    def std(self) -> float:
        """Per-coordinate noise std on the real cohort's slot sums, at ``privacy.clip``."""
        return self.std_at(self.privacy.clip)

    def std_at(self, clip: float) -> float:
        sens = contribution_sensitivity(clip, self.adaptive)
        return self.noise_cohort.noise_std(self.plan.noise, sens, max(self.cohort, 1.0))

    def secure_spec(self) -> SecureSpec:
        """The calibrated secure sum, as the clients' side enforces it."""
        p = self.privacy
        shares = self.share_cohort if p.noise_source == "clients" else None
        return SecureSpec(p.clip, self.std, shares, self.plan.releases, p.shortfall, self.adaptive)

    def stamp(self, plan: RoundPlan) -> None:
        if self.adaptive:
            for task in plan.tasks:
                task.clip = self.clip

    def summary(self) -> dict[str, Any]:
        p = self.privacy
        return {
            **super().summary(),
            **self.plan.summary(),
            "noise_cohort_size": self.noise_cohort.noise_cohort,
            "secure_spec": asdict(self.secure_spec()),  # what the clients' side enforces
            "population": self.population,
            "noise_std": self.std,
            "caveat": None
            if is_real_cohort(self.noise_cohort.noise_cohort, self.cohort)
            else cohort_caveat(self.noise_cohort.noise_cohort, self.cohort),
            "planned_epsilon_unamplified": self.planned_unamplified(),
            **({"clip_quantile": p.clip_quantile, "clip_lr": p.clip_lr} if self.adaptive else {}),
        }

    # -- client side ---------------------------------------------------------------------------
    def release_update(
        self, report: ClientReport, task: Any, result: Any, ctx: Any, slot: int | None = None
    ) -> None:
        clip = task.clip if self.adaptive and task.clip is not None else self.privacy.clip
        update = result.update.double().numpy()
        vector = torch.from_numpy(clip_l2(update, clip))
        slot = int(task.cluster or 0) if slot is None else int(slot)
        share = None
        if self.privacy.noise_source == "clients":
            rng = ctx.rng(SHARE_PURPOSE)
            shape = (len(ctx.models), vector.numel())
            std = self.std_at(clip)
            share = client_noise_share(*shape, std, self.share_cohort, rng, self.adaptive)
        under = bool(np.linalg.norm(update) <= clip) if self.adaptive else None  # NaN: above
        report.contribution = SecureContribution(slot, vector.float(), share, under)
        report.update = report.cluster = None  # nothing else leaves the client
        report.num_samples = 0  # nor its dataset's size (a client's data replaced by none)
        report.extra = {}

    def release_sketch(
        self,
        report: ClientReport,
        update: np.ndarray,
        k: int,
        projection_seed: int,
        rng: np.random.Generator,
    ) -> None:
        """The client's one local release: a k-dim random projection of ``update`` (public
        ``projection_seed``), clipped to S and noised at the calibrated z_l; its size stays."""
        z = self.plan.local_noise
        if z is None:
            raise BudgetError("the algorithm reserved no local release (local_release_share)")
        clip = self.privacy.clip
        value = private_sketch(update, k, projection_seed, clip, z, rng)
        params = {"z": z, "k": int(k), "clip": clip}
        report.update = Released(value, SKETCH_MECHANISM, local_gaussian_event(z), params)
        report.num_samples = 0

    def keep_update(self, report: ClientReport, task: Any, result: Any, ctx: Any) -> Any:
        """Kept on the client, nothing of it leaves: no secure input, nothing to charge."""
        report.update = report.cluster = None
        report.num_samples, report.extra = 0, {}
        return result.update

    def report_choice(self, report: ClientReport, choice: Any) -> None:
        """The choice is the contribution's slot: hidden inside the secure sum."""
        if report.contribution is not None:
            report.contribution.slot = int(choice)

    # -- the boundary --------------------------------------------------------------------------
    def check(self, algorithm: str, report: ClientReport, task: Any) -> None:
        if report.update is not None:
            self._check_sketch(algorithm, report.update)
        if report.cluster is not None:
            refuse(algorithm, "cluster", "under distributed DP only the secure contribution leaves")
        if report.extra:
            refuse(algorithm, "extra", "under distributed DP only the secure contribution leaves")
        if report.num_samples:
            refuse(algorithm, "num_samples", "under distributed DP a client's size stays with it")
        for w in report.withheld:  # kept on the client, charged: with the cost it claims
            why = self.release_problem(w) if isinstance(w, Released) else None
            if why is not None:
                refuse(algorithm, "withheld", why)
        # the contribution itself is checked where it is summed (SecureAggregator.check)

    def _check_sketch(self, algorithm: str, rel: Any) -> None:
        """An update in the clear is admitted only as the calibrated local sketch release."""
        z = self.plan.local_noise
        if not isinstance(rel, Released) or rel.mechanism != SKETCH_MECHANISM:
            refuse(algorithm, "update", "under distributed DP only the secure contribution leaves")
        if z is None or repr(rel.event) != repr(local_gaussian_event(z)):
            refuse(algorithm, "update", f"a sketch must carry the calibrated local event (z={z})")
        value, k = np.asarray(rel.value), self.needs.local_dim
        if value.ndim != 1 or value.shape[0] != k or rel.params.get("k") != k:
            refuse(algorithm, "update", f"a sketch is one vector of the declared dimension {k}")
        if not np.isfinite(value).all():
            refuse(algorithm, "update", "a sketch must be finite")

    def _check_sketch_plan(self, algorithm: str, round: int, reports: list[ClientReport]) -> None:
        """The noise was calibrated for one sketch per client, in the declared round: any other
        is refused before the server gets it."""
        senders = [r.client_id for r in reports if r.update is not None]
        if senders and round != self.needs.local_round:
            why = f"a sketch is released in round {self.needs.local_round} only (this is {round})"
            refuse(algorithm, "update", why)
        again = sorted(self._sketched.intersection(senders))
        if again or len(set(senders)) < len(senders):
            refuse(algorithm, "update", f"a client releases one sketch in a run ({again[:5]})")
        self._sketched.update(senders)

    def admit(
        self,
        algorithm: str,
        plan: RoundPlan,
        reports: list[ClientReport],
        rng: np.random.Generator | None,
        secure: SecureSumsOf | None = None,
    ) -> SecureReports | Aborted:
        """SecureSums (with the round's released sketches beside them). A round planned without
        a secure sum (``plan.info["secure_sum"] = False``: PINA's sketch round, local training)
        releases none and is charged none: the server gets only the released sketches.
        Contributions handed to the clients' side (``deposited``) are summed there, by
        ``secure``, with noise drawn there; the others (the library's in-process loop) here,
        with noise from ``rng`` (the clients' seed's)."""
        tasks = {t.client_id: t for t in plan.tasks}
        for rep in reports:
            self.check(algorithm, rep, tasks.get(rep.client_id))
        self._check_sketch_plan(algorithm, plan.round, reports)
        sketches = [
            Message(r.client_id, torch.as_tensor(np.asarray(r.update.value)))
            for r in reports
            if r.update is not None
        ]
        contributions = [r.contribution for r in reports if r.contribution is not None]
        deposited = [r.client_id for r in reports if r.deposited]
        if plan.info.get("secure_sum", True) is False:  # the algorithm planned no secure sum
            if contributions or deposited:
                refuse(algorithm, "contribution", "this round has no secure aggregation")
            return SecureReports(None, sketches)
        dim = int(plan.models[0].numel()) if plan.models else 0
        agg = self.secure_spec().aggregator(len(plan.models), dim, algorithm, self.clip)
        members = len(deposited) + len(contributions)
        self._metrics = {"clip": agg.clip} if self.adaptive else {}
        if agg.share_cohort is not None:  # fewer shares than sized for: top up, or abort
            aborted = agg.aborts(members)
            if agg.shortfall == "abort":
                self._metrics["aborted"] = float(aborted)
            else:
                self._metrics["noise_topped_up"] = float(agg.missing_share(members) > 0)
            if aborted:  # nothing is summed, released or charged (see ``charges``)
                return Aborted(members, agg.share_cohort)
        self._released = True
        if deposited:
            if secure is None or contributions:
                why = "handed to the clients' side, where this run sums none"
                refuse(algorithm, "contribution", why)
            sums = secure(plan.round, deposited, agg)
        else:
            if rng is None:
                raise ValueError("secure sums in this process need the secure noise's generator")
            sums = agg.aggregate(contributions, rng)
        if self.adaptive:
            self._learn_clip(sums)
        return SecureReports(sums, sketches)

    def view(self, messages: Sequence[Message] = ()) -> SecureReports:
        return SecureReports(None, messages)

    def _learn_clip(self, sums: SecureSums) -> None:
        """Adaptive clipping (Andrew et al. 2021) from the released sum alone (post-processing):
        the share of members under the clip is the noisy sum of their centred bits over the
        noisy member count (the count, not the planned cohort, so dropouts do not bias it), and
        the clip moves geometrically toward ``privacy.clip_quantile`` for the next round."""
        members = max(sum(sums.counts), 1.0)
        unclipped = 0.5 + sum(sums.under_clip or []) / members
        self._metrics["unclipped_fraction"] = unclipped
        p = self.privacy
        self.clip = geometric_clip_update(self.clip, unclipped, p.clip_quantile, p.clip_lr)

    def round_metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out

    # -- accounting ----------------------------------------------------------------------------
    def charges(self, round: int, reports: list[ClientReport]) -> list[Charge]:
        """The round's secure sum, if one was released. An aborted round's is not: it released
        nothing, and whether it aborts depends on who reported, not on what: under zero-out
        adjacency (a client's data replaced by none, the relation the sums are analysed under)
        both neighbours have the same members, so the abort is equally likely in both."""
        released, self._released = self._released, False
        out = [self.secure_charge()] if released else []  # whatever the round's plan said
        return out + group_releases(client_releases(reports))

    def planned_charges(
        self, round: int, participants: Sequence[int], selecting: Sequence[int]
    ) -> list[Charge]:
        """The secure sum's charge; in the algorithm's local-release round, the sketch's
        Gaussian to each participant instead."""
        if round == self.needs.local_round and self.plan.local_noise is not None:
            z, clip = self.plan.local_noise, self.privacy.clip
            params = {"z": z, "k": self.needs.local_dim, "clip": clip}
            event = local_gaussian_event(z)
            return [Charge(SKETCH_MECHANISM, event, list(participants), params)]
        return [self.secure_charge()]

    def other_epsilons(self, ledger: Any) -> dict[str, float]:
        """``epsilon_unamplified``: the worst client's eps with no amplification by sampling,
        for the secure sums released so far (the sketch's Gaussian first, if any client sent
        one): what a server that sees the cohort would grant for the same noise."""
        releases = ledger.count(SECURE_MECHANISM)
        sketched = ledger.count(SKETCH_MECHANISM, population=False) > 0
        z_l = self.plan.local_noise
        fixed = local_gaussian_event(z_l) if sketched and z_l is not None else None
        p = self.privacy
        eps = unamplified_epsilon(self.plan.noise, releases, p.delta, p.accountant, fixed)
        return {"epsilon_unamplified": eps}

    def planned_unamplified(self) -> float:
        """The whole planned schedule's eps with no amplification (sketch included)."""
        z_l, p = self.plan.local_noise, self.privacy
        fixed = None if z_l is None else local_gaussian_event(z_l)
        return unamplified_epsilon(
            self.plan.noise, self.plan.releases, p.delta, p.accountant, fixed
        )

    def secure_charge(self) -> Charge:
        """One secure sum, charged to the whole population."""
        params = {"z": self.plan.noise, "q": self.noise_rate, "sampling": "poisson"}
        event = self.noise_cohort.round_event(self.plan.noise)
        return Charge(SECURE_MECHANISM, event, None, params)
