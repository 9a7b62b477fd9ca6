"""The Coordinator runs the rounds (docs/architecture.md, "One round, as data flows").

`runtime.session` runs it inside a Ray actor. The rounds themselves are
``raysim.engine.rounds.RoundLoop`` (the same loop `compare --inline` runs in one process); the
coordinator gives it a pool of worker actors to run the clients on. The workers own the data and
the arithmetic.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from raysim.config import ExperimentConfig, RuntimeConfig
from raysim.engine.sealed import opened
from raysim.runtime.pool import WorkerPool
from raysim.runtime.reuse import Renewable
from raysim.runtime.worker import ClientWorker, fixed_threads

# This module imports no torch (the round loop and the model spec load in the actor): the driver
# of `raysim run` starts the actors from here without ever loading torch (docs/speed.md).


def worker_placement() -> dict[str, Any]:
    """Spread workers over the nodes, unless a placement group (a Tune trial) already decides."""
    try:
        if ray.util.get_current_placement_group() is not None:
            return {}
    except Exception:  # outside Ray (unit tests)
        return {}
    return {"scheduling_strategy": "SPREAD"}


def trains_in_coordinator(rt: RuntimeConfig, gpus: float, privacy_summary: dict[str, Any]) -> bool:
    """Whether the coordinator's own process trains clients too (and the pool has one actor
    fewer). The coordinator waits while the workers train, and it imports torch anyway: on two
    cores, a third process importing torch and holding a model cost W ~1 s of start-up and
    ~290 MiB (docs/speed.md). Only where the server is trusted with raw updates (an untrusted
    server must never hold one in its process), on CPU (a GPU share is a worker's), with shared
    workers (not one actor per client), outside a Tune trial (whose bundles place the
    workers) and on a driver's node with a worker's CPUs: on a cluster's head started without
    CPUs the coordinator holds none and stays there, so a worker node that goes away never
    takes the server along (``session.beside_driver``)."""
    if not rt.coordinator_trains or rt.actor_per_client or gpus > 0:
        return False
    if not privacy_summary.get("trusted_server", False):
        return False
    if not ray.is_initialized():  # outside Ray (unit tests); asking would start one
        return True
    if ray.util.get_current_placement_group() is not None:
        return False
    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    return node["Resources"].get("CPU", 0.0) >= rt.cpus_per_worker


def worker_options(rt: RuntimeConfig, num_gpus_per_worker: float) -> dict[str, Any]:
    """The Ray options of a ClientWorker actor."""
    return {
        "num_cpus": rt.cpus_per_worker,
        "num_gpus": num_gpus_per_worker,
        # The pool replaces a lost worker itself (WorkerPool._replace). A restartable actor whose
        # arguments hold an object ref makes Ray log an error line on every run.
        "max_restarts": 0,
        **worker_placement(),
    }


def worker_args(
    cfg: ExperimentConfig,
    algorithm: Any,
    data_ref: Any,
    num_gpus_per_worker: float,
    spec: Any,
    client_seed: int | None = None,
    mode: Any = None,
) -> tuple[Any, ...]:
    """A ClientWorker's constructor arguments (``data_ref`` in a list: fetched in the actor),
    without the clients' side (``ClientSide.new_worker`` and the driver add it, as keyword)."""
    rt = cfg.runtime
    return (
        algorithm,
        [data_ref],
        spec,
        cfg.seed,
        rt.threads_per_worker,
        num_gpus_per_worker,
        rt.vectorize,
        client_seed,
        mode,
    )


def worker_factory(
    cfg: ExperimentConfig,
    algorithm: Any,
    data_ref: Any,
    num_gpus_per_worker: float,
    spec: Any = None,
    mode: Any = None,
) -> Callable[[int], Any]:
    """Starts ClientWorker actor i (used by the pool to replace a lost worker, and to start the
    workers where the driver did not). ``algorithm`` and ``spec`` (default:
    ``model_spec(cfg)``) may be sealed."""
    if spec is None:
        from raysim.models.spec import model_spec

        spec = model_spec(cfg)
    actor = ray.remote(ClientWorker).options(**worker_options(cfg.runtime, num_gpus_per_worker))
    args = worker_args(cfg, algorithm, data_ref, num_gpus_per_worker, spec, None, mode)

    def make_worker(i: int) -> Any:
        return actor.remote(*args)

    return make_worker


class Coordinator(Renewable):
    """The Ray side of a run: a worker pool as the ``RoundLoop``'s executor."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Any,
        dataset_box: list[Any],
        true_clusters: np.ndarray,
        num_gpus_per_worker: float,
        workers: list[Any] | None = None,
        trains: bool = False,
        spec: Any = None,
        client_side: Any = None,
        mode: Any = None,
    ) -> None:
        """`workers`: ClientWorker actors the driver already started (in parallel with this
        actor, docs/speed.md); None: start them here. `trains`: this process trains pieces of
        each round too (``trains_in_coordinator``). `algorithm` and the model `spec` (default:
        ``model_spec(cfg)``) may be sealed. `client_side`: the ``ClientSide`` actor of an
        untrusted server's run: the clients' states, secure inputs and scores stay there, the
        secure sums are computed and the evaluations judged there, and it starts the workers
        this actor would (with the key this actor never holds)."""

        from raysim.engine.rounds import RoundLoop, group_size

        # the server's torch operations on a fixed thread count, as the workers' (Ray's
        # OMP_NUM_THREADS reaches torch only in a worker that loads it after Ray sets it)
        fixed_threads(cfg.runtime.threads_per_worker)
        sealed, algorithm = algorithm, opened(algorithm)
        sealed_mode, server_mode = mode, opened(mode)
        self.cfg = cfg
        self.loop = RoundLoop(cfg, algorithm, server_mode, true_clusters, self._execute)
        rt = cfg.runtime
        if spec is None:
            from raysim.models.spec import model_spec

            spec = model_spec(cfg)
        if client_side is None:
            make_worker = worker_factory(
                cfg, algorithm, dataset_box[0], num_gpus_per_worker, spec, sealed_mode
            )
        else:
            timeout = rt.round_timeout_s
            assert not trains, "an untrusted server's process trains no client"

            def make_worker(i: int) -> Any:
                return ray.get(client_side.new_worker.remote(i), timeout=timeout)

            def secure_sums(round: int, members: list[int], aggregator: Any) -> Any:
                ref = client_side.secure_sums.remote(round, members, aggregator)
                return ray.get(ref, timeout=timeout)

            self.loop.secure_sums = secure_sums
            self.loop.judge = None  # the clients' scores go to their side, which judges them
        self.group_size = group_size(rt.client_group_size, num_gpus_per_worker)
        size = len(true_clusters) if rt.actor_per_client else rt.num_workers
        local = None
        if trains:  # its own copy of the algorithm: client code never shares the server's object
            client_side = sealed if sealed is not algorithm else pickle.loads(pickle.dumps(sealed))
            own_mode = (
                sealed_mode
                if sealed_mode is not server_mode
                else pickle.loads(pickle.dumps(sealed_mode))
            )
            local = ClientWorker(
                client_side,
                dataset_box,
                spec,
                cfg.seed,
                rt.threads_per_worker,
                0.0,
                rt.vectorize,
                None,
                own_mode,
            )
        self.pool = WorkerPool(make_worker, size, rt.round_timeout_s, workers, local)

    def _execute(self, kind: str, round: int, models: list[Any], tasks: list[Any]) -> list[Any]:
        stacked = np.stack([m.numpy() for m in models]) if models else np.zeros((0, 0))
        if self.cfg.runtime.actor_per_client:  # each client pinned to its own actor
            shards = [(t.client_id, [[t]]) for t in tasks]
            return self.pool.run_pinned(kind, round, stacked, shards)
        from raysim.engine.rounds import task_groups

        groups = task_groups(kind, tasks, self.group_size, self.cfg.runtime.eval_group_size)
        return self.pool.run(kind, round, stacked, groups)

    # -- API -----------------------------------------------------------------------------------
    def info(self) -> list[dict[str, Any]]:
        return self.pool.ready()

    def step(self) -> dict[str, Any]:
        return self.loop.step()

    def snapshot(self) -> bytes:
        return self.loop.snapshot()

    def restore(self, blob: bytes) -> tuple[int, list[dict[str, Any]]]:
        out = self.loop.restore(blob)
        if self.loop.secure_sums is not None and self.loop.client_states:
            self.loop.client_states.clear()  # not kept here, not even for the error's sake
            raise ValueError(
                "this checkpoint holds the clients' states with the server's (written by the "
                "library's in-process loop, or by a raysim before the clients' side existed): "
                "continue it with raysim compare --inline, which moves them to the clients' side"
            )
        return out

    def results(self) -> dict[str, Any]:
        return {
            **self.loop.results(),
            "workers_replaced": self.pool.replaced,
            "coordinator_pid": os.getpid(),
        }

    def shutdown(self) -> None:
        self.pool.shutdown()
