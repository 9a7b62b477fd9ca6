"""`raysim privacy`: what a config will spend, computed without training.

It replays the privacy mode's planned per-round charges with every client taking part in every
round and making every choice it may make (the worst case, which is what calibration bounds)
through the same ledger a run uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raysim.privacy import PrivacyLedger


def privacy_report(prep: Any) -> dict[str, Any]:
    cfg, algo, env = prep.cfg, prep.algorithm, prep.env
    p = cfg.privacy
    out: dict[str, Any] = {"mode": p.mode, "delta": p.delta, "target_epsilon": p.epsilon}
    out.update(algo.privacy_summary())
    out.setdefault("noise_multiplier", None)
    if p.mode == "none":
        out.update(epsilon=float("inf"), epsilon_per_round={})
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
        for charge in algo.privacy.planned_charges(r, everyone, selecting):
            ledger.charge(r, charge.clients, charge.mechanism, charge.event, charge.params)
        for n, client in groups.items():
            per_round[f"train_size={n}"].append(ledger.epsilon(client))
    out["epsilon"] = max(v[-1] for v in per_round.values())
    out["epsilon_per_round"] = per_round
    return out
