"""A local run's Ray workers forked from a process that has torch and raysim imported already.

Every actor of a local run is a Python process that the raylet starts, and each spent ~3 CPU-s
importing Ray, torch and raysim before it could train: on two cores, W's two actors importing
torch side by side were the largest piece left before the first round (docs/speed.md). The
prepare child imports torch anyway, to check the user's input. Once its config is loaded, and
before it runs any torch operation (a forked OpenMP pool would not survive), it forks the
*zygote*, which imports raysim's actor modules and then only waits. The raylet starts each
worker through ``zygote_client.py``, which asks the zygote to fork the worker with the client's
arguments, environment, working directory, standard streams, priority and OOM score; the fork
runs Ray's worker script as ``setup_worker.py`` would have ``exec``ed it in a fresh interpreter
(for a worker without a runtime environment). Each worker still imports Ray itself: Ray's C++
side reads its configuration from the environment once per process, so a zygote that had
loaded it would hand every worker the zygote's (tried: the worker finds no job ID and aborts).
The third-party packages Ray's import loads need no Ray, so the zygote preloads them
(``RAY_DEPENDENCIES``): about half of a worker's import of Ray.
The worker registers with the raylet under its own PID, as Ray's container workers do. One thing
a fork cannot take from its environment: torch's default thread count, which OpenMP reads from
``OMP_NUM_THREADS`` when it loads (in the zygote), while Ray sets that variable in a worker only
as its first task starts. A forked worker starts with the count a fresh worker of at most one
CPU gets (``_fresh_thread_count``); raysim's actors set theirs (``runtime.threads_per_worker``).

``raysim compare`` and ``raysim sweep`` prepare their runs in the driver itself: they fork the
zygote from the driver (``fork_here``) before they import Ray, so Tune's trials, too, start
with torch and raysim loaded.

Where anything differs (not Linux, no ``pidfd_open``, a runtime environment that does more than
set variables, another interpreter or library path, Ray already loaded), the worker starts as
Ray starts it. The zygote lives as long as the driver (a pipe from it closes when it exits) and
kills its workers when it goes; the driver makes itself the reaper of its orphans, so the
zygote, once the prepare child has gone, and its workers stay in the driver's process tree (what
the benchmark sums memory over).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from raysim.engine.zygote_client import HEADER, STATUS, receive

CLIENT = Path(__file__).with_name("zygote_client.py")
# what a worker imports before it runs anything, loaded once, in the zygote (best effort; not
# Ray, above)
PRELOAD = (
    "torch",
    "raysim.runtime.worker",
    "raysim.runtime.client_side",
    "raysim.training",
    "raysim.models",
    "raysim.protocol",
)
# The third-party packages ``import ray`` loads (ray 2.60, ``python -X importtime``), which need
# no Ray: each forked worker imports Ray, and these took ~0.23 of its ~0.47 CPU-s. Only Ray's
# declared dependencies found in site-packages: never what Ray vendors in its thirdparty_files
# (psutil, colorama), which a worker must load from there.
RAY_DEPENDENCIES = (
    "yaml",
    "jsonschema",
    "requests",
    "google.protobuf",
    "filelock",
    "msgpack",
    "packaging.version",
)
# what decides which code and libraries a fresh interpreter would load: a worker whose
# environment sets them otherwise than the zygote's starts as Ray starts it (protobuf picks its
# implementation from its variable when it loads)
LOADER_ENV = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSAFEPATH",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",
)


@dataclass
class Plan:
    """A zygote that the prepare child (or the driver itself) forks: its socket's (abstract)
    name, and the pipe that closes when the driver exits (or lets it go)."""

    address: str
    lifeline: tuple[int, int]  # (read end: the zygote's, write end: the driver's)
    driver: int  # the driver's PID
    forked: bool = False


PLAN: Plan | None = None  # in the driver and in its prepare child; None in the zygote


def plan() -> Plan | None:
    """In the driver, before it forks the prepare child (or the zygote itself): a zygote for
    this run's local Ray, or None where forking workers is not supported here."""
    global PLAN
    release()
    if sys.platform != "linux" or not all(
        hasattr(os, n) for n in ("pidfd_open", "fork", "getpriority")
    ):
        return None
    if not hasattr(socket, "send_fds") or "ray" in sys.modules or not _pidfds():
        return None  # (Ray's C++ side, once loaded, keeps the environment it was loaded with)
    if not _reap_orphans():
        return None
    PLAN = Plan(f"raysim-zygote-{secrets.token_hex(12)}", os.pipe(), os.getpid())
    return PLAN


def _pidfds() -> bool:
    """Whether the kernel hands out process descriptors (Linux 5.3; a sandbox may refuse)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def _reap_orphans() -> bool:
    """Make this process the parent of its orphaned descendants (Linux's child subreaper), so
    that the zygote stays in its process tree once the prepare child is gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def launcher() -> list[str] | None:
    """The command that starts a worker through the zygote, to put before the worker's own;
    None where no zygote was forked."""
    if not forked():
        return None
    return [sys.executable, "-I", "-S", str(CLIENT), PLAN.address]


def forked() -> bool:
    """Whether the zygote was forked (by the driver, or by its prepare child for it)."""
    return PLAN is not None and PLAN.forked


def release() -> None:
    """In the driver: the zygote is not needed (or no longer): it exits with its workers."""
    global PLAN
    if PLAN is not None and os.getpid() == PLAN.driver:
        with contextlib.suppress(OSError):
            os.close(PLAN.lifeline[1])
    PLAN = None


def fork_planned() -> None:
    """In the prepare child, once its config is loaded and before any torch operation: fork the
    zygote (once). A no-op anywhere else."""
    if PLAN is None or PLAN.forked or os.getpid() == PLAN.driver or "ray" in sys.modules:
        return
    _fork(PLAN)


def fork_here() -> bool:
    """In a driver that runs in-process what ``raysim run`` prepares in a child (``raysim
    compare``, ``raysim sweep``: each actor and Tune trial would import torch and raysim
    afresh), before it imports Ray and before any torch operation: fork the zygote from this
    process (once). Returns whether this call forked it: only then is it the caller's to let go
    (``release``); a zygote forked before (by a test session, a notebook) outlives the call."""
    if not forked() and plan() is not None:
        _fork(PLAN)
        return True
    return False


def _fork(plan: Plan) -> None:
    plan.forked = True
    read, write = plan.lifeline
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        try:
            os.close(write)  # only the driver holds it: the zygote sees the driver go
            _serve(plan.address, read)
        finally:
            os._exit(0)
    os.close(read)
    if os.getpid() != plan.driver:
        os.close(write)


def _serve(address: str, lifeline: int) -> None:
    global PLAN
    PLAN = None  # the driver's: a worker forked from here plans nothing
    for fd in _open_fds():  # the prepare child's pipe to the driver, its shared file, ...
        if fd > 2 and fd != lifeline:
            with contextlib.suppress(OSError):
                os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: its exit ends this
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Out of the driver's process group, as Ray's daemons are (local_ray.own_process_group): a
    # SIGTERM to the group is the driver's to handle, and the driver's exit ends this one.
    os.setpgid(0, 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(64)
    atexit._clear()  # the driver's, which the forks copied: a worker runs its own
    _preload()
    if "ray" in sys.modules:  # a preload imported Ray after all: let the workers start as usual
        return
    gc.freeze()  # the preloaded objects stay out of the collector: fewer pages copied per fork
    _Server(listener, lifeline).run()


def _preload() -> None:
    # What a module warns as it loads (requests on a mismatched urllib3, say) went to a fresh
    # worker's log; the zygote's stderr is the user's terminal.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (*PRELOAD, *RAY_DEPENDENCIES):
            with contextlib.suppress(Exception):
                __import__(name)


class _Server:
    """The zygote's loop: fork a worker for each client, report each worker's exit to its
    client, kill the worker of a client that went away, and everything when the driver goes."""

    def __init__(self, listener: socket.socket, lifeline: int) -> None:
        self.listener = listener
        self.workers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self.accept)
        self.selector.register(lifeline, selectors.EVENT_READ, None)

    def run(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data is None:  # the lifeline: the driver is gone (or let this go)
                    for pid, _client in self.workers.values():
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                    return
                try:
                    key.data(key)
                except Exception:  # noqa: BLE001 - one client's trouble must not end the others'
                    import traceback

                    traceback.print_exc()

    def accept(self, key: selectors.SelectorKey) -> None:
        client, _ = self.listener.accept()
        pid = _fork_worker(client)
        if pid is None:
            client.close()
            return
        pidfd = os.pidfd_open(pid)
        self.workers[pidfd] = (pid, client)
        self.selector.register(pidfd, selectors.EVENT_READ, self.exited)
        self.selector.register(client, selectors.EVENT_READ, self.dropped)

    def exited(self, key: selectors.SelectorKey) -> None:
        """A worker exited: its client leaves with the worker's exit status."""
        pid, client = self.workers.pop(key.fd)
        self.selector.unregister(key.fd)
        os.close(key.fd)
        with contextlib.suppress(KeyError):  # (unless the client went first)
            self.selector.unregister(client)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            client.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
        client.close()

    def dropped(self, key: selectors.SelectorKey) -> None:
        """A client closed its end (it was killed): its worker goes too; ``exited`` reaps it."""
        self.selector.unregister(key.fileobj)
        for pid, client in self.workers.values():
            if client is key.fileobj:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _open_fds() -> list[int]:
    return [int(fd) for fd in os.listdir("/proc/self/fd")]


def _fork_worker(conn: socket.socket) -> int | None:
    """Fork a worker for the client on ``conn``; its PID, or None (declined: the client then
    runs the command itself, or a client that is not this user's, or that sent nothing)."""
    conn.settimeout(5.0)
    try:
        uid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8]
        if int.from_bytes(uid, sys.byteorder) != os.getuid():
            return None
        head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        size = HEADER.unpack(head)[0]
        body = receive(conn, size)
        if len(body) < size:
            raise ValueError("the client went away")
        request = json.loads(body)
        worker = _worker_script(request["argv"], request["env"])
        if worker is None or len(fds) != 3 or not same_loader(worker[1]):
            for fd in fds:
                os.close(fd)
            conn.sendall(b"0")
            return None
        script, request["env"] = worker
    except (OSError, ValueError, KeyError, TypeError, struct.error):  # not a client's request
        return None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _become_worker(request, fds, script)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        except BaseException:  # noqa: BLE001 - reported as the worker's own error would be
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                atexit._run_exitfuncs()  # as the interpreter does when it ends
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    with contextlib.suppress(OSError):
        conn.sendall(b"1")
    return pid


def same_loader(env: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``env`` would load what this process loaded."""
    return all(env.get(name) == os.environ.get(name) for name in LOADER_ENV)


def _worker_script(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """Ray's worker script with its arguments, and the environment it runs in, from the command
    the raylet would run (``python setup_worker.py WORKER ARGS... --serialized-runtime-env-context=C
    --language=PYTHON``) and that command's environment ``env``. None unless it is that command,
    with this interpreter and a runtime environment that at most sets variables (as Tune's
    trials' does): ``setup_worker.py`` would set them, then ``exec`` the worker as it is."""
    if len(argv) < 3 or argv[0] != sys.executable or Path(argv[1]).name != "setup_worker.py":
        return None
    rest, context, language = [], None, None
    for arg in argv[2:]:
        if arg.startswith("--serialized-runtime-env-context="):
            context = arg.split("=", 1)[1]
        elif arg.startswith("--language="):
            language = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if language != "PYTHON" or not rest or Path(rest[0]).name != "default_worker.py":
        return None
    ctx = json.loads(context or "{}")
    plain = {"command_prefix": [], "override_worker_entrypoint": None}
    if any(ctx.get(k) not in (None, v) for k, v in plain.items()):
        return None
    if ctx.get("py_executable") not in (None, sys.executable):
        return None
    env_vars = ctx.get("env_vars") or {}
    if not isinstance(env_vars, dict) or any(
        not isinstance(v, str) or "$" in v for v in env_vars.values()
    ):
        return None  # (Ray expands ``$X`` in them from the worker's environment)
    return rest, {**env, **env_vars}


def _become_worker(request: dict, fds: list[int], script: list[str]) -> int:
    """In the forked worker: take the client's streams, environment and priority, and run Ray's
    worker as a fresh interpreter would (``python default_worker.py ARGS...``)."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in _open_fds():  # the zygote's: its socket, the pipe, every other client's socket
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.setpgid(0, 0)  # a group of its own, as the raylet gives each worker
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_thread_count()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    if request.get("oom_score_adj") is not None:
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write(request["oom_score_adj"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    import numpy as np

    np.random.seed()  # as a fresh interpreter's would be (Python's random reseeds itself)
    sys.argv = list(script)
    sys.path[0] = str(Path(script[0]).parent)
    runpy.run_path(script[0], run_name="__main__")
    return 0


def _fresh_thread_count() -> None:
    """torch's thread count as in a fresh worker. OpenMP read ``OMP_NUM_THREADS`` when torch
    loaded, here in the zygote, while Ray sets it in a worker (to its CPUs, at least one) only as
    the worker's first task starts, before that task imports torch: a fresh worker of at most one
    CPU, such as a Tune trial's, runs one thread. raysim's own actors set theirs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
