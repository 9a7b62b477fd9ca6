"""Client sampling for a round: Poisson (each client independently with rate q) or a fixed-size
cohort of round(q*N) drawn without replacement. The accountant charges the matching
amplification (privacy.accounting), so the scheme here and there must agree."""

from __future__ import annotations

import numpy as np


def sample_cohort(
    num_clients: int, rate: float, scheme: str, rng: np.random.Generator
) -> np.ndarray:
    if rate >= 1.0:
        return np.arange(num_clients)
    if scheme == "poisson":
        return np.flatnonzero(rng.random(num_clients) < rate)
    if scheme == "without_replacement":
        return np.sort(rng.choice(num_clients, size=cohort_size(num_clients, rate), replace=False))
    raise ValueError(f"training.sampling: unknown scheme {scheme!r}")


def cohort_size(num_clients: int, rate: float) -> int:
    return max(1, round(rate * num_clients))


def dropout_rates(setting: float | list[float], true_clusters: np.ndarray) -> np.ndarray:
    """Each client's probability of being unavailable in a round (``training.client_dropout``:
    one number, or one per true cluster). The truth is the simulated world's, used here to
    decide who is unavailable; the algorithm never sees it."""
    truth = np.asarray(true_clusters, dtype=np.int64)
    if isinstance(setting, list):
        return np.asarray(setting, dtype=np.float64)[truth]
    return np.full(truth.shape, float(setting))


def unavailable(
    rates: np.ndarray,
    rng: np.random.Generator,
    before: np.ndarray | None = None,
    correlation: float = 0.0,
) -> np.ndarray:
    """Which clients of the population are unavailable this round (``training.client_dropout``):
    one uniform draw per client of the population, whoever was sampled, so a client's fate does
    not depend on who else was, and a run with dropout thins the very cohorts of the run without
    it. Rounds follow a two-state Markov chain per client: ``before`` is last round's (None: the
    first round, drawn at the long-run rate); at ``correlation`` rho an unavailable client stays
    so with p + rho (1 - p) and an available one drops with p (1 - rho), so the stationary rate
    is p and the lag-1 correlation rho (0: independent rounds, each client away with p).

    Privacy: the chain ignores the data, so whatever path it takes each round is a thinning of
    the planned sample, and the accounting of the sampling as planned stays valid and is
    conservative (a Poisson client reports at rate q (1 - p) <= q; a subset of a fixed-size
    cohort still differs in one client at most). It holds for every path, so for the mixture."""
    p = np.asarray(rates, dtype=np.float64)
    draws = rng.random(len(p))
    if before is None or correlation == 0:
        return draws < p
    stay, enter = p + correlation * (1.0 - p), p * (1.0 - correlation)
    return draws < np.where(before, stay, enter)


def report_count_pmf(rates: np.ndarray, rate: float, scheme: str) -> np.ndarray | None:
    """The distribution of a round's number of reporting clients (index: the count), for
    clients unavailable at ``rates`` (one per client of the population), closed form: Poisson
    sampling makes each client report independently at q (1 - p_i), a sum of one binomial per
    distinct rate; a fixed cohort of m with one rate p is Binomial(m, 1 - p). None where there is
    no such closed form here (a fixed cohort with rates that differ by cluster)."""
    from scipy.stats import binom  # not at import: the driver's start-up does not need it

    rates = np.asarray(rates, dtype=np.float64)
    n = len(rates)
    if rate < 1.0 and scheme == "without_replacement":
        if np.unique(rates).size > 1:
            return None
        m = cohort_size(n, rate)
        return binom.pmf(np.arange(m + 1), m, 1.0 - rates[0])
    q = min(rate, 1.0)
    pmf = np.ones(1)
    for p in np.unique(rates):
        k = int(np.count_nonzero(rates == p))
        pmf = np.convolve(pmf, binom.pmf(np.arange(k + 1), k, q * (1.0 - p)))
    return pmf
