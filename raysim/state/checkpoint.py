"""Run-directory files written while a run is going: the checkpoint and the partial metrics.

A checkpoint is data, never code. Anyone who can write into a run directory could otherwise run
code as whoever resumes it (a pickle calls whatever its bytes name), so:

- The file (``checkpoint.ckpt``) is a magic line, a one-line JSON header (format, version, the
  round, the config the run started with and its sha256, the clients' seed, the size and sha256
  of each part), then the parts: the round loop's state and, where the clients are kept apart
  from an untrusted server (``runtime.client_side``), theirs. The header and the checksums are
  checked without decoding anything: a truncated, unknown or foreign file is refused before Ray
  starts. (The checksums find damage, not an attacker, who can recompute them: the decoder is
  what keeps an attacker's bytes from running.)
- Each part is ``torch.save`` of the state tree, read back with ``torch.load(weights_only=True)``
  under an explicit allowlist: raysim's own state classes (the modules in ``ENGINE_MODULES``),
  the running algorithm's classes (those of its class's modules and its bases'), a few numpy
  reconstructors and ``method_of``. Torch's restricted unpickler refuses any other global
  (``os.system``, a ``__reduce__`` payload) without importing or calling it. Torch's format is
  used rather than a hand-written encoder because the state holds tensors, numpy arrays,
  dataclasses and pydantic configs, which it already reads back bit for bit.
- A checkpoint is written to a temporary name, fsync'd and renamed; the previous one is kept as
  ``checkpoint.prev.ckpt`` (hard-linked before the rename, so one of the two is always whole).
  A damaged newest one is refused with the way to the previous one: nothing is deleted, and the
  run is not marked failed.

Checkpoints of earlier raysim versions (``checkpoint.pkl``, pickles) are refused: they cannot be
read without running whatever they name.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import inspect
import io
import json
import os
import pickle
import re
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysim.config import ConfigError

CHECKPOINT = "checkpoint.ckpt"
PREVIOUS = "checkpoint.prev.ckpt"
LEGACY = "checkpoint.pkl"  # a pickle, from raysim before checkpoints were data: never loaded
MAGIC = b"RAYSIM-CHECKPOINT\n"
FORMAT, VERSION = "raysim-checkpoint", 1
# the engine's modules whose classes a checkpoint may hold (the state of the loop, the ledgers,
# the privacy modes, the configs): every class defined in one of them, none imported into them
ENGINE_MODULES = (
    "raysim.server.aggregation",
    "raysim.config",
    "raysim.metrics.evaluation",
    "raysim.models.pretrain",
    "raysim.models.spec",
    "raysim.privacy.modes.base",
    "raysim.privacy.modes.client",
    "raysim.privacy.modes.distributed",
    "raysim.privacy.modes.dprivacy",
    "raysim.privacy.modes.none",
    "raysim.privacy.modes.sample",
    "raysim.privacy.modes.secure",
    "raysim.privacy.needs",
    "raysim.privacy.planning",
    "raysim.privacy.distributed",
    "raysim.privacy.ledger",
    "raysim.privacy.metric_ledger",
    "raysim.protocol",
    "raysim.server.rebalancing",
)


# where the engine's state classes were before the engine, privacy and server folders (and
# PrivacyNeeds before it left the modes): a checkpoint written then names them there, and
# resumes as one written now. Old module -> the modules its classes are in now.
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "raysim.aggregation": ("raysim.server.aggregation",),
    "raysim.rebalancing": ("raysim.server.rebalancing",),
    "raysim.planning": ("raysim.privacy.planning",),
    "raysim.modes.base": ("raysim.privacy.modes.base", "raysim.privacy.needs"),
    "raysim.privacy.modes.base": ("raysim.privacy.needs",),
    **{
        f"raysim.modes.{m}": (f"raysim.privacy.modes.{m}",)
        for m in ("client", "distributed", "dprivacy", "none", "sample", "secure")
    },
}


class CheckpointError(ConfigError):
    """A checkpoint that is refused (unknown, damaged, of another config, or holding something
    the decoder does not allow): a user-facing error (exit 2), raised before Ray starts."""


# ---------------------------------------------------------------------------- the parts


def method_of(owner: Any, name: str) -> Any:
    """A bound method, as a checkpoint refers to one (a privacy mode keeps its algorithm's DP-SGD
    schedule). ``owner`` was built by the restricted decoder, so its class is allowed; only a
    public function defined on that class is given, never an arbitrary attribute (a generic
    ``getattr`` would reach any module through ``__globals__``)."""
    attr = getattr(type(owner), name, None) if isinstance(name, str) else None
    if name.startswith("_") or not inspect.isfunction(attr):
        raise pickle.UnpicklingError(f"{type(owner).__name__}.{name} is not a method to restore")
    return getattr(owner, name)


# the default factories a defaultdict in a checkpoint may have
_FACTORIES = (list, dict, set, int, float)


def defaultdict_of(factory: Any, items: dict) -> collections.defaultdict:
    """A defaultdict, as a checkpoint holds one (torch's decoder fills only plain dicts)."""
    if factory not in _FACTORIES or not isinstance(items, dict):
        raise pickle.UnpicklingError(f"a defaultdict of {factory!r} is not restored")
    return collections.defaultdict(factory, items)


class _Pickler(pickle.Pickler):
    """The pickler ``torch.save`` uses for a part: a bound method goes as ``method_of``, a
    defaultdict as ``defaultdict_of``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.MethodType) and not isinstance(obj.__self__, type):
            return method_of, (obj.__self__, obj.__func__.__name__)
        if type(obj) is collections.defaultdict:
            return defaultdict_of, (obj.default_factory, dict(obj))
        return NotImplemented


class _PickleModule:
    """``torch.save``'s ``pickle_module``: pickle, with ``_Pickler``."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    dump, dumps, load, loads = pickle.dump, pickle.dumps, pickle.load, pickle.loads
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL


def encode_state(state: Any) -> bytes:
    """One part of a checkpoint: ``state`` as torch's format (readable by ``decode_state``)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf, pickle_module=_PickleModule)
    return buf.getvalue()


def _classes_of(modules: Iterable[str]) -> list[type]:
    """The classes defined in ``modules`` (already imported: nothing is imported here)."""
    out = []
    for name in modules:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        out += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
    return out


def allowed_globals(algorithm: type | None = None) -> list[Any]:
    """What a checkpoint's part may name: the engine's state classes, ``algorithm``'s classes
    (those defined in the modules of its class and of its bases: its state, its params, its
    environment), numpy's array and scalar reconstructors, the containers pickle names, and
    ``method_of``."""
    import importlib

    import numpy as np

    for name in ENGINE_MODULES:
        importlib.import_module(name)
    modules = list(ENGINE_MODULES)
    if algorithm is not None:  # its modules, and the rest of its package (shared state classes)
        own = {c.__module__ for c in algorithm.__mro__} - {"builtins", "abc"}
        packages = {m.split(".")[0] + "." for m in own if "." in m} - {"raysim."}
        modules += sorted(own | {m for m in list(sys.modules) if m.startswith(tuple(packages))})
    dtypes = [type(np.dtype(t)) for t in "?bBhHiIlLqQefdgFDGUSV"]
    from dp_accounting.privacy_accountant import NeighboringRelation
    from numpy._core.multiarray import _reconstruct, scalar

    moved = [
        (cls, f"{old}.{cls.__qualname__}")
        for old, new in MOVED_MODULES.items()
        for cls in _classes_of(new)
    ]
    return [
        *_classes_of(modules),
        *moved,
        *dtypes,
        np.ndarray,
        np.dtype,
        _reconstruct,
        scalar,
        NeighboringRelation,
        defaultdict_of,
        collections.OrderedDict,
        set,
        frozenset,
        list,
        dict,
        tuple,
        method_of,
    ]


def decode_state(blob: bytes, algorithm: type | None = None) -> Any:
    """A part written by ``encode_state``, read by torch's restricted unpickler with
    ``allowed_globals(algorithm)``: anything else it names is refused (CheckpointError),
    never imported or called."""
    import torch

    if not blob.startswith(b"PK"):  # torch's zip format; a pickle starts with 0x80
        raise CheckpointError("a checkpoint part is not in raysim's checkpoint format")
    try:
        with torch.serialization.safe_globals(allowed_globals(algorithm)):
            return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        said = re.search(r"WeightsUnpickler error: *(.+)", str(exc))
        why = f"it names {named[1]}" if named else said[1].strip() if said else "not data"
        raise CheckpointError(
            f"a checkpoint holds something raysim does not load ({why}); it was not written "
            "by raysim, or was altered: refused, and nothing in it was run"
        ) from None
    except (RuntimeError, EOFError, ValueError, KeyError) as exc:
        raise CheckpointError(f"a checkpoint part cannot be read: {exc}") from None


# ---------------------------------------------------------------------------- the file


def config_record(config_text: str) -> dict[str, Any]:
    """The config a checkpoint continues: the saved config.yaml without ``runtime.*`` (how a run
    is executed may change on resume; its numbers may not) and without the clients' seed."""
    import yaml

    data = yaml.safe_load(config_text) or {}
    data.pop("runtime", None)
    # the clients' seed continues from the checkpoint's header (a run whose config left it out
    # drew one from the OS: its config.yaml records it, a rebuilt config may not)
    (data.get("privacy") or {}).pop("client_seed", None)
    # the draws of every run made before the key existed: left out, so that their records match
    if (data.get("data") or {}).get("draws") == "sequential":
        data["data"].pop("draws")
    return data


def config_digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def join_checkpoint(
    loop_blob: bytes,
    clients_blob: bytes | None,
    client_seed: int | None,
    round: int,
    config_text: str,
) -> bytes:
    """The checkpoint file: magic, header, the round loop's part, the clients' part (if any)."""
    record = config_record(config_text)
    parts = {"loop": loop_blob, "clients": clients_blob}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "round": round,
        "config_sha256": config_digest(record),
        "config": record,
        "client_seed": client_seed,
        "parts": {
            k: None if v is None else {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()}
            for k, v in parts.items()
        },
    }
    line = json.dumps(header, sort_keys=True).encode() + b"\n"
    return MAGIC + line + loop_blob + (clients_blob or b"")


def read_header(blob: bytes) -> tuple[dict[str, Any], dict[str, bytes | None]]:
    """The header and the parts of a checkpoint file, checked (format, version, sizes,
    checksums): CheckpointError for anything else. Nothing is decoded."""
    if blob.startswith(b"raysim:clients-apart:") or blob[:1] == b"\x80":
        raise CheckpointError(
            "it is a Python pickle (written by raysim before checkpoints were data): a pickle "
            "can run code when it is loaded, so it is not loaded"
        )
    if not blob.startswith(MAGIC):
        raise CheckpointError("it is not a raysim checkpoint")
    end = blob.find(b"\n", len(MAGIC))
    try:
        header = json.loads(blob[len(MAGIC) : end]) if end > 0 else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError("its header is damaged")
    if header.get("version") != VERSION:
        raise CheckpointError(
            f"it is version {header.get('version')!r} of the format; this raysim reads {VERSION}"
        )
    parts: dict[str, bytes | None] = {}
    at = end + 1
    for name in ("loop", "clients"):
        spec = header["parts"].get(name)
        if spec is None:
            parts[name] = None
            continue
        data = blob[at : at + spec["size"]]
        at += spec["size"]
        if len(data) != spec["size"]:
            raise CheckpointError(f"it is truncated ({name} part: {len(data)} of {spec['size']} B)")
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CheckpointError(f"its {name} part does not match its checksum (damaged)")
        parts[name] = data
    if parts["loop"] is None or at != len(blob):
        raise CheckpointError("it is damaged (its size does not match its header)")
    return header, parts


def split_checkpoint(blob: bytes | None) -> tuple[bytes | None, bytes | None, int | None]:
    """(the round loop's part, the clients' part, the clients' seed) of a checkpoint; None for
    what it does not hold (the seed: the run's serves)."""
    if blob is None:
        return None, None, None
    header, parts = read_header(blob)
    return parts["loop"], parts["clients"], header.get("client_seed")


def kept_apart(blob: bytes, run_seed: int) -> bytes:
    """``blob`` as a run whose clients are kept apart continues it: a checkpoint whose clients'
    states are in the round loop's part (a trusted server's way; a run made inline with the
    clients in the server's process) gets them and the judge of their evaluations moved to the
    clients' part, with the run's seed, which its clients drew from."""
    header, parts = read_header(blob)
    if parts["clients"] is not None:
        return blob
    snap = decode_state(parts["loop"])  # type: ignore[arg-type]
    states, snap["client_states"] = snap["client_states"], {}
    clients = {"states": states, "served": {}, "summed": {}, "judge": snap.pop("judge", None)}
    # the header's config is the run's: the same record goes back in
    import yaml

    return join_checkpoint(
        encode_state(snap),
        encode_state(clients),
        run_seed,
        header["round"],
        yaml.safe_dump(header["config"]),
    )


def clients_seed_of(blob: bytes, run_seed: int) -> int:
    """The clients' seed a run from ``blob`` continues with (an untrusted server's run)."""
    seed = split_checkpoint(blob)[2]
    return run_seed if seed is None else seed


def check_decodes(blob: bytes, algorithm: type | None, run_dir: Path | None = None) -> None:
    """Decode every part of ``blob`` under the allowlist: a part that names anything else is
    refused here (CheckpointError, naming the file ``load_checkpoint(run_dir)`` read) rather
    than in the coordinator, after Ray started."""
    try:
        loop, clients, _ = split_checkpoint(blob)
        decode_state(loop, algorithm)  # type: ignore[arg-type]
        if clients is not None:
            decode_state(clients, algorithm)
    except CheckpointError as exc:
        if run_dir is None:
            raise
        raise CheckpointError(f"{newest_checkpoint(run_dir)}: {exc}") from None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint file ``load_checkpoint`` reads: the newest, else the previous one."""
    new, prev = run_dir / CHECKPOINT, run_dir / PREVIOUS
    return new if new.is_file() else prev if prev.is_file() else None


def check_config(blob: bytes, config_text: str, where: str) -> None:
    """Refuse a checkpoint made under another config than ``config_text`` (runtime.* aside),
    naming the keys that differ."""
    from raysim.config import changed_keys

    header, _ = read_header(blob)
    record = config_record(config_text)
    if header.get("config_sha256") == config_digest(record):
        return
    import yaml

    keys = changed_keys(yaml.safe_dump(header.get("config") or {}), yaml.safe_dump(record))
    raise CheckpointError(
        f"{where}: config.yaml differs from the config the run started with "
        f"({', '.join(keys) or 'its checksum'}): the rounds done were run under the old one. "
        "Put the old values back to continue, or start a new run for the new ones"
    )


# ---------------------------------------------------------------------------- on disk


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """``path`` whole or not at all: written beside, fsync'd, renamed; the temporary file is
    removed whatever fails (a full disk leaves nothing behind)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checkpoint_due(every: int, done: int, last: bool) -> bool:
    """Whether the round just done gets a checkpoint: every ``every`` rounds (0: never) and the
    last one, so a finished run's staging directory always holds its final state."""
    return bool(every) and (done % every == 0 or last)


def save_checkpoint(run_dir: Path, blob: bytes) -> None:
    """The new checkpoint in place, the one it replaces kept as ``PREVIOUS``: the last two."""
    run_dir.mkdir(parents=True, exist_ok=True)
    new, prev = run_dir / CHECKPOINT, run_dir / PREVIOUS
    tmp = run_dir / (CHECKPOINT + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if new.is_file():  # the current one becomes the previous (a second name, then renamed)
            link = run_dir / (PREVIOUS + ".tmp")
            link.unlink(missing_ok=True)
            os.link(new, link)
            os.replace(link, prev)
        os.replace(tmp, new)
    except BaseException:
        for leftover in (tmp, run_dir / (PREVIOUS + ".tmp")):
            leftover.unlink(missing_ok=True)
        raise
    _fsync_dir(run_dir)


def _round_of(path: Path) -> int | None:
    """The round of an intact checkpoint file, else None."""
    try:
        return int(read_header(path.read_bytes())[0].get("round", 0))
    except (CheckpointError, OSError, ValueError, TypeError):
        return None


def load_checkpoint(run_dir: Path) -> bytes | None:
    """The run's newest checkpoint, checked (``read_header``), or None where it has none.
    A damaged one is refused with the way to the previous one; where only the previous one is
    there (the newest was moved aside, as that way says), the previous one is taken."""
    path = newest_checkpoint(run_dir)
    if path is None:
        if (run_dir / LEGACY).is_file():
            raise CheckpointError(
                f"{run_dir / LEGACY} was written by an earlier raysim as a Python pickle, which "
                "can run code when it is loaded: it cannot be loaded safely and is not. Start "
                "the run again (raysim run CONFIG --overwrite) with this raysim"
            )
        return None
    try:
        blob = path.read_bytes()
        read_header(blob)
    except (CheckpointError, OSError) as exc:
        why = exc if isinstance(exc, CheckpointError) else os.strerror(exc.errno or errno.EIO)
        raise CheckpointError(damaged(path, str(why))) from None
    if path.name == PREVIOUS:
        print(f"raysim: {CHECKPOINT} is missing: continuing from {path}", file=sys.stderr)
    return blob


def damaged(path: Path, why: str) -> str:
    """The message for a refused checkpoint: why, and how to go on from the previous one."""
    prev = path.with_name(PREVIOUS)
    msg = f"checkpoint {path} is refused: {why}."
    if path.name == CHECKPOINT and (r := _round_of(prev)) is not None:
        return (
            f"{msg} The previous checkpoint (after round {r}) is intact: to continue from it, "
            f"move {path} out of the way and resume again. Nothing was changed"
        )
    return f"{msg} No intact checkpoint is left: start the run again. Nothing was changed"


def write_partial_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """metrics.parquet with the rounds done so far (the final write replaces it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "metrics.parquet.tmp"
    try:
        pq.write_table(rows_table(rows), tmp)
        os.replace(tmp, run_dir / "metrics.parquet")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    keys: list[str] = []
    for row in rows:  # union of keys, first-seen order: evaluation rows have more columns
        keys += [k for k in row if k not in keys]
    return pa.table({k: [row.get(k) for row in rows] for k in keys})
