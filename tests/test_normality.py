"""The Shapiro-Wilk rule of PINA's aggregation: false alarms on pure noise, power on a signal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from raysim.seeding import SERVER, numpy_rng
from raysim.server.normality import MAX_SAMPLE, normality_weight, subsample

D = 5000


def test_pure_gaussian_noise_is_flagged_at_about_alpha():
    """1000 trials at alpha = 0.05: the false-alarm rate must lie in 2-7% (acceptance)."""
    rng = numpy_rng(0, 0, SERVER, "normality-null")
    flagged = sum(normality_weight(rng.normal(0.0, 3.0, D), rng).weight == 1.0 for _ in range(1000))
    assert 20 <= flagged <= 70, flagged


def test_a_laplace_signal_as_strong_as_the_noise_is_flagged():
    """200 trials: signal norm = noise norm, flagged (weight 1) in >= 99% (acceptance)."""
    rng = numpy_rng(0, 0, SERVER, "normality-alt")
    flagged = 0
    for _ in range(200):
        noise = rng.normal(0.0, 2.0, D)
        signal = rng.laplace(0.0, 1.0, D)
        signal *= np.linalg.norm(noise) / np.linalg.norm(signal)
        flagged += normality_weight(signal + noise, rng).weight == 1.0
    assert flagged >= 198, flagged


def test_rules_and_the_recorded_statistic():
    rng = np.random.default_rng(1)
    noise = rng.standard_normal(D)
    signal = noise + rng.laplace(size=D) * 3
    for x in (noise, signal):
        w, p, gate = normality_weight(x, np.random.default_rng(2), "gate")
        ref = stats.shapiro(x)  # d = 5000: the whole vector is tested
        assert (w, p) == (float(ref.statistic), float(ref.pvalue))
        assert gate == (0.0 if p >= 0.05 else 1.0)
        assert normality_weight(x, np.random.default_rng(2), "sw_weight").weight == w
        assert normality_weight(x, np.random.default_rng(2), "off") == (w, p, 1.0)
    assert normality_weight(noise, rng, "gate", alpha=0.01).pvalue > 0.01
    assert normality_weight(noise, rng).weight == 0.0  # this draw: p >= 0.05, not applied
    assert normality_weight(signal, rng).weight == 1.0


def test_large_aggregates_are_subsampled_with_the_callers_seed():
    x = np.random.default_rng(3).standard_normal(50_000)
    a = normality_weight(x, numpy_rng(7, 3, SERVER, "normality/0"))
    b = normality_weight(x, numpy_rng(7, 3, SERVER, "normality/0"))
    c = normality_weight(x, numpy_rng(7, 3, SERVER, "normality/1"))
    assert a == b and a != c
    sub = subsample(x, numpy_rng(7, 3, SERVER, "normality/0"))
    assert sub.size == MAX_SAMPLE and np.isin(sub, x).all() and np.unique(sub).size == MAX_SAMPLE
    assert a.statistic == float(stats.shapiro(sub).statistic)


def test_edge_cases_and_bad_arguments():
    rng = np.random.default_rng(0)
    w, p, weight = normality_weight(np.array([1.0, 2.0]), rng)
    assert math.isnan(w) and math.isnan(p) and weight == 1.0
    assert normality_weight(np.zeros(100), rng).weight == 0.0  # nothing to apply
    with pytest.raises(ValueError, match="gate, sw_weight, off"):
        normality_weight(np.ones(10), rng, rule="kurtosis")
    with pytest.raises(ValueError, match="alpha"):
        normality_weight(np.ones(10), rng, alpha=1.5)
    with pytest.raises(ValueError, match="non-finite"):
        normality_weight(np.array([1.0, np.nan, 2.0, 3.0]), rng)
