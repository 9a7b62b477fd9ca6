"""`raysim audit --adversary black-box`: input-space canaries in a real training run, scored
from the final models only (raysim.audit.blackbox)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from raysim.audit.blackbox import blackbox_audit
from raysim.audit.inputs import owners, with_canaries
from raysim.audit.training import membership
from raysim.cli.main import main
from raysim.compose import for_algorithm, prepare_named
from raysim.config import load_config

CONFIG = "configs/audit_digits.yaml"
# long enough for the canaries to be memorised where nothing stops it (seconds per run here)
TRAIN = ["rounds=5", "training.local_epochs=5", "training.lr=0.5"]
STRONG = ["rounds=10", "training.local_epochs=5", "training.lr=0.5"]


def _audit(sets: list[str], canaries: int | None = None):

    cfg = for_algorithm(load_config(CONFIG, sets))
    return blackbox_audit(cfg, prepare_named, canaries, seed=0)


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
    from raysim.engine.experiment import build_dataset

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
        (
            ["--adversary", "black-box", "--set", "privacy.mode=sample", "--runs", "50"]
            + ["--canaries", "5"],  # the multi-run audit: one canary a run
            "--canaries",
        ),
        (["--adversary", "black-box", "--runs", "0"], "--runs"),
        (
            ["--adversary", "black-box", "--set", "privacy.mode=sample", "--participation", "told"],
            "--participation",
        ),
        (["--adversary", "black-box", "--set", "privacy.mode=bogus"], "privacy.mode"),
        (  # two directions a pair canary: at most 325 in 650 weights
            ["--adversary", "black-box", "--set", "privacy.mode=dprivacy", "--canaries", "326"],
            "--canaries",
        ),
        (
            ["--adversary", "black-box", "--set", "training.sampling=without_replacement"],
            "training.sampling",
        ),
        (
            ["--adversary", "black-box", "--canaries", "651"],  # more than the 650 weights
            "--canaries",
        ),
        (  # fewer than the 12 clients and 500 canary slots the mode calibrates for
            ["--adversary", "black-box", "--set", "privacy.mode=distributed"]
            + ["--set", "privacy.population=100"],
            "privacy.population",
        ),
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


# ------------------------------------------------ canary clients (client, distributed)

# the noise cohort is the whole population of 12 clients and 200 canary slots (q = 1)
WHOLE = ["privacy.noise_cohort_size=212", "privacy.population=212", "privacy.client_seed=0"]
CANARY_CLIENTS = 200


def _noise_off(monkeypatch, mode: str) -> None:
    """The calibrated noise silently scaled to a thousandth where the mode draws it (tests
    only): the ledger still charges the calibrated multiplier."""
    if mode == "client":
        import raysim.privacy.modes.client as client

        real = client.gaussian_mechanism
        monkeypatch.setattr(
            client, "gaussian_mechanism", lambda t, s, z, rng: real(t, s, z * 1e-3, rng)
        )
    else:
        import raysim.privacy.modes.secure as secure

        real = secure.server_noise
        monkeypatch.setattr(secure, "server_noise", lambda std, *a: real(std * 1e-3, *a))


@pytest.mark.parametrize("mode", ["client", "distributed"])
@pytest.mark.parametrize("eps", [2.0, 8.0])
def test_canary_clients_bound_stays_under_the_claim(mode, eps):
    sets = [f"privacy.mode={mode}", f"privacy.epsilon={eps}", "rounds=2"]
    result, rows, prep = _audit(sets + (WHOLE if mode == "distributed" else []), CANARY_CLIENTS)
    assert result.adversary == "black-box" and result.mode == mode
    assert result.claimed_epsilon == pytest.approx(eps, rel=0.02)
    assert 0 <= result.lower_bound <= result.claimed_epsilon
    n = prep.dataset.num_clients - CANARY_CLIENTS
    np.testing.assert_array_equal(rows["client"], np.arange(n, n + CANARY_CLIENTS))


@pytest.mark.parametrize("mode", ["client", "distributed"])
def test_canary_clients_without_noise_the_attack_has_power(mode, monkeypatch):
    """The same training with the noise scaled to ~0 where the mode draws it: the final model
    gives the canaries away (the bound far above the claim: the fault is caught), clearly more
    than with the noise."""
    sets = [f"privacy.mode={mode}", "privacy.epsilon=2", "rounds=2"]
    sets += WHOLE if mode == "distributed" else []
    private, _, _ = _audit(sets, CANARY_CLIENTS)
    _noise_off(monkeypatch, mode)
    open_, rows, _ = _audit(sets, CANARY_CLIENTS)
    assert open_.claimed_epsilon == pytest.approx(2.0, rel=0.02)  # charged as calibrated
    assert open_.lower_bound > open_.claimed_epsilon
    assert open_.lower_bound > private.lower_bound + 1.0
    s, inc = rows["score"], rows["included"]
    assert s[inc].min() > s[~inc].max()  # every canary told apart


def test_excluded_canary_clients_never_take_part(monkeypatch):
    """Soundness: an excluded canary trains nothing and sends nothing in any round (it does not
    exist for the mechanism), an included one takes part in every round at rate 1, and the
    mode calibrated for the whole population with every canary slot."""
    from raysim.runtime import inline

    seen, real = {}, inline.inline_loop

    def spy(prep, *a, **kw):
        loop = real(prep, *a, **kw)
        seen["loop"] = loop
        return loop

    monkeypatch.setattr(inline, "inline_loop", spy)
    _, rows, prep = _audit(["rounds=3"], 40)
    loop = seen["loop"]
    ids, inc = rows["client"], rows["included"]
    assert loop.num_clients == 12 + 40 == prep.env.num_clients  # calibrated for N + m
    np.testing.assert_array_equal(loop.rounds_reported[ids[~inc]], 0)
    np.testing.assert_array_equal(loop.rounds_reported[ids[inc]], 3)
    np.testing.assert_array_equal(loop.rounds_reported[:12], 3)


def test_canary_trainer_returns_the_fixed_update():
    import torch

    from raysim.audit.clients import CanaryTrainer

    u = torch.tensor([0.6, 0.8, 0.0])
    inner = type("Inner", (), {"dim": 3, "evaluate": lambda self, *a: "evaluated"})()
    t = CanaryTrainer(inner, u)
    x = np.zeros((5, 2))
    (res,) = t.train_many([torch.zeros(3)], [(x, np.zeros(5))], [None], [None])
    assert torch.equal(res.update, u) and res.num_samples == 5 and res.update_norm == 1.0
    res.update.zero_()  # a release that edits its update leaves the canary's own intact
    assert torch.equal(t.train(torch.zeros(3), x, None, None, None).update, u)
    assert t.dim == 3 and t.evaluate() == "evaluated"


def test_canary_client_population():
    from raysim.audit.clients import with_canary_clients
    from raysim.engine.experiment import build_dataset

    base = build_dataset(load_config(CONFIG))
    ds = with_canary_clients(base, 30)
    assert ds.num_clients == base.num_clients + 30
    np.testing.assert_array_equal(ds.train_sizes[: base.num_clients], base.train_sizes)
    np.testing.assert_array_equal(ds.train_sizes[base.num_clients :], 1)
    for c in range(base.num_clients):
        np.testing.assert_array_equal(ds.client_train(c)[1], base.client_train(c)[1])
    j = base.num_clients + 13  # a copy of one train and one test row of client 13 mod 12
    np.testing.assert_array_equal(ds.client_train(j)[0], base.client_train(1)[0][:1])
    np.testing.assert_array_equal(ds.client_test(j)[0], base.client_test(1)[0][:1])
    assert ds.true_cluster[j] == base.true_cluster[1]


# ------------------------------------------------ pair canaries (dprivacy)

DPRIVACY = ["privacy.mode=dprivacy", "privacy.client_seed=0"]


def _laplace_off(monkeypatch) -> None:
    """The d-private noise silently shrunk a millionfold (tests only): the metric ledger still
    records n / nu per release."""
    import raysim.privacy.modes.dprivacy as dprivacy

    real = dprivacy.laplace_euclidean
    monkeypatch.setattr(
        dprivacy, "laplace_euclidean", lambda dim, eps, rng: real(dim, eps * 1e6, rng)
    )


@pytest.mark.parametrize("eps", [2.0, 8.0])
def test_pair_canaries_bound_stays_under_the_claim(eps):
    result, rows, prep = _audit([*DPRIVACY, f"privacy.epsilon={eps}"])
    assert result.mode == "dprivacy" and result.method == "one_run"
    assert result.canaries == 325  # two directions each in 650 weights
    assert result.claimed_epsilon == pytest.approx(eps)  # one release each at rate 1
    assert 0 <= result.lower_bound <= result.claimed_epsilon
    assert "metric" in result.claim_note
    n = prep.dataset.num_clients - 325
    np.testing.assert_array_equal(rows["client"], np.arange(n, n + 325))


def test_pair_canaries_without_noise_the_fault_is_caught(monkeypatch):
    """Two rounds, the d-private noise silenced: the final model tells every pair apart."""
    sets = [*DPRIVACY, "privacy.epsilon=2", "rounds=2"]
    private, _, _ = _audit(sets)
    _laplace_off(monkeypatch)
    open_, rows, _ = _audit(sets)
    assert open_.claimed_epsilon == pytest.approx(2.0)  # the ledger charged as before
    assert private.lower_bound <= private.claimed_epsilon
    assert open_.lower_bound > open_.claimed_epsilon + 1.0
    s, inc = rows["score"], rows["included"]
    assert s[inc].min() > s[~inc].max()


def test_pair_canaries_release_their_pair_and_the_claim_scales_by_the_distance(monkeypatch):
    """Each canary client releases u1 (its bit set) or u0 of norm r, at the distance d at which
    the metric ledger's leakage per unit norm, times d, is privacy.epsilon; every canary takes
    part in every round (no absent neighbour under metric DP)."""
    from raysim.audit import clients

    seen = {}
    real = clients.PairCanaryClients.updates

    def spy(self, cfg, prep, included):
        out = real(self, cfg, prep, included)
        seen.update(made=self, included=included, d=self.distance(cfg, prep), updates=out)
        return out

    monkeypatch.setattr(clients.PairCanaryClients, "updates", spy)
    result, rows, prep = _audit([*DPRIVACY, "privacy.epsilon=3", "rounds=2"], 20)
    made, d = seen["made"], seen["d"]
    r = clients.RADIUS
    assert d == pytest.approx(3 * r / (2 * 650))  # two releases of n / nu = 650 per unit norm
    b = made.u[:, 20:]
    for i, c in enumerate(made.clients):
        u = seen["updates"][int(c)].double().numpy()
        assert np.linalg.norm(u) == pytest.approx(r, rel=1e-6)
        other = u - (1 if seen["included"][i] else -1) * d * b[:, i]  # the pair's other one
        assert np.linalg.norm(other) == pytest.approx(r, rel=1e-6)
        assert u @ b[:, i] == pytest.approx(d / 2 if seen["included"][i] else -d / 2, rel=1e-4)
    assert result.claimed_epsilon == pytest.approx(3.0)


# ------------------------------------------------ the multi-run black-box audit


def _multi(sets: list[str], runs: int, seed: int = 0):
    cfg = for_algorithm(load_config(CONFIG, sets))
    return blackbox_audit(cfg, prepare_named, None, seed=seed, runs=runs)


@pytest.mark.parametrize(
    "sets",
    [["privacy.mode=client"], ["privacy.mode=sample"], DPRIVACY],
    ids=["client", "sample", "dprivacy"],
)
def test_multi_run_bound_stays_under_the_claim(sets):
    runs = 40 if "privacy.mode=sample" in sets else 100
    result, rows, _ = _multi([*sets, "privacy.epsilon=2"], runs)
    assert result.method == "multi_run" and result.adversary == "black-box"
    assert result.runs == runs and result.canaries == 1
    assert result.claimed_epsilon == pytest.approx(2.0, rel=0.02)
    assert 0 <= result.lower_bound <= result.claimed_epsilon
    np.testing.assert_array_equal(rows["index"], np.arange(runs))
    assert 0 < rows["included"].sum() < runs and np.isfinite(rows["score"]).all()


@pytest.mark.parametrize("mode", ["client", "dprivacy"])
def test_multi_run_without_noise_the_fault_is_caught(mode, monkeypatch):
    """200 trainings of one round with one canary each, the noise silenced where the mode
    draws it: the bound far above the claim of 2 (200 runs can show about 3)."""
    if mode == "client":
        _noise_off(monkeypatch, "client")
    else:
        _laplace_off(monkeypatch)
    sets = [f"privacy.mode={mode}", "privacy.epsilon=2"]
    result, rows, _ = _multi(sets, 200)
    assert result.claimed_epsilon == pytest.approx(2.0, rel=0.02)
    assert result.lower_bound > result.claimed_epsilon + 0.5
    s, inc = rows["score"], rows["included"]
    assert s[inc].min() > s[~inc].max()


def test_multi_run_input_canary_without_noise_has_power():
    """No noise (none), long enough training: one mislabelled input is told apart run by run,
    though every run draws its own initialisation and batches."""
    result, _, _ = _multi(["privacy.mode=none", *TRAIN], 60)
    assert result.method == "multi_run" and result.lower_bound > 1.0


def test_multi_run_draws_each_runs_seeds():
    """Each run's seeds from (audit seed, run, purpose), in place of the config's; the clients'
    seed only where the server is untrusted (a trusted one's clients use the run's)."""
    from raysim.audit.blackbox import run_config, run_membership

    cfg = load_config(CONFIG, ["privacy.mode=sample", "privacy.client_seed=7"])
    a, b, again = run_config(cfg, 0, 0), run_config(cfg, 0, 1), run_config(cfg, 0, 0)
    assert a.seed != b.seed and a.privacy.client_seed != b.privacy.client_seed
    assert (a.seed, a.privacy.client_seed) == (again.seed, again.privacy.client_seed)
    assert a.privacy.client_seed != 7 and run_config(cfg, 1, 0).seed != a.seed
    assert run_config(load_config(CONFIG), 0, 0).privacy.client_seed is None  # client: trusted
    inc = run_membership(400, 0)
    assert 150 < inc.sum() < 250
    np.testing.assert_array_equal(inc, run_membership(400, 0))


def test_cli_multi_run_black_box_writes_one_row_per_run(tmp_path, capsys):
    import pandas as pd

    out = tmp_path / "mr"
    argv = ["audit", CONFIG, "--adversary", "black-box", "--runs", "30", "--out", str(out)]
    assert main(argv) == 0
    info = json.loads((out / "audit.json").read_text())
    assert info["method"] == "multi_run" and info["runs"] == 30 and info["canaries"] == 1
    table = pd.read_parquet(out / "audit.parquet")
    assert list(table.columns) == ["run", "included", "score"] and len(table) == 30
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["seed"] == load_config(CONFIG).seed  # as given, not the last run's
    assert "multi_run, black-box adversary" in capsys.readouterr().out
