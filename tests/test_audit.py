"""`raysim audit` end to end: every mode's audited lower bound stays under its claim at two
budgets; faults planted by monkeypatching (never a shipped option) push it over; the CLI refuses
bad input with exit 2 and writes its files."""

from __future__ import annotations

import json

import pytest

from raysim.audit import canaries as canaries_mod
from raysim.audit.run import audit
from raysim.cli.main import main
from raysim.compose import for_algorithm
from raysim.config import load_config
from raysim.privacy.modes import client as client_mode
from raysim.privacy.modes.distributed import Distributed
from raysim.protocol import Message

CONFIG = "configs/audit_digits.yaml"


def prepared(*sets: str):
    from raysim.compose import prepare_named

    return prepare_named(for_algorithm(load_config(CONFIG, list(sets))))


MODE_SETS = {
    "client": [],
    "distributed": ["privacy.mode=distributed"],
    "sample": ["privacy.mode=sample", "privacy.delta=1e-3"],
    "dprivacy": ["privacy.mode=dprivacy"],
}


@pytest.mark.parametrize("eps", [2.0, 8.0])
@pytest.mark.parametrize("mode", sorted(MODE_SETS))
def test_audited_bound_stays_under_the_claim(mode, eps):
    prep = prepared(*MODE_SETS[mode], f"privacy.epsilon={eps}")
    result, rows = audit(prep, runs=3000, seed=1)
    assert result.lower_bound <= result.claimed_epsilon
    assert result.mode == mode and len(rows["score"]) == 3000
    assert result.claimed_epsilon == pytest.approx(eps, rel=0.05)  # the mode's calibration


@pytest.mark.parametrize("participation", ["hidden", "told"])
def test_distributed_amplified_and_unamplified_claims_hold(participation):
    """Half the clients sampled: the told adversary faces the unamplified Gaussian's eps."""
    prep = prepared(
        "privacy.mode=distributed", "training.sampling_rate=0.5", "privacy.noise_cohort_size=6"
    )
    result, _ = audit(prep, runs=3000, seed=2, participation=participation)
    assert result.lower_bound <= result.claimed_epsilon
    if participation == "told":
        assert result.claimed_epsilon > 2.5  # no amplification in its claim


FAULT = ["privacy.epsilon=3.5", "privacy.delta=1e-3"]  # noise multiplier ~1: room to detect


def test_fault_noise_halved_is_caught(monkeypatch):
    prep = prepared(*FAULT)
    honest, _ = audit(prep, runs=40_000, seed=3)
    real = client_mode.gaussian_mechanism
    monkeypatch.setattr(
        client_mode, "gaussian_mechanism", lambda t, s, z, rng: real(t, s, z / 2, rng)
    )
    faulty, _ = audit(prepared(*FAULT), runs=40_000, seed=3)
    assert honest.lower_bound <= honest.claimed_epsilon < faulty.lower_bound


def test_fault_clipping_skipped_is_caught(monkeypatch):
    monkeypatch.setattr(client_mode, "clip_l2", lambda x, bound: x)
    faulty, _ = audit(prepared(*FAULT), runs=40_000, seed=4)
    assert faulty.lower_bound > faulty.claimed_epsilon


def test_fault_raw_value_through_the_boundary_is_caught(monkeypatch):
    """A distributed admit that hands the server the clipped inputs, not their noisy sum."""

    def leaky(self, algorithm, plan, reports, rng, secure=None):
        self._released = True
        return [Message(r.client_id, r.contribution.vector) for r in reports]

    prep = prepared("privacy.mode=distributed", *FAULT)
    monkeypatch.setattr(Distributed, "admit", leaky)
    faulty, _ = audit(prep, runs=2000, seed=5)
    assert faulty.lower_bound > faulty.claimed_epsilon


def test_fault_participation_revealed_under_the_amplified_claim(monkeypatch):
    """The adversary learns who took part, the claim stays the amplified one."""
    sets = [
        "privacy.mode=distributed",
        "training.sampling_rate=0.25",
        "privacy.noise_cohort_size=3",
    ]
    sets += ["privacy.epsilon=1.0", "privacy.delta=1e-3"]  # amplified: z ~ 1
    honest, _ = audit(prepared(*sets), runs=10_000, seed=6)
    monkeypatch.setattr(
        canaries_mod.Target, "takes_part", lambda self, included, rate, run: included
    )
    faulty, _ = audit(prepared(*sets), runs=10_000, seed=6)
    assert faulty.participation == "hidden"  # audited against the amplified eps
    assert honest.lower_bound <= honest.claimed_epsilon < faulty.lower_bound


def test_none_shows_the_leak_bounded_by_the_canaries():
    result, _ = audit(prepared("privacy.mode=none"), runs=1, canaries=400, seed=7)
    assert result.method == "one_run" and result.lower_bound > 3


def test_cli_writes_the_files_and_report_prints_the_line(tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["audit", CONFIG, "--runs", "500", "--out", str(out)]) == 0
    info = json.loads((out / "audit.json").read_text())
    assert {"claimed_epsilon", "lower_bound", "confidence", "method", "view"} <= set(info)
    assert (out / "audit.parquet").is_file() and (out / "audit.png").is_file()
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert "eps >= " in capsys.readouterr().out
    assert main(["audit", CONFIG, "--runs", "500", "--out", str(out)]) == 2  # no --overwrite


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--runs", "0"], "--runs"),
        (["--runs", "10", "--canaries", "3"], "--canaries"),
        (["--runs", "1", "--canaries", "5000"], "--canaries"),
        (["--participation", "maybe"], "--participation"),
        (["--set", "privacy.mode=bogus"], "privacy.mode"),
    ],
)
def test_cli_refuses_bad_input(argv, field, tmp_path, capsys):
    assert main(["audit", CONFIG, "--out", str(tmp_path / "x"), *argv]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.slow
def test_full_table_and_tightness():
    """The docs' table (every mode, eps 2 and 8) holds; client mode, one round, q = 1, eps 2 at
    delta 1e-5: a million releases audit it at eps >= 1.0 (about two minutes on 2 cores)."""
    from raysim.cli.audit_table import full_table

    for r in full_table(runs=20_000):
        assert r.lower_bound <= r.claimed_epsilon, r.line()
    tight, _ = audit(prepared("privacy.epsilon=2.0"), runs=1_000_000, seed=0)
    assert tight.claimed_epsilon == pytest.approx(2.0, rel=0.01)
    assert 1.0 <= tight.lower_bound <= tight.claimed_epsilon
