"""Connecting to (or starting) Ray and driving a Coordinator actor round by round.

The driver only starts the coordinator and shows progress; the coordinator runs the rounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray

from raysim.config import RuntimeConfig
from raysim.runtime.coordinator import Coordinator


def ensure_ray(rt: RuntimeConfig) -> bool:
    """Connect to `runtime.address` or start a local Ray; True if this call started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if rt.address:
        ray.init(address=rt.address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    return True


def gpus_per_worker(rt: RuntimeConfig, cluster_gpus: float) -> float:
    """`auto`: share the cluster's GPUs evenly between the workers (at most one each); none on
    a CPU-only cluster, where a GPU request would wait forever."""
    if rt.gpus_per_worker == "auto":
        if cluster_gpus <= 0:
            return 0.0
        return min(1.0, cluster_gpus / rt.num_workers)
    return float(rt.gpus_per_worker)


def run_session(prep: Any, on_round: Callable[[dict], None] | None = None) -> dict[str, Any]:
    cfg = prep.cfg
    started = ensure_ray(cfg.runtime)
    t0 = time.perf_counter()
    try:
        gpus = gpus_per_worker(cfg.runtime, ray.cluster_resources().get("GPU", 0.0))
        data_ref = ray.put(prep.dataset)  # once: workers read it zero-copy
        coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=0, max_concurrency=1)
            .remote(cfg, prep.algorithm, [data_ref], prep.env.true_clusters, gpus)
        )
        timeout = cfg.runtime.round_timeout_s
        workers = ray.get(coordinator.info.remote(), timeout=timeout)
        for _ in range(cfg.rounds):
            row = ray.get(coordinator.step.remote(), timeout=timeout)
            if on_round:
                on_round(row)
        results = ray.get(coordinator.results.remote(), timeout=timeout)
        ray.get(coordinator.shutdown.remote(), timeout=timeout)
        ray.kill(coordinator)
        results["workers"] = workers
        results["gpus_per_worker"] = gpus
        results["wall_seconds"] = time.perf_counter() - t0
        return results
    finally:
        if started:
            ray.shutdown()
