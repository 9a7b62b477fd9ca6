"""Many runs of the engine's round loop in-process (no Ray), in a pool of processes: the grid
scripts' runner (rr_table.py, galli_nu_table.py). Each run is written as a usual result
directory; one that has its summary.json already is skipped, so a grid resumes."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path


def one_run(config: str, sets: list[str], run_dir: str) -> tuple[str, float, float]:
    """One run in this (worker) process: one torch thread, the CPU, no Ray. Returns its
    directory, wall seconds and CPU seconds (preparation included: data, calibration)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from algorithms import Environment, get_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.metrics.results import write_results
    from raysim.runtime.inline import run_inline

    t0, c0 = time.perf_counter(), time.process_time()
    cfg = load_config(Path(config), sets)
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    write_results(Path(run_dir), prep, run_inline(prep, device="cpu"))
    return run_dir, time.perf_counter() - t0, time.process_time() - c0


def run_all(runs: list[tuple[str, list[str], str]], jobs: int, label: str) -> None:
    """``runs``: (config, overrides, result directory); those already finished are skipped."""
    todo = [r for r in runs if not (Path(r[2]) / "summary.json").exists()]
    print(f"{label}: {len(todo)} runs to do, {jobs} at once", file=sys.stderr)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one_run, *r) for r in todo]
        for i, fut in enumerate(as_completed(futures), 1):
            d, secs, cpu = fut.result()
            print(f"[{i}/{len(todo)}] {d}: {secs:.0f} s wall, {cpu:.0f} s CPU", file=sys.stderr)
    print(f"{label}: all runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
