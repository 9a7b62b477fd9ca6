"""``training.client_dropout``: sampled clients that are unavailable neither train nor report,
nothing is charged to them, and the accounting keeps the plan's sampling (conservative)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import binom

from algorithms import ALGORITHMS, Environment
from raysim.cli.compare import collect, table
from raysim.compose import for_algorithm
from raysim.config import ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.privacy.modes.secure import SecureSpec
from raysim.privacy.report import privacy_report
from raysim.privacy.sampling import (
    dropout_rates,
    report_count_pmf,
    sample_cohort,
    unavailable,
)
from raysim.protocol import SecureContribution
from raysim.runtime.inline import run_inline
from raysim.runtime.run import run_prepared

SETS = [
    "rounds=4",
    "data.dataset=digits",
    "data.num_clients=12",
    "data.cluster_sizes=[6,6]",
    "model.name=linear",
    "training.batch_size=16",
    "training.sampling_rate=0.5",
    "privacy.mode=sample",
    "privacy.epsilon=8",
    "privacy.delta=1e-7",
    "privacy.client_seed=3",
    "runtime.progress=false",
]


def _prep(*sets: str):
    cfg = for_algorithm(load_config(None, [*SETS, *sets]), quiet=True)
    return prepare(cfg, ALGORITHMS[cfg.algorithm.name], Environment)


def _charged(res: dict) -> dict[int, set[int]]:
    """The clients charged in each round (sample-level DP charges each one that trained)."""
    out: dict[int, set[int]] = {}
    for row in res["ledger_rows"]:
        out.setdefault(row["round"], set()).add(row["client"])
    return out


def test_each_client_is_unavailable_at_its_rate_whoever_else_was_sampled():
    truth = np.repeat([0, 1, 2], 400)
    rates = dropout_rates([0.0, 0.3, 0.8], truth)
    ids = np.arange(len(truth))
    up = np.array([~unavailable(rates, np.random.default_rng(s))[ids] for s in range(200)])
    assert up[:, truth == 0].all()  # rate 0: never unavailable
    for cluster, p in ((1, 0.3), (2, 0.8)):
        n = up[:, truth == cluster].size
        sigma = np.sqrt(p * (1 - p) / n)
        assert abs((~up[:, truth == cluster]).mean() - p) < 5 * sigma
    assert np.array_equal(dropout_rates(0.25, truth), np.full(len(truth), 0.25))


@pytest.mark.parametrize(("p", "rho"), [(0.3, 0.6), (0.1, 0.9)])
def test_correlated_unavailability_keeps_its_rate_and_has_the_closed_form_stretches(p, rho):
    """The chain's long-run rate is p in every round, its lag-1 correlation rho, and an
    unavailable stretch lasts 1 / ((1 - p)(1 - rho)) rounds on average."""
    n, rounds = 20_000, 60
    rates = np.full(n, p)
    state, path = None, []
    for r in range(rounds):
        state = unavailable(rates, np.random.default_rng(r), state, rho)
        path.append(state)
    off = np.array(path)
    assert np.abs(off.mean(axis=1) - p).max() < 5 * np.sqrt(p * (1 - p) / n)
    a, b = off[:-1].ravel().astype(float), off[1:].ravel().astype(float)
    assert np.corrcoef(a, b)[0, 1] == pytest.approx(rho, abs=0.01)
    starts = off[1:] & ~off[:-1]  # stretches that begin after round 0 ...
    ends = ~off[1:] & off[:-1]  # ... and those that end before the last round
    assert off[1:-1].sum() / starts[:-1].sum() == pytest.approx(1 / ((1 - p) * (1 - rho)), rel=0.05)
    assert abs(int(starts.sum()) - int(ends.sum())) < 0.05 * starts.sum()


def test_uncorrelated_unavailability_is_the_independent_draw_bit_for_bit():
    rates = dropout_rates([0.0, 0.3, 0.8], np.repeat([0, 1, 2], 50))
    ids = np.arange(0, 150, 7)
    before = unavailable(rates, np.random.default_rng(1))
    again = unavailable(rates, np.random.default_rng(2), before, 0.0)
    independent = np.random.default_rng(2).random(len(rates)) < rates  # each client away with p
    assert np.array_equal(again[ids], independent[ids])


def test_a_run_with_sticky_unavailability_resumes_to_the_same_bits(tmp_path):
    """Last round's unavailability is state: it travels in the checkpoint."""
    from conftest import inline_run

    from raysim.state.checkpoint import load_checkpoint
    from raysim.state.rundir import staging_dir

    sets = {
        "rounds": 6,
        "model.name": "linear",
        "training.sampling_rate": 0.5,
        "training.client_dropout": 0.4,
        "training.dropout_correlation": 0.9,
    }
    whole = inline_run(tmp_path / "whole", sets)
    died = tmp_path / "died"
    with pytest.raises(KeyboardInterrupt):
        inline_run(died, sets, die_after=3)
    assert whole.equals(inline_run(died, sets, resume=load_checkpoint(staging_dir(died))))
    sticky = whole["dropped_out"].to_numpy()
    free = inline_run(tmp_path / "free", {**sets, "training.dropout_correlation": 0})
    assert not np.array_equal(sticky, free["dropped_out"].to_numpy())


def test_a_run_with_dropout_thins_the_cohorts_of_the_run_without():
    """The same cohorts are drawn; the unavailable clients leave them before training, so they
    are charged nothing that round; a cluster whose rate is 0 loses no one."""
    prep = _prep("training.client_dropout=[0,0.7]")
    truth = prep.truth
    full, thin = run_inline(_prep(), apart=False), run_inline(prep, apart=False)
    full_sets, thin_sets = _charged(full), _charged(thin)
    lost: set[int] = set()
    for r, row in enumerate(thin["history"], start=1):
        cohort, reported = full_sets.get(r, set()), thin_sets.get(r, set())
        assert reported <= cohort
        assert row["participants"] == len(reported)
        assert row["dropped_out"] == len(cohort) - len(reported)
        lost |= cohort - reported
    assert lost and all(truth[c] == 1 for c in lost)
    for c in range(len(truth)):  # clients.parquet's rounds_reported
        assert thin["rounds_reported"][c] == sum(c in s for s in thin_sets.values())
    assert "dropped_out" not in full["history"][0]
    # fewer rounds trained, less spent; the plan's accounting is the same
    assert max(thin["client_epsilon"]) <= max(full["client_epsilon"])
    assert sum(thin["client_epsilon"]) < sum(full["client_epsilon"])


def test_a_run_with_dropout_reproduces():
    runs = [run_inline(_prep("training.client_dropout=0.4"), apart=False) for _ in range(2)]
    a, b = (
        [{k: v for k, v in r.items() if k != "round_seconds"} for r in run["history"]]
        for run in runs
    )
    assert a == b and sum(r["dropped_out"] for r in a) > 0


def test_a_round_that_waits_for_all_loses_no_one():
    """R-DPCFL's first round clusters every client: the server waits for the unavailable."""
    res = run_inline(_prep("algorithm.name=rdpcfl", "training.client_dropout=0.5"), apart=False)
    first, *rest = res["history"]
    assert first["participants"] == 12 and first["dropped_out"] == 0
    assert sum(r["dropped_out"] for r in rest) > 0


def test_the_privacy_report_says_dropout_is_not_credited():
    plain = privacy_report(_prep(), schedule=False)
    thin = privacy_report(_prep("training.client_dropout=0.5"), schedule=False)
    assert thin["epsilon"] == plain["epsilon"]
    assert "accounted as if every sampled client reported" in thin["client_dropout"]


@pytest.mark.parametrize(
    "value, words",
    [
        ("1", "training.client_dropout"),
        ("-0.1", "[0, 1)"),
        ("[0.1,1.5]", "one per true cluster"),
        ("[]", "training.client_dropout"),
    ],
)
def test_a_bad_rate_is_refused_naming_the_key(value, words):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [*SETS, f"training.client_dropout={value}"])
    assert words in str(err.value)


def test_one_rate_per_true_cluster_is_checked_against_the_data_before_ray():
    with pytest.raises(ConfigError) as err:
        _prep("training.client_dropout=[0.1,0.2,0.3]")
    assert "3 rate(s) for the data's 2 true cluster(s)" in str(err.value)


def test_the_summary_and_the_compare_table_count_the_reports(tmp_path):
    for name, sets in (("thin", ["training.client_dropout=0.4"]), ("full", [])):
        out = tmp_path / name / "fedavg" / "seed0"
        run_prepared(_prep(*sets), out, session=run_inline)
        summary = json.loads((out / "summary.json").read_text())
        rows = pd.read_parquet(out / "metrics.parquet")
        assert summary["reports_per_round"] == pytest.approx(rows["participants"].mean())
        if sets:
            assert summary["dropped_out"] == rows["dropped_out"].sum() > 0
        else:
            assert "dropped_out" not in summary
    thin, full = (table(collect(tmp_path / name)) for name in ("thin", "full"))
    assert "| reports/round |" in thin and "reports/round" not in full


DISTRIBUTED = [
    "privacy.mode=distributed",
    "privacy.noise_source=clients",
    "privacy.population=1000000",
    "privacy.epsilon=8",
    "training.sampling_rate=1",
    "training.client_dropout=0.3",
]


def test_the_rounds_whose_shares_fell_short_are_counted():
    """12 expected members, 30% unavailable: with no tolerance nearly every round is short of
    shares; sized for 6 survivors (tolerance 0.5), fewer are; each round says which."""
    short = run_inline(_prep(*DISTRIBUTED), apart=False)["history"]
    tolerant = run_inline(_prep(*DISTRIBUTED, "privacy.dropout_tolerance=0.5"), apart=False)
    for rows, survivors in ((short, 12), (tolerant["history"], 6)):
        for row in rows:
            assert row["noise_topped_up"] == float(row["participants"] < survivors)
    assert sum(r["noise_topped_up"] for r in short) > sum(
        r["noise_topped_up"] for r in tolerant["history"]
    )
    apart = run_inline(_prep(*DISTRIBUTED, "privacy.dropout_tolerance=0.5"), apart=True)
    untimed = [{k: v for k, v in r.items() if k != "round_seconds"} for r in apart["history"]]
    assert untimed == [
        {k: v for k, v in r.items() if k != "round_seconds"} for r in tolerant["history"]
    ]  # the clients' side, in its own process, sizes and sums the shares alike
    spec = _prep(*DISTRIBUTED, "privacy.dropout_tolerance=0.5").privacy_summary["secure_spec"]
    assert spec["share_cohort"] == pytest.approx(6.0)  # what the clients' side enforces


ABORTING = [*DISTRIBUTED, "rounds=8", "training.eval_every=1", "privacy.dropout_tolerance=0.2"]


def test_a_round_short_of_shares_aborts_and_releases_nothing():
    """Shares sized for 9.6 of 12 members, 30% unavailable: under privacy.shortfall=abort a
    round with 9 or fewer members releases nothing: the model stays as it was (the same test
    loss), no secure sum is charged (eps stays), and the aggregator adds no noise ever."""
    res = run_inline(_prep(*ABORTING, "privacy.shortfall=abort"), apart=False)
    rows, charged = res["history"], _charged(res)
    assert {r["aborted"] for r in rows} == {0.0, 1.0}  # this seed has both
    assert all("noise_topped_up" not in r for r in rows)
    for before, row in zip(rows, rows[1:], strict=False):
        assert row["aborted"] == float(row["participants"] < 9.6)
        if row["aborted"]:
            assert row["loss"] == before["loss"] and row["epsilon"] == before["epsilon"]
            assert row["round"] not in charged
        else:
            assert row["loss"] != before["loss"] and row["epsilon"] > before["epsilon"]
    apart = run_inline(_prep(*ABORTING, "privacy.shortfall=abort"), apart=True)["history"]
    assert [(r["aborted"], r["loss"]) for r in apart] == [(r["aborted"], r["loss"]) for r in rows]
    topped = run_inline(_prep(*ABORTING), apart=False)["history"]  # the default: top_up
    assert [r["noise_topped_up"] for r in topped] == [r["aborted"] for r in rows]


def test_the_summary_and_the_compare_table_count_the_aborted_rounds(tmp_path):
    out = tmp_path / "fedavg" / "seed0"
    run_prepared(_prep(*ABORTING, "privacy.shortfall=abort"), out, session=run_inline)
    summary = json.loads((out / "summary.json").read_text())
    rows = pd.read_parquet(out / "metrics.parquet")
    assert summary["aborted_rounds"] == rows["aborted"].sum() > 0
    assert summary["epsilon"] < summary["epsilon_budget"]  # the aborted rounds spent nothing
    assert "| aborted rounds |" in table(collect(tmp_path))


def test_the_aggregator_refuses_to_sum_a_round_short_of_shares_under_abort():
    """The clients' side enforces the spec: a server cannot have a short round summed."""
    spec = _prep(*ABORTING, "privacy.shortfall=abort").privacy_summary["secure_spec"]
    agg = SecureSpec(**spec).aggregator(1, 3)
    shares = [SecureContribution(0, torch.zeros(3), torch.zeros(1, 4)) for _ in range(9)]  # 9 < 9.6
    with pytest.raises(PermissionError, match="shortfall=abort"):
        agg.aggregate(shares, np.random.default_rng(0))
    assert agg.aggregate([*shares, shares[0]], np.random.default_rng(0)).counts[0] > 0


@pytest.mark.parametrize(
    ("rates", "rate", "scheme"),
    [
        ([0.0, 0.3, 0.8], 0.4, "poisson"),
        ([0.5, 0.5, 0.5], 0.4, "without_replacement"),
        ([0.0, 0.3, 0.8], 1.0, "without_replacement"),
    ],
)
def test_the_report_count_closed_form_matches_the_draws(rates, rate, scheme):
    """report_count_pmf against the engine's own draws (sample_cohort, then unavailable)."""
    truth = np.repeat([0, 1, 2], [10, 12, 8])
    per_client = dropout_rates(rates, truth)
    pmf = report_count_pmf(per_client, rate, scheme)
    draws = 20_000
    counts = np.zeros(len(truth) + 1)
    for s in range(draws):
        rng = np.random.default_rng(s)
        cohort = sample_cohort(len(truth), rate, scheme, rng)
        counts[np.count_nonzero(~unavailable(per_client, rng)[cohort])] += 1
    seen = counts[: len(pmf)] / draws
    assert counts[len(pmf) :].sum() == 0
    assert np.all(np.abs(seen - pmf) <= 5 * np.sqrt(pmf * (1 - pmf) / draws) + 1e-3)
    if len(set(rates)) > 1:  # a fixed cohort over clusters of different rates: no closed form
        assert report_count_pmf(per_client, 0.4, "without_replacement") is None


def test_the_privacy_report_says_how_often_a_round_falls_short():
    report = privacy_report(_prep(*ABORTING, "privacy.shortfall=abort"))
    p = binom.cdf(9, 12, 0.7)  # 12 sampled, each available at 0.7, fewer than 9.6
    assert report["rounds_short_of_shares"].startswith(f"P = {p:.3g} per round")
    assert "aborts" in report["rounds_short_of_shares"]


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["privacy.dropout_tolerance=0.5"], "privacy.noise_source=clients"),
        (["privacy.shortfall=abort"], "privacy.shortfall is about"),
        (["training.dropout_correlation=0.5"], "give training.client_dropout a rate"),
        (["training.client_dropout=0.2", "training.dropout_correlation=1"], "must be < 1.0"),
        ([*DISTRIBUTED, "privacy.shortfall=stop"], "top_up"),
        (
            [*DISTRIBUTED, "training.sampling_rate=0.1", "privacy.dropout_tolerance=0.5"],
            "at least 1",
        ),
    ],
)
def test_a_setting_that_cannot_apply_is_refused(sets, words):
    with pytest.raises(ConfigError) as err:
        _prep(*sets)
    assert words in str(err.value)
