"""Run-directory files written while a run is going: the checkpoint and the partial metrics.

Both are replaced atomically (write, then rename), so a run killed at any instant leaves the
previous complete version: nothing already written is lost, and `raysim run --resume RUN_DIR`
starts from the last checkpoint.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

CHECKPOINT = "checkpoint.pkl"
# An untrusted server's run keeps the clients' part apart (runtime.client_side): its checkpoint
# is this prefix, then the pickled triple (round loop's checkpoint, clients' states or None,
# clients' seed). A plain checkpoint is a pickle, which starts with 0x80.
CLIENTS_APART = b"raysim:clients-apart:2\n"
# before the clients had a seed of their own: the pair (loop's, states); they drew from the
# run's seed, which continues them
CLIENTS_APART_V1 = b"raysim:clients-apart:1\n"


def join_checkpoint(loop_blob: bytes, clients_blob: bytes | None, client_seed: int) -> bytes:
    return CLIENTS_APART + pickle.dumps((loop_blob, clients_blob, client_seed))


def split_checkpoint(blob: bytes | None) -> tuple[bytes | None, bytes | None, int | None]:
    """(the round loop's checkpoint, the clients' states, the clients' seed) of a checkpoint;
    None for what it does not hold (the seed: the run's serves)."""
    if blob is not None and blob.startswith(CLIENTS_APART):
        return pickle.loads(blob[len(CLIENTS_APART) :])
    if blob is not None and blob.startswith(CLIENTS_APART_V1):
        return (*pickle.loads(blob[len(CLIENTS_APART_V1) :]), None)
    return blob, None, None


def kept_apart(blob: bytes, run_seed: int) -> bytes:
    """``blob`` as a run whose clients are kept apart continues it. A plain checkpoint (its
    clients' states in the round loop's, as a trusted server keeps them; ``sample`` runs before
    that mode kept its clients apart) gets the states and the judge of their evaluations moved
    to the clients' part, and the run's seed, which its clients drew from."""
    if blob.startswith((CLIENTS_APART, CLIENTS_APART_V1)):
        return blob
    snap = pickle.loads(blob)
    states, snap["client_states"] = snap["client_states"], {}
    clients = {"states": states, "served": {}, "summed": {}, "judge": snap.pop("judge", None)}
    clients = pickle.dumps(clients, protocol=pickle.HIGHEST_PROTOCOL)
    return join_checkpoint(pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL), clients, run_seed)


def clients_seed_of(blob: bytes, run_seed: int) -> int:
    """The clients' seed a run from ``blob`` continues with (an untrusted server's run)."""
    seed = split_checkpoint(blob)[2]
    return run_seed if seed is None else seed


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def checkpoint_due(every: int, done: int, last: bool) -> bool:
    """Whether the round just done gets a checkpoint: every ``every`` rounds (0: never) and the
    last one, so a finished run's staging directory always holds its final state."""
    return bool(every) and (done % every == 0 or last)


def save_checkpoint(run_dir: Path, blob: bytes) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / CHECKPOINT, blob)


def load_checkpoint(run_dir: Path) -> bytes | None:
    path = run_dir / CHECKPOINT
    return path.read_bytes() if path.is_file() else None


def write_partial_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """metrics.parquet with the rounds done so far (the final write replaces it)."""
    from raysim.metrics.results import _table

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "metrics.parquet.tmp"
    pq.write_table(_table(rows), tmp)
    os.replace(tmp, run_dir / "metrics.parquet")
