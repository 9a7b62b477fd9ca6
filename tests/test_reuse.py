"""Actors kept from one run to the next (raysim.runtime.reuse): the same bits as fresh actors, the
same processes, never a trusted server's process for an untrusted one, and nothing left holding
CPUs afterwards."""

from __future__ import annotations

import os
import time

import pyarrow.parquet as pq
import pytest
from conftest import RAY_TIMEOUT_S, small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.runtime import reuse
from raysim.runtime.run import run_prepared

COMMON = {
    "data.samples_per_client": 40,
    "training.sampling_rate": 0.9,
    "training.sampling": "without_replacement",
}


def _results(out, **overrides):
    cfg = load_config(None, small_config(**COMMON, **overrides))
    return run_prepared(prepare(cfg, get_algorithm(cfg.algorithm.name), Environment), out)


def _pids(results) -> set[int]:
    """The processes that trained: the workers (the coordinator's own where it trains)."""
    return {w["pid"] for w in results["workers"]}


def _run(out, **overrides):
    results = _results(out, **overrides)
    table = pq.read_table(out / "metrics.parquet").to_pandas().drop(columns=["round_seconds"])
    return table, _pids(results) | {results["coordinator_pid"]}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_kept_actors_give_fresh_bits_and_end_with_the_command(ray_session, tmp_path):
    """The first run's actors are fresh; the third renews them after a run of another algorithm,
    seed and privacy mode (the 1/2/3-worker test in test_vectorized_ray.py runs kept actors
    too)."""
    # DP under a trusted server, whose coordinator trains (sample's is untrusted: it trains none)
    dp = {"algorithm.name": "fedavg", "privacy.mode": "client", "privacy.delta": 1e-3}
    with reuse.kept_actors():
        fresh, pids_a = _run(tmp_path / "a", **dp)
        _, pids_b = _run(tmp_path / "b", **{"algorithm.name": "local", "privacy.mode": "none"})
        renewed, pids_c = _run(tmp_path / "c", **dp)
    assert pids_a == pids_b == pids_c and len(pids_a) == 2  # the coordinator and one worker
    assert renewed.equals(fresh), (renewed, fresh)
    # leaving the command's scope ends the kept actors and frees their CPUs
    _wait_for(lambda: all(_gone(p) for p in pids_c), "kept actors still running")
    _wait_for(lambda: ray_session.available_resources().get("CPU") == 2.0, "CPUs still held")
    assert not reuse.keeping()


def test_a_trusted_servers_process_never_serves_an_untrusted_server(ray_session, tmp_path):
    apart = {"runtime.coordinator_trains": False}  # the same Ray options for both coordinators
    untrusted = {"privacy.mode": "distributed", "privacy.noise_cohort_size": 6, **apart}
    with reuse.kept_actors():
        first = _results(tmp_path / "trusted", **{"privacy.mode": "none"}, **apart)
        second = _results(tmp_path / "untrusted", **untrusted)
    # the client workers serve on; the server's process is a new one
    assert _pids(first) == _pids(second) and len(_pids(first)) == 2
    assert second["coordinator_pid"] != first["coordinator_pid"]


def test_a_kept_actor_that_cannot_be_renewed_fails_the_run_and_is_ended(ray_session):
    import ray

    class Box(reuse.Renewable):
        def __init__(self, value: int) -> None:
            if value < 0:
                raise ValueError(f"value: expected >= 0, got {value}")
            self.value = value

        def get(self) -> int:
            return self.value

        def pid(self) -> int:
            return os.getpid()

    opts = {"num_cpus": 0.5}
    with reuse.kept_actors():
        box = reuse.start(Box, opts, (1,))
        pid = ray.get(box.pid.remote(), timeout=RAY_TIMEOUT_S)
        assert reuse.park(box, Box, opts)
        again = reuse.start(Box, opts, (2,))
        assert again is box and ray.get(again.get.remote(), timeout=RAY_TIMEOUT_S) == 2
        reuse.settle(RAY_TIMEOUT_S)
        assert ray.get(again.pid.remote(), timeout=RAY_TIMEOUT_S) == pid
        reuse.park(again, Box, opts)
        bad = reuse.start(Box, opts, (-1,))
        with pytest.raises(ValueError, match="value: expected >= 0"):
            reuse.settle(RAY_TIMEOUT_S)
        ray.kill(bad)  # what run_session's cleanup does with a run's actors
        # an idle actor that does not fit the next request is ended to free its CPUs
        other = reuse.start(Box, opts, (3,))
        reuse.park(other, Box, opts)
        big = reuse.start(Box, {"num_cpus": 1.0}, (4,))
        assert big is not other
        assert ray.get(big.get.remote(), timeout=RAY_TIMEOUT_S) == 4
        ray.kill(big)
    assert not reuse.keeping()
