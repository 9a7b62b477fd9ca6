"""PINA's normality-driven aggregation step: does a cluster's noisy aggregate hold any signal?

Under distributed DP the server sees each cluster's aggregate plus Gaussian noise. When a cluster
is empty or nearly so, that aggregate is (almost) pure noise and applying it makes the cluster's
model random-walk. A Shapiro-Wilk test (``scipy.stats.shapiro``) of the aggregate's coordinates
tells the two apart: i.i.d. Gaussian noise is normal, while a real update (heavy-tailed, sparse,
structured coordinates) added to it is not. The test runs on a seeded subsample of at most 5000
coordinates, the largest size for which scipy's p-value is accurate. It only post-processes a
released value, so it costs no privacy.

Rules (the paper gives only the idea; these are the readings offered, documented in the PINA
issue):

* ``"gate"`` (default): weight 0 when ``p >= alpha`` (indistinguishable from the DP noise: do not
  apply), else 1.
* ``"sw_weight"``: weight ``W``, the Shapiro-Wilk statistic, literally "weight by W". Measured
  here: ``W`` stays >= 0.99 at d = 5000 even when the test rejects, so this rule is close to
  ``"off"``; it is offered for comparison, not as a recommendation.
* ``"off"``: always 1 (plain aggregation; the test is still run and recorded).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, NamedTuple

import numpy as np

NormalityRule = Literal["gate", "sw_weight", "off"]
RULES: tuple[str, ...] = ("gate", "sw_weight", "off")
MAX_SAMPLE = 5000  # scipy.stats.shapiro: the p-value may be inaccurate above N = 5000


class NormalityResult(NamedTuple):
    """``W``, its p-value and the weight the rule gives (record all three per cluster/round)."""

    statistic: float
    pvalue: float
    weight: float


def subsample(x: np.ndarray, rng: np.random.Generator, size: int = MAX_SAMPLE) -> np.ndarray:
    """At most ``size`` coordinates of ``x`` drawn without replacement (all of them if fewer)."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    if flat.size <= size:
        return flat
    return flat[rng.choice(flat.size, size=size, replace=False)]


def normality_weight(
    aggregate: np.ndarray,
    rng: np.random.Generator,
    rule: NormalityRule = "gate",
    alpha: float = 0.05,
    max_sample: int = MAX_SAMPLE,
) -> NormalityResult:
    """Shapiro-Wilk test of a cluster's noisy aggregate and the weight ``rule`` gives it.

    ``rng`` draws the subsample: seed it by (run seed, round, server, purpose naming the
    cluster) so the result is reproducible. With fewer than 3 coordinates no test is possible:
    W and p are NaN and the weight is 1 under every rule.
    """
    if rule not in RULES:
        raise ValueError(f"normality rule must be one of {', '.join(RULES)}, got {rule!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"normality alpha must be in (0, 1), got {alpha}")
    if not 3 <= max_sample <= MAX_SAMPLE:
        raise ValueError(f"max_sample must be in [3, {MAX_SAMPLE}], got {max_sample}")
    sample = subsample(aggregate, rng, max_sample)
    if not np.all(np.isfinite(sample)):
        raise ValueError("the aggregate holds non-finite values")
    if sample.size < 3:
        return NormalityResult(math.nan, math.nan, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on a constant input (range zero): W = 1
        from scipy import stats  # imported where used: ~0.4 s for every process otherwise

        w, p = stats.shapiro(sample)
    w, p = float(w), float(p)
    if rule == "gate":
        weight = 0.0 if p >= alpha else 1.0
    elif rule == "sw_weight":
        weight = w
    else:
        weight = 1.0
    return NormalityResult(w, p, weight)
