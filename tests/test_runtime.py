from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.runtime.resources import gpus_per_worker
from raysim.runtime.run import run_prepared

TIMING = ["round_seconds"]


def _run(tmp_path, name, *overrides):
    cfg = load_config(None, small_config(**dict(o.split("=", 1) for o in overrides)))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    run_prepared(prep, tmp_path / name)
    return pq.read_table(tmp_path / name / "metrics.parquet").to_pandas().drop(columns=TIMING)


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_same_seed_same_metrics_for_1_and_2_workers(ray_session, tmp_path, algorithm):
    one = _run(tmp_path, "one", f"algorithm.name={algorithm}", "runtime.num_workers=1")
    two = _run(tmp_path, "two", f"algorithm.name={algorithm}", "runtime.num_workers=2")
    assert one.equals(two), (one, two)
    other = _run(tmp_path, "other", f"algorithm.name={algorithm}", "seed=1")
    assert not one.equals(other)


def test_dprivacy_with_dropout_same_for_1_and_2_workers(ray_session, tmp_path):
    """Untrusted-server runs keep the clients' side in its own actor: the bits still do not
    depend on the workers (distributed: tests/test_clients_apart.py), nor do the clients that
    are unavailable (training.client_dropout)."""
    sets = ["algorithm.name=ifca", "privacy.mode=dprivacy", "privacy.nu=5", "privacy.client_seed=7"]
    sets.append("training.client_dropout=0.4")
    one = _run(tmp_path, "one", *sets, "runtime.num_workers=1")
    two = _run(tmp_path, "two", *sets, "runtime.num_workers=2")
    assert one.equals(two), (one, two)
    assert one["dropped_out"].sum() > 0


def test_client_level_dp_and_actor_per_client_agree(ray_session, tmp_path):
    common = [
        "privacy.mode=client",
        "privacy.delta=0.01",
        "privacy.clip=1.0",
        "training.sampling_rate=0.5",
    ]
    pooled = _run(tmp_path, "pooled", *common)
    per_client = _run(
        tmp_path, "apc", *common, "runtime.actor_per_client=true", "runtime.cpus_per_worker=0.2"
    )
    assert pooled.equals(per_client)
    assert pooled["epsilon"].iloc[-1] <= 4.0 + 1e-9


_FAULTS = """
import resource, sys
import torch
from raysim.runtime.worker import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
b, ci, co = 16, 16, 32  # the Table-2 CNN's second convolution, per-sample weight gradients
a = torch.randn(b, ci, 14, 14).contiguous(memory_format=torch.channels_last)
g = torch.randn(b, co, 14, 14).contiguous(memory_format=torch.channels_last)
w = torch.empty(b * co, ci, 5, 5)
def step():
    fold = lambda t: t.contiguous().reshape(1, -1, 14, 14)
    torch.ops.aten.convolution_backward(
        fold(g), fold(a), w, None, [1, 1], [2, 2], [1, 1], False, [0, 0], b, [False, True, False]
    )
for _ in range(3):
    step()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_worker_keeps_the_memory_a_step_frees():
    """A DP-SGD step's grouped convolution frees a few MB that the next step allocates again:
    with glibc's defaults they are faulted in page by page at every step (~500 faults here);
    after keep_freed_memory the heap serves them again."""

    def run(arg):
        out = subprocess.run([sys.executable, "-c", _FAULTS, arg], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        kept, faults = out.stdout.split()
        return kept, float(faults)

    kept, faults = run("keep")
    assert kept == "True" and faults < 10
    assert run("default")[1] > faults  # the defaults' cost, on this machine's glibc


def test_auto_gpu_fraction():
    rt = load_config(None, ["runtime.num_workers=4"]).runtime
    assert gpus_per_worker(rt, 0) == 0.0
    assert gpus_per_worker(rt, 1) == 0.25
    assert gpus_per_worker(rt, 8) == 1.0
    rt = load_config(None, ["runtime.gpus_per_worker=0.5"]).runtime
    assert gpus_per_worker(rt, 0) == 0.5


def test_fractional_gpus_four_placed_fifth_waits():
    """A separate Ray with one fake GPU: four workers at 0.25 start, a fifth stays pending."""
    script = textwrap.dedent(
        """
        import os, ray
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from raysim.models import ModelSpec
        from raysim.runtime.worker import ClientWorker
        from raysim.data import build_federated_dataset
        from raysim.config import load_config
        from algorithms import get_algorithm
        from raysim.runtime.local_ray import start_local_ray
        start_local_ray(num_cpus=2, num_gpus=1)  # as a run starts it: seconds sooner
        cfg = load_config(None, ["data.num_clients=4", "data.cluster_sizes=null"])
        ds = ray.put(build_federated_dataset(cfg.data, 0))
        actor = ray.remote(ClientWorker).options(num_cpus=0.1, num_gpus=0.25)
        spec = ModelSpec("cnn")
        workers = [actor.remote(None, ds, spec, 0, 1, 0.25) for _ in range(5)]
        refs = [w.info.remote() for w in workers]
        ready, pending = ray.wait(refs, num_returns=4, timeout=120)
        # the fifth must not start: the four that did were placed within seconds
        more, pending = ray.wait(pending, num_returns=1, timeout=2)
        infos = ray.get(ready, timeout=30)
        print("READY", len(ready) + len(more), "PENDING", len(pending))
        print("DEVICES", sorted({i["device"] for i in infos}))
        print("CUDA", sorted({i["cuda_visible_devices"] for i in infos}))
        ray.shutdown()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert "READY 4 PENDING 1" in proc.stdout, proc.stdout + proc.stderr
    assert "DEVICES ['cpu']" in proc.stdout  # a declared-but-fake GPU: torch picks the CPU
    assert "CUDA ['0']" in proc.stdout
