"""The local Ray a run starts leaves out the head daemons it never uses and does not sleep while
its raylet registers (raysim.runtime.local_ray), and still runs tasks and actors; the suite's own
Ray is started the same way (conftest)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import ray

from raysim.runtime import local_ray
from raysim.runtime.local_ray import SKIPPED, lean_head, prompt_node_lookup, wait_until_registered


def test_suite_ray_has_no_monitor_api_server_or_log_monitor(ray_session) -> None:
    node = ray._private.worker._global_node
    assert {"gcs_server", "raylet"} <= set(node.all_processes)
    assert not {"monitor", "dashboard", "log_monitor"} & set(node.all_processes)


def test_lean_head_puts_the_start_methods_back() -> None:
    from ray._private.node import Node

    before = {name: Node.__dict__[name] for name in SKIPPED}
    with lean_head() as lean:
        assert lean
        assert all(Node.__dict__[name] is not before[name] for name in SKIPPED)
    assert {name: Node.__dict__[name] for name in SKIPPED} == before


def test_prompt_node_lookup_puts_rays_lookup_back() -> None:
    from ray._private import services

    before = services.get_node
    with prompt_node_lookup() as prompt:
        assert prompt
        assert services.get_node is not before
    assert services.get_node is before


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
