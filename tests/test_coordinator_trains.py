"""Where the coordinator's process trains a shard of clients itself, and where it must not."""

from __future__ import annotations

import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import RuntimeConfig, load_config
from raysim.engine.experiment import prepare
from raysim.runtime.coordinator import trains_in_coordinator
from raysim.runtime.run import run_prepared

TRUSTED = {"trusted_server": True}


def test_only_a_trusted_server_on_cpu_with_shared_workers_trains():
    rt = RuntimeConfig()
    assert trains_in_coordinator(rt, 0.0, TRUSTED)
    assert not trains_in_coordinator(rt, 0.0, {"trusted_server": False})
    assert not trains_in_coordinator(rt, 0.0, {})  # an algorithm that says nothing: not trusted
    assert not trains_in_coordinator(rt, 0.5, TRUSTED)  # GPU shares are the workers'
    assert not trains_in_coordinator(RuntimeConfig(actor_per_client=True), 0.0, TRUSTED)
    assert not trains_in_coordinator(RuntimeConfig(coordinator_trains=False), 0.0, TRUSTED)


@pytest.mark.parametrize(("mode", "in_coordinator"), [("none", True), ("dprivacy", False)])
def test_the_run_reports_where_its_clients_trained(ray_session, tmp_path, mode, in_coordinator):
    """Under an untrusted server (metric DP here) no client trains in the coordinator's process:
    every shard runs on a worker actor, so no raw update ever exists in the server's process."""
    overrides = {"privacy.mode": mode, "runtime.num_workers": 2, "rounds": 1}
    if mode == "dprivacy":
        overrides.update({"algorithm.name": "ifca", "privacy.nu": 5})
    cfg = load_config(None, small_config(**overrides))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    results = run_prepared(prep, tmp_path / mode)
    workers = results["workers"]
    assert len(workers) == 2
    assert [bool(w.get("in_coordinator")) for w in workers] == [in_coordinator, False]
