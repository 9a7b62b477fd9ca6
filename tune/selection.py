"""What choosing the best of a sweep's trials costs in privacy, which no trial's ledger holds.

A sweep ranks its trials by a metric measured on the clients' data and keeps the best: the choice
is a function of every trial's output, so the chosen model is only as private as all the trials
together. By basic composition it is (sum of the trials' eps, sum of their deltas)-DP, an upper
bound. Papernot and Steinke (2022, "Hyperparameter tuning with Renyi differential privacy") show
that some cost beyond one trial's eps cannot be avoided in general, and that running a random
number of trials (truncated negative binomial or Poisson) bounds it by a small multiple of one
trial's eps. raysim reports the composition bound and leaves the choice of remedy to the user:
tune on public or held-out data, or count the selection in the budget.
"""

from __future__ import annotations

import math
from typing import Any

CITATION = "Papernot and Steinke 2022"


def selection_cost(trials: Any) -> dict[str, Any] | None:
    """The composition bound of choosing among ``trials`` (trials.parquet as a DataFrame: its
    ``epsilon`` spent and ``delta`` per trial), or None where no trial is private."""
    private = trials[trials["epsilon"].notna() & trials["delta"].notna()]
    private = private[private["epsilon"].map(math.isfinite)]
    if private.empty:
        return None
    n = len(private)
    return {
        "trials": n,
        "epsilon_one_trial": float(private["epsilon"].max()),
        "epsilon_selection": float(private["epsilon"].sum()),
        "delta_selection": float(private["delta"].sum()),
        "bound": "basic composition over the trials (an upper bound)",
        "reference": CITATION,
    }


def selection_note(cost: dict[str, Any] | None) -> str | None:
    """One line for the sweep's summary: the eps of the chosen trial once the choice counts."""
    if cost is None or cost["trials"] < 2:
        return None
    return (
        f"privacy of the choice: picking the best of {cost['trials']} private trials uses the "
        f"clients' data in every one of them; the chosen model is "
        f"({cost['epsilon_selection']:.3g}, {cost['delta_selection']:.2g})-DP by composition, "
        f"not the eps {cost['epsilon_one_trial']:.3g} its own ledger shows ({CITATION}: tune "
        "on public or held-out data, or count the choice in the budget)"
    )
