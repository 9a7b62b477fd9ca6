"""Under ``privacy.mode: distributed`` every output carries two epsilons, labelled: the
noise-cohort one (amplified by sampling; it needs participation hidden from the server) and the
same noise's without amplification (every secure sum composed). Checked against plain
dp_accounting, not raysim's accounting."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import inline_run
from dp_accounting import ComposedDpEvent, GaussianDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from test_modes import prep_for

from raysim.cli.compare import collect, table
from raysim.metrics.html_report import group_runs, load_runs, summary_table
from raysim.metrics.report import comparison_table
from raysim.metrics.tables import render
from raysim.privacy import PrivacyLedger
from raysim.privacy.report import AMPLIFIED_LABEL, UNAMPLIFIED_LABEL, format_report, privacy_report

DISTRIBUTED = {
    "rounds": 3,
    "model.name": "mlp",
    "privacy.mode": "distributed",
    "privacy.epsilon": 8,
    "privacy.population": 1000000,
    "privacy.delta": 1e-7,
    "privacy.clip": 5,
}


def _independent(delta: float, z: float, releases: int, z_local: float | None = None) -> float:
    """Plain dp_accounting: ``releases`` Gaussians at z (no sampling), after the sketch's."""
    events = [] if z_local is None else [GaussianDpEvent(z_local)]
    events.append(SelfComposedDpEvent(GaussianDpEvent(z), releases))
    acc = RdpAccountant()
    acc.compose(ComposedDpEvent(events))
    return acc.get_epsilon(delta)


def test_a_distributed_run_shows_both_epsilons_labelled(tmp_path):
    run = tmp_path / "fedavg" / "seed0"  # the layout raysim compare writes
    metrics = inline_run(run, DISTRIBUTED)
    summary = json.loads((run / "summary.json").read_text())
    z, delta = summary["privacy"]["noise_multiplier"], summary["delta"]
    # metrics.parquet: one more column, per round, never below the noise-cohort eps
    assert list(metrics["epsilon_unamplified"]) == pytest.approx(
        [_independent(delta, z, r) for r in (1, 2, 3)], rel=1e-9
    )
    assert (metrics["epsilon_unamplified"] > 1.9 * metrics["epsilon"]).all()
    assert metrics["epsilon"].iloc[-1] == pytest.approx(8, rel=1e-3)  # the calibrated budget
    # summary.json: both, with what each assumes
    assert summary["epsilon_unamplified"] == pytest.approx(_independent(delta, z, 3), rel=1e-9)
    assert summary["privacy"]["planned_epsilon_unamplified"] == pytest.approx(
        summary["epsilon_unamplified"], rel=1e-9
    )
    labels = summary["epsilon_labels"]
    assert (
        AMPLIFIED_LABEL in labels["epsilon"] and UNAMPLIFIED_LABEL in labels["epsilon_unamplified"]
    )
    amplified, unamplified = f"{summary['epsilon']:.2f}", f"{summary['epsilon_unamplified']:.2f}"
    both = f"{amplified} ({AMPLIFIED_LABEL}) / {unamplified} ({UNAMPLIFIED_LABEL})"
    # compare.md's table, `raysim report`'s text table, the HTML page's summary and its data
    compare_md = table(collect(tmp_path))
    assert both in compare_md and "who took part is hidden from the server" in compare_md
    assert both in comparison_table([run])
    _, rows = summary_table(group_runs(load_runs([run])))
    assert both in rows[0]
    record = json.loads(render([run], "json"))["groups"][0]
    assert record["epsilon_unamplified_mean"] == pytest.approx(summary["epsilon_unamplified"])
    assert record["epsilon_mean"] == pytest.approx(summary["epsilon"])
    assert both in render([run], "markdown")
    assert (run / "epsilon.png").is_file()
    # the ledger itself is unchanged: population-wide charges, no new columns
    ledger = pq.read_table(run / "privacy.parquet")
    assert ledger.column_names == ["client", "round", "mechanism", "params", "epsilon"]


def test_other_modes_have_one_epsilon(tmp_path):
    metrics = inline_run(tmp_path / "client", {**DISTRIBUTED, "privacy.mode": "client"})
    summary = json.loads((tmp_path / "client" / "summary.json").read_text())
    assert "epsilon_unamplified" not in metrics and "epsilon_unamplified" not in summary
    assert "epsilon_labels" not in summary
    assert UNAMPLIFIED_LABEL not in comparison_table([tmp_path / "client"])


def test_the_sketchs_gaussian_comes_first_without_amplification():
    """PINA's local sketch is one plain Gaussian to its senders: their unamplified eps composes
    it with every secure sum released, and one without a sketch composes the sums alone."""
    prep = prep_for(
        "algorithm.name=pina",
        "algorithm.init=kmeans",
        "rounds=5",
        "privacy.mode=distributed",
        "privacy.epsilon=8",
        "privacy.noise_cohort_size=6",
        "privacy.clip=1",
    )
    mode = prep.mode
    z, z_local, delta = mode.plan.noise, mode.plan.local_noise, prep.cfg.privacy.delta
    assert z_local is not None
    ledger = PrivacyLedger(delta, num_clients=12)
    assert mode.other_epsilons(ledger) == {"epsilon_unamplified": 0.0}
    for r in (1, 2):
        charge = mode.secure_charge()
        ledger.charge(r, charge.clients, charge.mechanism, charge.event, charge.params)
    assert mode.other_epsilons(ledger)["epsilon_unamplified"] == pytest.approx(
        _independent(delta, z, 2), rel=1e-9
    )
    (sketch,) = mode.planned_charges(mode.needs.local_round, [0, 3], [])
    ledger.charge(3, sketch.clients, sketch.mechanism, sketch.event, sketch.params)
    assert mode.other_epsilons(ledger)["epsilon_unamplified"] == pytest.approx(
        _independent(delta, z, 2, z_local), rel=1e-9
    )
    planned = _independent(delta, z, mode.plan.releases, z_local)
    assert mode.planned_unamplified() == pytest.approx(planned, rel=1e-9)
    text = format_report(privacy_report(prep, schedule=False))  # `raysim privacy`
    assert f"({AMPLIFIED_LABEL}) / {planned:.4g} ({UNAMPLIFIED_LABEL})" in text.splitlines()[0]
