"""Connecting to (or starting) Ray and driving a Coordinator actor round by round.

The driver only starts the coordinator and shows progress; the coordinator runs the rounds.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysim.config import RuntimeConfig, dump_config
from raysim.engine.driver import Progress, drive
from raysim.metrics.evaluation import Judge
from raysim.runtime import reuse
from raysim.runtime.client_side import ClientSide, OnRay, client_key
from raysim.runtime.coordinator import (
    Coordinator,
    trains_in_coordinator,
    worker_args,
    worker_options,
)
from raysim.runtime.local_ray import start_local_ray
from raysim.runtime.resources import check_cluster, gpus_per_worker
from raysim.runtime.worker import ClientWorker
from raysim.state.checkpoint import (
    clients_seed_of,
    kept_apart,
)
from raysim.state.rundir import handlers_kept

log = logging.getLogger(__name__)


# when this process asked for Ray and when it had it (process_age), for the runs' start-up
RAY_STARTUP: dict[str, float | None] = {}


def ensure_ray(rt: RuntimeConfig) -> bool:
    """Connect to `runtime.address` or start a local Ray; True if this call started it."""
    if ray.is_initialized():
        return False
    RAY_STARTUP["ray_start"] = process_age()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # ray.init takes SIGTERM over (its handler exits at once, status 1 or 15): a handler this
    # process set (the CLI's: stop the run as Ctrl-C does) is put back; the run's own cleanup
    # shuts Ray down.
    with handlers_kept(signal.SIGTERM, only_python=True):
        if rt.address:
            ray.init(address=rt.address, log_to_driver=False)
        else:
            start_local_ray()
    RAY_STARTUP["ray_ready"] = process_age()
    return True


def process_age() -> float | None:
    """Seconds since this process started (Linux: from /proc), so that a run's start-up is timed
    from the command, imports included; None where the kernel does not say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time
        with open("/proc/uptime") as f:
            return round(float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def _start_workers(
    prep: Any, data_ref: Any, gpus: float, trains: bool, clients: ClientsApart | None
) -> list[Any]:
    """The ClientWorker actors, started by the driver so that they import torch and build their
    model while the coordinator actor starts (not after it, as when it starts them); one fewer
    where the coordinator ``trains`` clients itself. Kept actors are renewed where a command
    keeps them (``raysim.runtime.reuse``)."""
    rt = prep.cfg.runtime
    size = len(prep.truth) if rt.actor_per_client else rt.num_workers
    args = worker_args(
        prep.cfg, prep.algorithm, data_ref, gpus, prep.spec, prep.client_seed, prep.mode
    )
    if clients is not None:
        args = (*args, (OnRay(clients.actor), clients.key))
    opts = worker_options(rt, gpus)
    return [reuse.start(ClientWorker, opts, args) for _ in range(size - trains)]


def beside_driver(cpus: float) -> NodeAffinitySchedulingStrategy:
    """On the driver's node (the head on a cluster): a worker node that goes away takes no
    server or clients' side along. Pinned where the actor holds no CPU: Ray spills a soft
    preference off a head started with ``--num-cpus 0`` (the usual head of a large cluster),
    measured with ``ray.cluster_utils.Cluster``. An actor that holds a worker's CPUs (a
    coordinator that trains, only where the driver's node has them) only prefers it: where
    others hold them it goes where CPUs are free instead of waiting, and a lost node then
    restarts it from its checkpoint."""
    here = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(here, soft=cpus > 0)


class ClientsApart:
    """An untrusted server's run: the ``ClientSide`` actor (the clients' states, secure inputs
    and scores, out of the coordinator's process), its key and the clients' seed, which only
    the driver, that actor and the workers hold. The driver adds the metrics judged there to
    the coordinator's rows. A checkpoint then carries the clients' states, judge and seed
    beside the round loop's, all written by the driver."""

    def __init__(self, prep: Any, data_ref: Any, gpus: float) -> None:
        assert prep.client_seed is not None, "prepared without the clients' seed"
        self.key, self.seed = client_key(), prep.client_seed
        rt = prep.cfg.runtime
        self.timeout = rt.round_timeout_s
        args = (
            worker_options(rt, gpus),
            worker_args(prep.cfg, prep.algorithm, data_ref, gpus, prep.spec, self.seed, prep.mode),
        )
        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1, "max_restarts": 0}
        if ray.util.get_current_placement_group() is None:  # beside the driver, as the server
            opts["scheduling_strategy"] = beside_driver(0)  # is: a lost node takes neither
        snapshots = rt.checkpoint_every > 0
        side = ray.remote(ClientSide).options(**opts)
        secure = prep.privacy_summary.get("secure_spec")  # the clients' own copy of the plan
        judge = Judge.of_run(prep.truth, prep.cfg)
        self.actor = side.remote(self.key, *args, snapshots, self.seed, secure, judge)

    def restore(self, blob: bytes | None, round: int) -> dict[int, dict]:
        """Back to a checkpoint's states and judge; the metrics judged up to ``round``."""
        ref = self.actor.restore.remote(self.key, blob, round)
        return ray.get(ref, timeout=self.timeout)

    def judge(self, round: int) -> dict[str, Any]:
        return ray.get(self.actor.judge.remote(self.key, round), timeout=self.timeout)

    def evaluations(self, timeout: float) -> list[Any]:
        return ray.get(self.actor.evaluations.remote(self.key), timeout=timeout)

    def snapshot(self, round: int) -> Any:
        return self.actor.snapshot.remote(self.key, round)

    def outlived(self, timeout: float) -> bool:
        """After a lost server: end the workers the actor started for it, and say whether the
        actor lives (False: it was lost too)."""
        try:
            ray.get(self.actor.end_workers.remote(self.key), timeout=timeout)
            return True
        except RayActorError:
            return False

    def shutdown(self) -> None:
        ray.kill(self.actor)


class OnCoordinator:
    """The coordinator actor as the driver (``engine.driver.drive``) calls a round loop: each
    call a Ray ObjectRef, which the driver waits for."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def restore(self, blob: bytes) -> Any:
        return self.actor.restore.remote(blob)

    def step(self) -> Any:
        return self.actor.step.remote()

    def snapshot(self) -> Any:
        return self.actor.snapshot.remote()


def _coordinator_options(prep: Any, trains: bool) -> tuple[dict[str, Any], tuple[str, bool]]:
    """The coordinator's Ray options and its reuse tag. It stays next to the driver (the head on
    a cluster) unless a Tune trial's placement group decides: a worker node that goes away then
    never takes it along. Where it ``trains`` clients, it holds a worker's CPUs. A process that
    served a trusted server is never renewed as an untrusted one's."""
    cpus = prep.cfg.runtime.cpus_per_worker if trains else 0
    opts: dict[str, Any] = {"num_cpus": cpus, "max_concurrency": 1}
    if ray.util.get_current_placement_group() is None:
        opts["scheduling_strategy"] = beside_driver(cpus)
    return opts, ("trusted_server", bool(prep.privacy_summary.get("trusted_server", False)))


def _start_coordinator(
    prep: Any,
    data_ref: Any,
    gpus: float,
    workers: list[Any] | None,
    trains: bool,
    clients: ClientsApart | None,
) -> Any:
    opts, tag = _coordinator_options(prep, trains)
    side = None if clients is None else clients.actor
    args = (
        prep.cfg,
        prep.algorithm,
        [data_ref],
        prep.truth,
        gpus,
        workers,
        trains,
        prep.spec,
        side,
        prep.mode,
    )
    return reuse.start(Coordinator, opts, args, tag)


def _park(prep: Any, coordinator: Any, workers: list[Any], gpus: float, trains: bool) -> bool:
    """Keep a cleanly finished run's actors for the command's next run, where it keeps them."""
    if not reuse.keeping():
        return False
    opts, tag = _coordinator_options(prep, trains)
    reuse.park(coordinator, Coordinator, opts, tag)
    for w in workers:
        reuse.park(w, ClientWorker, worker_options(prep.cfg.runtime, gpus))
    return True


def run_session(
    prep: Any,
    on_round: Callable[[dict], None] | None = None,
    out_dir: Path | None = None,
    resume: bytes | None = None,
    gpus: float | None = None,
) -> dict[str, Any]:
    """Run the remaining rounds. With `out_dir`, metrics.parquet and a checkpoint (every
    `runtime.checkpoint_every` rounds) are written as rounds finish; `resume` is a checkpoint to
    continue from; `gpus` (per worker) overrides `runtime.gpus_per_worker` (a Tune trial passes its
    bundles' share). A lost coordinator (or clients' side) is restarted from the last checkpoint
    (kept in memory)."""
    cfg = prep.cfg
    rt = cfg.runtime
    started = ensure_ray(rt)
    # where the time before the first round went, in seconds since the process started: the
    # input checked and Ray asked for (the CLI starts Ray once its runs are prepared), Ray up,
    # the data in the object store, the actors ready, round 1 asked for
    startup = dict(RAY_STARTUP)
    t0 = time.perf_counter()
    timeout = rt.round_timeout_s
    coordinator = None
    clients: ClientsApart | None = None
    early_workers: list[Any] = []
    try:
        if gpus is None:
            gpus = gpus_per_worker(rt, ray.cluster_resources().get("GPU", 0.0))
        if ray.util.get_current_placement_group() is None:  # a Tune trial's bundles are checked
            # by the sweep; a request that can never be met stops here
            check_cluster(rt, gpus, clients=len(prep.truth))
        trains = trains_in_coordinator(rt, gpus, prep.privacy_summary)
        apart = not prep.privacy_summary.get("trusted_server", False)
        data_ref = ray.put(prep.dataset)  # once: workers read it zero-copy
        # The driver keeps no second copy: from here on it reads the object store too (the copy
        # prepare built is freed); a private copy comes back when the run ends (below).
        prep.dataset = None
        prep.dataset = ray.get(data_ref, timeout=timeout)
        blob = resume
        config = dump_config(prep.recorded_config())  # what each checkpoint continues
        if apart and resume is not None:  # the clients continue with their states and seed
            blob = kept_apart(resume, cfg.seed)
            prep.client_seed = clients_seed_of(blob, cfg.seed)
        progress = Progress(blob)
        restarts = 0
        while True:
            try:
                if coordinator is None:
                    startup.setdefault("data_in_store", process_age())
                    # the clients' side outlives a lost server, as devices would, with its
                    # memory of what they released (back to the checkpoint's states below);
                    # a lost one is new
                    if apart and (clients is None or not clients.outlived(timeout)):
                        clients = ClientsApart(prep, data_ref, gpus)
                    if not restarts:  # workers from the driver, in parallel with the coordinator
                        early_workers = _start_workers(prep, data_ref, gpus, trains, clients)
                    else:  # a lost coordinator's workers go; the new one starts its own
                        for w in early_workers:
                            ray.kill(w)
                        early_workers = []
                    coordinator = _start_coordinator(
                        prep, data_ref, gpus, early_workers or None, trains, clients
                    )
                    reuse.settle(timeout)  # a kept actor that could not be renewed fails here
                    workers = ray.get(coordinator.info.remote(), timeout=timeout)
                    reuse.drop_idle()  # kept actors this run has no use for free their CPUs
                    startup.setdefault("workers_ready", process_age())
                    startup.setdefault("first_round", process_age())
                # the next round asked for before this one's files are written: the workers do
                # not wait for the driver's disk (the actor runs the snapshot first)
                drive(
                    OnCoordinator(coordinator),
                    clients,
                    cfg,
                    progress,
                    config,
                    prep.client_seed,
                    out_dir,
                    on_round,
                    resolve=lambda ref: ray.get(ref, timeout=timeout),
                    ahead=True,
                )
                break
            except RayActorError as exc:  # back to the last checkpoint, kept in progress.blob
                restarts += 1
                if restarts > rt.max_coordinator_restarts:
                    raise
                log.warning("an actor lost after round %d (%s): restarting", progress.done, exc)
                if coordinator is not None:  # where the clients' side went, it lives on
                    ray.kill(coordinator)
                coordinator = None
        results = ray.get(coordinator.results.remote(), timeout=timeout)
        if clients is not None:  # the rows with the metrics judged apart, and the scores
            results["history"] = progress.rows
            results["eval"] = clients.evaluations(timeout)
        clean = not restarts and not results["workers_replaced"]
        if clean and _park(prep, coordinator, early_workers, gpus, trains):
            coordinator, early_workers = None, []  # kept for the command's next run
        else:
            ray.get(coordinator.shutdown.remote(), timeout=timeout)
        results["workers"] = workers
        results["gpus_per_worker"] = gpus
        results["wall_seconds"] = time.perf_counter() - t0
        results["startup_seconds"] = startup
        results["coordinator_restarts"] = restarts
        return results
    finally:
        if coordinator is not None:  # a failed run must not leave its actors holding CPUs
            ray.kill(coordinator)
        if clients is not None:
            clients.shutdown()
        for w in early_workers:
            ray.kill(w)
        if prep.dataset is not None:  # its buffers live in the object store: copy them out
            prep.dataset = pickle.loads(pickle.dumps(prep.dataset))
        if started:
            ray.shutdown()
