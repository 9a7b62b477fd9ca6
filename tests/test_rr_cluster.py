"""RR-Cluster (algorithms.rr_cluster): B = 0 is the base exactly, the base as a composed
object, identifier privatization, one round's privacy event, clustering accuracy, and the
synthetic model-collapse case study (appendix E.5) run in-process without Ray."""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path
from typing import get_args

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from conftest import mode_of, releaser_of, view_of
from test_rdpcfl import env_for

from algorithms import Environment
from algorithms.fedcam import AdditiveMoves
from algorithms.fesem import NearestCentre
from algorithms.ifca import IFCA, LossChoice
from algorithms.rr_base import ClusterBase
from algorithms.rr_cluster import BASES, RRCluster, RRParams
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.metrics.evaluation import clustering_accuracy
from raysim.models import build_model
from raysim.privacy import epsilon
from raysim.privacy.identifiers import keep_probability
from raysim.protocol import ClientContext, ClientReport, Message, RoundPlan
from raysim.seeding import SERVER, numpy_rng
from raysim.training import LocalTrainer

CLIENT = [
    "privacy.mode=client",
    "training.sampling=without_replacement",
    "privacy.clip=0.5",
    "privacy.epsilon=1e9",
]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def reports_for(algo, k: int, n: int = 12) -> list[Message]:
    p = algo.env.init_weights.numel()
    g = torch.Generator().manual_seed(0)
    return [
        Message(c, 0.01 * torch.randn(p, generator=g), 10, c % k, extra={"selected": True})
        for c in range(n)
    ]


def test_B_zero_is_ifca_exactly():
    sets = ("privacy.mode=none", "algorithm.num_clusters=3")
    ifca, rr = IFCA(env_for(*sets)), RRCluster(env_for(*sets, "algorithm.B=0"))
    s1, s2 = ifca.init_state(rng()), rr.init_state(rng())
    assert all(torch.equal(a, b) for a, b in zip(s1.models, s2.models, strict=True))
    p1, p2 = ifca.plan_round(s1, 1, rng(1)), rr.plan_round(s2, 1, rng(1))
    assert [(t.client_id, t.extra) for t in p1.tasks] == [(t.client_id, t.extra) for t in p2.tasks]
    reps = reports_for(ifca, 2)  # cluster 2 gets nothing
    r1 = ifca.server_step(s1, RoundPlan([], s1.models, round=1), view_of(ifca, reps), rng(2))
    r2 = rr.server_step(
        s2, RoundPlan([], s2.models, round=1), view_of(rr, copy.deepcopy(reps)), rng(2)
    )
    assert all(torch.equal(a, b) for a, b in zip(r1.state.models, r2.state.models, strict=True))
    assert torch.equal(r2.state.models[2], s2.models[2])


# ------------------------------------------------------------------------- the composed base


def test_an_unknown_base_is_refused_when_the_algorithm_is_built():
    """``algorithm.base`` takes exactly the bases RR-Cluster has an implementation of: the
    config's allowed values and the implementations cannot drift apart."""
    assert set(get_args(RRParams.model_fields["base"].annotation)) == set(BASES)
    assert {name: cls.name for name, cls in BASES.items()} == {n: n for n in BASES}
    with pytest.raises(ConfigError, match="algorithm.base: got 'kmeans'; allowed: ifca"):
        RRCluster(env_for("privacy.mode=none", "algorithm.base=kmeans"))


@pytest.mark.parametrize(
    "name, cls, grouped",
    [("ifca", LossChoice, True), ("fesem", NearestCentre, False), ("fedcam", AdditiveMoves, True)],
)
def test_each_base_is_one_object_picked_once(name, cls, grouped):
    algo = RRCluster(env_for("privacy.mode=none", f"algorithm.base={name}", "algorithm.B=2"))
    assert type(algo.base) is cls and algo.base.rr is algo
    assert algo.trains_in_groups() is grouped  # FeSEM clients train from the centres' mean


class Recording(ClusterBase):
    """A base that records what RR-Cluster asks of it and answers recognisably."""

    name = "recording"
    trains_in_groups = False

    def __init__(self, rr: RRCluster) -> None:
        super().__init__(rr)
        self.calls: list[str] = []

    def client_step(self, task, ctx):
        self.calls.append("client_step")
        return ClientReport(task.client_id, None, 1, 1)

    def sum_sensitivity(self, cluster: float) -> float:
        self.calls.append("sum_sensitivity")
        return 7 * cluster

    def move(self, state, reports, groups, rng, counts):
        self.calls.append("move")
        return [m + 1 for m in state.models], {"mine": len(groups)}


def test_rr_cluster_reaches_its_base_only_through_the_object():
    """Built as ifca, then handed another base: every base-dependent step follows the object it
    holds, none the configured name (a branch on ``algorithm.base`` would still run IFCA's)."""
    sets = (*CLIENT, "training.sampling_rate=0.5", "algorithm.num_clusters=2", "algorithm.B=2")
    algo = RRCluster(env_for(*sets))
    ifca_sens = algo.model_sensitivity()
    algo.base = rec = Recording(algo)
    assert not algo.trains_in_groups()
    assert algo.model_sensitivity() == pytest.approx(7 * ifca_sens)
    report = algo.client_step(algo.task(3, cluster=None, select=True), None)
    assert (report.client_id, report.cluster) == (3, 1)
    st = algo.init_state(rng())
    reps = reports_for(algo, 2, n=6)
    res = algo.server_step(st, RoundPlan([], st.models, round=1), view_of(algo, reps), rng(2))
    assert all(torch.equal(a, b + 1) for a, b in zip(res.state.models, st.models, strict=True))
    assert res.state.info["mine"] == 6 and "grouping" in res.state.info
    assert rec.calls == ["sum_sensitivity", "client_step", "move"]


@pytest.mark.parametrize("base", sorted(BASES))
def test_a_checkpoint_holds_the_composed_algorithm(base):
    """The mode's DP-SGD schedule is a bound method of the algorithm, so a checkpoint holds
    RR-Cluster with its base and round plan: the restricted decoder takes them back, whole."""
    from raysim.state.checkpoint import decode_state, encode_state

    sets = (*CLIENT, "training.sampling_rate=0.5", f"algorithm.base={base}", "algorithm.B=2")
    algo = RRCluster(env_for(*sets))
    back = decode_state(encode_state({"schedule": algo.dpsgd_schedule}), RRCluster)["schedule"]
    again = back.__self__
    assert type(again.base) is BASES[base] and again.base.rr is again and again.rounds.algo is again
    assert again.model_sensitivity() == algo.model_sensitivity()
    assert back(10) == algo.dpsgd_schedule(10)


def test_nothing_in_algorithms_branches_on_the_base_name():
    """The base is picked once (``BASES[params.base]``); no other code compares the name."""
    compared = []
    for path in sorted(Path("algorithms").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [node.left, *node.comparators]
                if any(isinstance(n, ast.Attribute) and n.attr == "base" for n in names):
                    compared.append(f"{path}:{node.lineno}")
    assert compared == []


def test_rebalancing_feeds_every_cluster():
    rr = RRCluster(env_for("privacy.mode=none", "algorithm.num_clusters=3", "algorithm.B=3"))
    st = rr.init_state(rng())
    res = rr.server_step(
        st, RoundPlan([], st.models, round=1), view_of(rr, reports_for(rr, 2)), rng(2)
    )
    assert not torch.equal(res.state.models[2], st.models[2])
    assert res.metrics["round_cluster_size_min"] == 3


def test_client_mode_needs_fixed_cohorts_and_small_B():
    with pytest.raises(ConfigError, match="without_replacement"):  # the mode refuses it
        mode_of(RRCluster(env_for("privacy.mode=client", "algorithm.B=0")))
    with pytest.raises(ConfigError, match="B <= qM/k"):
        RRCluster(env_for(*CLIENT, "training.sampling_rate=0.5", "algorithm.B=3"))


def test_settings_that_could_not_run_or_would_be_ignored_are_refused():
    """A selection window at a sampling rate below 1 left clients first sampled after it with
    no choice to keep (round 2 failed with a TrustBoundaryError); GMFSC's global fallback was
    silently skipped under base fedcam. Both are refused when the algorithm is built, and the
    settings that work still build."""
    SMALL = (*CLIENT, "algorithm.B=0")
    with pytest.raises(ConfigError, match="algorithm.selection_fraction"):
        RRCluster(env_for(*SMALL, "training.sampling_rate=0.5", "algorithm.selection_fraction=0.3"))
    RRCluster(env_for(*SMALL, "training.sampling_rate=1", "algorithm.selection_fraction=0.3"))
    with pytest.raises(ConfigError, match="algorithm.small_clusters"):
        RRCluster(env_for(*SMALL, "algorithm.base=fedcam", "algorithm.small_clusters=global"))
    RRCluster(env_for(*SMALL, "algorithm.base=fesem", "algorithm.small_clusters=global"))


def test_identifiers_are_privatized():
    """Small id noise keeps the clients' choices, large noise scrambles them; the grouping only
    ever sees the noisy argmax."""
    k, n = 4, 400
    choices = np.arange(n) % k
    reps = [Message(c, None, 1, int(choices[c])) for c in range(n)]
    quiet = RRCluster(env_for(*CLIENT, "algorithm.B=0", "privacy.noise_multiplier=0.1"))
    assert np.array_equal(quiet.group(view_of(quiet, reps), k, rng()), choices)
    loud = RRCluster(env_for(*CLIENT, "algorithm.B=0", "privacy.noise_multiplier=50"))
    kept = np.mean(loud.group(view_of(loud, reps), k, rng()) == choices)
    # the noise std is 50*sqrt(2) times the one-hot's height: the closed-form keep rate, within
    # four binomial standard deviations of the 400 draws
    expected = keep_probability(50 * math.sqrt(2), k)
    assert abs(kept - expected) < 4 * math.sqrt(expected * (1 - expected) / n)
    # std / sensitivity of the ids = the plan's multiplier (replace-one sensitivity sqrt(2)*C_s)
    assert mode_of(quiet).plan.id_noise == pytest.approx(0.1)  # id_noise_ratio 1


def test_one_round_event_composes_ids_and_models_under_sampling():
    sets = (*CLIENT, "training.sampling_rate=0.5", "privacy.noise_multiplier=2", "algorithm.B=2")
    algo = RRCluster(env_for(*sets))
    ev = mode_of(algo).planned_charges(1, [], [])[0].event
    assert isinstance(ev, dpa.SampledWithoutReplacementDpEvent)
    assert (ev.source_dataset_size, ev.sample_size) == (21, 10)
    zs = sorted(e.noise_multiplier for e in ev.event.events)
    assert zs == [2.0, 2.0]  # identifier and model Gaussians, id_noise_ratio = 1
    # composing them is one Gaussian with 1/z^2 = 1/z1^2 + 1/z2^2
    one = dpa.SampledWithoutReplacementDpEvent(21, 10, dpa.GaussianDpEvent(2 / math.sqrt(2)))
    assert epsilon(ev, 1e-4) == pytest.approx(epsilon(one, 1e-4), rel=1e-6)
    assert algo.model_sensitivity() == pytest.approx(2 * 0.5)  # ids privatized: 2*C_theta


def test_calibrated_run_spends_the_budget():
    sets = (*CLIENT, "training.sampling_rate=0.5", "rounds=5", "privacy.epsilon=4", "algorithm.B=2")
    algo = RRCluster(env_for(*sets, calibrate=True))
    ev = dpa.SelfComposedDpEvent(mode_of(algo).plan.round_event(), 5)
    assert epsilon(ev, 1e-4) == pytest.approx(4.0, rel=2e-2)


def test_clustering_accuracy_hungarian():
    true = np.array([0, 0, 1, 1, 2, 2])
    assert clustering_accuracy(true, np.array([2, 2, 0, 0, 1, 1])) == 1.0
    assert clustering_accuracy(true, np.array([1, 1, 1, 1, 0, 0])) == pytest.approx(4 / 6)
    assert clustering_accuracy(true, np.array([0, 0, 0, 0, 0, 0])) == pytest.approx(2 / 6)


# ------------------------------------------------------------------- synthetic model collapse


def synthetic_run(name: str, *sets: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A few non-private rounds in-process; the initial and final cluster models."""
    from algorithms import get_algorithm

    base = [
        "rounds=6",
        "seed=1",
        f"algorithm.name={name}",
        "data.dataset=synthetic_linear",
        "data.num_clients=40",
        "data.cluster_sizes=[20, 20]",
        "data.dim=2",
        "data.cluster_separation=0.3",
        "data.samples_per_client=20",
        "model.name=linear",
        "privacy.mode=none",
        "training.lr=0.05",
        "training.batch_size=10",
        "training.sampling_rate=0.5",
        "training.sampling=without_replacement",
        "algorithm.num_clusters=2",
    ]
    cfg = load_config(None, base + list(sets))
    prep = prepare(cfg, get_algorithm(name), Environment)
    algo, ds = prep.algorithm, prep.dataset
    trainer = LocalTrainer(build_model("linear", ds.feature_shape, ds.num_classes), ds.task, "cpu")
    state = algo.init_state(numpy_rng(cfg.seed, 0, SERVER, "init"))
    init = [m.clone() for m in state.models]
    for r in range(1, cfg.rounds + 1):
        plan = algo.plan_round(state, r, numpy_rng(cfg.seed, r, SERVER, "plan"))
        plan.round = r
        mode_of(algo).stamp(plan)  # what the engine adds to the plan: the update clip
        reps = [
            algo.client_step(
                t,
                ClientContext(
                    t.client_id, r, cfg.seed, trainer, ds, plan.models, releaser_of(algo)
                ),
            )
            for t in plan.tasks
        ]
        state = algo.server_step(
            state, plan, view_of(algo, reps), numpy_rng(cfg.seed, r, SERVER, "server")
        ).state
    return init, state.models


def test_ifca_collapses_while_rr_cluster_trains_every_model():
    """Two true lines, two randomly initialised models (seed 1): one IFCA model is never
    anyone's lowest loss and stays at its initialisation; B = 4 feeds it every round."""
    init, final = synthetic_run("ifca")
    untrained = [torch.equal(a, b) for a, b in zip(init, final, strict=True)]
    assert any(untrained)
    init, final = synthetic_run("rr_cluster", "algorithm.B=4")
    assert not any(torch.equal(a, b) for a, b in zip(init, final, strict=True))


# ------------------------------------------------------------------------ baselines of the family


def test_fesem_nearest_centre():
    from algorithms.fesem import nearest_centre

    centres = [torch.zeros(3), torch.ones(3), -torch.ones(3)]
    assert nearest_centre(torch.full((3,), 0.9), centres) == 1
    assert nearest_centre(torch.full((3,), -0.2), centres) == 0


def test_gmfsc_gives_small_clusters_the_global_model():
    sets = ("privacy.mode=none", "algorithm.num_clusters=3", "algorithm.B=3")
    algo = RRCluster(env_for(*sets, "algorithm.small_clusters=global"))
    st = algo.init_state(rng())
    reps = reports_for(algo, 2, n=7)  # sizes 4, 3, 0: cluster 2 is small, nothing moves
    res = algo.server_step(st, RoundPlan([], st.models, round=1), view_of(algo, reps), rng(2))
    assert res.metrics["round_cluster_size_min"] == 0
    expected = torch.stack(st.models).mean(0) + sum(r.update for r in reps) / len(reps)
    assert torch.allclose(res.state.models[2], expected, atol=1e-6)
    assert not torch.equal(res.state.models[0], res.state.models[2])


def test_fedprox_sets_the_proximal_term():
    from algorithms.fedprox import FedProx

    algo = FedProx(env_for("privacy.mode=none", "algorithm.mu=0.1"))
    plan = algo.plan_round(algo.init_state(rng()), 1, rng())
    assert all(t.train.prox_mu == 0.1 for t in plan.tasks)


def test_fedcam_moves_global_and_cluster_parts():
    sets = ("privacy.mode=none", "algorithm.num_clusters=2", "algorithm.B=0")
    algo = RRCluster(env_for(*sets, "algorithm.base=fedcam", "algorithm.global_share=0.5"))
    st = algo.init_state(rng())
    reps = reports_for(algo, 1, n=4)  # everyone in cluster 0
    res = algo.server_step(st, RoundPlan([], st.models, round=1), view_of(algo, reps), rng(2))
    mean = sum(r.update for r in reps) / 4
    g0 = torch.stack(st.models).mean(0)
    assert torch.allclose(res.state.info["global"], g0 + 0.5 * mean, atol=1e-6)
    assert torch.allclose(res.state.models[0], st.models[0] + mean, atol=1e-6)
    assert torch.allclose(res.state.models[1], st.models[1] + 0.5 * mean, atol=1e-6)
    dp_sets = (*CLIENT, "training.sampling_rate=0.5", "algorithm.base=fedcam", "algorithm.B=2")
    dp = RRCluster(env_for(*dp_sets))
    assert dp.model_sensitivity() == pytest.approx(math.hypot(1.0, 2 * 0.5))


def test_fedper_keeps_the_head_on_the_client():
    from algorithms.fedper import FedPer

    algo = FedPer(env_for("privacy.mode=none"))
    assert 0 < algo.head < algo.env.init_weights.numel()  # the last linear layer
    p = algo.env.init_weights.numel()
    head = torch.ones(algo.head)
    mixed = algo.personal(torch.zeros(p), head)
    assert torch.equal(mixed[-algo.head :], head) and mixed[: -algo.head].abs().sum() == 0
    assert torch.equal(algo.personal(torch.zeros(p), None), torch.zeros(p))


def test_fedper_head_is_the_last_layer_and_a_frozen_one_is_refused():
    """A LoRA ViT trains adapters only: its last trainable parameters are the last block's
    adapters, not a head. FedPer refuses it, and takes the head when the head trains."""
    from algorithms.fedper import FedPer
    from raysim.config import ConfigError

    lora = ("privacy.mode=none", "model.name=vit_lora", "model.base=random")
    with pytest.raises(ConfigError, match="model.train_head=true"):
        FedPer(env_for(*lora))
    algo = FedPer(env_for(*lora, "model.train_head=true"))
    assert algo.head == 64 * 10 + 10  # the ViT's head: dim 64 -> 10 classes


def test_a_B_that_moves_nothing_changes_no_draw():
    """Rebalancing draws from its own stream: runs differing only in B see the same identifier
    and model noise, so a B that moves nothing gives the very same models (paired comparisons)."""
    base = (
        *CLIENT,
        "training.sampling_rate=0.6",
        "privacy.noise_multiplier=1e-3",
        "algorithm.num_clusters=2",
    )
    outs = []
    for b in ("0", "1"):
        algo = RRCluster(env_for(*base, f"algorithm.B={b}"))
        st = algo.init_state(rng())
        res = algo.server_step(
            st, RoundPlan([], st.models, round=1), view_of(algo, reports_for(algo, 2)), rng(5)
        )
        assert res.metrics.get("rebalance_moved", 0) == 0
        outs.append(res.state.models)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
