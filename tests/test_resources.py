"""Requests that can never be placed stop at once with the fix (Ray would wait forever)."""

from __future__ import annotations

import time

import pytest
from conftest import small_config

from raysim.cli.main import main
from raysim.config import ConfigError, RuntimeConfig
from raysim.runtime.resources import check_request, fits, sized_cpus_per_worker

TWO_CPUS = [{"CPU": 2.0, "memory": 1e10}]


def test_fits_packs_bundles_onto_nodes():
    assert fits([{"CPU": 1.0}] * 2, TWO_CPUS)
    assert not fits([{"CPU": 1.0}] * 2 + [{"CPU": 0.01}], TWO_CPUS)
    assert not fits([{"CPU": 1.5}] * 2, [{"CPU": 2.0}, {"CPU": 1.0}])  # no node fits the 2nd
    assert fits([{"CPU": 1.0, "GPU": 0.5}] * 2, [{"CPU": 4.0, "GPU": 1.0}])
    assert not fits([{"CPU": 1.0, "GPU": 0.5}], TWO_CPUS)


def test_trial_of_2_01_cpus_on_2_names_the_fix():
    rt = RuntimeConfig(num_workers=2, cpus_per_worker=1.0)
    with pytest.raises(ConfigError) as err:
        check_request(rt, 0.0, TWO_CPUS, trial=True)
    msg = str(err.value)
    assert "a trial needs 2.01 CPUs (2 workers x 1 CPU + 0.01)" in msg
    assert "runtime.num_workers=1" in msg and "runtime.cpus_per_worker=0.99" in msg
    assert check_request(rt, 0.0, TWO_CPUS, trial=False) is None  # a plain run fits
    fixed = RuntimeConfig(num_workers=2, cpus_per_worker=0.99)
    assert check_request(fixed, 0.0, TWO_CPUS, trial=True) is None  # the suggested fix fits


def test_too_many_workers_and_a_gpu_on_a_cpu_cluster():
    with pytest.raises(ConfigError, match=r"needs 1000 CPUs .* set runtime.num_workers=2$"):
        check_request(RuntimeConfig(num_workers=1000), 0.0, TWO_CPUS)
    with pytest.raises(ConfigError, match="no GPU.*gpus_per_worker=auto"):
        check_request(RuntimeConfig(gpus_per_worker=0.5), 0.5, TWO_CPUS)


def test_the_fixes_named_fit_and_one_actor_per_client_is_counted():
    with pytest.raises(ConfigError) as err:  # no worker count fits 8-CPU workers on 2 CPUs
        check_request(RuntimeConfig(num_workers=1, cpus_per_worker=8), 0.0, TWO_CPUS)
    assert str(err.value).endswith("set runtime.cpus_per_worker=2")
    per_client = RuntimeConfig(actor_per_client=True)  # 2 workers, but 12 clients: 12 actors
    with pytest.raises(ConfigError) as err:
        check_request(per_client, 0.0, TWO_CPUS, clients=12)
    msg = str(err.value)
    assert "needs 12 CPUs (12 workers x 1 CPU: runtime.actor_per_client" in msg
    assert msg.endswith("set runtime.cpus_per_worker=0.16 or runtime.actor_per_client=false")
    fixed = RuntimeConfig(actor_per_client=True, cpus_per_worker=0.16)
    assert check_request(fixed, 0.0, TWO_CPUS, clients=12) is None
    assert check_request(per_client, 0.0, TWO_CPUS, clients=2) is None


def test_autoscaling_cluster_may_wait_only_for_a_node_type_that_fits():
    rt = RuntimeConfig(num_workers=8, address="auto")
    types = {"head": {"CPU": 2}, "worker": {"CPU": 16}}
    assert "waiting for the autoscaler" in check_request(rt, 0.0, TWO_CPUS, types=types)
    big = RuntimeConfig(num_workers=2, cpus_per_worker=32, address="auto")
    with pytest.raises(ConfigError):
        check_request(big, 0.0, TWO_CPUS, types=types)
    assert "no cluster config" in check_request(rt, 0.0, TWO_CPUS, types=None)


def test_sweep_trials_are_sized_to_the_largest_node():
    assert sized_cpus_per_worker(2, TWO_CPUS) == 0.99
    assert sized_cpus_per_worker(2, [{"CPU": 16.0}]) == 1.0


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("runtime.num_workers=1000", "runtime.num_workers=2"),
        ("runtime.gpus_per_worker=0.5", "GPU"),
        ("runtime.actor_per_client=true", "runtime.actor_per_client=false"),  # 8 clients
    ],
)
def test_unplaceable_run_stops_at_once(
    ray_session, tmp_path, capsys, monkeypatch, override, needle
):
    out = tmp_path / "out"
    sets = sum((["--set", s] for s in small_config(rounds=1)), []) + ["--set", override]
    t0 = time.perf_counter()
    assert main(["run", "--out", str(out), *sets]) == 2
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing left behind
    # several runs into the default runs/NAME-TIME: not even that directory
    capsys.readouterr()
    many = ["run", "--algorithms", "fedavg,local", *sets]
    monkeypatch.chdir(tmp_path)
    assert main(many) == 2
    assert needle in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "override, needle",
    [
        ("runtime.gpus_per_worker=1", "this cluster has no GPU"),
        ("runtime.cpus_per_worker=4", "the run needs 8 CPUs (2 workers x 4 CPU)"),
    ],
)
def test_a_run_this_machine_can_never_place_stops_before_ray_starts(tmp_path, override, needle):
    """Without a Ray running (a fresh process), the local Ray's resources are known before it
    starts: the run is refused before it does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    sets = sum((["--set", s] for s in [*small_config(rounds=1), override]), [])
    argv = [sys.executable, "-m", "raysim.cli.main", "run", "--out", str(tmp_path / "o"), *sets]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stdout + done.stderr
    assert not (tmp_path / "o").exists()
