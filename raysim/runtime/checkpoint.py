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
# An untrusted server's Ray run keeps the clients' states apart (runtime.client_side): its
# checkpoint is this prefix, then the pickled pair (round loop's checkpoint, clients' states).
# A plain checkpoint is a pickle, which starts with 0x80.
CLIENTS_APART = b"raysim:clients-apart:1\n"


def join_checkpoint(loop_blob: bytes, clients_blob: bytes) -> bytes:
    return CLIENTS_APART + pickle.dumps((loop_blob, clients_blob))


def split_checkpoint(blob: bytes | None) -> tuple[bytes | None, bytes | None]:
    """(the round loop's checkpoint, the clients' states or None) of a checkpoint."""
    if blob is None or not blob.startswith(CLIENTS_APART):
        return blob, None
    return pickle.loads(blob[len(CLIENTS_APART) :])


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
