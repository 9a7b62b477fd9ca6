"""`raysim privacy`: what a config will spend, computed without training.

It replays the privacy mode's planned per-round charges with every client taking part in every
round and making every choice it may make (the worst case, which is what calibration bounds)
through the same ledger a run uses.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raysim.privacy import PrivacyLedger
from raysim.privacy.sampling import dropout_rates, report_count_pmf

# what each eps holds under, where a run has both (distributed: the noise-cohort eps assumes the
# cohort's participation is hidden from the server; the other is the same noise, no sampling)
AMPLIFIED_LABEL = "amplified by sampling, participation hidden"
UNAMPLIFIED_LABEL = "no amplification"
EPSILON_LABELS = {
    "epsilon": f"{AMPLIFIED_LABEL}: amplified by Poisson sampling at noise_cohort_size/population",
    "epsilon_unamplified": f"{UNAMPLIFIED_LABEL}: the same noise, every secure sum composed "
    "(what holds where the server sees who took part)",
}


def both_epsilons(eps: str, unamplified: str) -> str:
    """A distributed run's two eps, already formatted, each labelled with what it assumes."""
    return f"{eps} ({AMPLIFIED_LABEL}) / {unamplified} ({UNAMPLIFIED_LABEL})"


def privacy_report(prep: Any, schedule: bool = True) -> dict[str, Any]:
    """Planned spend; ``schedule`` adds eps after every round per train size (long)."""
    cfg, algo, env, mode = prep.cfg, prep.algorithm, prep.env, prep.mode
    p = cfg.privacy
    out: dict[str, Any] = {"mode": p.mode, "delta": p.delta, "target_epsilon": p.epsilon}
    out.update(prep.privacy_summary)
    out.setdefault("noise_multiplier", None)
    if not mode.private:
        out.update(epsilon=float("inf"), epsilon_per_round={})
        return out
    if mode.metric:  # metric leakage, not (eps, delta): n / nu per release
        per_release = mode.release_leakage(int(env.init_weights.numel()))
        out.update(
            rounds=cfg.rounds,
            leakage_per_release=per_release,
            leakage_worst_case=per_release * cfg.rounds,
            leakage_cap=p.leakage_cap,
        )
        return out
    ledger = PrivacyLedger(delta=p.delta, accountant=p.accountant, budget=None)
    everyone = list(range(len(env.train_sizes)))
    # One representative client per train size: clients of one size spend alike.
    groups = {
        int(n): int(np.flatnonzero(env.train_sizes == n)[0]) for n in np.unique(env.train_sizes)
    }
    per_round: dict[str, list[float]] = {f"train_size={n}": [] for n in groups}
    for r in range(1, cfg.rounds + 1):
        # Choices only known at run time (R-DPCFL's selections): the worst case the plan reserved.
        selecting = everyone if algo.may_select(r) else []
        for charge in mode.planned_charges(r, everyone, selecting):
            ledger.charge(r, charge.clients, charge.mechanism, charge.event, charge.params)
        for n, client in groups.items():
            per_round[f"train_size={n}"].append(ledger.epsilon(client))
    if np.any(
        cfg.training.client_dropout
    ):  # raysim.privacy.sampling.unavailable: why this is sound
        out["client_dropout"] = (
            f"{cfg.training.client_dropout}: accounted as if every sampled client reported "
            "(unavailable clients only spend less)"
        )
    short = _short_of_shares(prep)
    if short is not None:
        out["rounds_short_of_shares"] = short
    out["epsilon"] = max(v[-1] for v in per_round.values())
    out["rounds"] = cfg.rounds
    out["clients"] = int(len(env.train_sizes))
    out["train_sizes"] = sorted(groups)
    if schedule:
        out["epsilon_per_round"] = per_round
    return out


def _short_of_shares(prep: Any) -> str | None:
    """Under per-client noise shares, how often a round has fewer members than the shares were
    sized for (``privacy.dropout_tolerance``) and so is topped up or aborted
    (``privacy.shortfall``), in closed form (raysim.privacy.sampling.report_count_pmf)."""
    cfg, mode = prep.cfg, prep.mode
    if cfg.privacy.mode != "distributed" or cfg.privacy.noise_source != "clients":
        return None
    t = cfg.training
    pmf = report_count_pmf(dropout_rates(t.client_dropout, prep.truth), t.sampling_rate, t.sampling)
    outcome = "aborts" if cfg.privacy.shortfall == "abort" else "is topped up by the aggregator"
    needed = mode.share_cohort
    if pmf is None:
        return f"a round with fewer than {needed:.4g} members {outcome}"
    p = float(pmf[: math.ceil(needed)].sum())
    return f"P = {p:.3g} per round (fewer than {needed:.4g} members: the round {outcome})"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list) and len(value) > 8:
        return f"{len(value)} values, {_fmt(value[0])} .. {_fmt(value[-1])}"
    return str(value)


def format_report(report: dict[str, Any]) -> str:
    """A few lines a person reads: what is spent, by what noise; the schedule is in --json."""
    if report["mode"] == "none":
        return "privacy.mode none: no differential privacy, eps = ∞ (nothing is accounted)"
    if report["mode"] == "dprivacy":
        return (
            f"privacy.mode dprivacy (metric local DP, nu {report['nu']:g}): each release leaks "
            f"eps * ||delta|| = n / nu = {report['leakage_per_release']:.4g}; a client in every "
            f"one of the {report['rounds']} rounds leaks {report['leakage_worst_case']:.4g} in "
            f"total (cap: {_fmt(report['leakage_cap'])}). Not (eps, delta)-DP: the noise scale "
            "reveals ||delta||, and the cluster choice is public."
        )
    eps = _fmt(report["epsilon"])
    unamplified = report.get("planned_epsilon_unamplified")
    if unamplified is not None:  # distributed: both, each with what it assumes
        eps = both_epsilons(eps, _fmt(unamplified))
    lines = [
        f"privacy.mode {report['mode']}: eps {eps} at delta "
        f"{report['delta']:g} over {report.get('rounds', '?')} rounds (target "
        f"{_fmt(report['target_epsilon'])}; the worst case: every round charged to every "
        "client, at its sampling rate where clients are sampled)",
        f"noise multiplier: {_fmt(report.get('noise_multiplier'))}",
    ]
    skip = {"mode", "epsilon", "delta", "rounds", "target_epsilon", "noise_multiplier"}
    skip |= {"epsilon_per_round", "planned_epsilon_unamplified"}
    lines += [f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in report.items() if k not in skip]
    lines.append("(eps after every round: raysim privacy CONFIG --json)")
    return "\n".join(lines)
