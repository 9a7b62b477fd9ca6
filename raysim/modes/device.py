"""What each client's device enforces by itself, whatever the server asks.

Under an untrusted server (``sample``, ``distributed``, ``dprivacy``) the mode's admission
checks and the ledger that refuses a release past the budget run in the server's process. They
bind an honest-but-curious server; a server that deviates from the protocol could skip them and
ask the clients for more. These rules run on the clients' side instead: in the worker, which
stands for the devices (``vet_releases``), and in ``runtime.client_side.ClientSide``, their
memory (``request_digest``). They use only what the driver (the experimenter) gave the clients
before the run: the mode and the algorithm with their calibrated plan.

* A client trains a round at most once, and only a round 1..R of the run. Its noise and batches
  in round r are drawn from (the clients' seed, r, client): two releases of one round made from
  different inputs would share their noise, and their difference would be free of it. A request
  identical to one served already (the same broadcast, task and state: a piece run again after
  its worker died, or the rounds after a restored checkpoint) gives the same bits and is served.
* Every accounted release a client makes in round r must be one its plan holds for it in round
  r (``PrivacyMode.planned_charges``, with a choice where the algorithm may make one then), and
  cost no more: DP-SGD at the planned noise or more and the planned sampling rate and steps or
  fewer; a choice at the planned eps or less; a sketch only in its planned round. (A release
  without an event, metric DP's, costs what the client's own mode sets, whatever the server
  sends: its count is what the first rule bounds, and ``releases_per_client`` under a cap.)

So a client spends at most the plan's worst case (every client in every round), which the run
was checked against before it started. What the clients cannot check is the server's sampling:
under ``sample`` that costs nothing (the worst case assumes no sampling of clients), under
``distributed`` the secure sums' accounting assumes the server draws its cohorts as planned.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np

from raysim.modes.base import client_releases
from raysim.protocol import Charge, ClientReport, ClientTask

RELATIVE_TOLERANCE = 1e-9  # float rounding of a parameter computed twice

# How a release's parameters may differ from the plan's without costing more, per mechanism:
# +1, at least the plan's (noise); -1, at most the plan's (rate, steps, eps). A mechanism not
# listed must carry the planned event itself.
NO_COSTLIER: dict[str, dict[str, int]] = {
    "dpsgd": {"z": +1, "q": -1, "steps": -1},
    "exponential_selection": {"epsilon": -1},
    "local_gaussian_sketch": {"z": +1},
}


class ReleaseRefused(PermissionError):
    """A client would release more than its plan allows: the server asked for what the protocol
    does not hold."""


def broadcast_digest(models: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(models).data, digest_size=16).digest()


def request_digest(broadcast: bytes, task: ClientTask) -> bytes:
    """What decides a client's output in a round, but for its state (which the clients' side
    holds and adds): the broadcast and every field of the task the server sent."""
    fields = (task.client_id, task.cluster, task.train, task.extra)
    blob = pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(broadcast + blob, digest_size=16).digest()


def state_digest(request: bytes, state: Any) -> bytes:
    blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(request + blob, digest_size=16).digest()


def check_round(round: int, rounds: int) -> None:
    if not 1 <= round <= rounds:
        why = f"the run has rounds 1..{rounds}; its clients train in no other"
        raise ReleaseRefused(f"round {round}: {why}")


def vet_releases(mode: Any, round: int, reports: Sequence[ClientReport], may_select: bool) -> None:
    """Refuse the round's replies if a release is not one the plan holds for its client: each
    planned charge covers one release, at most as costly."""
    left: dict[int, list[Charge]] = {}
    for client, rel in client_releases(reports):
        if client not in left:
            selecting = [client] if may_select else []
            left[client] = list(mode.planned_charges(round, [client], selecting))
        fits = [c for c in left[client] if c.mechanism == rel.mechanism and _no_costlier(rel, c)]
        if not fits:
            held = "; ".join(f"{c.mechanism} {c.params}" for c in left[client]) or "none"
            raise ReleaseRefused(
                f"round {round}: client {client} would release {rel.mechanism} {rel.params}; "
                f"its plan holds {held}"
            )
        left[client].remove(fits[0])


def _no_costlier(rel: Any, charge: Charge) -> bool:
    rules = NO_COSTLIER.get(rel.mechanism)
    if rules is None:
        return repr(rel.event) == repr(charge.event)
    for name, direction in rules.items():
        got, plan = rel.params.get(name), charge.params.get(name)
        if not isinstance(got, Real) or not isinstance(plan, Real):
            return False
        slack = RELATIVE_TOLERANCE * abs(plan)
        if direction > 0 and not got >= plan - slack or direction < 0 and not got <= plan + slack:
            return False
    return True
