"""Galli et al.'s Algorithm 1 (algorithms/dp_group.py) on its synthetic experiment, in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import view_of

from algorithms import Environment, get_algorithm
from algorithms.clustered import ClusterState
from algorithms.dp_group import kmeans_from
from raysim.compose import for_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.protocol import Message, RoundPlan
from raysim.runtime.inline import inline_loop

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "galli_synthetic.yaml"
OPTIMA = np.array([[5.0, 6.0], [4.0, -4.5]])


def finished(*sets: str):
    cfg = for_algorithm(load_config(CONFIG, ["runtime.progress=false", *sets]))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    loop = inline_loop(prep)
    for _ in range(cfg.rounds):
        loop.step()
    return loop


def distances(loop) -> np.ndarray:
    st = loop.state
    hyps = np.stack([m.numpy() for m in (st.models if hasattr(st, "models") else [st.model])])
    return np.linalg.norm(OPTIMA[:, None] - hyps[None], axis=2).min(axis=1)


def test_each_release_leaks_n_over_nu_and_totals_add_up():
    loop = finished("rounds=10", "privacy.nu=5")
    rows = loop.metric_ledger.rows()
    assert len(rows) == 10 * 7  # U = 7 releases per round
    assert all(r["leakage"] == pytest.approx(2 / 5) for r in rows)
    parts = np.bincount([r["client"] for r in rows], minlength=100)
    totals = np.array([loop.metric_ledger.total(c) for c in range(100)])
    np.testing.assert_allclose(totals, 0.4 * parts, rtol=1e-12)
    assert loop.ledger.rows() == []  # no (eps, delta) event: metric DP has its own ledger


def test_weak_noise_recovers_both_optima_and_fedavg_cannot():
    # under MSE the steps are long far from the optima: 30 rounds (RMSE: tests/test_rmse_loss.py)
    near = distances(finished("rounds=30", "privacy.nu=0.05", "training.regression_loss=mse"))
    assert (near < 0.5).all(), near
    fedavg = distances(finished("rounds=50", "algorithm.name=fedavg", "privacy.mode=none"))
    assert (fedavg >= 4).all(), fedavg


def test_kmeans_starts_at_the_hypotheses_and_keeps_their_labels():
    g = np.random.default_rng(0)
    centres = np.array([[5.0, 6.0], [4.0, -4.5]])
    pts = np.concatenate(
        [centres[1] + 0.1 * g.normal(size=(5, 2)), centres[0] + g.normal(size=(3, 2)) * 0.1]
    )
    assert kmeans_from(pts, centres).tolist() == [1] * 5 + [0] * 3


def test_server_means_sanitized_parameters_and_an_empty_cluster_keeps_its_hypothesis():
    cfg = load_config(CONFIG, ["runtime.progress=false"])
    prep = prepare(cfg, get_algorithm("dp_group"), Environment)
    algo = prep.algorithm
    st = ClusterState([torch.tensor([5.0, 6.0]), torch.tensor([-50.0, -50.0])])
    # three releases, all near hypothesis 0 (two of them chose hypothesis 1 but landed near 0)
    msgs = [
        Message(0, torch.tensor([0.5, 0.0]), 0, 0),
        Message(1, torch.tensor([55.0, 56.5]), 0, 1),
        Message(2, torch.tensor([54.5, 55.5]), 0, 1),
    ]
    res = algo.server_step(
        st, RoundPlan([], st.models, round=1), view_of(algo, msgs), np.random.default_rng(0)
    )
    expected = torch.tensor([[5.5, 6.0], [5.0, 6.5], [4.5, 5.5]]).mean(0)
    assert torch.allclose(res.state.models[0], expected)
    assert torch.equal(res.state.models[1], st.models[1])  # empty after k-means: kept


def load_script():
    import importlib.util

    path = CONFIG.parents[1] / "scripts" / "galli_synthetic.py"
    spec = importlib.util.spec_from_file_location("galli_synthetic", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_readme_synthetic_script_runs_a_seed_and_sees_every_release():
    """scripts/galli_synthetic.py (the README's command) watches what the server is given;
    one seed of Algorithm 1 at nu = 1 under RMSE ends near both optima, as its table row says,
    and is judged every round on held-out users."""
    script = load_script()
    res = script.run(0, script.settings([1.0])["Algorithm 1, RMSE, nu=1"], rounds=150)
    assert max(res["dist"]) < 0.5
    assert res["released"] and res["leak_per_participation"] == pytest.approx(2.0)
    assert len(res["validation_loss"]) == 150 and 1 <= res["stop"] <= 150
    assert res["validation_loss"][-1] < res["validation_loss"][0]


def test_the_scripts_validation_is_eq14_on_held_out_users_and_stops_on_patience():
    script = load_script()
    cfg = load_config(CONFIG, ["runtime.progress=false"])
    x, y = script.validation_users(cfg, seed=0)
    assert x.shape == (100, 10, 2) and y.shape == (100, 10)
    train = prepare(cfg, get_algorithm("dp_group"), Environment)
    trained = train.dataset.table.column("y").to_numpy()
    assert not np.isin(y.astype(np.float32), trained).any()  # not the training users
    # at the optima each user's residual is its label noise u ~ U[0, 1]: Eq. 14 ~ sqrt(1/3)
    assert script.validation_loss(OPTIMA, x, y) == pytest.approx(np.sqrt(1 / 3), abs=0.05)
    far = script.validation_loss(OPTIMA + 3.0, x, y)
    by_hand = np.sqrt((((x @ (OPTIMA + 3.0).T) - y[..., None]) ** 2).mean(1)).min(1).mean()
    assert far == pytest.approx(by_hand)
    assert script.stop_round([3.0, 2.0, 2.5, 2.0, 1.0], patience=2) == 4
    assert script.stop_round([3.0, 2.0, 1.0], patience=2) == 3  # never: the last round
