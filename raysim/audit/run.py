"""`raysim audit`: canaries through a privacy mode's release path, scored from the server's view,
and an empirical lower bound on epsilon beside the epsilon the ledger claims.

``runs == 1``: the one-run audit (Steinke et al. 2023) with ``canaries`` canaries, each included
with probability 1/2 in one release. ``runs > 1``: the multi-run audit, one canary included with
probability 1/2 in each of ``runs`` independent releases (each seeded by (seed, run, purpose)).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from raysim.audit import PARTICIPATION
from raysim.audit.bounds import Bound, multi_run_bound, one_run_bound
from raysim.audit.canaries import TARGETS, Target
from raysim.config import ConfigError
from raysim.seeding import SERVER, numpy_rng


@dataclass
class AuditResult:
    mode: str
    method: str
    view: str
    participation: str
    claimed_epsilon: float
    lower_bound: float
    confidence: float
    delta: float
    canaries: int
    runs: int
    seconds: float
    claim_note: str = ""
    threshold: float | None = None
    guesses: int | None = None
    correct: int | None = None
    adversary: str = "white-box"  # or "black-box": the final models only (audit.blackbox)

    @property
    def tightness(self) -> float:
        """The bound over the claim (1: the claim is met exactly by an attack)."""
        if not math.isfinite(self.claimed_epsilon) or self.claimed_epsilon <= 0:
            return float("nan")
        return self.lower_bound / self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tightness": self.tightness}

    def line(self) -> str:
        claim = "∞" if not math.isfinite(self.claimed_epsilon) else f"{self.claimed_epsilon:.3g}"
        if self.adversary != "white-box":
            return (
                f"audit ({self.mode}, {self.method}, {self.adversary} adversary, view: "
                f"{self.view}): eps >= {self.lower_bound:.3g} at {100 * self.confidence:g}% "
                f"confidence (delta {self.delta:g}) against claimed {claim}"
            )
        return (
            f"audit ({self.mode}, {self.method}, {self.participation} participation, "
            f"view: {self.view}): eps >= {self.lower_bound:.3g} at {100 * self.confidence:g}% "
            f"confidence (delta {self.delta:g}) against claimed {claim}"
        )


def make_target(prep: Any, seed: int, canaries: int, participation: str) -> Target:
    """The configured mode's target, built from the prepared algorithm's own (calibrated) mode."""
    mode = prep.mode
    dim = int(prep.env.init_weights.numel())
    cls = TARGETS.get(mode.name)
    if cls is None:
        raise ConfigError(f"privacy.mode: the audit knows no mode {mode.name!r}")
    if mode.name == "client" and mode.plan.sampling != "poisson":
        raise ConfigError(
            "training.sampling: the audit's canary is added or removed (Poisson sampling); "
            "set training.sampling=poisson"
        )
    limit = dim // 2 if mode.name == "dprivacy" else dim
    if canaries > limit:
        raise ConfigError(
            f"--canaries: at most {limit} orthogonal canaries fit this model "
            f"(dimension {dim}), got {canaries}"
        )
    kw: dict[str, Any] = {}
    if mode.name == "dprivacy":
        kw["claim"] = prep.cfg.privacy.epsilon or 2.0
    return cls(mode, dim, seed, canaries, participation, **kw)


def audit(
    prep: Any,
    canaries: int = 1,
    runs: int = 1000,
    seed: int = 0,
    participation: str = "hidden",
    confidence: float = 0.95,
    progress: Callable[[int], None] | None = None,
) -> tuple[AuditResult, dict[str, np.ndarray]]:
    """Audit the prepared experiment's mechanism; returns the result and its rows (one per
    canary of the one-run audit, one per run of the multi-run audit)."""
    if participation not in PARTICIPATION:
        raise ConfigError(
            f"--participation: one of {', '.join(PARTICIPATION)}, got {participation!r}"
        )
    if runs < 1:
        raise ConfigError(f"--runs: at least 1, got {runs}")
    if canaries < 1 or (runs > 1 and canaries != 1):
        raise ConfigError(
            f"--canaries: at least 1 with --runs 1 (one run); the multi-run audit (--runs > 1) "
            f"puts 1 canary in each run, got {canaries}"
        )
    if runs == 1 and canaries < 2:
        raise ConfigError("--canaries: the one-run audit (--runs 1) needs at least 2")
    t0 = time.perf_counter()
    target = make_target(prep, seed, canaries, participation)
    delta = prep.cfg.privacy.delta
    membership = numpy_rng(seed, 0, SERVER, "audit_membership")
    if runs == 1:
        included = membership.random(canaries) < 0.5
        scores = target.scores(included, 1)
        if progress:
            progress(1)
        bound: Bound = one_run_bound(scores, included, delta, confidence)
    else:
        included = membership.random(runs) < 0.5
        scores = np.empty(runs)
        for r in range(runs):
            scores[r] = target.scores(included[r : r + 1], r + 1)[0]
            if progress:
                progress(1)
        if included.all() or not included.any():
            raise ConfigError(f"--runs: {runs} runs gave no run without (or with) the canary")
        bound = multi_run_bound(scores[included], scores[~included], delta, confidence)
    claimed = float(target.claimed())
    result = AuditResult(
        mode=target.mode.name,
        method=bound.method,
        view=target.view,
        participation=participation,
        claimed_epsilon=claimed,
        lower_bound=bound.epsilon,
        confidence=confidence,
        delta=delta,
        canaries=canaries,
        runs=runs,
        seconds=time.perf_counter() - t0,
        claim_note=target.claim_note,
        threshold=bound.threshold,
        guesses=bound.guesses,
        correct=bound.correct,
    )
    rows = {"index": np.arange(len(scores)), "included": included, "score": scores}
    return result, rows
