"""`raysim sweep SWEEP.yaml`: run a sweep file with Ray Tune, locally or on a cluster.

Writes OUT/trials.parquet (one row per trial: its swept values, final metrics, eps), prints the
best trials and draws OUT/privacy_utility.png and OUT/knob_<key>.png. Tune's own state lives in
OUT/tune: `--resume` continues an interrupted sweep from there (finished trials are kept,
unfinished and errored ones run again).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from raysim.config import ConfigError
from tune.space import Sweep, load_sweep, trial_config

TUNE_DIR = "tune"


def add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    sp = subparsers.add_parser("sweep", help="run a Ray Tune sweep file (tune/sweeps/*.yaml)")
    sp.add_argument("sweep", help="sweep YAML: base config + search space")
    sp.add_argument("--num-samples", type=int, help="repeats of the grid / random draws")
    sp.add_argument("--scheduler", choices=["fifo", "asha"], help="asha stops bad trials early")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override the base")
    sp.add_argument("--out", help="sweep directory (default: runs/sweep-NAME)")
    sp.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    sp.add_argument("--max-concurrent", type=int, help="trials at once (default: what fits)")
    sp.set_defaults(func=sweep_main)
    return sp


def _scheduler(name: str | None, sweep: Sweep, rounds: int):
    if name in (None, "fifo"):
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(
        time_attr="training_iteration", max_t=rounds, grace_period=max(1, rounds // 4)
    )


def _tuner(sweep: Sweep, args: argparse.Namespace, storage: Path):
    from ray import tune

    from tune.trainable import make_trainable

    trainable = make_trainable(sweep.base)
    path = storage / sweep.name
    if args.resume:
        if not tune.Tuner.can_restore(str(path)):
            raise ConfigError(f"--resume: no sweep to continue in {str(path)!r}")
        return tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    rounds = trial_config(sweep.base, {}).rounds
    return tune.Tuner(
        trainable,
        param_space=sweep.param_space(),
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=args.num_samples or sweep.num_samples,
            scheduler=_scheduler(args.scheduler or sweep.scheduler, sweep, rounds),
            max_concurrent_trials=args.max_concurrent,
        ),
        run_config=tune.RunConfig(
            name=sweep.name, storage_path=str(storage), verbose=0, log_to_file=True
        ),
    )


def trial_rows(grid: Any, sweep: Sweep) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        cfg = trial_config(sweep.base, result.config)
        m = result.metrics or {}
        rows.append(
            {
                "trial_id": m.get("trial_id"),
                **{k: result.config.get(k) for k in sweep.space},
                "algorithm": cfg.algorithm.name,
                "epsilon_budget": cfg.privacy.epsilon if cfg.privacy.mode != "none" else None,
                "rounds_done": m.get("round"),
                "accuracy": m.get("accuracy"),
                "loss": m.get("loss"),
                "ari": m.get("ari"),
                "accuracy_min": m.get("accuracy_min"),
                "epsilon": m.get("epsilon"),
                "error": None if result.error is None else type(result.error).__name__,
                "path": result.path,
            }
        )
    return rows


def sweep_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sweep = load_sweep(args.sweep, list(args.set or []))  # user mistakes fail before Ray
    out = Path(args.out or Path("runs") / f"sweep-{sweep.name}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    from raysim.runtime.session import ensure_ray
    from tune.plots import plot_sweep

    started = ensure_ray(trial_config(sweep.base, {}).runtime)
    try:
        grid = _tuner(sweep, args, out / TUNE_DIR).fit()
    finally:
        if started:
            import ray

            ray.shutdown()
    df = pd.DataFrame(trial_rows(grid, sweep))
    df.to_parquet(out / "trials.parquet", index=False)
    plot_sweep(df, sweep, out)
    best = df.sort_values(sweep.metric, ascending=sweep.mode == "min", na_position="last")
    cols = [*sweep.space, "accuracy", "loss", "ari", "epsilon", "rounds_done"]
    print(best[[c for c in dict.fromkeys(cols) if c in best]].head(5).to_string(index=False))
    print(f"sweep results: {out}", file=sys.stderr)
    failed = int(df["error"].notna().sum())
    if failed:
        print(
            f"raysim: {failed} of {len(df)} trials failed (see {out / TUNE_DIR})", file=sys.stderr
        )
    return 1 if failed == len(df) else 0
