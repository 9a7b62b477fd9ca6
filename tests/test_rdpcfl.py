"""R-DPCFL, stage by stage, without Ray: the two-phase privacy schedule with its reserved
selections, round 1 (full batch, GMM, MSS/MPO, E_c, M), soft clustering, private loss-based
selection and per-cluster aggregation.

The full batch of round 1 is realised by gradient accumulation; that accumulating equals one
big batch is tested with the trainer (tests/test_training_dp.py::
test_full_batch_accumulation_equals_one_big_batch), not repeated here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import mode_of, releaser_of, summary_of, view_of
from sklearn.metrics import adjusted_rand_score

from algorithms import Environment, get_algorithm
from algorithms.clustered import ClusterState, SelectionParams, model_scores, selection_utility
from algorithms.rdpcfl import RDPCFL
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import check_supports
from raysim.models import build_model, flat_params
from raysim.privacy import (
    Phase,
    dpsgd_event,
    epsilon,
    rdpcfl_phases,
    selection_event,
)
from raysim.protocol import ClientContext, ClientReport, Message, RoundPlan
from raysim.server.clustering import max_pairwise_overlap, sample_assignments, switch_round
from raysim.training import LocalTrainer, TrainConfig

SIZES = [3, 6, 6, 6]
N = 200  # train samples per client


def env_for(*sets: str, sizes=SIZES, n: int = N, calibrate: bool = False) -> Environment:
    """An environment without data; z is fixed unless ``calibrate`` (RDP calibration of a
    Poisson schedule takes seconds)."""
    base = [
        "rounds=10",
        "data.dataset=digits",
        f"data.num_clients={sum(sizes)}",
        f"data.cluster_sizes={list(sizes)}",
        "model.name=cnn",
        "privacy.mode=sample",
        "privacy.epsilon=4",
        "privacy.delta=1e-4",
        "training.batch_size=32",
        "training.lr=0.05",
    ]
    if not calibrate:
        base += ["privacy.noise_multiplier=1.0", "privacy.epsilon=100"]
    cfg = load_config(None, base + list(sets))
    init = flat_params(build_model("cnn", (1, 8, 8), 10, seed=0))
    truth = np.repeat(np.arange(len(sizes)), sizes)
    return Environment(cfg, np.full(len(truth), n), init, (1, 8, 8), 10, ground_truth=truth)


def round1_reports(env: Environment, separation: float = 50.0, seed: int = 0):
    """Round-1-like updates, ~1e-3 in size: one random centre per true cluster plus unit
    isotropic noise, the centres ~2 * separation apart (true separation score ~separation)."""
    rng = np.random.default_rng(seed)
    p = env.init_weights.numel()
    centres = rng.normal(size=(len(SIZES), p)) * 2 * separation / math.sqrt(2 * p)
    reps = []
    for c, k in enumerate(env.ground_truth):
        u = (centres[k] + rng.normal(size=p)) * 1e-3
        reps.append(Message(c, torch.tensor(u, dtype=torch.float32), N, 0))
    return reps


# ------------------------------------------------------------------------------- privacy


def test_schedule_is_full_batch_then_poisson():
    algo = RDPCFL(env_for())
    sched = algo.dpsgd_schedule(N)
    assert len(sched) == 10
    assert sched[0] == Phase(1.0, 1)  # K = 1 full-batch step
    assert all(ph == Phase(32 / N, math.ceil(N / 32)) for ph in sched[1:])
    # the privacy library's own description of the same schedule
    lib = rdpcfl_phases(N, 32, 1, 10)
    assert lib[0] == sched[0] and lib[1].steps == sum(ph.steps for ph in sched[1:])


def test_noise_is_calibrated_for_schedule_plus_reserved_selections():
    algo = RDPCFL(env_for("rounds=4", calibrate=True))
    z = mode_of(algo).plan.noise[N]
    assert algo.reserved_selections() == 3  # E - 1: E_c >= 1 leaves at most rounds 2..E
    sched = algo.dpsgd_schedule(N)
    total = [dpsgd_event(sched, z), selection_event(0.05, 3)]
    from dp_accounting import ComposedDpEvent

    eps = epsilon(ComposedDpEvent(total), 1e-4)
    assert eps <= 4.0 + 1e-9 and eps > 3.95  # meets the budget, wastes (almost) none of it
    # without the selections the same z would leave room: they are really reserved
    assert epsilon(dpsgd_event(sched, z), 1e-4) < eps
    summary = summary_of(algo)
    assert summary["reserved_selections"] == 3 and summary["eps_select"] == 0.05
    # the worst-case replay (raysim privacy) spends exactly what was calibrated
    from raysim.privacy import PrivacyLedger

    ledger = PrivacyLedger(delta=1e-4)
    everyone = list(range(21))
    for r in range(1, 5):
        selecting = everyone if algo.may_select(r) else []
        for ch in mode_of(algo).planned_charges(r, everyone, selecting):
            ledger.charge(r, ch.clients, ch.mechanism, ch.event, ch.params)
    assert ledger.epsilon(0) == pytest.approx(eps, rel=1e-6)


def test_selection_window_reserves_fewer():
    algo = RDPCFL(env_for("algorithm.selection_fraction=0.2", "rounds=3", calibrate=True))
    assert algo.reserved_selections() == 1
    full = RDPCFL(env_for("rounds=3", calibrate=True))
    assert full.reserved_selections() == 2
    assert mode_of(algo).plan.noise[N] < mode_of(full).plan.noise[N]


def test_unknown_parameter_is_refused():
    with pytest.raises(ConfigError, match="eps_selct"):
        RDPCFL(env_for("algorithm.eps_selct=0.1"))
    with pytest.raises(ConfigError, match="privacy.mode: algorithm 'rdpcfl' does not support"):
        check_supports(env_for("privacy.mode=client").cfg, RDPCFL)


# ------------------------------------------------------------------------------ round 1


def test_round_one_trains_everyone_full_batch_from_the_initial_model():
    algo = RDPCFL(env_for("training.sampling_rate=0.5"))
    plan = algo.plan_round(algo.init_state(None), 1, np.random.default_rng(0))
    mode_of(algo).stamp(plan)  # the engine's part: the clients' DP-SGD noise
    assert [t.client_id for t in plan.tasks] == list(range(21))  # all, despite sampling
    assert all(t.train.full_batch and t.cluster == 0 for t in plan.tasks)
    assert all(t.train.dp_noise_multiplier == mode_of(algo).plan.noise[N] for t in plan.tasks)
    assert len(plan.models) == 1 and torch.equal(plan.models[0], algo.env.init_weights)


def test_ablation_without_full_batch():
    algo = RDPCFL(env_for("algorithm.full_batch_first_round=false"))
    plan = algo.plan_round(algo.init_state(None), 1, np.random.default_rng(0))
    assert not plan.tasks[0].train.full_batch
    assert algo.dpsgd_schedule(N)[0] == Phase(32 / N, math.ceil(N / 32))


def server_round1(algo: RDPCFL, reports, seed: int = 0):
    state = algo.init_state(None)
    plan = algo.plan_round(state, 1, np.random.default_rng(seed))
    plan.round = 1
    return algo.server_step(state, plan, view_of(algo, reports), np.random.default_rng(seed))


def test_round_one_server_fits_gmm_sets_ec_and_restarts_models():
    algo = RDPCFL(env_for("algorithm.num_clusters=4"))
    res = server_round1(algo, round1_reports(algo.env, separation=150.0))
    st: ClusterState = res.state
    assert len(st.models) == 4 and all(torch.equal(m, algo.env.init_weights) for m in st.models)
    assert adjusted_rand_score(algo.env.ground_truth, st.assigned) == 1.0
    m = res.metrics
    assert m["num_clusters"] == 4 and m["stage"] == 1
    assert m["gmm_mpo"] == pytest.approx(max_pairwise_overlap(m["gmm_mss"]))
    assert m["switch_round"] == switch_round(m["gmm_mpo"], 10) == 5
    assert st.info["posteriors"].shape == (21, 4)
    # every participant pays its full-batch round; no selection yet
    planned = mode_of(algo).planned_charges(1, list(range(21)), [])
    assert [c.mechanism for c in planned] == ["dpsgd"] and planned[0].params["q"] == 1.0
    assert not algo.may_select(1)


@pytest.mark.parametrize("select", ["none", "pca"])
@pytest.mark.parametrize("projection", ["none", "pca"])
def test_m_is_argmax_mss_when_not_given(projection, select):
    algo = RDPCFL(
        env_for(
            f"algorithm.projection={projection}",
            f"algorithm.select_projection={select}",
            "algorithm.gmm_n_init=4",
        )
    )
    res = server_round1(algo, round1_reports(algo.env, separation=150.0))
    m = res.metrics
    scores = {k: m[f"mss_m{k}"] for k in range(2, 9)}
    assert m["num_clusters"] == max(scores, key=scores.get) == 4
    full = algo.env.init_weights.numel()
    assert m["select_dims"] == (3 if select == "pca" else full)
    assert m["gmm_dims"] == (3 if projection == "pca" else full)
    if select == projection:  # the clustering GMM is the chosen candidate fit
        assert m["gmm_mss"] == scores[4]
    assert adjusted_rand_score(algo.env.ground_truth, res.state.assigned) == 1.0


def test_uncertain_gmm_switches_early():
    """Clients from one blob (signal directions only): MSS ~ 1, MPO large, E_c well below
    E / 2. (In full dimension a split of pure noise scores ~p^(1/4): see clustering.py.)"""
    algo = RDPCFL(env_for("algorithm.num_clusters=2", "algorithm.projection=pca"))
    res = server_round1(algo, round1_reports(algo.env, separation=0.0))
    assert res.metrics["gmm_mpo"] > 0.1
    assert res.metrics["switch_round"] < 5  # E / 2 for a certain GMM


# --------------------------------------------------------------------- rounds 2..E and after


def fitted(algo: RDPCFL, e_c: int) -> ClusterState:
    post = np.tile([0.7, 0.2, 0.1, 0.0], (21, 1))
    post[::2] = [0.0, 0.0, 0.0, 1.0]
    models = [algo.env.init_weights.clone() + k for k in range(4)]
    info = {"posteriors": post, "switch_round": e_c, "metrics": {"gmm_mss": 9.0}}
    return ClusterState(models, np.argmax(post, axis=1), info)


def test_soft_stage_draws_clusters_from_the_posteriors():
    algo = RDPCFL(env_for())
    st = fitted(algo, e_c=5)
    plan = algo.plan_round(st, 3, np.random.default_rng(42))
    drawn = sample_assignments(st.info["posteriors"], np.random.default_rng(42))
    assert [t.cluster for t in plan.tasks] == drawn.tolist()
    assert all(not t.extra.get("select") and not t.train.full_batch for t in plan.tasks)
    assert len(plan.models) == 4
    assert plan.info["stage"] == 2


def test_selection_stage_and_its_window():
    algo = RDPCFL(env_for("algorithm.selection_fraction=0.2"))  # window of 2 rounds
    st = fitted(algo, e_c=5)
    plan6 = algo.plan_round(st, 6, np.random.default_rng(0))
    assert plan6.info["stage"] == 3
    assert all(t.extra.get("select") and t.cluster is None for t in plan6.tasks)
    plan8 = algo.plan_round(st, 8, np.random.default_rng(0))  # after rounds 6-7: keep
    assert [t.cluster for t in plan8.tasks] == st.assigned.tolist()


def test_aggregation_is_the_plain_mean_per_cluster_and_selection_is_charged():
    algo = RDPCFL(env_for())
    st = fitted(algo, e_c=1)
    plan = RoundPlan([], st.models, {"stage": 3}, round=4)
    p = algo.env.init_weights.numel()
    reps = [
        Message(0, torch.full((p,), 1.0), N, 2, extra={"selected": True}),
        Message(1, torch.full((p,), 3.0), N, 2, extra={"selected": True}),
        Message(2, torch.full((p,), 5.0), 5 * N, 0, extra={"selected": True}),
    ]
    res = algo.server_step(st, plan, view_of(algo, reps), np.random.default_rng(0))
    new = res.state
    assert torch.allclose(new.models[2], st.models[2] + 2.0)  # 1/|cluster| weights, not by N
    assert torch.allclose(new.models[0], st.models[0] + 5.0)
    assert torch.equal(new.models[1], st.models[1]) and torch.equal(new.models[3], st.models[3])
    assert new.assigned[:3].tolist() == [2, 2, 0]
    assert new.assigned[3:].tolist() == st.assigned[3:].tolist()
    # the choices are charged from their releases (raysim.privacy.modes.sample)
    choice = mode_of(algo).release_choice(
        np.array([0.0, 1.0]), 0.01, 0.05, np.random.default_rng(0)
    )
    sent = [ClientReport(c, None, N, choice) for c in (0, 1, 2)]
    mech = {c.mechanism: c for c in mode_of(algo).charges(4, sent)}
    assert set(mech) == {"exponential_selection"}
    assert list(mech["exponential_selection"].clients) == [0, 1, 2]
    assert res.metrics["gmm_mss"] == 9.0 and res.metrics["stage"] == 3


# ------------------------------------------------------------------ the private choice


@functools.cache
def choice_mode(private: bool):
    return mode_of(RDPCFL(env_for() if private else env_for("privacy.mode=none")))


def choose(params, private, losses, accs, n, rng) -> int:
    """A client's choice through its privacy mode (sample-level DP, or none)."""
    mode = choice_mode(private)
    utility, sens = selection_utility(params, losses, accs, n)
    choice = mode.release_choice(utility, sens, params.eps_select, rng)
    return int(getattr(choice, "value", choice))


def test_exponential_mechanism_frequencies():
    """P(m) is proportional to exp(eps * u_m / (2 * sensitivity)), u = -clipped loss."""
    params = SelectionParams(eps_select=0.5, loss_clip=2.0, select_by="loss")
    losses, n = np.array([0.30, 0.32, 0.50]), 101
    rng = np.random.default_rng(0)
    picks = [choose(params, True, losses, losses, n, rng) for _ in range(20000)]
    freq = np.bincount(picks, minlength=3) / len(picks)
    sens = 2.0 / (n - 1)
    w = np.exp(0.5 * -losses / (2 * sens))
    assert np.allclose(freq, w / w.sum(), atol=0.015)
    assert choose(params, False, losses, losses, n, rng) == 0  # no DP: the argmin


def test_accuracy_utility_and_sensitivity():
    params = SelectionParams(eps_select=1e6, select_by="accuracy")
    accs = np.array([0.2, 0.9, 0.5])
    assert choose(params, True, np.zeros(3), accs, 50, np.random.default_rng(0)) == 1


@dataclass
class OneClient:
    """The slice of a FederatedDataset a client step reads."""

    x: np.ndarray
    y: np.ndarray

    def client_train(self, i):
        return self.x, self.y

    def client_test(self, i):
        return self.x, self.y


def test_client_picks_the_model_that_fits_its_data_and_trains_it():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 120)
    x = (np.eye(3)[y] @ rng.normal(size=(3, 64)) * 3 + rng.normal(size=(120, 64))).astype(
        np.float32
    )
    x = x.reshape(120, 1, 8, 8)
    trainer = LocalTrainer(build_model("cnn", (1, 8, 8), 3, seed=1), "classification")
    bad = flat_params(trainer.model).clone()
    good = bad.clone()
    fit = TrainConfig(lr=0.5, batch_size=32, local_epochs=15)
    good = bad + trainer.train(bad, x, y, fit, torch.Generator().manual_seed(0)).update
    losses, accs = model_scores(trainer, [bad, good], x, y, loss_clip=5.0)
    assert losses[1] < losses[0] and accs[1] > accs[0]
    assert np.all(losses <= 5.0)

    env = env_for("privacy.mode=none", sizes=[1], n=120)
    algo = RDPCFL(env)
    task = algo.selecting_task(0)
    ctx = ClientContext(0, 12, 0, trainer, OneClient(x, y), [bad, good], releaser_of(algo))
    report = algo.client_step(task, ctx)
    assert report.cluster == 1 and report.extra["selected"]
    assert report.update is not None and report.update.shape == good.shape


def test_registry_has_every_algorithm():
    for name in ("rdpcfl", "ifca", "kmeans_cfl", "mr_mtl", "oracle", "fedavg", "local"):
        assert get_algorithm(name).name == name


@pytest.mark.parametrize("candidates", ["[1]", "[]", "[50]"])
def test_candidates_for_m_that_none_can_be_are_refused_before_the_run(candidates):
    from raysim.config import ConfigError

    with pytest.raises(ConfigError, match=r"num_clusters_candidates=.* lie in \[2, 4\] for 5"):
        RDPCFL(env_for(f"algorithm.num_clusters_candidates={candidates}", sizes=(2, 3)))
    RDPCFL(env_for(f"algorithm.num_clusters_candidates={candidates}", "algorithm.num_clusters=2"))
