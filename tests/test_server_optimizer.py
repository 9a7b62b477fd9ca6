"""The server's optimizer (FedOpt): its steps against the textbook formulas written out here in
float64 NumPy, its keys' errors, and whole runs: FedAvgM and FedAdam change a run, reproduce
from the seed, and resume from a checkpoint to the same bits (the momentum travels in it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import inline_run, small_config

from algorithms import Environment, get_algorithm
from raysim.cli.main import main
from raysim.compose import for_algorithm
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.server.aggregation import ServerOptimizer
from raysim.state.checkpoint import load_checkpoint
from raysim.state.rundir import staging_dir

UPDATES = np.random.default_rng(0).normal(size=(4, 6))
START = np.random.default_rng(1).normal(size=6)


def _steps(**keys) -> np.ndarray:
    """The models after each of UPDATES, by ServerOptimizer on slot 3."""
    cfg = load_config(None, [f"algorithm.{k}={v}" for k, v in keys.items()]).algorithm
    opt, model, out = ServerOptimizer(cfg), torch.tensor(START, dtype=torch.float32), []
    for u in UPDATES:
        model = opt.move(3, model, torch.tensor(u, dtype=torch.float32))
        out.append(model.double().numpy())
    return np.array(out)


def test_plain_sgd_is_fedavg_bit_for_bit():
    cfg = load_config(None, ["algorithm.server_lr=0.7"]).algorithm
    model, update = torch.randn(50), torch.randn(50)
    assert torch.equal(ServerOptimizer(cfg).move(0, model, update), model + 0.7 * update)


def test_momentum_is_heavy_ball_on_the_updates():
    lr, mu = 0.5, 0.9
    x, v, want = START.copy(), np.zeros(6), []
    for u in UPDATES:
        v = mu * v + u
        x = x + lr * v
        want.append(x.copy())
    np.testing.assert_allclose(_steps(server_lr=lr, server_momentum=mu), want, rtol=0, atol=1e-5)


def test_adam_is_bias_corrected_adam_on_minus_the_updates():
    lr, b1, b2, tau = 0.1, 0.8, 0.95, 1e-2
    x, m, v, want = START.copy(), np.zeros(6), np.zeros(6), []
    for t, u in enumerate(UPDATES, start=1):
        g = -u
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + tau)
        want.append(x.copy())
    got = _steps(
        server_optimizer="adam", server_lr=lr, server_betas=f"[{b1}, {b2}]", server_tau=tau
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_adagrad_accumulates_squares():
    lr, tau = 0.3, 1e-3
    x, s, want = START.copy(), np.zeros(6), []
    for u in UPDATES:
        s = s + u * u
        x = x + lr * u / (np.sqrt(s) + tau)
        want.append(x.copy())
    got = _steps(server_optimizer="adagrad", server_lr=lr, server_tau=tau)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_slots_keep_their_own_state():
    cfg = load_config(None, ["algorithm.server_momentum=0.5"]).algorithm
    opt, zero, one = ServerOptimizer(cfg), torch.zeros(3), torch.ones(3)
    opt.move(0, zero, one)
    assert torch.equal(opt.move(1, zero, one), one)  # slot 1: no momentum from slot 0
    assert torch.equal(opt.move(0, zero, one), 1.5 * one)  # slot 0: 0.5 * 1 + 1


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["algorithm.server_optimizer=adam", "algorithm.server_momentum=0.9"], "server_betas[0]"),
        (["algorithm.server_optimizer=nadam"], "sgd"),
        (["algorithm.server_betas=[0.9, 1.0]"], "[0, 1)"),
        (["algorithm.server_momentum=1"], "server_momentum"),
        (["algorithm.server_tau=0"], "server_tau"),
    ],
)
def test_bad_keys_exit_2_naming_them(sets, words, capsys):
    argv = ["privacy"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_algorithms_without_a_server_model_leave_the_keys_out(capsys):
    sets = ["algorithm.name=local", "algorithm.server_optimizer=adam", "algorithm.server_lr=0.1"]
    cfg = for_algorithm(load_config(None, sets))
    assert "local does not take algorithm.server_lr, algorithm.server_optimizer" in (
        capsys.readouterr().err
    )
    assert (cfg.algorithm.server_optimizer, cfg.algorithm.server_lr) == ("sgd", 1.0)
    # built directly (not through a command), such an algorithm refuses them
    with pytest.raises(ConfigError, match="no server model to move"):
        prepare(load_config(None, sets), get_algorithm("local"), Environment)


def test_fedcam_refuses_anything_but_plain_sgd():
    sets = small_config(
        **{
            "algorithm.name": "rr_cluster",
            "algorithm.base": "fedcam",
            "algorithm.server_momentum": 0.9,
            "privacy.mode": "none",
        }
    )
    with pytest.raises(ConfigError, match="base fedcam"):
        prepare(load_config(None, sets), get_algorithm("rr_cluster"), Environment)


# ----------------------------------------------------------------------------- whole runs
RUN = {
    "rounds": 3,
    "model.name": "mlp",
    "privacy.mode": "client",
    "privacy.epsilon": 8,
    "privacy.clip": 1,
    "training.sampling_rate": 0.5,
    "training.sampling": "without_replacement",
}


def _run(out, die_after=None, resume=None, **extra):
    return inline_run(out, {**RUN, **extra}, die_after, resume)


@pytest.mark.parametrize(
    "keys",
    [
        {"algorithm.name": "fedavg", "algorithm.server_momentum": 0.9},
        {
            "algorithm.name": "rr_cluster",
            "algorithm.num_clusters": 2,
            "algorithm.B": 1,
            "algorithm.server_optimizer": "adam",
            "algorithm.server_lr": 0.01,
        },
    ],
    ids=["fedavgm", "rr_cluster-adam"],
)
def test_optimizer_runs_reproduce_and_resume_to_the_same_bits(tmp_path, keys):
    plain_keys = {k: v for k, v in keys.items() if not k.startswith("algorithm.server_")}
    plain = _run(tmp_path / "plain", **plain_keys)
    whole = _run(tmp_path / "whole", **keys)
    assert not np.array_equal(plain["loss"], whole["loss"])  # the optimizer acted
    again = _run(tmp_path / "again", **keys)
    assert whole.equals(again)

    died = tmp_path / "died"
    with pytest.raises(KeyboardInterrupt):
        _run(died, die_after=2, **keys)
    blob = load_checkpoint(staging_dir(died))
    resumed = _run(died, resume=blob, **keys)
    assert whole.equals(resumed)
