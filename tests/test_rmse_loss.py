"""``training.regression_loss: rmse`` (Galli et al.'s Eq. 14): the loss, its gradient, the
config's checks, and dp_group trained and judged with it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from algorithms import Environment, get_algorithm
from algorithms.clustered import SelectionParams, selection_utility
from raysim.compose import for_algorithm
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.models import build_model
from raysim.runtime.inline import inline_loop
from raysim.training import LocalTrainer, TrainConfig
from raysim.training.losses import batch_loss, dataset_loss

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "galli_synthetic.yaml"
OPTIMA = np.array([[5.0, 6.0], [4.0, -4.5]])


def linear_trainer(loss: str, weights: list[float]) -> tuple[LocalTrainer, torch.Tensor]:
    t = LocalTrainer(
        build_model("linear", (2,), 0, seed=0, bias=False), "regression", regression_loss=loss
    )
    return t, torch.tensor(weights, dtype=torch.float32)


def test_rmse_of_a_batch_by_hand():
    se = torch.tensor([1.0, 4.0, 9.0])  # residuals 1, 2, 3
    assert float(batch_loss(se, "rmse")) == pytest.approx(math.sqrt(14 / 3), rel=1e-6)
    assert float(batch_loss(se, "mse")) == pytest.approx(14 / 3)
    assert dataset_loss(14.0, 3, "rmse") == pytest.approx(math.sqrt(14 / 3))
    assert dataset_loss(14.0, 3, "mse") == pytest.approx(14 / 3)
    with pytest.raises(ValueError, match="unknown regression loss 'mae'"):
        batch_loss(se, "mae")


def test_one_full_batch_step_is_the_closed_form_rmse_gradient():
    g = np.random.default_rng(0)
    x = g.normal(size=(10, 2)).astype(np.float32)
    y = (x @ np.array([5.0, 6.0]) + g.uniform(size=10)).astype(np.float32)
    theta = np.array([0.5, -1.0])
    t, w = linear_trainer("rmse", theta.tolist())
    cfg = TrainConfig(lr=0.1, batch_size=10, local_epochs=1)
    res = t.train(w, x, y, cfg, torch.Generator().manual_seed(0))
    r = x.astype(np.float64) @ theta - y
    rmse = np.sqrt(np.mean(r**2))
    grad = x.T @ r / (len(y) * rmse)  # d/dtheta sqrt(mean r^2)
    np.testing.assert_allclose(res.update.numpy(), -0.1 * grad, rtol=1e-4)
    assert res.train_loss == pytest.approx(rmse, rel=1e-5)


def test_rmse_gradient_norm_does_not_grow_with_the_distance_but_mse_does():
    g = np.random.default_rng(1)
    x = g.normal(size=(10, 2)).astype(np.float32)
    opt = np.array([4.0, -4.5])
    y = (x @ opt).astype(np.float32)  # noiseless: the residual scales with the distance
    away = np.array([0.6, 0.8])
    norms = {}
    for loss in ("mse", "rmse"):
        for r in (1.0, 100.0):
            t, w = linear_trainer(loss, (opt + r * away).tolist())
            cfg = TrainConfig(lr=0.01, batch_size=10, local_epochs=1)
            norms[loss, r] = float(t.train(w, x, y, cfg, torch.Generator()).update.norm())
    # float32 weights of size ~100 round the update to ~1e-5 of its size: rel 1e-2, not exact
    assert norms["rmse", 100.0] == pytest.approx(norms["rmse", 1.0], rel=1e-2)
    assert norms["mse", 100.0] == pytest.approx(100 * norms["mse", 1.0], rel=1e-2)


def test_scores_and_evaluation_are_eq14_over_the_client_data():
    g = np.random.default_rng(2)
    x = g.normal(size=(7, 2)).astype(np.float32)
    y = g.normal(size=7).astype(np.float32)
    models = [torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 0.5])]
    mse, _ = linear_trainer("mse", [0, 0])[0].scores(models, x, y, batch_size=3)
    rmse_t = linear_trainer("rmse", [0, 0])[0]
    rmse, _ = rmse_t.scores(models, x, y, batch_size=3)  # chunks of 3: a root of the whole mean
    np.testing.assert_allclose(rmse, np.sqrt(mse), rtol=1e-6)
    by_hand = np.sqrt(np.mean((x.astype(np.float64) @ [1.0, 2.0] - y) ** 2))
    assert rmse_t.evaluate(models[0], x, y).loss == pytest.approx(by_hand, rel=1e-5)
    packed = rmse_t.evaluate_many(models[0], [(x[:3], y[:3]), (x[3:], y[3:])])
    assert packed[1].loss == pytest.approx(
        np.sqrt(np.mean((x[3:].astype(np.float64) @ [1.0, 2.0] - y[3:]) ** 2)), rel=1e-5
    )


def test_rmse_selection_sensitivity_bounds_a_replaced_record():
    """A private loss-based choice under rmse: the utility is -Eq. 14 of the clipped squared
    errors, and its sensitivity sqrt(clip / (n - 1)) bounds what replacing one record does."""
    params = SelectionParams(eps_select=1.0, loss_clip=4.0, select_by="loss")
    n = 10
    _, sens = selection_utility(params, np.zeros(2), np.zeros(2), n, "rmse")
    assert sens == pytest.approx(math.sqrt(4.0 / 9))
    assert selection_utility(params, np.zeros(2), np.zeros(2), n)[1] == pytest.approx(4.0 / 9)
    g = np.random.default_rng(3)
    worst = 0.0
    for _ in range(2000):
        se = np.minimum(g.exponential(g.choice([0.01, 1.0, 10.0]), size=n), 4.0)
        other = se.copy()
        other[g.integers(n)] = g.choice([0.0, 4.0])
        worst = max(worst, abs(np.sqrt(se.mean()) - np.sqrt(other.mean())))
        worst = max(worst, abs(np.sqrt(se.mean()) - np.sqrt(se[1:].mean())))  # one removed
    assert 0.5 * sens < worst <= sens


def test_trainer_refuses_rmse_for_classification_and_under_dp_sgd():
    with pytest.raises(ValueError, match="needs a regression task"):
        LocalTrainer(
            build_model("linear", (2,), 3, seed=0), "classification", regression_loss="rmse"
        )
    t, w = linear_trainer("rmse", [0.0, 0.0])
    dp = TrainConfig(lr=0.1, batch_size=2, dp_noise_multiplier=1.0)
    x, y = np.ones((4, 2), np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="regression_loss: DP-SGD"):
        t.train(w, x, y, dp, torch.Generator())


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["training.regression_loss=mae"], "training.regression_loss"),
        (
            ["data.dataset=synthetic_linear", "model.name=linear", "privacy.mode=sample"]
            + ["training.regression_loss=rmse"],
            "training.regression_loss=rmse cannot train under privacy.mode=sample",
        ),
    ],
)
def test_bad_regression_loss_names_the_field(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert needle in str(err.value)


def test_rmse_on_a_classification_dataset_names_the_field():
    sets = ["training.regression_loss=rmse", "privacy.mode=none", "runtime.progress=false"]
    cfg = load_config(None, sets)
    with pytest.raises(ConfigError, match=r"training.regression_loss=rmse: .* classification"):
        prepare(for_algorithm(cfg), get_algorithm(cfg.algorithm.name), Environment)


def run_galli(*sets: str):
    cfg = for_algorithm(load_config(CONFIG, ["runtime.progress=false", *sets]))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    loop = inline_loop(prep)
    rows = [loop.step() for _ in range(cfg.rounds)]
    hyps = np.stack([m.numpy() for m in loop.state.models])
    return rows, np.linalg.norm(OPTIMA[:, None] - hyps[None], axis=2).min(axis=1)


def test_dp_group_trains_and_is_judged_with_rmse():
    rows, dist = run_galli(
        "training.regression_loss=rmse",
        "training.early_stop_patience=null",
        "rounds=120",
        "privacy.nu=0.05",
    )
    assert (dist < 0.5).all(), dist
    # judged by Eq. 14 per client: near both optima, u ~ U[0, 1] leaves an RMSE ~ sqrt(1/3)
    assert 0.4 < rows[-1]["loss"] < 0.8, rows[-1]["loss"]
    _, mse_dist = run_galli(
        "training.regression_loss=mse",
        "training.early_stop_patience=null",
        "rounds=120",
        "privacy.nu=0.05",
    )
    assert (mse_dist < 0.5).all(), mse_dist
