"""`raysim sweep SWEEP.yaml`: run a sweep file with Ray Tune, locally or on a cluster.

Writes OUT/trials.parquet (one row per trial: its swept values, final metrics, eps), prints the
best trials and draws OUT/privacy_utility.png and OUT/knob_<key>.png. Tune's own state lives in
OUT/tune: `--resume` continues an interrupted sweep from there (finished trials are kept,
unfinished and errored ones run again).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from raysim.config import ConfigError
from raysim.seeding import public_seed
from raysim.state.rundir import error_text, handlers_kept, out_flag
from tune.selection import selection_cost, selection_note
from tune.space import (
    REPORTED,
    Sweep,
    combinations,
    label,
    load_sweep,
    trial_config,
    trial_variants,
)

TUNE_DIR = "tune"
SETTINGS = "sweep.yaml"  # what the trials are made from (base, space): --resume keeps to it
SELECTION = "selection.json"  # what choosing the best trial costs (tune.selection)
MAX_PREPARED = 64  # trial configs prepared before Ray (~0.5 s each); beyond, each value alone


def add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    sp = subparsers.add_parser("sweep", help="run a Ray Tune sweep file (tune/sweeps/*.yaml)")
    sp.add_argument("sweep", help="sweep YAML: base config + search space")
    sp.add_argument("--num-samples", type=int, help="repeats of the grid / random draws")
    sp.add_argument("--scheduler", choices=["fifo", "asha"], help="asha stops bad trials early")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override the base")
    sp.add_argument("--out", help="sweep directory (default: runs/sweep-NAME)")
    sp.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    sp.add_argument("--max-concurrent", type=int, help="trials at once (default: what fits)")
    sp.add_argument("--overwrite", action="store_true", help="replace the sweep already in --out")
    sp.set_defaults(func=sweep_main)
    return sp


def _scheduler(name: str | None, sweep: Sweep, rounds: int):
    if name in (None, "fifo"):
        return None
    from ray.tune.schedulers import ASHAScheduler

    # max_t past the last round: ASHA stops a trial at max_t, and one stopped at its last
    # round's report would never write its summary (a finished trial with no results).
    return ASHAScheduler(
        time_attr="training_iteration", max_t=rounds + 1, grace_period=max(1, rounds // 4)
    )


def search_alg(sweep: Sweep, max_concurrent: int | None = None):
    """Tune's own variant generator, but seeded from the base config's seed: unseeded it draws
    the random (non-grid) values from the global np.random, and two sweeps of one seed would
    try different hyperparameters."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    seed = public_seed(trial_config(sweep.base, {}).seed, 0, "sweep")
    # The limit lives here: Tune ignores max_concurrent_trials beside a given generator.
    return BasicVariantGenerator(max_concurrent=max_concurrent or 0, random_state=seed)


def tune_config(sweep: Sweep, args: argparse.Namespace):
    """Tune's settings of a fresh sweep (a resumed one keeps those it saved, its draws too)."""
    from ray import tune

    rounds = trial_config(sweep.base, {}).rounds
    return tune.TuneConfig(
        metric=sweep.metric,
        mode=sweep.mode,
        num_samples=args.num_samples or sweep.num_samples,
        scheduler=_scheduler(args.scheduler or sweep.scheduler, sweep, rounds),
        search_alg=search_alg(sweep, args.max_concurrent),
    )


def run_config(sweep: Sweep, storage: Path):
    """Tune's run settings: Tune's own logger callbacks for ``tracking.backend``, and with
    ``runtime.progress`` Tune's live table of the trials (their status, values and metric)."""
    from ray import tune

    from raysim.metrics.tracking import sweep_callbacks

    base = trial_config(sweep.base, {})
    return tune.RunConfig(
        name=sweep.name,
        storage_path=str(storage),
        verbose=1 if base.runtime.progress else 0,
        log_to_file=True,
        callbacks=sweep_callbacks(base.tracking, sweep.name),
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
    return tune.Tuner(
        trainable,
        param_space=sweep.param_space(),
        tune_config=tune_config(sweep, args),
        run_config=run_config(sweep, storage),
    )


def trial_rows(grid: Any, sweep: Sweep) -> list[dict[str, Any]]:
    """One row per trial that started. One an interruption kept from starting has no config
    in the grid (its row would show the base's values as its own): it is left out, counted
    among the unfinished, and `--resume` runs it."""
    rows = []
    for result in grid:
        if result.config is None:
            continue
        params = result.config
        cfg = trial_config(sweep.base, params)
        m = result.metrics or {}
        rows.append(
            {
                "trial_id": m.get("trial_id"),
                **{k: params.get(k) for k in sweep.space},
                "algorithm": cfg.algorithm.name,
                **_budget(cfg),
                "rounds_done": m.get("round"),
                **{k: m.get(k) for k in REPORTED},  # every metric a sweep may rank by
                "epsilon": m.get("epsilon"),
                "error": None if result.error is None else error_text(result.error),
                "path": result.path,
            }
        )
    return _flat_values(rows, sweep)


def _budget(cfg: Any) -> dict[str, float | None]:
    """A trial's (eps, delta) budget, where its mode's ledger is in (eps, delta)."""
    from raysim.privacy.modes import MODES

    mode = MODES[cfg.privacy.mode]
    accounted = mode.private and mode.accounts_epsilon
    return {
        "epsilon_budget": cfg.privacy.epsilon if mode.private else None,
        "delta": cfg.privacy.delta if accounted else None,
    }


def _flat_values(rows: list[dict[str, Any]], sweep: Sweep) -> list[dict[str, Any]]:
    """A swept key with list values (``training.client_dropout: [0, 0.5]``, cluster sizes) is
    written as JSON text, every value of it: a Parquet column holds one type."""
    for key in sweep.space:
        if any(isinstance(row[key], list | dict) for row in rows):
            for row in rows:
                row[key] = json.dumps(row[key])
    return rows


def size_to_cluster(sweep: Sweep, nodes: list[dict[str, float]]) -> None:
    """Where the sweep pins no runtime.cpus_per_worker, give each trial's workers the share of
    the largest node that lets a trial run (at most 1 CPU each), instead of a request that waits
    forever."""
    from raysim.runtime.resources import sized_cpus_per_worker

    pinned = "cpus_per_worker" in (sweep.base.get("runtime") or {})
    if pinned or "runtime.cpus_per_worker" in sweep.space:
        return
    rt = trial_config(sweep.base, {}).runtime
    cpus = sized_cpus_per_worker(rt.num_workers, nodes)
    if cpus < rt.cpus_per_worker and cpus > 0:
        sweep.base.setdefault("runtime", {})["cpus_per_worker"] = cpus
        print(
            f"raysim: trials sized to this cluster: {rt.num_workers} workers x {cpus:g} CPU "
            "each (set runtime.cpus_per_worker to choose)",
            file=sys.stderr,
        )


def check_trials(sweep: Sweep, nodes: list[dict[str, float]]) -> None:
    """Every trial's placement group must fit the cluster (or, on an autoscaling cluster, a
    node type), else ConfigError with the fix: Tune itself would wait forever."""
    from raysim.runtime.resources import check_request, gpus_per_worker, node_types

    cluster_gpus = sum(n.get("GPU", 0.0) for n in nodes)
    variants: list[dict[str, Any]] = [{}]
    for key, spec in sweep.space.items():
        ((kind, values),) = spec.items()
        if key.startswith("runtime.") and kind in ("grid", "choice"):
            variants += [{key: v} for v in values]
    notes = set()
    for params in variants:
        rt = trial_config(sweep.base, params).runtime
        types = node_types() if rt.address else None
        note = check_request(rt, gpus_per_worker(rt, cluster_gpus), nodes, True, types)
        if note:
            notes.add(note)
    for note in sorted(notes):
        print(f"raysim: {note}", file=sys.stderr)


def check_trials_start(sweep: Sweep) -> None:
    """Every trial's config prepared (its data built, its noise calibrated) before Ray, as
    `raysim compare` does: a budget or a split that a trial cannot meet is refused now, naming
    the trial, not after the other trials ran. The trials are the combinations of the grid and
    choice values, each range at its two ends, or each value alone past MAX_PREPARED."""
    from raysim.compose import check_budgets, for_algorithm
    from raysim.config import dump_config
    from raysim.limits import check_schedule

    # one of each config: e.g. fedavg's trials that differ only in keys it leaves out
    distinct: dict[str, tuple[str, Any]] = {}
    for params in trial_variants(sweep.space, MAX_PREPARED):
        cfg = for_algorithm(trial_config(sweep.base, params), quiet=True)
        try:  # a schedule this machine cannot hold: refused before any trial is prepared
            check_schedule(cfg)
        except ConfigError as exc:
            raise ConfigError(f"trial {label(params) or '(the base config)'}: {exc}") from None
        distinct.setdefault(dump_config(cfg), (label(params), cfg))
    count = combinations(sweep.space)
    how = f" (of {count} combinations, each value alone)" if count > MAX_PREPARED else ""
    print(
        f"raysim: preparing {len(distinct)} trial configurations{how} before Ray", file=sys.stderr
    )
    check_budgets(list(distinct.values()), what="trial configurations")


def _unfinished_trials(grid: Any) -> int:
    """Trials an interruption left to `--resume`. Read from the state Tune saved: after Ctrl-C
    (or SIGTERM) the trials in memory are all TERMINATED, those saved still running (loaded
    back as PENDING)."""
    from ray.tune import ExperimentAnalysis

    trials = ExperimentAnalysis(grid.experiment_path).trials
    return sum(t.status not in ("TERMINATED", "ERROR") for t in trials)


def check_out(out: Path, args: argparse.Namespace) -> None:
    """The flags, and --out against what it holds, before Ray: a sweep goes into a directory of
    its own, continues only one that is there, and replaces one only with --overwrite."""
    for flag in ("num_samples", "max_concurrent"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the sweep in --out; --overwrite replaces it")
    from raysim.state.rundir import check_place

    check_place(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    held = out.is_dir() and any(out.iterdir())
    swept = (out / TUNE_DIR).is_dir()
    if args.resume and not swept:
        raise ConfigError(f"--resume: {str(out)!r} holds no sweep to continue")
    if held and not swept:
        raise ConfigError(f"--out {str(out)!r} holds other files, not a sweep: choose another")
    if swept and not (args.resume or args.overwrite):
        raise ConfigError(
            f"--out {str(out)!r} already holds a sweep: --resume continues it, --overwrite "
            "replaces it, or choose another --out"
        )


def clear_out(out: Path) -> None:
    """The sweep --overwrite replaces, once the new one is known to start: its trials must not
    mix with the old ones'."""
    if not (out / TUNE_DIR).is_dir():
        return
    import shutil

    shutil.rmtree(out / TUNE_DIR)
    made = (
        "trials.parquet",
        SELECTION,
        "privacy_utility.png",
        *(p.name for p in out.glob("knob_*")),
    )
    for old in made:
        (out / old).unlink(missing_ok=True)


def set_flags(sets: list[str]) -> list[str]:
    return [token for item in sets for token in ("--set", item)]


def save_settings(out: Path, sweep: Sweep, sets: list[str]) -> None:
    saved = {"base": sweep.base, "space": sweep.space, "set": sets}
    (out / SETTINGS).write_text(yaml.safe_dump(saved, sort_keys=False))


def check_same_settings(out: Path, sweep: Sweep) -> list[str]:
    """A resumed sweep's trials are made from what its first ones were: another base (the sweep
    file's, or --set values) or space is refused, naming the keys; runtime.* may change. The
    --set values it started with (none known for a sweep started before they were kept)."""
    from raysim.config import changed_keys, dump_config

    path = out / SETTINGS
    if not path.is_file():
        return []
    saved = yaml.safe_load(path.read_text())
    before, now = trial_config(saved["base"], {}), trial_config(sweep.base, {})
    changed = changed_keys(dump_config(before), dump_config(now))
    changed += ["space"] if saved["space"] != sweep.space else []
    if changed:
        sets = shlex.join(set_flags(saved["set"]))
        raise ConfigError(
            f"--resume: the sweep in {str(out)!r} was started with other settings "
            f"({', '.join(changed)}): resume it with the same sweep file and --set values "
            f"(it started with {sets or 'none'}), or choose another --out"
        )
    return list(saved["set"])


def check_tracking(sweep: Sweep) -> None:
    """The base's ``tracking`` holds for every trial (Tune's callbacks log them all): its
    package must be there, and a swept tracking key or a TensorBoard ``dir`` is refused, as
    Tune's TensorBoard callback writes into each trial's own directory."""
    from raysim.metrics.tracking import check_available, mlflow_uri

    swept = sorted(k for k in sweep.space if k.startswith("tracking."))
    if swept:
        raise ConfigError(
            f"space: {', '.join(swept)}: a sweep's trials are all logged alike; set tracking "
            "in the base config"
        )
    tracking = trial_config(sweep.base, {}).tracking
    check_available(tracking)
    if tracking.backend == "mlflow":  # a resumed sweep's callback (saved by Tune) needs it too
        mlflow_uri(tracking)
    if tracking.backend == "tensorboard" and tracking.dir:
        raise ConfigError(
            "tracking.dir: a sweep's TensorBoard logs go into each trial's directory "
            "(OUT/tune/NAME/TRIAL, read with `tensorboard --logdir OUT/tune`); leave it unset"
        )


class _SaidByRaysim(logging.Filter):
    """Tune's own words on an interrupted sweep: a `Tuner.restore(...)` call to resume it, and a
    warning per trial that never started. raysim says both itself (the command that continues
    it, the unfinished trials), and Tune's ~30 lines buried that one line."""

    SAID = ("Experiment has been interrupted", "Failed to fetch metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.SAID)


SAID_BY_RAYSIM = _SaidByRaysim()  # one: a logger adds a filter it holds already no more


def sweep_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sweep = load_sweep(args.sweep, list(args.set or []))  # user mistakes fail before Ray
    check_tracking(sweep)
    out = Path(out_flag(args.out) or Path("runs") / f"sweep-{sweep.name}").resolve()
    check_out(out, args)
    sets = list(args.set or [])
    if args.resume:  # it was checked when it started
        sets = check_same_settings(out, sweep) or sets
    else:
        check_trials_start(sweep)
    if args.overwrite:
        clear_out(out)
    from raysim.engine import zygote

    runtime = trial_config(sweep.base, {}).runtime
    # before Ray loads: the trials' processes are forked from it
    forked_here = runtime.forks_workers and zygote.fork_here()
    import pandas as pd

    from raysim.runtime.resources import alive_nodes
    from raysim.runtime.session import ensure_ray
    from tune.plots import plot_sweep

    for name in ("ray.tune.tune", "ray.tune.analysis.experiment_analysis"):
        logging.getLogger(name).addFilter(SAID_BY_RAYSIM)
    started = False
    try:
        started = ensure_ray(runtime)
        nodes = alive_nodes()
        size_to_cluster(sweep, nodes)
        check_trials(sweep, nodes)  # before Tune: it would wait forever on a misfit
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            save_settings(out, sweep, sets)
        with handlers_kept(signal.SIGINT, signal.SIGUSR1):
            grid = _tuner(sweep, args, out / TUNE_DIR).fit()
    finally:
        if started:
            import ray

            ray.shutdown()
        if forked_here:
            zygote.release()
    df = pd.DataFrame(trial_rows(grid, sweep))
    df.to_parquet(out / "trials.parquet", index=False)
    plot_sweep(df, sweep, out)
    best = df.sort_values(sweep.metric, ascending=sweep.mode == "min", na_position="last")
    cols = [*sweep.space, "accuracy", sweep.metric, "loss", "ari", "epsilon", "rounds_done"]
    shown = best[[c for c in dict.fromkeys(cols) if c in best]].head(5).copy()
    shown = shown.dropna(axis="columns", how="all")  # e.g. ari where no trial clusters
    for col in ("accuracy", "accuracy_min", "accuracy_minority"):
        if col in shown:
            shown[col] = (100 * shown[col]).round(1)
    which = "all" if len(df) <= len(shown) else f"the best {len(shown)} of"
    print(f"{which} {len(df)} trials by {sweep.metric} (every trial: {out / 'trials.parquet'})")
    print(shown.rename(columns={"accuracy": "accuracy %"}).to_string(index=False))
    cost = selection_cost(df)
    note = selection_note(cost)
    (out / SELECTION).write_text(json.dumps({**(cost or {}), "note": note}, indent=2) + "\n")
    if note:
        print(note)
    print(f"sweep results: {out}", file=sys.stderr)
    unfinished = _unfinished_trials(grid)
    if unfinished:
        again = ["raysim", "sweep", args.sweep, "--out", str(out), "--resume", *set_flags(sets)]
        print(
            f"raysim: interrupted with {unfinished} trials unfinished; continue with "
            f"`{shlex.join(again)}`",
            file=sys.stderr,
        )
        return 130
    failed = df[df["error"].notna()]
    if len(failed):
        print(f"raysim: {len(failed)} of {len(df)} trials failed:", file=sys.stderr)
        for _, row in failed.iterrows():
            values = ", ".join(f"{k}={row[k]}" for k in sweep.space)
            print(f"  {values}: {row['error']} (logs: {row['path']})", file=sys.stderr)
        return 1
    return 0
