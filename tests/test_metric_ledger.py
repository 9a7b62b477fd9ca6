"""d-privacy leakage ledger (Galli et al., Alg. 2 and Thm 3.1) and the Fig.-2 table and plot."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from raysim.metrics.leakage import max_leakage_per_cluster, plot_max_leakage
from raysim.privacy import BudgetError, MetricLedger, PrivacyConfigError


def _paper_run(ledger: MetricLedger, seed: int = 0, clients: int = 100, rounds: int = 50):
    """U = 7 of 100 clients per round, n = 2, nu = 5, random update norms; returns the counts
    of participations, counted from the sampling itself (not from the ledger)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(clients, dtype=int)
    for t in range(1, rounds + 1):
        for c in rng.choice(clients, size=7, replace=False):
            ledger.record(int(c), t, dim=2, nu=5.0)
            counts[c] += 1
    return counts


def test_totals_are_0_4_times_participations_at_nu_5_n_2() -> None:
    ledger = MetricLedger()
    counts = _paper_run(ledger)
    for c in range(100):
        assert ledger.total(c) == pytest.approx(0.4 * counts[c], rel=1e-12, abs=0)
        assert ledger.participations(c) == counts[c]
    assert set(ledger.totals()) == {c for c in range(100) if counts[c]}
    assert sum(counts) == 7 * 50 == len(ledger.rows())


def test_each_row_is_n_over_nu_and_holds_no_update_norm() -> None:
    """n / nu per release; no ||delta|| nor eps (a function of it) in what the server keeps."""
    ledger = MetricLedger()
    _paper_run(ledger, seed=1, rounds=5)
    for r in ledger.rows():
        assert r["leakage"] == pytest.approx(0.4, rel=1e-15) and r["dim"] == 2 and r["nu"] == 5
        assert not {"delta_norm", "epsilon", "radius"} & set(r)
    # running totals per client
    df = pd.DataFrame(ledger.rows())
    for _, sub in df.groupby("client"):
        np.testing.assert_allclose(sub["total"], 0.4 * np.arange(1, len(sub) + 1), rtol=1e-12)


def test_total_bounds_the_log_likelihood_ratio_of_all_releases() -> None:
    """Thm 3.1, checked on the Laplace density K exp(-eps ||y - x||) of Prop. 3.1: for inputs
    x, x' within each release's radius, the log ratio of the joint density of the releases is at
    most the ledger's total, and reaches it (x' at the radius, y beyond x on the same line): the
    total is the least such bound, not merely a bound."""
    rng = np.random.default_rng(2)
    ledger = MetricLedger()
    inside, worst = 0.0, 0.0
    for t in range(1, 6):
        radius = float(rng.uniform(0.1, 2))
        ledger.record(0, t, dim=2, nu=5.0)
        eps = 2 / (5.0 * radius)  # Algorithm 2's eps for this radius, by hand
        x, u = rng.normal(size=2), rng.normal(size=2)
        u /= np.linalg.norm(u)
        x2 = x + u * radius * rng.uniform(0.5, 1)  # within the radius
        y = x + 0.3 * rng.normal(size=2)  # any release point
        inside += eps * (np.linalg.norm(y - x2) - np.linalg.norm(y - x))
        far, y_far = x + u * radius, x - u * float(rng.uniform(0.1, 3))
        worst += eps * (np.linalg.norm(y_far - far) - np.linalg.norm(y_far - x))
    assert inside <= ledger.total(0) + 1e-12
    assert worst == pytest.approx(ledger.total(0), rel=1e-12)
    assert ledger.total(0) == pytest.approx(5 * 2 / 5.0, rel=1e-12)  # five releases of n / nu


def test_cap_makes_a_client_skip_and_refuses_an_overspend() -> None:
    ledger = MetricLedger(cap=1.0)
    leak = MetricLedger.leakage(2, 5.0)
    for t in (1, 2):
        assert not ledger.would_exceed(7, leak)
        ledger.record(7, t, 2, 5.0)
    assert ledger.would_exceed(7, leak)  # 1.2 > 1.0: this client skips
    assert not ledger.would_exceed(8, leak)  # others are unaffected
    with pytest.raises(BudgetError, match="client 7"):
        ledger.record(7, 3, 2, 5.0)
    assert ledger.total(7) == pytest.approx(0.8)
    exact = MetricLedger(cap=1.2)  # 3 x 0.4 sums to 1.2000000000000002: rounding is allowed
    for t in (1, 2, 3):
        exact.record(0, t, 2, 5.0)
    assert exact.would_exceed(0, leak)


def test_bad_input() -> None:
    ledger = MetricLedger()
    with pytest.raises(PrivacyConfigError):
        MetricLedger(cap=0)
    with pytest.raises(PrivacyConfigError):
        ledger.record(0, 2, 2, 0.0)
    with pytest.raises(PrivacyConfigError):
        ledger.record(0, 2, 0, 5.0)


def test_state_round_trip_and_client_rows() -> None:
    ledger = MetricLedger(cap=3.0)
    _paper_run(ledger, seed=3, clients=10, rounds=4)
    back = MetricLedger.from_state(ledger.state_dict())
    assert back.rows() == ledger.rows() and back.cap == 3.0
    rows = ledger.client_rows(range(12))
    assert [r["client_id"] for r in rows] == list(range(12))
    assert rows[11] == {"client_id": 11, "leakage": 0.0, "releases": 0}
    assert all(r["leakage"] == pytest.approx(0.4 * r["releases"]) for r in rows)


def test_max_leakage_per_cluster_by_hand(tmp_path) -> None:
    ledger = MetricLedger()
    for client, t in [(0, 1), (1, 2), (1, 3), (2, 3), (0, 5)]:
        ledger.record(client, t, 2, 5.0)
    clusters = [0, 0, 1, 1]  # client 3 never releases
    table = max_leakage_per_cluster(ledger.rows(), clusters, rounds=6)
    got = table.pivot(index="round", columns="cluster", values="max_leakage")
    np.testing.assert_allclose(got[0], [0.4, 0.4, 0.8, 0.8, 0.8, 0.8])  # client 1 leads from 3
    np.testing.assert_allclose(got[1], [0, 0, 0.4, 0.4, 0.4, 0.4])
    out = tmp_path / "leakage.png"
    plotted = plot_max_leakage(ledger.rows(), clusters, out)
    assert out.stat().st_size > 1000 and plotted["round"].max() == 5
    empty = max_leakage_per_cluster([], clusters, rounds=2)
    assert (empty["max_leakage"] == 0).all() and len(empty) == 4
