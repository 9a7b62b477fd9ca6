"""Run directories that are never lost or mixed.

A run writes into a staging directory beside its target (``OUT.incomplete``) and the finished
directory is moved into place with a rename, so ``OUT`` is always either a whole run or absent:
a crash never leaves a mix of a new run's config with an old run's summary. The staging directory
holds ``status.json`` (running / interrupted, rounds done, the error), the checkpoint and the
metrics written so far: ``raysim run --resume OUT`` continues it and ``raysim report`` says that
it is unfinished. ``--out`` onto an existing run refuses unless the caller asks to overwrite.
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysim.config import ConfigError

SUFFIX = ".incomplete"
STATUS = "status.json"
# In a directory raysim made to hold several runs and the files about them (a multi-algorithm
# run's comparison.png, a compare's table): only such a directory gets those files written in.
MARKER = ".raysim"
# What raysim writes beside the runs in such a directory (a multi-algorithm run, a compare).
HOME_FILES = frozenset({MARKER, "comparison.png", "compare.md", "compare.json"})
# Directories of the system, never written in at any depth (the real path, symlinks followed).
SYSTEM_TREES = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
    "/sbin", "/sys", "/usr/bin", "/usr/include", "/usr/lib", "/usr/lib32", "/usr/lib64",
    "/usr/libexec", "/usr/sbin", "/usr/share", "/var/cache", "/var/lib", "/var/log", "/var/spool",
)  # fmt: skip
# Directories whose own entries are the system's or other users' (/usr/local, /var/log, /home/x):
# raysim writes neither in them nor in a new directory of their own; deeper is the user's own
# (/usr/src/app/runs in a container, /var/tmp/x, /home/me/runs).
SYSTEM_TOPS = ("/", "/usr", "/var", "/opt", "/srv", "/home", "/mnt", "/media")


def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + SUFFIX)


def target_of(path: Path) -> Path:
    """The run directory a staging directory will become (``path`` itself if not staging)."""
    return path.with_name(path.name.removesuffix(SUFFIX)) if path.name.endswith(SUFFIX) else path


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def check_place(path: Path, flag: str = "--out") -> None:
    """Refuse (ConfigError naming ``flag``) a path in a system directory (``SYSTEM_TREES``), or
    that is or would be an entry of one of ``SYSTEM_TOPS`` (``--out /`` wrote /fedavg, /local...),
    whether given as is or reached through a symlink."""
    given = Path(os.path.abspath(path))
    for p in dict.fromkeys((given, given.resolve())):
        tree = next((t for t in SYSTEM_TREES if p == Path(t) or Path(t) in p.parents), None)
        top = next((t for t in SYSTEM_TOPS if p == Path(t) or p.parent == Path(t)), None)
        if tree is not None or top is not None:
            where = (
                f"in the system directory {tree}"
                if tree
                else ("a system directory" if p == Path(top) else f"directly in {top}")
            )
            seen = "" if p == given else f" (it leads to {str(p)!r})"
            raise ConfigError(
                f"{flag} {str(path)!r} is {where}{seen}: raysim writes results only in a "
                f"directory of yours (the default is runs/ in the current directory): choose "
                f"another {flag}"
            )


def _raysim_made(path: Path, depth: int = 2) -> bool:
    """Whether ``path`` is a directory raysim made: a run, a run's staging directory, one that
    holds its marker, or (``depth`` levels down; made before the marker) one that holds only
    those and the files raysim writes beside runs."""
    if not path.is_dir() or path.is_symlink():
        return False
    if _is_run(path) or path.name.endswith(SUFFIX) or (path / MARKER).is_file():
        return True
    if depth == 0:
        return False
    return all(
        p.name in HOME_FILES and p.is_file() or _raysim_made(p, depth - 1) for p in path.iterdir()
    )


def check_home(home: Path, flag: str = "--out") -> None:
    """The directory that will hold several runs and the files about them (a multi-algorithm
    run's comparison.png, a compare's compare.md) must be new, empty or made by raysim: a
    directory of the user's own keeps its comparison.png."""
    check_place(home, flag)
    if home.exists() and not home.is_dir():  # the runs would go below a file
        raise ConfigError(f"{flag}: {str(home)!r} exists and is not a directory")
    if home.is_dir() and any(home.iterdir()) and not _raysim_made(home):
        raise ConfigError(
            f"{flag} {str(home)!r} is a non-empty directory that raysim did not make (it holds "
            f"files other than runs, and no {MARKER}): several runs and their comparison go into "
            f"a new directory: choose another {flag}"
        )


def mark_home(home: Path) -> None:
    """Make ``home`` (checked by ``check_home``) and mark it as raysim's."""
    home.mkdir(parents=True, exist_ok=True)
    marker = home / MARKER
    if not marker.is_file():
        marker.write_text("made by raysim to hold runs and the files about them\n")


def remove_if_unused(path: Path) -> None:
    """Remove ``path`` if it holds nothing, or only raysim's marker (a run that never started)."""
    if path.is_dir() and all(p.name == MARKER for p in path.iterdir()):
        (path / MARKER).unlink(missing_ok=True)
        path.rmdir()


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse (ConfigError) to write a run onto existing results unless ``overwrite``; never
    replace a non-empty directory that is not a run, even then; never write in a system
    directory (``check_place``)."""
    check_place(out)
    stage = staging_dir(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    above = next((p for p in out.parents if p.exists()), None)  # where it would be made
    if above is not None and not above.is_dir():
        raise ConfigError(f"--out: {str(above)!r} exists and is not a directory")
    occupied = out.is_dir() and any(out.iterdir())
    if occupied and not _is_run(out):
        raise ConfigError(
            f"--out {str(out)!r} is a non-empty directory that holds no run (no config.yaml): "
            "choose another --out"
        )
    if overwrite:
        check_not_running(stage)
        return
    if occupied:
        raise ConfigError(
            f"--out {str(out)!r} already holds a run: pass --overwrite to replace it, or choose "
            "another --out"
        )
    if stage.is_dir():
        raise ConfigError(
            f"an unfinished run is in {str(stage)!r}: continue it with `raysim run --resume "
            f"{out}`, or pass --overwrite to start over"
        )


def read_status(stage: Path) -> dict:
    path = stage / STATUS
    return json.loads(path.read_text()) if path.is_file() else {}


def date_recorded_draws(run: Path) -> None:
    """A run whose config.yaml predates ``data.draws`` drew its clients' rows in sequence:
    record ``draws: sequential`` in it (atomically), so that the run continues, and its
    population is rebuilt, as it started. A recorded config holds every key, so a missing one
    dates it; the checkpoint's record of such a run is unchanged
    (``state.checkpoint.config_record`` leaves ``sequential`` out)."""
    import yaml

    path = run / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return  # reading it is refused, with its reason, where it is loaded
    data = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(data, dict) or "draws" in data:
        return
    data["draws"] = "sequential"
    tmp = path.with_name(f".config.yaml.{os.getpid()}.partial")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(path)
    print(
        f"raysim: {path} predates data.draws: continued with draws: sequential, as it was drawn",
        file=sys.stderr,
    )


def _write_json(path: Path, data: dict, indent: int) -> None:
    """Whole or not at all: written beside, fsync'd, then renamed into place (the temporary
    file goes whatever fails)."""
    from raysim.state.checkpoint import atomic_write

    atomic_write(path, json.dumps(data, indent=indent, default=str).encode())


def write_status(stage: Path, **fields: object) -> None:
    _write_json(stage / STATUS, {**read_status(stage), **fields}, indent=1)


def _rounds_done(stage: Path) -> int:
    """Rounds a staging directory's metrics.parquet holds (0 before the first)."""
    if not (stage / "metrics.parquet").is_file():
        return 0
    import pyarrow.parquet as pq

    return pq.read_metadata(stage / "metrics.parquet").num_rows


def machine() -> dict[str, object]:
    """The machine this process runs on. A run's round times are only comparable on one machine,
    and a run continued on another CPU (another oneDNN kernel, another summation order) is not
    bit for bit the run it would have been: so each stretch of a run records where it ran. For
    a run on a Ray cluster this is the driver's machine, not the workers'."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "torch": torch_version}


def _stretch(stage: Path) -> dict[str, object]:
    """Where this start of the run ran from: the first round it runs, when, and the machine."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"from_round": _rounds_done(stage) + 1, "started": when, **machine()}


# -------------------------------------------------------------------- one writer per run
LOCK = ".lock"
# this process's locks, by staging directory: (file descriptor, times taken)
_held: dict[Path, list[int]] = {}


def _holder(stage: Path) -> str:
    try:
        pid = (stage / LOCK).read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid else "another process"


def lock(stage: Path) -> None:
    """Take the run's advisory lock (``fcntl.flock`` on ``STAGE/.lock``), held until
    ``release``: a second writer of the same run (``--resume`` twice, ``--overwrite`` onto a
    running run) is refused (ConfigError) instead of mixing its files with the first's. The lock
    goes with the process, so a killed run never leaves it held. Taken again by the process that
    holds it, it is counted (``release`` undoes one)."""
    import fcntl

    key = stage.absolute()
    if key in _held:
        _held[key][1] += 1
        return
    fd = os.open(stage / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"run {target_of(stage)} is being written by {_holder(stage)}: wait for it to end "
            "(or stop it), then try again"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = [fd, 1]


def check_not_running(stage: Path) -> None:
    """Refuse (ConfigError) where another process writes the run staged in ``stage``: asked
    before Ray starts (``--overwrite`` onto a running run), as ``lock`` would refuse it after."""
    import fcntl

    path = stage / LOCK
    if stage.absolute() in _held or not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(
            f"run {target_of(stage)} is being written by {_holder(stage)}: wait for it to end "
            "(or stop it), then try again"
        ) from None
    finally:
        os.close(fd)  # and with it the probe's lock


def release(stage: Path, remove: bool = False) -> None:
    """Give one ``lock`` back; the last one closes the lock (``remove``: and deletes its file,
    of a finished run, whose directory is no longer a staging one)."""
    key = stage.absolute()
    held = _held.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0 and not remove:
        return
    del _held[key]
    if remove:
        (stage / LOCK).unlink(missing_ok=True)
    os.close(held[0])


def _refuse_links(out: Path) -> None:
    """A run directory that is a symbolic link is refused: replacing it would replace the link
    and leave its target behind (or delete the target's run through it). Links above it are
    fine: the rename happens inside the directory they lead to."""
    for path in (out, staging_dir(out)):
        if path.is_symlink():
            raise ConfigError(
                f"--out {str(path)!r} is a symbolic link (to {os.readlink(path)!r}): give the "
                "directory itself, or another --out"
            )


def _claim(out: Path, config_text: str) -> Path:
    """A new staging directory for ``out``, locked: made under a name of its own and renamed
    into place, so that a concurrent writer finds either none or one that is locked. An old
    one (a run stopped before) is removed only while its lock is held here."""
    stage = staging_dir(out)
    if stage.exists():
        lock(stage)  # refused while another process runs it
        try:
            shutil.rmtree(stage)
        finally:
            release(stage)
    fresh = stage.with_name(f"{stage.name}.new-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    try:
        lock(fresh)
        (fresh / "config.yaml").write_text(config_text)
        try:
            os.rename(fresh, stage)  # refused if another writer made one meanwhile
        except OSError:
            raise ConfigError(
                f"run {out} is being written by {_holder(stage)}: wait for it to end, then try "
                "again"
            ) from None
    except BaseException:
        release(fresh)
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    _held[stage.absolute()] = _held.pop(fresh.absolute())
    return stage


def begin(out: Path, config_text: str, rounds: int, overwrite: bool, resume: bool) -> Path:
    """The staging directory to run in, locked (``lock``) for this process until ``commit`` or
    ``stop``: a fresh one, or (``resume``) the existing one. The resolved config is recorded
    in the status (a run with no checkpoint yet can still tell an edited config.yaml)."""
    from raysim.state.checkpoint import config_digest, config_record

    _refuse_links(out)
    stage = staging_dir(out)
    record = config_record(config_text)
    if resume:
        if not stage.is_dir():
            stage.mkdir(parents=True)
            (stage / "config.yaml").write_text(config_text)
        lock(stage)
        status = read_status(stage)
        status.pop("error", None)  # the last stop's: this process is running it again
        status.update(
            status="running",
            resumed=time.strftime("%Y-%m-%d %H:%M:%S"),
            pid=os.getpid(),
            stretches=[*status.get("stretches", []), _stretch(stage)],
        )
        status.setdefault("config", record)
        status.setdefault("config_sha256", config_digest(record))
        try:
            _write_json(stage / STATUS, status, indent=1)
        except BaseException:
            release(stage)
            raise
        return stage
    check_target(out, overwrite)
    stage = _claim(out, config_text)
    try:
        write_status(
            stage,
            status="running",
            rounds=rounds,
            overwrite=overwrite,
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            pid=os.getpid(),
            stretches=[_stretch(stage)],
            config=record,
            config_sha256=config_digest(record),
        )
    except BaseException:
        release(stage)
        raise
    return stage


def stop_on_sigterm() -> None:
    """Make SIGTERM do what Ctrl-C does: a run is marked interrupted (resumable), exit 130.

    `kill PID`, `timeout`, a batch scheduler's cancel and `ray job stop` send SIGTERM, and a
    job started in the background (`raysim ... &` from a script) has SIGINT ignored, so SIGTERM
    is the one way to stop it cleanly. Where a library handles Ctrl-C itself (Ray Tune, during a
    sweep: it saves the sweep's state, then returns), SIGTERM goes to that handler. The first
    SIGTERM interrupts; later ones are ignored, so that they cannot cut the writing of the
    run's state short (SIGKILL still ends it at once).
    """

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(ctrl_c) and ctrl_c is not signal.default_int_handler:
            ctrl_c(signal.SIGINT, frame)
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)


@contextmanager
def handlers_kept(*signums: int, only_python: bool = False) -> Iterator[None]:
    """Put back the signal handlers that a library call replaces and leaves behind: ray.init
    takes SIGTERM (its handler exits at once), Ray Tune's fit() takes SIGINT and SIGUSR1 (its
    handler, left after a sweep, only sets a flag nothing reads: Ctrl-C and SIGTERM would do
    nothing). ``only_python``: put back only a handler this process set itself, so that a
    process that set none keeps the library's."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals (the libraries leave them alone too)
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None and (callable(handler) or not only_python):
                signal.signal(signum, handler)


def stopped_by_sigterm(exc: KeyboardInterrupt) -> bool:
    """Whether ``exc`` came from SIGTERM (``stop_on_sigterm``) rather than Ctrl-C."""
    return exc.args == (signal.SIGTERM.name,)


def out_flag(value: str | None) -> str | None:
    """``--out`` as given: None when left out; an empty one is a mistake (not the default)."""
    if value is not None and not value.strip():
        raise ConfigError("--out: give a directory (it is empty)")
    return value


def json_safe(x: Any) -> Any:
    """``x`` for JSON: a non-finite float (eps of a run that is not (eps, delta)-DP, a loss that
    diverged) as null, which JSON has, instead of NaN or Infinity, which it has not."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def error_text(exc: BaseException) -> str:
    """The root cause in one line: Ray wraps an actor's exception in a RayTaskError whose text
    is the remote traceback, with terminal colours."""
    cause = getattr(exc, "cause", None) or exc
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).strip().splitlines()
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def clean_partial(stage: Path) -> None:
    """Remove the temporary files a write cut short left in ``stage`` (``*.tmp``)."""
    for tmp in stage.glob("*.tmp"):
        tmp.unlink(missing_ok=True)


def mark_interrupted(stage: Path, exc: BaseException) -> None:
    """The run stopped: its status says how and why, and partial files go. Where the status
    cannot be replaced (a full disk: there is no room for a second copy), it is rewritten in
    place, once the partial files have freed their space, so it never stays "running"."""
    kind = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    clean_partial(stage)
    status = {**read_status(stage), "status": kind, "error": error_text(exc)}
    try:
        _write_json(stage / STATUS, status, indent=1)
    except OSError:
        with open(stage / STATUS, "w") as f:
            f.write(json.dumps(status, default=str))


def stop(stage: Path, exc: BaseException) -> None:
    """``mark_interrupted``, then the run's lock is given back."""
    try:
        mark_interrupted(stage, exc)
    finally:
        release(stage)


def commit(stage: Path, out: Path) -> None:
    """Move the finished staging directory into place (rename; an old run is swapped out). The
    status goes; where the run ran (its stretches) stays, in summary.json."""
    from raysim.state.checkpoint import CHECKPOINT, PREVIOUS

    stretches = read_status(stage).get("stretches")
    summary = stage / "summary.json"
    if stretches and summary.is_file():
        _write_json(summary, {**json.loads(summary.read_text()), "stretches": stretches}, indent=2)
    (stage / STATUS).unlink(missing_ok=True)
    # a finished run is not continued (more rounds would not match the noise spent): its
    # checkpoints are of no use, and can be large (89 MB for a ResNet-18 run)
    (stage / CHECKPOINT).unlink(missing_ok=True)
    (stage / PREVIOUS).unlink(missing_ok=True)
    _refuse_links(out)
    if out.exists():
        old = out.with_name(f"{out.name}.replaced-{os.getpid()}")
        if _exchange(stage, out):  # one step: OUT is the old run, then the new one
            os.replace(stage, old)
        else:  # no exchange here: OUT is absent between the renames, the old run beside it
            os.replace(out, old)
            os.replace(stage, out)
        shutil.rmtree(old)
    else:
        os.replace(stage, out)
    if stage.absolute() in _held:
        _move_lock(stage, out)


def _move_lock(stage: Path, out: Path) -> None:
    """The lock taken on ``stage`` now lives in ``out`` (renamed with it): given back, its file
    removed."""
    _held[out.absolute()] = _held.pop(stage.absolute())
    release(out, remove=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so that no moment
    has neither the old run nor the new one in place; False where the system has no such call."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    args = (at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if renameat2(*args) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@dataclass
class Unfinished:
    path: Path
    status: str
    rounds_done: int
    rounds: int | None
    error: str | None

    def describe(self) -> str:
        of = f" of {self.rounds}" if self.rounds else ""
        why = {"running": "still running, or killed"}.get(self.status, self.status)
        err = f": {self.error}" if self.error else ""
        return (
            f"{self.path}: unfinished ({why}{err}) after round {self.rounds_done}{of}; "
            f"continue it with `raysim run --resume {target_of(self.path)}`"
        )


def unfinished(path: Path) -> Unfinished | None:
    """The state of an unfinished run at ``path`` (its staging dir or its target), else None."""
    stage = path if path.name.endswith(SUFFIX) else staging_dir(path)
    if not stage.is_dir():
        return None
    status = read_status(stage)
    return Unfinished(
        stage,
        status.get("status", "running"),
        _rounds_done(stage),
        status.get("rounds"),
        status.get("error"),
    )


def _mlflow_artifact(path: Path, root: Path) -> bool:
    """Whether ``path`` lies in an MLflow file store's artifacts (RUN/artifacts/..., RUN holding
    meta.yaml): a copy of a run's files that tracking.backend mlflow logged, not a run."""
    return any(
        p.name == "artifacts" and (p.parent / "meta.yaml").is_file()
        for p in path.parents
        if p != root and root in p.parents
    )


def find_runs(root: Path) -> tuple[list[Path], list[Unfinished]]:
    """Finished runs (directories with summary.json) and unfinished ones at or under ``root``."""
    if (root / "summary.json").is_file() and not root.name.endswith(SUFFIX):
        return [root], []
    if root.name.endswith(SUFFIX) or staging_dir(root).is_dir() and not root.is_dir():
        info = unfinished(root)
        return [], [info] if info else []
    done = sorted(
        p.parent
        for p in root.rglob("summary.json")
        if not any(part.endswith(SUFFIX) for part in p.parent.relative_to(root).parts)
        and not _mlflow_artifact(p, root)
    )
    stages = sorted(p for p in root.rglob("*" + SUFFIX) if p.is_dir())
    return done, [u for s in stages if (u := unfinished(s)) is not None]
