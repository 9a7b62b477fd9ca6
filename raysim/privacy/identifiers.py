"""How much a privatized cluster identifier still says (RR-Cluster diagnostics).

A client's one-hot (clipped to height min(1, C_s)) gets N(0, (C_s z_eff)^2) on each of its k
coordinates and only the argmax is used. What matters is the noise-to-signal ratio
s = noise std / one-hot height (C_s cancels): s = sqrt(2) * z_id under replace-one (fixed
cohorts), z_id under add/remove, where z_id is the accountant's multiplier (std / sensitivity).
The argmax keeps the client's choice with probability

    P(keep) = P(1/s + Z_0 > max_{j=1..k-1} Z_j) = integral phi(x) Phi(x + 1/s)^(k-1) dx,

a k-dimensional Gaussian order statistic, integrated numerically (scipy.integrate.quad).
"""

from __future__ import annotations

import math


def noise_to_signal(id_noise_multiplier: float, replace_one: bool) -> float:
    """s of the identifier Gaussian whose accountant multiplier is ``id_noise_multiplier``."""
    return id_noise_multiplier * (math.sqrt(2.0) if replace_one else 1.0)


def keep_probability(s: float, k: int) -> float:
    """P(noisy argmax == own choice) for k clusters at noise-to-signal s (s = 0: exact)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k == 1 or s == 0:
        return 1.0
    if not math.isfinite(s):
        return 1.0 / k
    mu = 1.0 / s
    from scipy import integrate, stats  # imported where used: ~0.4 s for every process otherwise

    def f(x: float) -> float:
        return stats.norm.pdf(x) * stats.norm.cdf(x + mu) ** (k - 1)

    value, _ = integrate.quad(f, -math.inf, math.inf, epsabs=1e-10, limit=200)
    return float(value)
