"""Hostile algorithms: each one is written as an algorithm author who wants more than its privacy
mode lets out would write it, and each must be refused (TrustBoundaryError on the server's side,
ReleaseRefused on the clients') or left unable to obtain the value it is after.

The holes they probe (issue 58): an event-less or mis-priced ``Released``; ``extra`` as a side
channel; many flags and a forged leakage record under ``dprivacy``; the data config in the
server's process and the population in a client's context; an exact mean published under
``client``; and, found while writing these, the cluster index and ``num_samples`` as channels.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from algorithms import Environment
from algorithms.dp_group import DPGroup
from algorithms.fedavg import FedAvg, GlobalState
from algorithms.ifca import IFCA
from raysim.config import load_config
from raysim.data import build_federated_dataset
from raysim.engine.experiment import prepare
from raysim.privacy import MetricLeakage, Phase, Released, dpsgd_event, selection_event
from raysim.privacy.events import dp_event
from raysim.privacy.modes import TrustBoundaryError
from raysim.privacy.modes.device import ReleaseRefused, vet_releases
from raysim.protocol import ClientReport, RoundPlan, SealedUpdate, ServerResult
from raysim.runtime.inline import inline_loop
from raysim.server.rebalancing import sensitivity

TINY = [
    "rounds=2",
    "data.dataset=digits",
    "data.num_clients=12",
    "data.cluster_sizes=[6,6]",
    "model.name=linear",
    "training.batch_size=16",
    "runtime.progress=false",
    "algorithm.num_clusters=2",
]
SAMPLE = ("privacy.mode=sample", "privacy.epsilon=4", "privacy.delta=1e-3")
CLIENT = ("privacy.mode=client", "privacy.epsilon=4", "privacy.delta=1e-3")
DPRIV = ("privacy.mode=dprivacy", "privacy.nu=5")
MODES = {"none": ("privacy.mode=none",), "sample": SAMPLE, "client": CLIENT}


def prep(cls: type, *sets: str):
    cfg = load_config(None, TINY + [f"algorithm.name={cls.base_name}", *sets])
    return prepare(cfg, cls, Environment)


def step(cls: type, *sets: str) -> dict:
    return inline_loop(prep(cls, *sets)).step()


def raw_update(task, ctx) -> tuple[torch.Tensor, int]:
    """What every attacker wants to send: the client's update trained without noise."""
    x, y = ctx.train_data()
    train = replace(task.train, dp_noise_multiplier=None, update_clip=None)
    res = ctx.trainer.train(ctx.models[0], x, y, train, ctx.generator("train"))
    return res.update, res.num_samples


class Hostile(FedAvg):
    base_name = "fedavg"
    privacy_modes = ("none", "sample", "client", "distributed", "dprivacy")


# ------------------------------------------------------------------ 1. releases and their events


class UnchargedUpdate(Hostile):
    """Claims DP-SGD for an un-noised update and attaches no event: nothing would be charged."""

    name = "uncharged"

    def client_step(self, task, ctx):
        update, n = raw_update(task, ctx)
        return ClientReport(task.client_id, Released(update, "dpsgd"), n, 0)


class CheapEventUpdate(Hostile):
    """Carries the planned parameters but a near-free event: charged almost nothing."""

    name = "cheap_event"

    def client_step(self, task, ctx):
        honest = super().client_step(task, ctx)
        update, _ = raw_update(task, ctx)
        p = honest.update.params
        cheap = dpsgd_event([Phase(p["q"], 1)], 1e6)
        honest.update = Released(update, "dpsgd", cheap, dict(p))
        return honest


class ClaimsMoreNoise(Hostile):
    """Prices its un-noised update as DP-SGD at 1000 times the planned noise: the event matches
    its parameters, so only the plan can tell that it claims noise that never ran."""

    name = "claims_more_noise"

    def client_step(self, task, ctx):
        honest = super().client_step(task, ctx)
        update, _ = raw_update(task, ctx)
        p = {**honest.update.params, "z": honest.update.params["z"] * 1000}
        event = dpsgd_event([Phase(p["q"], p["steps"])], p["z"])
        honest.update = Released(update, "dpsgd", event, p)
        return honest


class OtherMechanismUpdate(Hostile):
    """Sends its update as a mechanism sample-level DP does not use (a central Gaussian)."""

    name = "other_mechanism"

    def client_step(self, task, ctx):
        update, n = raw_update(task, ctx)
        rel = Released(update, "central_gaussian", dp_event.GaussianDpEvent(1e6), {"z": 1e6})
        return ClientReport(task.client_id, rel, n, 0)


class ExactChoice(IFCA):
    """Chooses its cluster by the exact argmax and sends the choice as an uncharged release."""

    base_name = "ifca"
    name = "exact_choice"

    def trains_in_groups(self) -> bool:
        return False

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        if isinstance(report.cluster, Released):
            report.cluster = Released(report.cluster.value, "exponential_selection")
        return report


class CheapChoice(ExactChoice):
    """Sends its choice with the event of a far smaller epsilon than it used."""

    name = "cheap_choice"

    def client_step(self, task, ctx):
        report = IFCA.client_step(self, task, ctx)
        if isinstance(report.cluster, Released):
            c = report.cluster
            report.cluster = Released(c.value, c.mechanism, selection_event(1e-9, 1), c.params)
        return report


@pytest.mark.parametrize(
    "cls, why",
    [
        (UnchargedUpdate, "carries no event"),
        (CheapEventUpdate, "not the one its parameters"),
        (OtherMechanismUpdate, "not one of mode sample's"),
        (ClaimsMoreNoise, "must run at the plan's z"),
    ],
)
def test_sample_admits_only_dpsgd_releases_priced_by_their_parameters(cls, why):
    with pytest.raises(TrustBoundaryError, match=f"report field 'update': .*{why}"):
        step(cls, *SAMPLE)


@pytest.mark.parametrize(
    "cls, why", [(ExactChoice, "carries no event"), (CheapChoice, "not the one its parameters")]
)
def test_a_cluster_choice_must_carry_its_own_charge(cls, why):
    with pytest.raises(TrustBoundaryError, match=f"report field 'cluster': .*{why}"):
        step(cls, *SAMPLE)


def _sample_mode():
    return prep(Hostile, *SAMPLE).mode


@pytest.mark.parametrize(
    "field", ["update", "cluster", "withheld"], ids=["update", "cluster", "withheld"]
)
def test_the_clients_vetting_refuses_an_event_less_release_instead_of_skipping_it(field):
    mode = _sample_mode()
    rel = Released(torch.ones(3), "dpsgd") if field != "cluster" else Released(1, "dpsgd")
    report = ClientReport(0, num_samples=0)
    if field == "withheld":
        report.withheld.append(rel)
    else:
        setattr(report, field, rel)
    with pytest.raises(ReleaseRefused, match=f"client 0's {field}: .*carries no event"):
        vet_releases(mode, 1, [report], may_select=True)


def test_the_clients_vetting_refuses_an_unsanitized_update_and_undeclared_extra():
    mode = _sample_mode()
    with pytest.raises(ReleaseRefused, match="would leave unsanitized"):
        vet_releases(mode, 1, [ClientReport(0, torch.ones(3))], may_select=False)
    sneaky = ClientReport(0, extra={"norm": 3.5})
    with pytest.raises(ReleaseRefused, match="extra: fields \\['norm'\\] are not declared"):
        vet_releases(mode, 1, [sneaky], may_select=False)


# ---------------------------------------------------------------------- 2. extra and side fields


class NormInExtra(Hostile):
    """Sends an honest (sanitized) update and its exact norm beside it."""

    name = "norm_in_extra"

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        update, _ = raw_update(task, ctx)
        report.extra["norm"] = float(update.norm())
        return report


class SelectedBit(Hostile):
    """Encodes one bit of its data (is label 0 its most common label?) in the ``selected`` flag
    the clustered algorithms send, in a round where its task asked for no choice."""

    name = "selected_bit"

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        _, y = ctx.train_data()
        report.extra["selected"] = bool(np.bincount(y).argmax() == 0)
        return report


class HugeCluster(Hostile):
    """Hides its update's norm in the cluster index (which is an int, so it crossed as is)."""

    name = "huge_cluster"

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        update, _ = raw_update(task, ctx)
        report.cluster = 1_000_000 + int(update.norm() * 1000)
        return report


class InflatedSize(Hostile):
    """Adds a count of its own labels to ``num_samples``, which sample-level DP lets through as
    the (public) dataset size."""

    name = "inflated_size"

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        _, y = ctx.train_data()
        report.num_samples += int((np.asarray(y) == 0).sum())
        return report


@pytest.mark.parametrize("mode", list(MODES))
def test_extra_carries_only_declared_fields_in_every_mode(mode):
    with pytest.raises(TrustBoundaryError, match="report field 'extra': fields \\['norm'\\]"):
        step(NormInExtra, *MODES[mode])


def test_the_selected_flag_cannot_carry_a_bit_of_data():
    with pytest.raises(TrustBoundaryError, match="report field 'extra': 'selected'"):
        step(SelectedBit, *SAMPLE)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cluster_is_an_index_of_the_rounds_models(mode):
    with pytest.raises(TrustBoundaryError, match="report field 'cluster'"):
        step(HugeCluster, *MODES[mode])


@pytest.mark.parametrize("mode", ["sample", "client"])
def test_num_samples_is_the_clients_own_train_size(mode):
    with pytest.raises(TrustBoundaryError, match="report field 'num_samples'"):
        step(InflatedSize, *MODES[mode])


def test_the_server_gets_only_declared_extra_fields():
    """What crosses is built from the declaration, not copied from the report."""
    mode = prep(Hostile, *SAMPLE).mode
    from raysim.privacy.modes.base import to_message

    report = ClientReport(0, extra={"selected": True, "ignored": 1.5})
    assert to_message(report, mode.extra_fields).extra == {"selected": True}


# ------------------------------------------------------------------------------ 3. dprivacy


class ManyFlags(DPGroup):
    """Sends an honest d-private release and the top 8 bits of its update's norm as flags."""

    base_name = "dp_group"
    name = "many_flags"

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        x, y = ctx.train_data()
        bits = int(min(np.abs(x).sum(), 255))
        report.extra.update({f"bit{i}": bool(bits >> i & 1) for i in range(8)})
        return report


class LargeNu(DPGroup):
    """Noises at 100 nu (far less noise) and records a leakage at that nu, which costs less."""

    base_name = "dp_group"
    name = "large_nu"
    factor, short = 100.0, False

    def client_step(self, task, ctx):
        report = super().client_step(task, ctx)
        rel, nu = report.update, self.cfg.privacy.nu * self.factor
        dim = 1 if self.short else rel.leakage.dim
        report.update = Released(rel.value, rel.mechanism, None, {"nu": nu}, MetricLeakage(dim, nu))
        return report


class ShortRecord(LargeNu):
    """Records the leakage of a 1-parameter release for its full vector."""

    name = "short_record"
    factor, short = 1.0, True


def test_dprivacy_bounds_the_number_of_flags():
    with pytest.raises(TrustBoundaryError, match="report field 'extra'"):
        step(ManyFlags, *DPRIV)


@pytest.mark.parametrize(
    "cls, why", [(LargeNu, "privacy.nu = 5"), (ShortRecord, "count the \\d+ released")]
)
def test_dprivacy_checks_the_leakage_record_against_nu_and_dimension(cls, why):
    with pytest.raises(TrustBoundaryError, match=f"report field 'update': .*{why}"):
        step(cls, *DPRIV)


class HonestIFCA(IFCA):
    base_name = "ifca"


class HonestDPGroup(DPGroup):
    base_name = "dp_group"


@pytest.mark.parametrize(
    "cls, sets",
    [
        (Hostile, SAMPLE),
        (Hostile, CLIENT),
        (Hostile, ("privacy.mode=none",)),
        (HonestDPGroup, DPRIV),
        (HonestIFCA, SAMPLE),
    ],
)
def test_honest_algorithms_pass_the_same_boundaries(cls, sets):
    loop = inline_loop(prep(cls, *sets))
    for _ in range(2):
        loop.step()


# ------------------------------------------------------------- 4. the data and the population


class Population(Hostile):
    """Rebuilds every client's rows and the true clusters in the server's process, from the
    data config and the run's seed it holds, and so becomes the oracle."""

    name = "population"

    def server_step(self, state, plan, reports, rng):
        ds = build_federated_dataset(self.cfg.data, self.cfg.seed)
        state = GlobalState(state.model + float(ds.true_cluster[0]))
        return ServerResult(state)


class Neighbours(Hostile):
    """A client step that reads another client's rows and the true clusters from its context."""

    name = "neighbours"
    target = "rows"

    def client_step(self, task, ctx):
        if self.target == "rows":
            ctx.dataset.client_train((task.client_id + 1) % self.env.num_clients)
        else:
            ctx.dataset.true_cluster  # noqa: B018
        return super().client_step(task, ctx)


@pytest.mark.parametrize("mode", [SAMPLE, DPRIV], ids=["sample", "dprivacy"])
def test_an_untrusted_servers_algorithm_cannot_rebuild_the_population(mode):
    with pytest.raises(TrustBoundaryError, match="data.\\w+: the data config stays"):
        step(Population, *mode)


def test_a_client_sees_only_its_own_rows():
    with pytest.raises(TrustBoundaryError, match="a client sees its own only"):
        step(Neighbours, *SAMPLE)
    other = type("TrueClusters", (Neighbours,), {"target": "truth", "name": "truth"})
    with pytest.raises(AttributeError):
        step(other, *SAMPLE)


# ------------------------------------------------------------------------------ 5. client mode


class ExactMean(Hostile):
    """Publishes the plain mean of the updates and never calls noisy_sum."""

    name = "exact_mean"

    def server_step(self, state, plan, reports, rng):
        mean = torch.stack([r.update for r in reports]).mean(0)
        return ServerResult(GlobalState(state.model + mean))


class ChargedThenExact(Hostile):
    """Calls noisy_sum (so the round is charged) and publishes the exact mean instead."""

    name = "charged_then_exact"

    def server_step(self, state, plan, reports, rng):
        self.aggregate(state.model, reports, rng)
        mean = sum(r.update for r in reports) / len(reports)
        return ServerResult(GlobalState(state.model + mean))


class NoSumAtAll(Hostile):
    """Publishes one client's update as the model's next step, through numpy."""

    name = "no_sum_at_all"

    def server_step(self, state, plan, reports, rng):
        first = torch.as_tensor(np.asarray(reports[0].update, dtype=np.float32))
        return ServerResult(GlobalState(state.model + first))


class KeepsTheUpdate(Hostile):
    """Keeps a client's (sealed) update in its state, for a later round or the checkpoint."""

    name = "keeps_the_update"

    def server_step(self, state, plan, reports, rng):
        result = super().server_step(state, plan, reports, rng)
        result.state.kept = reports[0].update
        return result


@pytest.mark.parametrize("cls", [ExactMean, ChargedThenExact, NoSumAtAll])
def test_client_mode_server_cannot_publish_an_exact_update_or_mean(cls):
    with pytest.raises((TypeError, RuntimeError, TrustBoundaryError)):
        step(cls, *CLIENT)


def test_a_sealed_update_opens_only_in_noisy_sum_and_never_pickles():
    loop = inline_loop(prep(KeepsTheUpdate, *CLIENT))
    loop.step()  # the honest sum went through
    kept = loop.state.kept
    assert isinstance(kept, SealedUpdate) and repr(kept) == "SealedUpdate(<client update>)"
    with pytest.raises(TrustBoundaryError, match="never leaves the round"):
        pickle.dumps(kept)
    with pytest.raises(TrustBoundaryError, match="never leaves the round"):
        loop.snapshot()


# ------------------------------------------------------------------------- admission directly


def test_admission_of_a_report_built_by_hand():
    """The same checks where an algorithm skips the engine's helpers entirely."""
    prepared = prep(Hostile, *SAMPLE)
    algo, mode = prepared.algorithm, prepared.mode
    plan = RoundPlan([algo.task(0)], [algo.env.init_weights], round=1)
    rng = np.random.default_rng(0)
    rep = ClientReport(0, Released(torch.zeros(3), "dpsgd"), 0, 0)
    with pytest.raises(TrustBoundaryError, match="carries no event"):
        mode.admit("hand", plan, [rep], rng)
    mode = prep(Hostile, "privacy.mode=none").mode
    for cluster in (True, 1, -1, 2.0):  # a bool, a float, or past the round's one model
        rep = ClientReport(0, torch.zeros(3), 0, cluster)
        with pytest.raises(TrustBoundaryError, match="not an index"):
            mode.admit("hand", plan, [rep], rng)


def test_rebalancing_sensitivity_under_add_remove_with_private_ids_raises():
    with pytest.raises(ValueError, match="training.sampling: poisson"):
        sensitivity(1.0, 3, replace_one=False)
    assert sensitivity(1.0, 3, replace_one=True) == 2.0
    assert sensitivity(1.0, 0, replace_one=False) == 1.0  # no rebalancing: one sum, C


# ------------------------------------------------------------- 6. the engine owns the mode


class LowersTheNoise(Hostile):
    """Asks the mode for its noisy sum at a tiny sensitivity: noise for no client at all."""

    name = "lowers_the_noise"

    def server_step(self, state, plan, reports, rng):
        total = reports.sum(list(reports), rng, like=state.model, sensitivity=1e-9)
        return ServerResult(GlobalState(state.model + total / max(len(reports), 1)))


class AsksForItsMode(Hostile):
    """Looks for the privacy mode where an algorithm used to hold it, to branch on it."""

    name = "asks_for_its_mode"

    def server_step(self, state, plan, reports, rng):
        if self.privacy.name == "client":  # noqa: B018 - the attribute is the attack
            return ServerResult(state)
        return super().server_step(state, plan, reports, rng)


class ReadsTheSecureSlots(Hostile):
    """Under secure aggregation, looks for the clients' individual vectors in its view."""

    name = "reads_the_secure_slots"

    def server_step(self, state, plan, reports, rng):
        found = [m.update for m in reports]  # the view lists no client's vector
        total = reports.sum(list(reports), rng, like=state.model)  # and sums none
        return ServerResult(GlobalState(state.model + total), {"found": len(found)})


def test_client_mode_refuses_a_noisy_sum_below_its_sensitivity():
    with pytest.raises(TrustBoundaryError, match="sensitivity 1e-09 is below the mode's"):
        step(LowersTheNoise, *CLIENT)


@pytest.mark.parametrize("mode", ["none", "client"])
def test_an_algorithm_holds_no_privacy_mode(mode):
    """The engine builds the mode; nothing the algorithm holds is one."""
    from raysim.privacy.modes import PrivacyMode

    prepared = prep(Hostile, *MODES[mode])
    assert isinstance(prepared.mode, PrivacyMode)
    held = [v for v in vars(prepared.algorithm).values() if isinstance(v, PrivacyMode)]
    assert held == []
    with pytest.raises(AttributeError, match="privacy"):
        step(AsksForItsMode, *MODES[mode])


def test_secure_aggregation_shows_no_client_vector_and_no_sum_of_messages():
    sets = ("privacy.mode=distributed", "privacy.client_seed=7", "privacy.noise_cohort_size=12")
    with pytest.raises(TrustBoundaryError, match="per-slot sums only"):
        step(ReadsTheSecureSlots, *sets)


def test_algorithms_never_dispatch_on_the_privacy_mode():
    """The acceptance of the engine-owned mode, kept: no algorithm builds, imports or branches
    on a mode (it asks its view, ``raysim.privacy.view``, and its context's releaser)."""
    import pathlib
    import re

    forbidden = re.compile(
        r"central_noise|secure_aggregation|SecureSums|make_mode|privacy\.modes?\b|PrivacyMode\b"
        r"|self\.privacy\b"
    )
    root = pathlib.Path(__file__).resolve().parents[1] / "algorithms"
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for path in sorted(root.glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert hits == []
