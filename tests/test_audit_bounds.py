"""The audit's bounds against closed forms: Clopper-Pearson at zero successes, the one-run
p-value at delta 0 (a binomial tail) and at v = r (q^r), randomized response (an exactly eps-DP
mechanism whose optimal test is known), and the Gaussian mechanism, whose true eps(delta) comes
from dp_accounting's PLD accountant (Balle and Wang's analytic Gaussian, independently of the
bound)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats

from raysim.audit.bounds import (
    clopper_pearson_upper,
    eps_from_rates,
    multi_run_bound,
    one_run_bound,
    one_run_epsilon,
    one_run_p_value,
    threshold_bounds,
)


def gaussian_eps(mu: float, delta: float) -> float:
    """True eps(delta) of the Gaussian mechanism with sensitivity/std = mu (PLD, tight)."""
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.GaussianDpEvent(1.0 / mu))
    return float(acc.get_epsilon(delta))


def test_clopper_pearson_closed_form_at_zero_and_all():
    n, alpha = 1000, 0.05
    assert clopper_pearson_upper(0, n, alpha) == pytest.approx(1 - alpha ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(n, n, alpha) == 1.0
    # k successes: the rate whose binomial CDF at k is alpha
    hi = float(clopper_pearson_upper(37, n, alpha))
    assert stats.binom.cdf(37, n, hi) == pytest.approx(alpha, rel=1e-6)


def test_eps_from_rates_is_the_dp_inequality():
    assert eps_from_rates(0.01, 0.5, 0.0) == pytest.approx(math.log(50))
    assert eps_from_rates(0.5, 0.01, 0.0) == pytest.approx(math.log(50))  # the symmetric term
    assert eps_from_rates(0.5, 0.5, 0.0) == 0.0
    assert eps_from_rates(0.01, 0.5, 0.1) == pytest.approx(math.log(40))


def test_exact_gaussian_rates_never_exceed_the_true_epsilon():
    """At the exact rates of every threshold test, the bound is at most eps(delta), and the
    best threshold comes close to it (the Neyman-Pearson test of a Gaussian pair)."""
    mu, delta = 1.0, 1e-5
    truth = gaussian_eps(mu, delta)
    t = np.linspace(-3, 9, 2000)
    eps = eps_from_rates(stats.norm.sf(t), stats.norm.cdf(t - mu), delta)
    assert eps.max() <= truth + 1e-9
    assert eps.max() >= 0.9 * truth


def test_one_run_p_value_closed_forms():
    m, r, v, eps = 1000, 100, 70, 1.0
    p = 1 / (1 + math.exp(-eps))
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, p))
    # the delta term adds 2 m delta max_i P[v - i <= Bin < v] / i
    worst = max(
        sum(stats.binom.pmf(v - j, r, p) for j in range(1, i + 1)) / i for i in range(1, v + 1)
    )
    want = stats.binom.sf(v - 1, r, p) + 2 * m * 1e-6 * worst
    assert one_run_p_value(m, r, v, eps, 1e-6) == pytest.approx(want)
    # every guess right, delta 0: P = q^r < alpha  <=>  eps < log(q / (1 - q)), q = alpha^(1/r)
    q = 0.05 ** (1 / 50)
    assert one_run_epsilon(1000, 50, 50, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), 1e-6)


def test_one_run_bound_on_randomized_response():
    """Randomized response at eps0 is exactly eps0-DP: the bound stays below and gets close."""
    rng = np.random.default_rng(0)
    eps0, m = 1.0, 20_000
    included = rng.random(m) < 0.5
    truthful = rng.random(m) < math.exp(eps0) / (1 + math.exp(eps0))
    scores = np.where(truthful, included, ~included).astype(float) + 1e-3 * rng.random(m)
    b = one_run_bound(scores, included, 0.0, 0.95)
    assert b.epsilon <= eps0
    assert b.epsilon >= 0.85 * eps0


def test_multi_run_bound_on_the_gaussian_mechanism():
    rng = np.random.default_rng(1)
    mu, delta, n = 1.0, 1e-5, 50_000
    b = multi_run_bound(rng.normal(mu, 1, n), rng.normal(0, 1, n), delta, 0.95)
    truth = gaussian_eps(mu, delta)
    assert b.epsilon <= truth
    assert b.epsilon >= 0.5 * truth


def test_multi_run_bound_holds_at_its_confidence():
    """Randomized response at eps0 audited 200 times: the bound passes eps0 in at most ~5%."""
    eps0, n = 1.0, 400
    p = math.exp(eps0) / (1 + math.exp(eps0))
    over = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        s_in = (rng.random(n) < p).astype(float)
        s_out = (rng.random(n) < 1 - p).astype(float)
        over += multi_run_bound(s_in, s_out, 0.0, 0.95).epsilon > eps0
    assert over <= 20  # 5% of 200 is 10; binomial slack


def test_threshold_bounds_count_ties_as_in_and_split_the_confidence():
    """50 in at exactly t, 50 out below it: no error seen; each rate's bound at alpha / 2."""
    b = threshold_bounds(np.ones(50), np.zeros(50), np.array([1.0]), 0.0, 0.9)
    hi = 1 - 0.05 ** (1 / 50)
    assert b[0] == pytest.approx(math.log((1 - hi) / hi))
