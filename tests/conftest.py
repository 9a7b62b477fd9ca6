"""One Ray for the whole test session (2 CPUs, no GPU): starting Ray costs seconds. Its
workers, and those of every Ray a test starts in this process, are forked from one zygote
(raysim/engine/zygote.py), forked here before anything loads Ray or torch, as `raysim compare`
forks its own: a worker started afresh spends ~3 CPU-s importing torch and raysim, and every
run's actors are new workers."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """pytest-xdist's workers for ``-n auto`` (pyproject.toml's addopts). The default run's
    tests wait on subprocesses and Ray for ~40% of their time on 2 cores, so two workers at
    least; four at most, as each starts its own Ray and holds torch (~1 GB). None (0) for the
    slow tests, which are timed one at a time, and for tests named one by one (``a::b``)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if config.option.markexpr != "not slow" or any("::" in a for a in config.args):
        return 0
    return max(2, min(4, os.cpu_count() or 1))


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the sources once, then fork the zygote before collection imports Ray,
    outside pytest's capture of fds 1 and 2 (a zygote forked with them held crashed its
    workers: "Object ... was not stored"). Under pytest-xdist each worker forks its own."""
    if not hasattr(config, "workerinput"):  # the controller (or the only process)
        _compile_sources()
    from raysim.engine import zygote

    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        zygote.fork_here()  # a no-op where forking is not supported or Ray is loaded already
        return
    with capman.global_and_fixture_disabled():
        zygote.fork_here()


def _compile_sources() -> None:
    """Where PYTHONDONTWRITEBYTECODE is set (on the development machine it is), every process
    the suite starts (the CLI's, a run's prepare child) would compile raysim's sources again,
    ~0.5 CPU-s each; compiled once here, they are read from __pycache__."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for package in ("raysim", "algorithms", "tune"):
        compileall.compile_dir(root / package, quiet=1)


RAY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread, as in the workers: two threads on two shared cores spin and crawl."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from raysim.runtime.local_ray import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=2)  # as a run starts it: without the daemons it never uses
    yield ray
    ray.shutdown()


def small_config(**overrides: object) -> list[str]:
    """--set overrides for a fast run on digits (a few seconds per round on 2 cores)."""
    base = {
        "rounds": 2,
        "algorithm.name": "fedavg",
        "data.dataset": "digits",
        "data.num_clients": 8,
        "data.cluster_sizes": "[4, 4]",
        "data.shift": "rotation",
        "data.samples_per_client": "null",  # all of digits, ~224 per client: not the demo's 60
        "training.lr": 0.1,
        "model.name": "cnn",
        "privacy.mode": "sample",
        "privacy.epsilon": 4,
        "privacy.delta": 1e-3,
        "training.batch_size": 16,
        "runtime.num_workers": 2,
        "runtime.progress": "false",
        "runtime.round_timeout_s": RAY_TIMEOUT_S,
    }
    base.update(overrides)
    if base["privacy.mode"] in ("sample", "distributed", "dprivacy"):  # an untrusted server:
        base.setdefault("privacy.client_seed", 11)  # the clients' seed, fixed: runs compare
    return [f"{k}={v}" for k, v in base.items()]


def inline_run(out, settings: dict, die_after: int | None = None, resume: bytes | None = None):
    """A small_config run with ``settings``, in this process without Ray (``raysim compare
    --inline``'s loop), into ``out``; its metrics without the timings. ``die_after``: stop it
    with KeyboardInterrupt after that round (a checkpoint stays); ``resume``: continue one."""
    import pyarrow.parquet as pq

    from algorithms import Environment, get_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.runtime.inline import run_inline
    from raysim.runtime.run import run_prepared

    cfg = load_config(None, small_config(**settings))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)

    def die(row):
        if row["round"] == die_after:
            raise KeyboardInterrupt

    run_prepared(prep, out, on_round=die if die_after else None, resume=resume, session=run_inline)
    return pq.read_table(out / "metrics.parquet").to_pandas().drop(columns="round_seconds")


_MODES: dict[int, Any] = {}


def mode_of(algo: Any) -> Any:
    """The engine's privacy mode for an algorithm a test built by hand (as ``prepare`` builds
    it: from the algorithm's needs), one per algorithm object so that a test's patch holds."""
    from raysim.privacy.modes import make_mode

    key = id(algo)
    if key not in _MODES or _MODES[key][0] is not algo:
        _MODES[key] = (algo, make_mode(algo.cfg, algo.env.train_sizes, algo.privacy_needs()))
    return _MODES[key][1]


def view_of(algo: Any, messages: Any) -> Any:
    """The server's view of ``messages`` under the algorithm's mode (``PrivacyMode.view``)."""
    return mode_of(algo).view(list(messages))


def summary_of(algo: Any) -> dict[str, Any]:
    """The privacy summary ``prepare`` records: the mode's, with what the algorithm adds."""
    mode = mode_of(algo)
    return {**mode.summary(), **algo.privacy_summary(mode.view())}


def releaser_of(algo: Any) -> Any:
    """The clients' side of the algorithm's mode, for a ClientContext a test builds by hand."""
    from raysim.privacy.modes.releaser import Releaser

    return Releaser(mode_of(algo))
