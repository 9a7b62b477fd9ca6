"""What each client's device enforces by itself, whatever the server asks.

Under an untrusted server (``sample``, ``distributed``, ``dprivacy``) the mode's admission
checks and the ledger that refuses a release past the budget run in the server's process. They
bind an honest-but-curious server; a server that deviates from the protocol could skip them and
ask the clients for more. These rules run on the clients' side instead: in the worker, which
stands for the devices (``check_broadcast``, ``check_round``, ``vet_releases``), and in
``runtime.client_side.ClientSide``, their memory (``admit``, with ``request_digest``). They use
only what the driver (the experimenter) gave the clients before the run: the mode and the
algorithm with their calibrated plan, and the clients' own model.

* A broadcast is taken only as finite float32 rows of the client's model size (in a training
  round whose algorithm sends something else, the width its plan sets: PINA's Lloyd's rounds
  send centroids of the clients' sketches): the same bytes read as another dtype or width would
  be other weights passing for the same request.
* A client trains a round at most once, and only a round 1..R of the run; it is evaluated only
  after the rounds the run evaluates, once each. Its noise and batches in round r are drawn from
  (the clients' seed, r, client): two releases of one round made from different inputs would
  share their noise, and their difference would be free of it. A request identical to one
  served already (the same broadcast, task and state: a piece run again after its worker died,
  or the rounds after a restored checkpoint) gives the same bits and is served again. Two
  tasks of one client in one piece are refused. (What was served is kept with each checkpoint
  and through a lost server; a resumed process knows only what its checkpoint holds.)
* Every accounted release a client makes in round r must be one its plan holds for it in round
  r (``PrivacyMode.planned_charges``, with a choice where the algorithm may make one then), one
  release per planned charge, and cost no more: DP-SGD at the planned noise or more and the
  planned sampling rate and steps or fewer; a choice at the planned eps or less; a sketch only
  in its planned round. (A release without an event, metric DP's, costs what the client's own
  mode sets, whatever the server sends: its count is what the rule above bounds, and
  ``releases_per_client`` under a cap.)
* A release must be finite. Training does not let a crafted broadcast make it otherwise: a
  sample whose gradient has no finite norm counts as a zero-gradient one in DP-SGD, and a
  clipped update without a finite norm as zero (``training.config``, ``privacy.clip_l2``).

A refusal that depends only on what the server sent leaves the round the client's to train; one
that depends on what the client computed on its data (``ReleaseRefused.spent``), or any other
failure after training, uses the round up, so that retrying cannot ask the data a question each
time.

So a client spends at most the plan's worst case (every client in every round), which the run
was checked against before it started. What the clients cannot check is the server's sampling:
under ``sample`` that costs nothing (the worst case assumes no sampling of clients), under
``distributed`` the secure sums' accounting assumes the server draws its cohorts as planned.
Nor do the rules make evaluation private: an evaluation reports a client's loss and accuracy on
the models the server sends, which are the experimenter's measurements, not DP releases.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
from collections.abc import Sequence
from dataclasses import fields
from numbers import Real
from typing import Any

import numpy as np

from raysim.privacy import Released
from raysim.privacy.modes.base import client_releases, released_fields
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
    does not hold. ``spent``: the refusal came from what the client computed on its data (a
    non-finite output), so the round is used up; otherwise it depends only on what the server
    sent, and the round stays the client's to train."""

    def __init__(self, message: str, spent: bool = False) -> None:
        super().__init__(message)
        self.spent = spent


def check_broadcast(models: Any, width: int) -> np.ndarray:
    """The broadcast as the clients take it: finite float32 rows of ``width`` (their model's
    size, or what the algorithm's plan sends in the round; none for a round without models).
    Another dtype or width would be the same bytes read as other weights, and could pass for
    the same request."""
    if not isinstance(models, np.ndarray) or models.dtype != np.float32 or models.ndim != 2:
        raise ReleaseRefused("the broadcast must be a 2-D float32 array")
    if models.shape[0] and models.shape[1] != width:
        raise ReleaseRefused(f"the broadcast's rows have {models.shape[1]} values, not {width}")
    if not np.isfinite(models).all():
        raise ReleaseRefused("the broadcast must be finite")
    return np.ascontiguousarray(models)


# Of what a server sends, only plain values: an object of its own class (a TrainConfig whose
# noise reads one way for the trainer and another for the release) could say two things.
PLAIN = (bool, int, float, str, type(None), np.bool_, np.int32, np.int64, np.float32, np.float64)


def _plain(x: Any) -> bool:
    if type(x) in PLAIN:
        return True
    if type(x) in (list, tuple):
        return all(_plain(v) for v in x)
    if type(x) is dict:
        return all(type(k) is str and _plain(v) for k, v in x.items())
    return type(x) is np.ndarray and x.dtype.kind in "biuf"


def check_task(task: Any) -> None:
    """A task is a ``ClientTask`` of plain values, its train config a ``TrainConfig``'s."""
    from raysim.training.config import TrainConfig

    train = getattr(task, "train", None)
    plain = type(task) is ClientTask and all(
        _plain(v) for v in (task.client_id, task.cluster, task.weight, task.extra)
    )
    if plain and train is not None:
        values = [getattr(train, f.name) for f in fields(TrainConfig)]
        plain = type(train) is TrainConfig and all(type(v) in PLAIN for v in values)
    if not plain:
        raise ReleaseRefused("a task must be a ClientTask of plain values and a TrainConfig")


def broadcast_digest(models: np.ndarray) -> bytes:
    shape = repr((models.dtype.str, models.shape)).encode()
    return hashlib.blake2b(shape + np.ascontiguousarray(models).data, digest_size=16).digest()


def request_digest(broadcast: bytes, task: ClientTask, group: Sequence[int]) -> bytes:
    """What decides a client's output in a round, but for its state (which the clients' side
    holds and adds): the broadcast, every field of the task the server sent, and the clients
    trained with it (a group is vectorized together: another grouping rounds otherwise)."""
    sent = (task.client_id, task.cluster, task.train, task.extra, tuple(group))
    blob = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(broadcast + blob, digest_size=16).digest()


def state_digest(request: bytes, state: Any) -> bytes:
    """The request with the state's contents: the same state restored from a checkpoint (new
    objects, the same values) digests the same."""
    out = io.BytesIO()
    _ContentPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    return hashlib.blake2b(request + out.getvalue(), digest_size=16).digest()


class _ContentPickler(pickle.Pickler):
    """Pickles a tensor as its dtype, shape and bytes. Torch's own pickling names a tensor's
    storage by its memory address, so a state read back from a snapshot would pickle to other
    bytes than the one it was saved from, and a round run again after a restart would look like
    one asked on other inputs. Never unpickled: it only feeds a digest."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not imported: no tensor to meet
        if torch is None or not isinstance(obj, torch.Tensor):
            return NotImplemented
        flat = obj.detach().cpu().contiguous().reshape(-1)
        return _tensor, (str(obj.dtype), tuple(obj.shape), flat.view(torch.uint8).numpy().tobytes())


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> None:
    """What a tensor is named by in ``_ContentPickler``'s bytes (never called)."""


def check_round(kind: str, round: int, cfg: Any) -> None:
    """Train in the run's rounds 1..R; evaluate in those the run evaluates in."""
    rounds = cfg.rounds
    if type(round) is not int or not 1 <= round <= rounds:
        why = f"the run has rounds 1..{rounds}; its clients take part in no other"
        raise ReleaseRefused(f"round {round!r}: {why}")
    if kind == "evaluate" and not cfg.evaluated_after(round):
        why = f"the run evaluates every {cfg.training.eval_every} rounds and after round {rounds}"
        raise ReleaseRefused(f"round {round}: no evaluation: {why}")


def vet_releases(mode: Any, round: int, reports: Sequence[ClientReport], may_select: bool) -> None:
    """Refuse the round's replies if a release is not one the plan holds for its client: each
    planned charge covers one release, at most as costly."""
    for rep in reports:
        values = [rep.update, *rep.withheld]
        vector = None if rep.contribution is None else rep.contribution.vector
        if not all(_finite(v) for v in [*values, vector]):
            why = f"client {rep.client_id}'s output is not finite: nothing of it is released"
            raise ReleaseRefused(f"round {round}: {why}", spent=True)
        # every release names one of the mode's mechanisms and carries its cost: one without
        # would cross uncharged (``client_releases`` below charges only those with an event)
        for name, rel in released_fields(rep):
            why = mode.release_problem(rel)
            if why is not None:
                raise ReleaseRefused(f"round {round}: client {rep.client_id}'s {name}: {why}")
        if (
            not mode.trusted_server
            and rep.update is not None
            and not isinstance(rep.update, Released)
        ):
            why = f"client {rep.client_id}'s update would leave unsanitized"
            raise ReleaseRefused(f"round {round}: {why}")
        why = mode.extra_problem(rep.extra, None)
        if why is not None:
            raise ReleaseRefused(f"round {round}: client {rep.client_id}'s extra: {why}")
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


def _finite(value: Any) -> bool:
    value = getattr(value, "value", value)  # a Released's
    if value is None or isinstance(value, int | float | np.integer | np.floating):
        return value is None or bool(np.isfinite(value))
    import torch

    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return bool(np.isfinite(np.asarray(value, dtype=np.float64)).all())
