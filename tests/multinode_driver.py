"""Runs the multi-node scenarios of test_multinode.py in its own process: a
`ray.cluster_utils.Cluster` (head with no CPU + two 2-CPU worker nodes) cannot share the test
session's Ray. Usage: python multinode_driver.py OUT_DIR SETTINGS_JSON [SCENARIO,...]
(scenarios: undisturbed, trusted (the same under a trusted server), worker_killed,
node_removed; default: undisturbed,node_removed)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # before `import ray`; the tests import only the helpers
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if "RAY_TMPDIR" not in os.environ:  # a private one, removed at the end
        os.environ["RAY_TMPDIR"] = OWN_TMP = tempfile.mkdtemp(prefix="raysim-mn-")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from algorithms import Environment, get_algorithm  # noqa: E402
from raysim.config import load_config  # noqa: E402
from raysim.engine.experiment import prepare  # noqa: E402
from raysim.runtime.run import run_prepared  # noqa: E402

FAULT_DELAY_S = 0.25  # after round 1 is reported (while round 2 runs): inside round 2 or 3


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier}
        found += sorted(frontier)
    return found


def actor_pids(class_name: str = "ClientWorker") -> list[int]:
    """Processes of a Ray actor class in this process's own tree (never anyone else's)."""
    found = []
    for pid in _descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"ray::{class_name}" in cmd:
            found.append(pid)
    return found


def run(out: Path, overrides: list[str], fault=None) -> dict:
    cfg = load_config(None, overrides)
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)

    def on_round(row: dict) -> None:
        if fault is not None and row["round"] == 1:
            threading.Timer(FAULT_DELAY_S, fault).start()

    results = run_prepared(prep, out, on_round=on_round)
    return {
        "nodes": sorted({w["node_id"] for w in results["workers"]}),
        "in_coordinator": any(w.get("in_coordinator") for w in results["workers"]),
        "workers_replaced": results["workers_replaced"],
        "coordinator_restarts": results["coordinator_restarts"],
    }


def kill_a_worker(info: dict, class_name: str = "ClientWorker") -> None:
    pids = actor_pids(class_name)
    info["killed_pid"] = pids[0] if pids else None
    if pids:
        os.kill(pids[0], signal.SIGKILL)


def main() -> int:
    out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
    scenarios = sys.argv[3].split(",") if len(sys.argv) > 3 else ["undisturbed", "node_removed"]
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    info: dict = {"seconds": {}}

    def remove_a_node() -> None:
        cluster.remove_node(nodes[1])
        info["removed"] = True

    faults = {
        "undisturbed": None,
        "trusted": None,
        "worker_killed": lambda: kill_a_worker(info),
        "node_removed": remove_a_node,  # last: the node stays gone
    }
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=60)
        info["seconds"]["cluster_up"] = time.perf_counter() - t0
        for name in scenarios:
            t = time.perf_counter()
            settings = overrides + ["privacy.mode=none"] if name == "trusted" else overrides
            info[name] = run(out / name, settings, faults[name])
            info["seconds"][name] = time.perf_counter() - t
    finally:
        ray.shutdown()
        cluster.shutdown()
        if "OWN_TMP" in globals():
            shutil.rmtree(OWN_TMP, ignore_errors=True)
    (out / "info.json").write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
