"""Empirical lower bounds on epsilon from membership guesses on canaries.

Two standard audits, each a valid lower bound at the stated one-sided confidence: if the
mechanism were (eps, delta)-DP for an eps below the bound, outcomes as extreme as those observed
would have probability under ``1 - confidence``.

* Multi-run (Jagielski et al. 2020, "Auditing differentially private machine learning"; Nasr
  et al. 2021, "Adversary instantiation"; Nasr et al. 2023, "Tight auditing"): independent runs
  with and without the canary; a threshold test on the scores; Clopper-Pearson upper bounds on
  its false-positive and false-negative rates; (eps, delta)-DP implies
  ``FPR * e^eps + delta >= 1 - FNR`` and the same with the two swapped, so
  ``eps >= log((1 - delta - FNR_hi) / FPR_hi)``.
* One run (Steinke, Nasr and Jagielski 2023, "Privacy auditing with one (1) training run",
  Theorem 3.3 / Algorithm 2): m canaries, each included independently with probability 1/2;
  the auditor guesses "in" on the top scores and "out" on the bottom ones (abstaining on the
  rest); under (eps, delta)-DP the number of correct guesses out of r is stochastically
  dominated by Binomial(r, e^eps / (1 + e^eps)) up to a delta term.

Choosing the threshold (or the number of guesses) on the very scores that are then bounded
would overstate the confidence: the multi-run audit picks its threshold on one part of the runs
and bounds it on the others; the one-run audit tries a fixed grid of guess counts, each at the
confidence split over the grid (Bonferroni).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

# the shares of m the one-run audit guesses on, at each end (fixed before any score is seen)
ONE_RUN_GUESS_SHARES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound of a binomial rate: k successes in n trials; the
    true rate is below it with probability at least 1 - alpha."""
    k = np.asarray(k, dtype=np.float64)
    if n <= 0:
        return np.ones_like(k)
    hi = stats.beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, hi)


def eps_from_rates(fpr_hi: np.ndarray, fnr_hi: np.ndarray, delta: float) -> np.ndarray:
    """The epsilon that rates bounded by ``fpr_hi``, ``fnr_hi`` force at ``delta``: the larger
    of log((1 - delta - FNR) / FPR) and log((1 - delta - FPR) / FNR); 0 where neither is > 0."""
    fpr_hi, fnr_hi = np.asarray(fpr_hi, float), np.asarray(fnr_hi, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log((1.0 - delta - fnr_hi) / fpr_hi)
        b = np.log((1.0 - delta - fpr_hi) / fnr_hi)
    out = np.fmax(np.nan_to_num(a, nan=0.0, neginf=0.0), np.nan_to_num(b, nan=0.0, neginf=0.0))
    return np.maximum(out, 0.0)


def threshold_bounds(
    scores_in: np.ndarray,
    scores_out: np.ndarray,
    thresholds: np.ndarray,
    delta: float,
    confidence: float,
) -> np.ndarray:
    """eps lower bound of the test "in if score >= t", for each threshold t, from these scores.
    Each of the two Clopper-Pearson bounds holds at (1 + confidence) / 2, so both together at
    ``confidence``."""
    alpha = (1.0 - confidence) / 2.0
    s_in, s_out = np.sort(np.asarray(scores_in, float)), np.sort(np.asarray(scores_out, float))
    t = np.asarray(thresholds, float)
    fp = len(s_out) - np.searchsorted(s_out, t, side="left")  # out scored >= t
    fn = np.searchsorted(s_in, t, side="left")  # in scored < t
    fpr_hi = clopper_pearson_upper(fp, len(s_out), alpha)
    fnr_hi = clopper_pearson_upper(fn, len(s_in), alpha)
    return eps_from_rates(fpr_hi, fnr_hi, delta)


@dataclass(frozen=True)
class Bound:
    """An audit's result: the lower bound and how it was reached."""

    epsilon: float
    method: str
    confidence: float
    delta: float
    threshold: float | None = None  # multi-run: the test's threshold
    guesses: int | None = None  # one-run: r guesses, v of them right
    correct: int | None = None


def multi_run_bound(
    scores_in: np.ndarray,
    scores_out: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    select_share: float = 0.25,
) -> Bound:
    """Multi-run audit: the threshold is chosen on the first ``select_share`` of each side's
    runs (by the bound it gives there), then bounded on the rest alone, so the confidence holds
    for the threshold chosen (the runs are exchangeable: order is the order they ran in)."""
    s_in, s_out = np.asarray(scores_in, float), np.asarray(scores_out, float)
    if len(s_in) < 2 or len(s_out) < 2:
        raise ValueError("the multi-run audit needs at least 2 runs with and 2 without")
    k_in, k_out = max(1, int(len(s_in) * select_share)), max(1, int(len(s_out) * select_share))
    sel_in, sel_out = s_in[:k_in], s_out[:k_out]
    candidates = np.unique(np.concatenate([sel_in, sel_out]))
    if len(candidates) > 4000:  # quantiles of the pooled scores: the choice needs no more
        candidates = np.quantile(candidates, np.linspace(0, 1, 4000))
    chosen = threshold_bounds(sel_in, sel_out, candidates, delta, confidence)
    t = float(candidates[int(np.argmax(chosen))])
    eps = float(threshold_bounds(s_in[k_in:], s_out[k_out:], np.array([t]), delta, confidence)[0])
    return Bound(eps, "multi_run", confidence, delta, threshold=t)


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke et al. (2023), Theorem 3.3: the probability, under an (eps, delta)-DP mechanism,
    of at least v correct guesses out of r on m canaries included with probability 1/2:
    P[Bin(r, p) >= v] + 2 m delta max_{1<=i<=v} P[v - i <= Bin(r, p) < v] / i,
    p = e^eps / (1 + e^eps)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-eps))
    tail = float(stats.binom.sf(v - 1, r, p))
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)  # pmf(v-1), pmf(v-2), ..., pmf(0)
    worst = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * worst)


def one_run_epsilon(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """The largest eps whose p-value is still below ``alpha`` (Algorithm 2: bisection; the
    p-value grows with eps): (eps, delta)-DP is rejected for every smaller eps."""
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < alpha:
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:
            return lo
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) < alpha else (lo, mid)
    return lo


def one_run_bound(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    shares: tuple[float, ...] = ONE_RUN_GUESS_SHARES,
) -> Bound:
    """One-run audit: for each share s of the grid, guess "in" on the top s*m scores and "out"
    on the bottom s*m, and bound it at alpha / len(grid) (Bonferroni over the grid); the best
    of the grid is a lower bound at ``confidence``."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    m = len(scores)
    order = np.argsort(scores, kind="stable")
    alpha = (1.0 - confidence) / len(shares)
    best = Bound(0.0, "one_run", confidence, delta, guesses=0, correct=0)
    for share in shares:
        k = min(int(share * m), m // 2)
        if k < 1:
            continue
        v = int(included[order[m - k :]].sum() + (~included[order[:k]]).sum())
        eps = one_run_epsilon(m, 2 * k, v, delta, alpha)
        if eps > best.epsilon:
            best = Bound(eps, "one_run", confidence, delta, guesses=2 * k, correct=v)
    return best
