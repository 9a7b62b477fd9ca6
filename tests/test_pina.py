"""PINA (algorithms/pina.py) under the untrusted-server mode: what the server step receives, the
accounting of the sketch beside the secure sums (checked with plain dp_accounting), stage 1's
clustering quality on rotated Fashion-MNIST, the normality step, and determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import mode_of
from dp_accounting import (
    ComposedDpEvent,
    GaussianDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from dp_accounting.rdp import RdpAccountant
from sklearn.metrics import adjusted_rand_score
from test_modes import replayed_rows

from algorithms import Environment, get_algorithm
from algorithms.pina import PinaState
from raysim.compose import for_algorithm
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.privacy import Released
from raysim.privacy.modes import TrustBoundaryError
from raysim.privacy.modes.distributed import SKETCH_MECHANISM
from raysim.privacy.view import SecureReports
from raysim.protocol import ClientReport, Message, RoundPlan, SecureContribution, SecureSums
from raysim.runtime.inline import inline_loop

# Rotated Fashion-MNIST, CNN-LoRA on a pretrained frozen base (cached on disk after the first
# build), distributed DP under the noise-cohort convention.
BASE = [
    "data.dataset=fmnist",
    "data.shift=rotation",
    "data.samples_per_client=100",
    "data.public_pretrain_samples=2000",
    "model.name=cnn_lora",
    "algorithm.name=pina",
    "algorithm.num_clusters=2",
    "privacy.mode=distributed",
    "privacy.epsilon=8",
    "privacy.clip=1",
    "privacy.noise_cohort_size=10000",
    "privacy.population=1000000",
    "privacy.client_seed=12345",  # the clients' draws: the same in every run compared
    "training.lr=0.05",
    "training.sampling_rate=0.5",
    "runtime.progress=false",
]
SMALL = ["rounds=4", "data.num_clients=16", "data.cluster_sizes=[12,4]", "training.eval_every=4"]


def prep_for(*sets: str):
    cfg = for_algorithm(load_config(None, BASE + list(sets)))
    return prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)


def recording_loop(prep):
    """The inline round loop, recording what each round's clients reported and what the server
    step received."""
    algo = prep.algorithm
    seen: list[tuple[int, list[ClientReport], object]] = []
    admit, step = prep.mode.admit, algo.server_step
    reports_of: dict[int, list[ClientReport]] = {}

    def admit_rec(name, plan, reports, rng, secure=None):
        reports_of[plan.round] = list(reports)
        return admit(name, plan, reports, rng, secure)

    def step_rec(state, plan, view, rng):
        seen.append((plan.round, reports_of[plan.round], view))
        return step(state, plan, view, rng)

    prep.mode.admit, algo.server_step = admit_rec, step_rec
    return inline_loop(prep), seen


# ------------------------------------------------------------------ the untrusted server


def test_the_server_step_sees_only_privatized_sketches_and_secure_sums():
    prep = prep_for(*SMALL)
    loop, seen = recording_loop(prep)
    for _ in range(prep.cfg.rounds):
        loop.step()
    dim = prep.algorithm.env.init_weights.numel()
    k = prep.algorithm.params.sketch_dim
    z_local = prep.mode.plan.local_noise
    assert [r for r, _, _ in seen] == [1, 2, 3, 4]
    # round 1: only the released sketches, each the very Released value its client sent
    _, reports, view = seen[0]
    assert isinstance(view, list) and all(isinstance(m, Message) for m in view)
    assert len(view) == len(reports) == prep.cfg.data.num_clients
    for m, rep in zip(view, reports, strict=True):
        assert isinstance(rep.update, Released) and rep.update.mechanism == SKETCH_MECHANISM
        assert rep.contribution is None and m.cluster is None and m.num_samples == 0
        assert m.update.numel() == k < dim
        assert np.array_equal(m.update.numpy(), rep.update.value)
        # noised: away from the clean (clipped, unit-norm-bounded) projection by ~z * sqrt(k)
        clean = prep.algorithm.clean_sketch(rep.state["update"])
        gap = np.linalg.norm(rep.update.value - clean)
        assert 0.5 * z_local * np.sqrt(k) < gap < 1.5 * z_local * np.sqrt(k)
    # later rounds: per-slot noisy sums and counts only, no message, no sketch
    for _, reports, view in seen[1:]:
        assert isinstance(view, SecureReports) and view.sums is not None and list(view) == []
        sums = view.sums
        assert len(sums.sums) == len(sums.counts) == 2
        assert all(s.numel() == dim for s in sums.sums)
        assert all(r.update is None and r.cluster is None for r in reports)
        assert all(r.contribution is not None for r in reports)
        # each slot's sum is its members' clipped vectors plus noise at the calibrated std
        std = prep.mode.std
        for slot, noisy in enumerate(sums.sums):
            clean = sum(
                (r.contribution.vector.double() for r in reports if r.contribution.slot == slot),
                torch.zeros(dim, dtype=torch.float64),
            )
            residual = (noisy.double() - clean).numpy()
            assert abs(residual.mean()) < 5 * std / np.sqrt(dim)
            assert residual.std() == pytest.approx(std, rel=0.1)


def _sketch_round():
    prep = prep_for(*SMALL)
    algo = prep.algorithm
    state = algo.init_state(np.random.default_rng(0))
    plan = algo.plan_round(state, 1, np.random.default_rng(0))
    plan.round = 1
    return algo, plan


def test_the_runtime_check_refuses_raw_or_mislabelled_sketches():
    algo, plan = _sketch_round()
    k = algo.params.sketch_dim
    raw = ClientReport(0, update=torch.zeros(k))
    with pytest.raises(TrustBoundaryError, match="update"):
        mode_of(algo).admit(algo.name, plan, [raw], np.random.default_rng(0))
    weak = Released(np.zeros(k), SKETCH_MECHANISM, GaussianDpEvent(0.01), {"k": k})
    with pytest.raises(TrustBoundaryError, match="calibrated local event"):
        mode_of(algo).admit(algo.name, plan, [ClientReport(0, update=weak)], None)
    rep = ClientReport(0)
    mode_of(algo).release_sketch(rep, np.ones(500), k, 7, np.random.default_rng(1))
    rep.contribution = SecureContribution(0, torch.zeros(algo.env.init_weights.numel()))
    with pytest.raises(TrustBoundaryError, match="no secure aggregation"):
        mode_of(algo).admit(algo.name, plan, [rep], np.random.default_rng(0))


def test_calibration_covers_the_sketch_and_every_secure_sum():
    """Checked with plain dp_accounting: the sketching client composes one Gaussian (z_l) with
    rounds - 1 Poisson-sampled Gaussians at q = noise_cohort / population."""
    prep = prep_for(*SMALL, "rounds=30")
    mode = prep.mode
    z, z_l, delta = mode.plan.noise, mode.plan.local_noise, prep.cfg.privacy.delta
    assert mode.plan.releases == 29
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 128))

    def eps(event):
        return RdpAccountant(orders).compose(event).get_epsilon(delta)

    sketch = GaussianDpEvent(z_l)
    assert eps(sketch) == pytest.approx(4.0, rel=2e-3)  # half of eps = 8
    secure = SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(z)), 29)
    assert eps(ComposedDpEvent([sketch, secure])) == pytest.approx(8.0, rel=2e-3)
    lower = SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(0.99 * z)), 29)
    assert eps(ComposedDpEvent([sketch, lower])) > 8.0


def test_a_run_spends_what_was_calibrated_and_charges_the_sketch_to_its_sender():
    prep = prep_for(*SMALL, "algorithm.sketch_rate=0.5")
    loop, _ = recording_loop(prep)
    loop.step()
    sketched = {c for c in range(16) if loop.ledger.epsilon(c) > 0}
    assert 0 < len(sketched) < 16  # only the sketching clients were charged in round 1
    for _ in range(prep.cfg.rounds - 1):
        loop.step()
    eps = [loop.ledger.epsilon(c) for c in range(16)]
    assert max(eps) <= 8.0 * (1 + 1e-3)
    assert all(eps[c] > max(eps[o] for o in range(16) if o not in sketched) for c in sketched)


def test_the_privacy_plan_matches_the_releases_with_a_sketch_round():
    """`raysim privacy`'s planned charges (sketch to each participant in round 1, then the
    secure sums) equal what the run charged from its releases."""
    released, planned = replayed_rows(prep_for(*SMALL, "model.name=linear"))
    assert len(released) == len(planned) > 16
    assert released[0]["mechanism"] == SKETCH_MECHANISM
    for a, b in zip(released, planned, strict=True):
        for key in ("client", "round", "mechanism"):
            assert a[key] == b[key]
        assert json.loads(a["params"]) == json.loads(b["params"])
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-9)


def test_local_runs_under_distributed_and_charges_nothing():
    prep = prep_for(*SMALL, "algorithm.name=local")
    loop, seen = recording_loop(prep)
    loop.step()
    assert seen[0][2] == [] and loop.ledger.epsilon(0) == 0.0


def test_too_few_rounds_for_stage_one_is_a_config_error():
    with pytest.raises(ConfigError, match="rounds"):
        prep_for(*SMALL, "rounds=4", "algorithm.init=lloyd", "algorithm.lloyd_iters=4")


# ----------------------------------------------------------------- the normality step


def test_the_normality_gate_skips_a_cluster_that_holds_only_noise():
    """Cluster 0's noisy mean carries a real update (heavy-tailed), cluster 1's is pure DP
    noise: the gate applies 0 and leaves model 1 alone; sw_weight weights by W; off applies
    both. W, p and the weights are recorded."""
    outs = {}
    for rule in ("gate", "sw_weight", "off"):
        prep = prep_for(*SMALL, f"algorithm.normality={rule}")
        algo = prep.algorithm
        d = algo.env.init_weights.numel()
        g = np.random.default_rng(5)
        signal = g.laplace(0, 0.05, d) * (g.random(d) < 0.2)
        noise = g.normal(0, 0.01, (2, d))
        sums = SecureSums(
            [torch.tensor((signal + noise[0]) * 6), torch.tensor(noise[1] * 3)], [6.0, 3.0]
        )
        state = PinaState([algo.env.init_weights.clone() for _ in range(2)])
        plan = RoundPlan([], state.models, round=5)
        outs[rule] = algo.server_step(state, plan, SecureReports(sums), np.random.default_rng(0))
    base = prep.algorithm.env.init_weights
    gate, sw, off = outs["gate"], outs["sw_weight"], outs["off"]
    assert gate.metrics["sw_p_0"] < 0.05 <= gate.metrics["sw_p_1"]
    assert gate.metrics["weight_0"] == 1.0 and gate.metrics["weight_1"] == 0.0
    assert torch.equal(gate.state.models[1], base)
    assert not torch.equal(gate.state.models[0], base)
    assert sw.metrics["weight_1"] == pytest.approx(sw.metrics["sw_W_1"])
    moved = (sw.state.models[1] - base).double()
    assert torch.allclose(moved, sw.metrics["sw_W_1"] * (off.state.models[1] - base).double())
    assert off.metrics["weight_1"] == 1.0 and not torch.equal(off.state.models[1], base)


# ------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("source", ["server", "clients"])
def test_two_runs_with_one_seed_are_identical(source):
    rows, models = [], []
    for _ in range(2):
        prep = prep_for(*SMALL, "rounds=3", f"privacy.noise_source={source}")
        loop = inline_loop(prep)
        rows.append([loop.step() for _ in range(3)])
        models.append(loop.state.models)
    strip = [[{k: v for k, v in r.items() if k != "round_seconds"} for r in rs] for rs in rows]
    assert strip[0] == strip[1]
    assert all(torch.equal(a, b) for a, b in zip(*models, strict=True))


# ---------------------------------------------------------------------- stage 1 quality


def stage1_ari(*sets: str) -> float:
    """ARI of stage 1 on 200 clients of rotated FMNIST (C = 2, 100 + 100): the server's k-means
    labels (init=kmeans), or the slots the clients chose in the initialisation round (lloyd)."""
    prep = prep_for(
        "data.num_clients=200",
        "data.cluster_sizes=[100,100]",
        "training.sampling_rate=1.0",
        "training.eval_every=100",
        "rounds=12",
        *sets,
    )
    loop = inline_loop(prep)
    algo = prep.algorithm
    if algo.params.init == "kmeans":
        loop.step()
        labels = loop.state.labels
    else:
        for _ in range(algo.init_round()):
            loop.step()
        labels = np.array([loop.client_states[c]["slot"] for c in range(200)])
    return float(adjusted_rand_score(prep.truth, labels))


@pytest.mark.slow
def test_stage1_separates_rotations_without_dp():
    assert stage1_ari("privacy.mode=none") >= 0.95


@pytest.mark.slow
def test_stage1_dp_lloyd_through_the_secure_sum_at_eps_8():
    assert stage1_ari("algorithm.init=lloyd") >= 0.8
