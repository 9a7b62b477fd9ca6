"""One training of the black-box audit with its canaries in: the engine's in-process round loop,
the rounds, the model each canary's client is judged on, and the claim the run's ledger makes.
Shared by the input-space canaries (``raysim.audit.inputs``) and the canary clients
(``raysim.audit.clients``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.config import ConfigError
from raysim.seeding import SERVER, numpy_rng

CLAIM_NOTE = "the largest epsilon the run's ledger charged a client"


def membership(m: int, seed: int) -> np.ndarray:
    """Canary i is included with probability 1/2, drawn from its own (seed, i, purpose) key."""
    return np.array(
        [numpy_rng(seed, i, SERVER, "audit_canary_in").random() < 0.5 for i in range(m)]
    )


def on_judged_models(prep: Any, plan: Any, by_model: np.ndarray, clients: np.ndarray) -> np.ndarray:
    """Each canary's score on the model its client is judged on (``by_model``: models x
    canaries; a client that picks its model: the best of the released models)."""
    tasks = {t.client_id: t for t in plan.tasks}
    scores = np.empty(len(clients))
    for i, c in enumerate(clients):
        task = tasks.get(int(c))
        if task is None or task.cluster is None:
            raise ConfigError(
                f"algorithm.name: {prep.cfg.algorithm.name} judges client {int(c)} on a personal "
                "model the server never holds: the black-box audit sees released models only"
            )
        scores[i] = by_model[:, i].max() if task.extra.get("select") else by_model[task.cluster, i]
    return scores


def claimed_epsilon(prep: Any, loop: Any) -> float:
    """The largest epsilon the run's ledger charged a client (inf where nothing is accounted)."""
    if not prep.mode.accounts_epsilon:
        return float("inf")
    return float(max(loop.ledger.epsilon(c) for c in range(loop.num_clients)))


@dataclass
class Trained:
    """One training with canaries: every canary's score, the claim the run's ledger makes for
    each canary, and what the rows add (``client``: the client each canary is or joins)."""

    scores: np.ndarray
    claimed: float
    prep: Any
    clients: np.ndarray


def start_loop(
    prep: Any, make_worker: Callable[..., Any] | None = None, absent: np.ndarray | None = None
) -> Any:
    """The engine's in-process round loop for ``prep`` (``absent``: the clients unavailable
    every round, who leave each plan before it runs, the engine's path for a dropped client)."""
    from raysim.runtime.inline import inline_loop

    loop = inline_loop(prep, device="cpu", apart=False, make_worker=make_worker)
    if absent is not None:
        loop.dropout = absent if loop.dropout is None else np.maximum(loop.dropout, absent)
    return loop


def run_rounds(loop: Any, rounds: int, progress: Callable[[int], None] | None) -> Any:
    """The configured rounds (to an early stop); returns the loop."""
    for _ in range(rounds):
        row = loop.step()
        if progress:
            progress(1)
        if row.get("early_stopped"):
            break
    return loop
