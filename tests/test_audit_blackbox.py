"""`raysim audit --adversary black-box`: input-space canaries in a real training run, scored
from the final models only (raysim.audit.blackbox)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raysim.audit.blackbox import blackbox_audit, membership, owners, with_canaries
from raysim.cli import main
from raysim.compare import for_algorithm
from raysim.config import load_config

CONFIG = "configs/audit_digits.yaml"
# long enough for the canaries to be memorised where nothing stops it (seconds per run here)
TRAIN = ["rounds=5", "training.local_epochs=5", "training.lr=0.5"]
STRONG = ["rounds=10", "training.local_epochs=5", "training.lr=0.5"]


def _audit(sets: list[str], canaries: int | None = None):
    from raysim.cli import _prepare

    cfg = for_algorithm(load_config(CONFIG, sets))
    return blackbox_audit(cfg, _prepare, canaries, seed=0)


@pytest.mark.parametrize("eps", [2.0, 8.0])
def test_black_box_bound_stays_under_the_claim(eps):
    result, rows, _ = _audit(["privacy.mode=sample", f"privacy.epsilon={eps}", *TRAIN])
    assert result.adversary == "black-box" and result.method == "one_run"
    assert result.claimed_epsilon == pytest.approx(eps, rel=0.02)
    assert 0 <= result.lower_bound <= result.claimed_epsilon
    assert len(rows["score"]) == result.canaries and 0 < rows["included"].sum() < result.canaries


def test_without_noise_the_attack_has_power():
    """No noise (privacy.mode=none): the final models betray the canaries they were trained
    on, clearly more than under DP-SGD with the same training."""
    open_, _, _ = _audit(["privacy.mode=none", *STRONG], canaries=200)
    private, _, _ = _audit(["privacy.mode=sample", "privacy.epsilon=2", *STRONG], canaries=200)
    assert open_.lower_bound > 0.4
    assert open_.lower_bound > private.lower_bound + 0.3


def test_canaries_join_only_their_owners_train_rows():
    from raysim.experiment import build_dataset

    cfg = load_config(CONFIG)
    base = build_dataset(cfg)
    m = 40
    x = np.full((m, *base.feature_shape), 7, dtype=np.uint8)
    y = np.arange(m) % base.num_classes
    included, owner = membership(m, 3), owners(m, base.num_clients, 3)
    assert 5 < included.sum() < 35
    assert np.bincount(owner).max() - np.bincount(owner).min() <= 1
    ds = with_canaries(base, x, y, included, owner)
    added = np.bincount(owner[included], minlength=base.num_clients)
    np.testing.assert_array_equal(ds.train_sizes, base.train_sizes + added)
    np.testing.assert_array_equal(ds.test_sizes, base.test_sizes)
    for c in range(base.num_clients):
        xs, ys = ds.client_train(c)
        xb, yb = base.client_train(c)
        np.testing.assert_array_equal(xs[: len(xb)], xb)
        np.testing.assert_array_equal(ys[len(yb) :], y[included & (owner == c)])
        np.testing.assert_array_equal(ds.client_test(c)[1], base.client_test(c)[1])


def test_cli_black_box_writes_the_adversary_and_report_shows_it(tmp_path, capsys):
    out = tmp_path / "bb"
    argv = ["audit", CONFIG, "--adversary", "black-box", "--set", "privacy.mode=sample"]
    assert main([*argv, "--canaries", "60", "--out", str(out)]) == 0
    info = json.loads((out / "audit.json").read_text())
    assert info["adversary"] == "black-box" and info["runs"] == 1 and info["canaries"] == 60
    assert "black-box adversary" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    assert "black-box adversary" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--adversary", "grey-box"], "--adversary"),
        (["--adversary", "black-box", "--set", "privacy.mode=sample", "--runs", "50"], "--runs"),
        (
            ["--adversary", "black-box", "--set", "privacy.mode=sample", "--participation", "told"],
            "--participation",
        ),
        (["--adversary", "black-box"], "privacy.mode"),  # client mode: not built black-box
        (["--adversary", "black-box", "--set", "privacy.mode=distributed"], "distributed"),
        (
            ["--adversary", "black-box", "--set", "privacy.mode=sample", "--canaries", "1"],
            "--canaries",
        ),
    ],
)
def test_cli_refuses_bad_black_box_input(argv, field, tmp_path, capsys):
    assert main(["audit", CONFIG, "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err
    assert not (tmp_path / "x" / "audit.json").exists()
