"""Checking a request for actors against the cluster before anything waits on it.

Ray never fails an actor or a placement group that cannot be placed: it waits, silently and
forever (an actor asking for a GPU on a CPU-only cluster, 1000 one-CPU workers on 2 CPUs, a Tune
trial of 2.01 CPUs on 2). So every run and every sweep checks its bundles against the alive
nodes first and stops with the fix (ConfigError, exit 2). On an autoscaling cluster
(`runtime.address` given) a request that fits one of the cluster config's node types may wait
for new nodes, with a message saying so.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import yaml

from raysim.config import ConfigError, RuntimeConfig

TRIAL_CPU = 0.01  # a Tune trial's own bundle: its driver loop and the zero-CPU coordinator
# Written by `ray up` on the head node: the cluster config with its node types.
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml")


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def fits(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> bool:
    """First-fit-decreasing of the bundles onto the nodes' total resources (the bundles of one
    request are alike, so first fit is exact here)."""
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: -sum(b.values())):
        for f in free:
            if all(f.get(k, 0.0) + 1e-9 >= v for k, v in b.items() if v > 0):
                for k, v in b.items():
                    f[k] = f.get(k, 0.0) - v
                break
        else:
            return False
    return True


def _floor2(x: float) -> float:
    return math.floor(x * 100) / 100


def node_types(path: Path = BOOTSTRAP_CONFIG) -> dict[str, dict[str, float]] | None:
    """The autoscaler's node types (name -> resources) when this is a launcher cluster's head."""
    p = path.expanduser()
    if not p.is_file():
        return None
    try:
        types = (yaml.safe_load(p.read_text()) or {}).get("available_node_types") or {}
    except yaml.YAMLError:
        return None
    return {name: dict(t.get("resources") or {}) for name, t in types.items()}


def worker_bundle(rt: RuntimeConfig, gpus: float) -> dict[str, float]:
    return {"CPU": float(rt.cpus_per_worker), **({"GPU": gpus} if gpus else {})}


def check_request(
    rt: RuntimeConfig,
    gpus: float,
    nodes: list[dict[str, float]],
    trial: bool = False,
    types: dict[str, dict[str, float]] | None = None,
    clients: int | None = None,
) -> str | None:
    """None when the workers (plus a Tune trial's own bundle) can be placed now. Otherwise a
    ConfigError with the fix, or, on an autoscaling cluster where a node type fits every
    bundle, the message to print before waiting. ``clients``: the population, whose every
    client gets a worker of its own under ``runtime.actor_per_client``."""
    per_client = rt.actor_per_client and clients is not None
    n, c = (clients if per_client else rt.num_workers), float(rt.cpus_per_worker)
    bundles = [worker_bundle(rt, gpus)] * n + ([{"CPU": TRIAL_CPU}] if trial else [])
    if fits(bundles, nodes):
        return None
    have_cpu = sum(x.get("CPU", 0.0) for x in nodes)
    have_gpu = sum(x.get("GPU", 0.0) for x in nodes)
    what = "a trial" if trial else "the run"
    if rt.address and types is not None:
        if all(any(fits([b], [t]) for t in types.values()) for b in bundles):
            return (
                f"{what} needs more than this cluster has now ({have_cpu:g} CPUs, {have_gpu:g} "
                "GPUs); a node type of the cluster config fits it: waiting for the autoscaler "
                "to add nodes"
            )
    elif rt.address:
        return (
            f"{what} needs more than this cluster has now ({have_cpu:g} CPUs, {have_gpu:g} GPUs): "
            "waiting in case an autoscaler adds nodes (no cluster config found to check)"
        )
    if gpus and have_gpu <= 0:
        raise ConfigError(
            f"runtime.gpus_per_worker={rt.gpus_per_worker}: this cluster has no GPU, so the "
            "workers would wait forever: set runtime.gpus_per_worker=auto (GPUs when there are, "
            "else the CPU)"
        )
    extra = f" + {TRIAL_CPU:g}" if trial else ""
    spare = have_cpu - (TRIAL_CPU if trial else 0.0)
    fixes = []  # only settings that fit
    room = math.floor(spare / c + 1e-9)
    trial_bundle = [{"CPU": TRIAL_CPU}] if trial else []
    if (
        room >= 1
        and not per_client
        and fits([worker_bundle(rt, gpus)] * room + trial_bundle, nodes)
    ):
        fixes.append(f"runtime.num_workers={room}")
    smaller = rt.model_copy(update={"cpus_per_worker": _floor2(spare / n)})
    if spare / n >= 0.01 and fits([worker_bundle(smaller, gpus)] * n + trial_bundle, nodes):
        fixes.append(f"runtime.cpus_per_worker={smaller.cpus_per_worker:g}")
    if per_client:
        fixes.append("runtime.actor_per_client=false")
    if not fixes:
        fixes.append("runtime.num_workers or runtime.cpus_per_worker lower")
    why = ": runtime.actor_per_client gives each client its own" if per_client else ""
    need = f"{n * c + (TRIAL_CPU if trial else 0.0):g} CPUs ({n} workers x {c:g} CPU{extra}{why})"
    if gpus:
        need += f" and {n * gpus:g} GPUs ({gpus:g} each)"
    raise ConfigError(
        f"{what} needs {need}; this cluster has {have_cpu:g} CPUs and {have_gpu:g} GPUs"
        f"{' (no node fits a worker)' if have_cpu >= n * c else ''}: set {' or '.join(fixes)}"
    )


def check_cluster(
    rt: RuntimeConfig, gpus: float, trial: bool = False, clients: int | None = None
) -> None:
    """check_request against the alive nodes of the connected Ray; prints a wait message."""
    types = node_types() if rt.address else None
    note = check_request(rt, gpus, alive_nodes(), trial, types, clients)
    if note:
        print(f"raysim: {note}", file=sys.stderr)


def local_node() -> list[dict[str, float]] | None:
    """The CPUs and GPUs a local Ray starts with, by Ray's own detection (cgroup limits and
    CUDA_VISIBLE_DEVICES included); None where its internals do not say."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource
        from ray._private.utils import get_num_cpus

        manager = get_accelerator_manager_for_resource("GPU")
        gpus = float(manager.get_current_node_num_accelerators() or 0)
        return [{"CPU": float(get_num_cpus()), "GPU": gpus}]
    except Exception:  # noqa: BLE001 - another Ray: the check waits until Ray is up
        return None


def check_before_local_ray(rt: RuntimeConfig, clients: int) -> None:
    """check_request before a local Ray starts, against what it would have: a run it could
    never place stops before Ray starts, not once it is up. Where Ray runs already or a
    cluster is named, the check is made against it (``check_cluster``)."""
    import ray

    if rt.address or ray.is_initialized() or (nodes := local_node()) is None:
        return
    check_request(rt, gpus_per_worker(rt, nodes[0]["GPU"]), nodes, clients=clients)


def sized_cpus_per_worker(num_workers: int, nodes: list[dict[str, float]]) -> float:
    """A trial's cpus_per_worker when the sweep does not pin it: one CPU per worker where the
    cluster has room, else the share that lets one trial run on the largest node."""
    biggest = max((x.get("CPU", 0.0) for x in nodes), default=0.0)
    return min(1.0, _floor2((biggest - TRIAL_CPU) / num_workers))


def gpus_per_worker(rt: RuntimeConfig, cluster_gpus: float) -> float:
    """`auto`: share the cluster's GPUs evenly between the workers (at most one each); none on
    a CPU-only cluster, where a GPU request would wait forever."""
    if rt.gpus_per_worker == "auto":
        if cluster_gpus <= 0:
            return 0.0
        return min(1.0, cluster_gpus / rt.num_workers)
    return float(rt.gpus_per_worker)
