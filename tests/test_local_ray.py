"""The local Ray a run starts leaves out the head daemons it never uses, does not sleep while its
raylet registers, registers the raylet without waiting for its agents and runs those at idle
priority (raysim.runtime.local_ray), and still runs tasks and actors; the suite's own Ray is
started the same way (conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import ray

from raysim.runtime import local_ray
from raysim.runtime.local_ray import (
    AGENT_PORTS,
    IDLE_PRIORITY,
    SKIPPED,
    background_agents,
    lean_head,
    own_process_group,
    prompt_node_lookup,
    wait_until_registered,
)


def test_suite_ray_has_no_monitor_api_server_or_log_monitor(ray_session) -> None:
    node = ray._private.worker._global_node
    assert {"gcs_server", "raylet"} <= set(node.all_processes)
    assert not {"monitor", "dashboard", "log_monitor"} & set(node.all_processes)


def test_the_daemons_are_out_of_the_drivers_process_group(ray_session) -> None:
    """A SIGTERM to the driver's group (``timeout``) must reach the driver alone: the raylet
    and the GCS, stopped by it, would end the driver before it marks its run interrupted."""
    node = ray._private.worker._global_node
    daemons = [node.all_processes[kind][0].process.pid for kind in ("gcs_server", "raylet")]
    assert all(os.getpgid(pid) not in (os.getpgrp(), 0) for pid in daemons)
    children = [pid for pid in all_pids() if parent(pid) == daemons[1]]  # agents, workers
    assert children and all(os.getpgid(pid) != os.getpgrp() for pid in children)


def test_lean_head_puts_the_start_methods_back() -> None:
    from ray._private.node import Node

    before = {name: Node.__dict__[name] for name in SKIPPED}
    with lean_head() as lean:
        assert lean
        assert all(Node.__dict__[name] is not before[name] for name in SKIPPED)
    assert {name: Node.__dict__[name] for name in SKIPPED} == before


@pytest.mark.parametrize(
    ("patch", "name"), [(prompt_node_lookup, "get_node"), (own_process_group, "ConsolePopen")]
)
def test_a_patch_of_rays_services_is_put_back(patch, name) -> None:
    from ray._private import services

    before = getattr(services, name)
    with patch() as applied:
        assert applied
        assert getattr(services, name) is not before
    assert getattr(services, name) is before


def test_background_agents_puts_rays_functions_back() -> None:
    from ray._private import services
    from ray._private.parameter import RayParams

    before = RayParams.__init__, services.start_ray_process
    with background_agents() as applied:
        assert applied
        assert (RayParams.__init__, services.start_ray_process) != before
    assert (RayParams.__init__, services.start_ray_process) == before


def test_the_raylet_is_told_its_agents_ports_and_the_agents_run_at_idle_priority(
    ray_session,
) -> None:
    """Told every port it would otherwise wait to read from its agents' files, the raylet
    registers at once; the agents, started through idle_priority.py, run as SCHED_IDLE."""
    node = ray._private.worker._global_node
    raylet = node.all_processes["raylet"][0].process.pid
    flags = dict(a.split("=", 1) for a in cmdline(raylet) if a.startswith("--") and "=" in a)
    info = ray._private.services.get_node(node.gcs_address, node.node_id)
    for name in AGENT_PORTS:
        assert info[name] > 0, name
    assert int(flags["--dashboard_agent_listen_port"]) == info["dashboard_agent_listen_port"]
    assert int(flags["--metrics-agent-port"]) == info["metrics_agent_port"]
    assert int(flags["--metrics_export_port"]) == info["metrics_export_port"]
    assert int(flags["--runtime_env_agent_port"]) == info["runtime_env_agent_port"]
    for flag in ("--dashboard_agent_command", "--runtime_env_agent_command"):
        assert str(IDLE_PRIORITY) in flags[flag]
    # an agent's command line until it is up, then the title it sets
    names = ("dashboard/agent.py", "runtime_env/agent/main.py", "ray::DashboardAgent")
    names += ("ray::RuntimeEnvAgent",)
    children = [pid for pid in all_pids() if parent(pid) == raylet]
    agents = [pid for pid in children if any(a.endswith(names) for a in cmdline(pid)[:3])]
    assert len(agents) == 2, [cmdline(pid)[:3] for pid in children]
    assert all(os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in agents)


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")
    except OSError:
        return []


def test_idle_priority_runs_the_command_at_idle_priority_in_its_own_process() -> None:
    """The command replaces the launcher (the same PID, which the raylet watches)."""
    probe = "import os; print(os.getpid(), os.sched_getscheduler(0) == os.SCHED_IDLE)"
    with subprocess.Popen(
        [sys.executable, "-I", "-S", str(IDLE_PRIORITY), sys.executable, "-c", probe],
        stdout=subprocess.PIPE,
        text=True,
    ) as launched:
        out, _ = launched.communicate(timeout=60)
    assert launched.returncode == 0
    assert out.split() == [str(launched.pid), "True"]


def test_free_ports_are_distinct_unbound_and_below_the_ephemeral_range() -> None:
    import socket

    ports = local_ray.free_ports(4)
    assert ports is not None and len(set(ports)) == 4
    for port in ports:
        assert local_ray.PORT_FLOOR <= port < local_ray._ephemeral_floor()
        with socket.socket() as s:
            s.bind(("", port))


def test_no_ports_are_drawn_from_a_range_too_small_or_taken(monkeypatch) -> None:
    monkeypatch.setattr(local_ray, "_ephemeral_floor", lambda: local_ray.PORT_FLOOR + 50)
    assert local_ray.free_ports(4) is None
    monkeypatch.setattr(local_ray, "_ephemeral_floor", lambda: local_ray.PORT_FLOOR + 1000)
    monkeypatch.setattr(local_ray, "_unbound", lambda port: False)
    assert local_ray.free_ports(4) is None


def test_a_bound_port_is_not_unbound() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        assert not local_ray._unbound(s.getsockname()[1])


def test_the_node_table_shows_the_registered_node_and_no_other(ray_session) -> None:
    node = ray._private.worker._global_node
    assert wait_until_registered(node.gcs_address, node.node_id, timeout_s=5.0)
    start = time.monotonic()
    assert not wait_until_registered(node.gcs_address, "ab" * 28, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 5.0  # looked until the timeout, not past it


def test_a_failed_prompt_look_falls_back_to_rays_lookup(monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("no GCS client here")

    monkeypatch.setattr(local_ray, "wait_until_registered", broken)
    calls = []
    lookup = local_ray._prompt(lambda address, node: calls.append((address, node)) or {"ok": 1})
    assert lookup("gcs:1", "node") == {"ok": 1}
    assert calls == [("gcs:1", "node")]


def test_a_run_started_ray_runs_actors_and_reports_their_errors() -> None:
    """In a fresh process (the suite's Ray is already up): start, use, shut down."""
    script = textwrap.dedent(
        """
        import os, ray
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from raysim.runtime.local_ray import start_local_ray
        start_local_ray(num_cpus=1)
        procs = sorted(ray._private.worker._global_node.all_processes)

        @ray.remote
        class Boom:
            def ok(self):
                return os.getpid()
            def fail(self):
                raise ValueError("raised in the actor")

        b = Boom.remote()
        assert ray.get(b.ok.remote(), timeout=60) != os.getpid()
        try:
            ray.get(b.fail.remote(), timeout=60)
        except ValueError as exc:
            assert "raised in the actor" in str(exc)
        else:
            raise AssertionError("the actor's error did not reach the driver")
        ray.shutdown()
        print(procs)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['gcs_server', 'raylet']", out.stdout
