"""Starting the single-node Ray of a local run without the head daemons that run never uses,
and without the whole seconds ``ray.init`` sleeps while its raylet registers.

A local Ray head starts three Python daemons that a raysim run never talks to:

- the autoscaler monitor: there is nothing to scale on one machine;
- the dashboard's API server, started even with ``include_dashboard=False`` (for usage stats,
  the state API and job submission); ``ray.init`` waits for it before it starts the raylet;
- the log monitor, which streams worker logs to drivers; raysim runs with ``log_to_driver=False``.

Measured on the 2-core machine (docs/speed.md): ``ray.init`` takes 2.0 s instead of 4.1 s, the
Ray tree holds 118 MiB less (PSS), and ``ray.shutdown`` takes 0.1-0.3 s instead of 1.1-1.4 s (the
monitor's SIGTERM handler reports to the GCS, which is already gone, so it sits out its whole 1 s
grace period). Ray has no public switch for them (``ray start --no-monitor`` exists, ``ray.init``
has no such argument), so the head node's three start methods are skipped while ``ray.init``
builds it, and put back at once. A Ray whose node class does not have all three starts as usual.
What is lost: ``ray status`` and the state API (``ray list ...``) against this Ray, which only
lives as long as the run. Connecting to a cluster (``runtime.address``) is never affected.

And ``ray.init`` learns that the raylet has registered with the GCS without sleeping a whole
second between its looks (``prompt_node_lookup``), and the raylet registers without waiting for
its agents, which start in the background (``background_agents``).
"""

from __future__ import annotations

import inspect
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

SKIPPED = ("start_monitor", "start_api_server", "start_log_monitor")
POLL_S = 0.02  # between two looks at the GCS's node table (one look: ~0.5 ms of the GCS's time)
# How long to watch before handing over to Ray's lookup: registration takes 1-2 s, and a raylet
# that never registers is then reported by Ray (after its own 30 s) only this much later.
WATCH_S = 10.0


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def lean_head() -> Iterator[bool]:
    """While active, a Ray head started in this process leaves out the daemons in ``SKIPPED``;
    yields whether it does (False: an unknown Ray layout, started as usual)."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield False
        return
    saved = {name: Node.__dict__.get(name) for name in SKIPPED}
    if any(fn is None for fn in saved.values()):
        yield False
        return
    for name in SKIPPED:
        setattr(Node, name, _skip)
    try:
        yield True
    finally:
        for name, fn in saved.items():
            setattr(Node, name, fn)


@contextmanager
def prompt_node_lookup() -> Iterator[bool]:
    """While active, ``ray.init`` finds its raylet registered as soon as it is. Ray's lookup
    (``services.get_node``, C++ ``GlobalStateAccessor::GetNode``) asks the GCS and, while the
    raylet has not registered, sleeps one whole second before asking again; the raylet
    registers once the dashboard agent is up, 1-2 s after it starts, so ``ray.init`` slept
    0-1 s (0.8 s measured) with both cores idle. This waits for the node in the GCS's node
    table, looking every ``POLL_S``, then makes Ray's own lookup, which then finds it at once.
    Yields whether it does (False: an unknown Ray layout, looked up as usual)."""
    services = getattr(ray._private, "services", None)
    lookup = getattr(services, "get_node", None)
    if lookup is None or not hasattr(services, "_get_gcs_client_options"):
        yield False
        return
    services.get_node = _prompt(lookup)
    try:
        yield True
    finally:
        services.get_node = lookup


def _prompt(lookup: Callable[[str, str], dict]) -> Callable[[str, str], dict]:
    def get_node(gcs_address: str, node_id: str) -> dict:
        try:
            wait_until_registered(gcs_address, node_id, timeout_s=WATCH_S)
        except Exception:  # noqa: BLE001 - Ray's lookup below waits (and reports) as it always did
            pass
        return lookup(gcs_address, node_id)

    return get_node


def wait_until_registered(gcs_address: str, node_id: str, timeout_s: float) -> bool:
    """Whether node ``node_id`` (hex) is alive in the GCS's node table within ``timeout_s``."""
    from ray._private import services
    from ray._private.state import GlobalState

    state = GlobalState()
    state._initialize_global_state(services._get_gcs_client_options(gcs_address))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if any(n["NodeID"] == node_id and n["Alive"] for n in state.node_table()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
    finally:
        state.disconnect()


# The ports a raylet reads from files its agents write once they are up, unless it is given them.
AGENT_PORTS = (
    "metrics_agent_port",
    "metrics_export_port",
    "runtime_env_agent_port",
    "dashboard_agent_listen_port",
)
AGENT_COMMANDS = ("--dashboard_agent_command=", "--runtime_env_agent_command=")
IDLE_PRIORITY = Path(__file__).with_name("idle_priority.py")
PORT_FLOOR = 10000  # the agents' ports are drawn from [PORT_FLOOR, the ephemeral range's start)


def free_ports(n: int) -> list[int] | None:
    """``n`` distinct ports that no socket holds now, drawn from below the kernel's ephemeral
    range; None where there is no such range to draw from.

    An agent binds its port seconds after it is chosen (longer at idle priority), and the raylet
    dies with an agent that cannot. Ports the kernel hands out to ``connect`` and ``bind(0)``,
    which every Ray process does many times as it starts, lie in the ephemeral range; below it
    a port is taken only by a process that names it. The draw is not part of any result, so it
    does not come from the run's seeded generators."""
    low = _ephemeral_floor()
    if low - PORT_FLOOR < 100 * n:
        return None
    draw = random.SystemRandom()
    ports: list[int] = []
    for _ in range(100 * n):
        port = draw.randrange(PORT_FLOOR, low)
        if port not in ports and _unbound(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    return None


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (Linux's default where it does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _unbound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address, as the agents bind theirs
        except OSError:
            return False
    return True


@contextmanager
def raylet_command(rewrite: Callable[[list[str]], list[str]]) -> Iterator[bool]:
    """While active, the command line of a raylet started in this process is ``rewrite``'s
    (the raylet's flags carry the commands it starts its agents and workers with). Yields
    whether it applies (False: an unknown Ray layout)."""
    from ray._private import ray_constants, services

    start = getattr(services, "start_ray_process", None)
    if start is None:
        yield False
        return

    def start_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = rewrite(list(command))
        return start(command, process_type, *args, **kwargs)

    services.start_ray_process = start_process
    try:
        yield True
    finally:
        services.start_ray_process = start


def launched_by(launcher: list[str], flags: tuple[str, ...], arg: str) -> str:
    """A raylet argument whose value is a command (``--FLAG=COMMAND``), for one of ``flags``,
    with the command run through ``launcher`` (which ends by running it); other arguments as
    they are."""
    for flag in flags:
        if arg.startswith(flag):
            return f"{flag}{subprocess.list2cmdline(launcher)} {arg[len(flag) :]}"
    return arg


@contextmanager
def background_agents() -> Iterator[bool]:
    """While active, a Ray head started in this process registers its raylet without waiting
    for the raylet's two Python agents, which start at idle CPU priority.

    A raylet not told its agents' ports (Ray binds them dynamically) waits, before it registers
    with the GCS, for the files in which the dashboard agent and the runtime-env agent write
    them; the dashboard agent writes its last one once it has imported aiohttp, grpc and every
    dashboard module (2.3 CPU-s for the two agents on the 2-core machine). ``ray.init`` waited
    that long, and the agents then took the cores from the run's workers (Ray starts those at
    nice 15) while these imported torch. Here each port is chosen before the raylet starts (a
    free one, as Ray itself did before its ports became dynamic, but from outside the range the
    kernel hands out: ``free_ports``), the raylet is given all four, and the agents run at idle
    priority (``idle_priority.py``): they come up on what the run leaves idle. Nothing a run
    does needs them: they serve metrics export, the dashboard and runtime environments, which a
    local run does not use. Yields whether it applies (False: an unknown Ray layout, or no
    ports to draw from; started as usual)."""
    import ray._raylet
    from ray._private import services
    from ray._private.parameter import RayParams

    start_raylet = inspect.signature(services.start_raylet).parameters
    known = hasattr(ray._raylet, "persist_port") and all(p in start_raylet for p in AGENT_PORTS)
    chosen = free_ports(len(AGENT_PORTS)) if known else None
    if chosen is None:
        yield False
        return
    ports = dict(zip(AGENT_PORTS, chosen, strict=True))
    idle = [sys.executable, "-I", "-S", str(IDLE_PRIORITY)]

    def rewrite(command: list[str]) -> list[str]:
        listen = ports["dashboard_agent_listen_port"]
        command = [launched_by(idle, AGENT_COMMANDS, arg) for arg in command]
        return [*command, f"--dashboard_agent_listen_port={listen}"]

    init = RayParams.__init__

    def params_init(self: RayParams, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for name, port in ports.items():
            setattr(self, name, port)

    with raylet_command(rewrite) as applies:
        if not applies:
            yield False
            return
        RayParams.__init__ = params_init
        try:
            yield True
        finally:
            RayParams.__init__ = init


@contextmanager
def forked_workers() -> Iterator[bool]:
    """While active, a Ray head started in this process starts its Python workers through the
    run's zygote (``zygote.py``), if one was forked: each worker then begins with torch and
    raysim imported. Yields whether it does."""
    from raysim.engine import zygote

    launcher = zygote.launcher()
    if launcher is None:
        yield False
        return
    flags = ("--python_worker_command=",)
    with raylet_command(lambda command: [launched_by(launcher, flags, a) for a in command]) as on:
        yield on


@contextmanager
def own_process_group() -> Iterator[bool]:
    """While active, the daemons of a Ray head started in this process (the GCS and the raylet,
    and through the raylet its agents) run in a process group of their own, not the driver's.

    ``timeout``, ``kill -TERM -PGID`` and a shell that ends its job signal the driver's whole
    process group. Ray blocks SIGINT in its daemons, so Ctrl-C reaches only the driver, which
    marks its run interrupted and shuts Ray down; SIGTERM it does not block: the raylet stopped
    at once, the driver's connection to the object store broke, and Ray's C++ ended the driver
    (exit 1) before its SIGTERM handler ran, leaving the run marked as running. In a group of
    their own the daemons hear SIGTERM only from ``ray.shutdown``; they still end with the
    driver if it is killed (Ray's kernel fate-sharing, ``PR_SET_PDEATHSIG``). Yields whether it
    applies (False: an unknown Ray layout, or no kernel fate-sharing to end them with the
    driver)."""
    from ray._private import services, utils

    popen = getattr(services, "ConsolePopen", None)
    fate_sharing = getattr(utils, "detect_fate_sharing_support", lambda: False)()
    if popen is None or not fate_sharing or sys.platform == "win32":
        yield False
        return

    class OwnGroupPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if sys.version_info >= (3, 11):
                kwargs.setdefault("process_group", 0)
            else:
                kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield True
    finally:
        services.ConsolePopen = popen


# Set (to anything but "" or "0"): a plain ``ray.init``, none of the changes above. They reach
# into Ray's internals; this is the way to keep working when a Ray release moves them, and the
# path the test suite checks so that it keeps working.
PLAIN_RAY_ENV = "RAYSIM_PLAIN_RAY"


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init(address="local", ...)`` without the head daemons a run does not use, without
    sleeping while its raylet registers, without waiting for the raylet's agents, with its
    workers forked from the run's zygote where there is one, and with its daemons out of the
    driver's process group; a plain ``ray.init`` where ``RAYSIM_PLAIN_RAY`` is set."""
    if os.environ.get(PLAIN_RAY_ENV, "") not in ("", "0"):
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
        return
    with (
        lean_head(),
        prompt_node_lookup(),
        background_agents(),
        forked_workers(),
        own_process_group(),
    ):
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
