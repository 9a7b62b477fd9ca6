"""Run directories that are never lost or mixed.

A run writes into a staging directory beside its target (``OUT.incomplete``) and the finished
directory is moved into place with a rename, so ``OUT`` is always either a whole run or absent:
a crash never leaves a mix of a new run's config with an old run's summary. The staging directory
holds ``status.json`` (running / interrupted, rounds done, the error), the checkpoint and the
metrics written so far: ``raysim run --resume OUT`` continues it and ``raysim report`` says that
it is unfinished. ``--out`` onto an existing run refuses unless the caller asks to overwrite.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import signal
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


def _write_json(path: Path, data: dict, indent: int) -> None:
    """Whole or not at all: written beside, then renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
    os.replace(tmp, path)


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


def begin(out: Path, config_text: str, rounds: int, overwrite: bool, resume: bool) -> Path:
    """The staging directory to run in: a fresh one, or (``resume``) the existing one."""
    stage = staging_dir(out)
    if resume:
        if not stage.is_dir():
            stage.mkdir(parents=True)
            (stage / "config.yaml").write_text(config_text)
        status = read_status(stage)
        status.pop("error", None)  # the last stop's: this process is running it again
        status.update(
            status="running",
            resumed=time.strftime("%Y-%m-%d %H:%M:%S"),
            pid=os.getpid(),
            stretches=[*status.get("stretches", []), _stretch(stage)],
        )
        _write_json(stage / STATUS, status, indent=1)
        return stage
    check_target(out, overwrite)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    (stage / "config.yaml").write_text(config_text)
    write_status(
        stage,
        status="running",
        rounds=rounds,
        overwrite=overwrite,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        pid=os.getpid(),
        stretches=[_stretch(stage)],
    )
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


def mark_interrupted(stage: Path, exc: BaseException) -> None:
    kind = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    write_status(stage, status=kind, error=error_text(exc))


def commit(stage: Path, out: Path) -> None:
    """Move the finished staging directory into place (rename; an old run is swapped out). The
    status goes; where the run ran (its stretches) stays, in summary.json."""
    from raysim.runtime.checkpoint import CHECKPOINT

    stretches = read_status(stage).get("stretches")
    summary = stage / "summary.json"
    if stretches and summary.is_file():
        _write_json(summary, {**json.loads(summary.read_text()), "stretches": stretches}, indent=2)
    (stage / STATUS).unlink(missing_ok=True)
    # a finished run is not continued (more rounds would not match the noise spent): its
    # checkpoint is of no use, and can be large (89 MB for a ResNet-18 run)
    (stage / CHECKPOINT).unlink(missing_ok=True)
    if out.exists():
        old = out.with_name(f"{out.name}.replaced-{os.getpid()}")
        os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old)
    else:
        os.replace(stage, out)


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
    )
    stages = sorted(p for p in root.rglob("*" + SUFFIX) if p.is_dir())
    return done, [u for s in stages if (u := unfinished(s)) is not None]
