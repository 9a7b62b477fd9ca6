"""The loop around the round step, once for every way of running: resume from a checkpoint,
step, add the metrics judged on the clients' side, checkpoint, write the metrics, report, stop.

``raysim run`` drives the coordinator actor with it (``runtime.session``: the steps are Ray
calls, the next round asked for before this one's files are written, and a lost actor restarted
from the checkpoint ``Progress`` keeps); ``raysim compare --inline`` drives the in-process
``RoundLoop`` (``runtime.inline.run_inline``: the same calls, answered at once). Either one's
checkpoint continues the other's run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from raysim.metrics.evaluation import Judge
from raysim.state.checkpoint import (
    checkpoint_due,
    join_checkpoint,
    save_checkpoint,
    split_checkpoint,
    write_partial_metrics,
)


class Rounds(Protocol):
    """The round loop as the driver calls it; each call's answer, or a handle to it that
    ``resolve`` waits for (a Ray ObjectRef)."""

    def restore(self, blob: bytes) -> Any: ...
    def step(self) -> Any: ...
    def snapshot(self) -> Any: ...


class Clients(Protocol):
    """The clients' side where the server is untrusted: their states and scores."""

    def restore(self, blob: bytes | None, round: int) -> dict[int, dict[str, Any]]: ...
    def judge(self, round: int) -> dict[str, Any]: ...
    def snapshot(self, round: int) -> Any: ...


class StatesHere:
    """The clients' side of a run whose clients' states the round loop itself keeps (a trusted
    server, or an in-process loop): a checkpoint's clients' part (a run that kept them apart)
    joins the loop's states; nothing is judged or kept apart."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def restore(self, blob: bytes | None, round: int) -> dict[int, dict[str, Any]]:
        if blob is not None:
            self.loop.client_states.update(read_snapshot(blob).states)
        return {}

    def judge(self, round: int) -> dict[str, Any]:
        return {}

    def snapshot(self, round: int) -> None:
        return None


@dataclass
class Progress:
    """How far a run got: the rounds done, their metrics rows and the last checkpoint (in
    memory: a lost server restarts from it)."""

    blob: bytes | None = None
    done: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)


def drive(
    rounds: Rounds,
    clients: Clients | None,
    cfg: Any,
    progress: Progress,
    config_text: str,
    client_seed: int | None,
    out_dir: Path | None = None,
    on_round: Callable[[dict], None] | None = None,
    resolve: Callable[[Any], Any] = lambda x: x,
    ahead: bool = False,
    checkpoints: bool = True,
) -> None:
    """Run the rounds left after ``progress.blob`` (the run's checkpoint, if any), updating
    ``progress`` as they finish. ``ahead``: ask for the next round before this one's files are
    written (the workers do not wait for the driver's disk). ``config_text`` and
    ``client_seed`` go into each checkpoint, so that it continues the run by itself;
    ``checkpoints`` False takes none (an in-process run with nowhere to write one)."""
    loop_blob, clients_blob, _ = split_checkpoint(progress.blob)
    done, rows = 0, []
    if loop_blob is not None:
        done, rows = resolve(rounds.restore(loop_blob))
        rows = list(rows)
    if clients is not None:  # back to the checkpoint's states, with the metrics judged there
        add_judged(rows, clients.restore(clients_blob, done))
    progress.done, progress.rows = done, rows
    pending = None
    while done < cfg.rounds:
        if pending is None:
            pending = rounds.step()
        row = resolve(pending)
        pending = None
        done += 1
        if clients is not None and cfg.evaluated_after(done):  # judged apart
            row.update(clients.judge(done))
        rows.append(row)
        last = done == cfg.rounds or bool(row.get("early_stopped"))
        due = checkpoints and checkpoint_due(cfg.runtime.checkpoint_every, done, last)
        snap = rounds.snapshot() if due else None
        # the clients' states as after this round (asked now: before the next round changes them)
        keep_clients = snap is not None and clients is not None and client_seed is not None
        client_snap = clients.snapshot(done) if keep_clients else None  # type: ignore[union-attr]
        if ahead and not last:  # the loop runs the snapshot first, then the next round
            pending = rounds.step()
        if snap is not None:  # the checkpoint changes with both its parts or not at all
            loop_part = resolve(snap)
            clients_part = None if client_snap is None else resolve(client_snap)
            progress.blob = join_checkpoint(loop_part, clients_part, client_seed, done, config_text)
        progress.done = done
        if snap is not None and out_dir is not None:
            save_checkpoint(out_dir, progress.blob)
        if out_dir is not None:
            write_partial_metrics(out_dir, rows)
        if on_round:
            on_round(row)
        if last:
            break


class Snapshot(NamedTuple):
    """A ``ClientSide.snapshot``: the clients' states; what decided each client's output, per
    kind, client and round; the members of each round summed; the judge and what it judged,
    by round."""

    states: dict[int, Any]
    served: dict[str, dict[int, dict[int, bytes]]]
    summed: dict[int, tuple[int, ...]]
    judge: Judge | None = None
    judged: dict[int, dict[str, Any]] = {}


def read_snapshot(blob: bytes) -> Snapshot:
    """One written before the clients kept what they released holds the states alone (and one
    before they kept the sums, no sums; before they judged, no judge)."""
    from raysim.state.checkpoint import decode_state

    snap = decode_state(blob)
    if "states" in snap:
        return Snapshot(
            snap["states"],
            snap["served"],
            snap.get("summed", {}),
            snap.get("judge"),
            snap.get("judged", {}),
        )
    return Snapshot(snap, {}, {})


def add_judged(rows: list[dict[str, Any]], judged: dict[int, dict[str, Any]]) -> None:
    """The metrics judged on the clients' side into the round loop's rows (restored from a
    checkpoint, whose server never held them), by round."""
    for row in rows:
        row.update(judged.get(row["round"], {}))
