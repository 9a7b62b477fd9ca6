"""`raysim compare`: one setup under several algorithms and seeds, and the paper's table.

    raysim compare CONFIG --algorithms rdpcfl,ifca,fedavg,local --seeds 0,1,2 [--set k=v]
                   [--out DIR [--resume]] [--inline [--jobs N]] [--report-only]

Each (algorithm, seed) run writes its usual result directory under OUT/ALGORITHM/seedS; the
table (mean +- std over seeds of the final All / Majority / Minority accuracy, the minimum client
accuracy, how many seeds clustered every client correctly after round 1 and at the end, and
R-DPCFL's chosen M, MSS and E_c) is printed and written to OUT/compare.md and compare.json.

``--inline`` runs the rounds in this process, without Ray (``raysim.runtime.inline``): the
same algorithm calls with the same seeded generators, so the same numbers as the engine on the
same device;
it serves machines without Ray (the GPU box) and tests. ``--jobs N`` runs N of the inline runs
at once, each in its own process (each run's numbers are the same as alone). Every run writes
checkpoints as ``raysim run`` does, inline too; ``--out OUT --resume`` keeps OUT's finished runs
and continues its unfinished ones from their checkpoints (a paper-scale table is hours of runs).
``--report-only`` re-reads OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from raysim.config import ConfigError, changed_keys, dump_config, load_config, with_client_seed

# (column, metric in summary.json "final", scale)
ACCURACY_COLUMNS = (
    ("All", "accuracy"),
    ("Majority", "accuracy_majority"),
    ("Minority", "accuracy_minority"),
    ("Min acc", "accuracy_min"),
    ("Acc disparity", "accuracy_disparity"),
)


# ------------------------------------------------------------------------------- the table


def _mean_std(values: Sequence[float | None], scale: float = 100.0) -> str:
    vals = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "-"
    if len(vals) == 1:  # one seed: no spread to show
        return f"{vals[0]:.2f}"
    return f"{np.mean(vals):.2f} ± {float(np.std(vals)):.2f}"


def _first_row_value(run_dir: Path, column: str) -> Any:
    import pyarrow.parquet as pq

    table = pq.read_table(run_dir / "metrics.parquet")
    if column not in table.column_names:
        return None
    return table.column(column).to_pylist()[0]


def collect(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every finished run under OUT/ALGORITHM/seedS, grouped by algorithm."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for summary_path in sorted(out.glob("*/seed*/summary.json")):
        run_dir = summary_path.parent
        s = json.loads(summary_path.read_text())
        final = s.get("final", {})
        row = {"seed": s["seed"], "dir": str(run_dir), "rounds": s["rounds"], **final}
        row["ari_round1"] = _first_row_value(run_dir, "ari")
        row["epsilon_spent"] = s.get("epsilon")
        row["epsilon_unamplified"] = s.get("epsilon_unamplified")
        row["warning"] = s.get("warning")
        row["privacy_mode"] = s.get("privacy_mode")
        row["rounds_seconds"] = s.get("rounds_seconds")
        row["reports_per_round"] = s.get("reports_per_round")
        row["dropped_out"] = s.get("dropped_out")
        row["aborted_rounds"] = s.get("aborted_rounds")
        row["stretches"] = s.get("stretches")
        row["client_seed"] = _client_seed_of(run_dir)
        runs.setdefault(run_dir.parent.name, []).append(row)
    return runs


def _client_seed_of(run_dir: Path) -> int | None:
    """The clients' seed a run recorded (an untrusted server's run: the one given, or the one
    it drew); None for a trusted server's, or a run made before the clients had one."""
    from raysim.config import read_yaml_mapping

    path = run_dir / "config.yaml"
    cfg = read_yaml_mapping(path, "the run's config") if path.is_file() else {}
    return (cfg.get("privacy") or {}).get("client_seed")


def shared_client_seeds(runs: dict[str, list[dict[str, Any]]], names: Sequence[str]) -> str | None:
    """A note for the algorithms whose seeds all ran with one clients' seed (a pinned
    ``privacy.client_seed``): their clients drew the same DP noise, batches and choices in each
    run, so the spread over seeds is the server's draws alone, not that of independent runs."""
    shared: dict[str, int] = {}
    for a in names:
        seeds = {r.get("client_seed") for r in runs[a]}
        if len(runs[a]) > 1 and len(seeds) == 1 and None not in seeds:
            shared[a] = seeds.pop()
    if not shared:
        return None
    which = "; ".join(f"{a} ({seed})" for a, seed in shared.items())
    return (
        f"Seeds sharing one clients' seed (privacy.client_seed, pinned): {which}. Their clients "
        "drew the same DP noise, batches and choices in every seed, so the std over seeds "
        "measures the server's draws only (leave privacy.client_seed out: each run draws its "
        "own)."
    )


def table_order(out: Path) -> list[str]:
    """The algorithms in the order of the table already in OUT (none: no table yet), so that a
    compare that adds runs to OUT, or continues them, leaves the rows where they were."""
    md = out / "compare.md"
    if not md.is_file():
        return []
    rows = itertools.takewhile(lambda line: line.startswith("|"), md.read_text().splitlines())
    return [row.split("|")[1].strip().split(" (")[0] for row in list(rows)[2:]]


DISTRIBUTED_EPS_NOTE = (
    "Distributed DP (eps A (amplified by sampling, participation hidden) / B (no "
    "amplification)): A is accounted for a cohort of privacy.noise_cohort_size Poisson-sampled "
    "from privacy.population, and holds only where who took part is hidden from the server; B is "
    "the same noise with every secure sum composed (sampling rate 1), what holds where the "
    "server sees the cohort."
)


def table(runs: dict[str, list[dict[str, Any]]], order: Sequence[str] | None = None) -> str:
    """Markdown: accuracies in %, mean ± std over seeds; clustering success as k/n seeds."""
    names = [a for a in (order or runs) if a in runs]
    # where clients were unavailable (training.client_dropout): the reports a round got
    dropout = any(r.get("dropped_out") is not None for a in names for r in runs[a])
    # where a secure aggregation could abort (privacy.shortfall: abort): how many rounds did
    aborts = any(r.get("aborted_rounds") is not None for a in names for r in runs[a])
    head = ["algorithm", "seeds", "rounds"] + (["reports/round"] if dropout else [])
    head += ["aborted rounds"] if aborts else []
    head += [c for c, _ in ACCURACY_COLUMNS]
    head += ["ARI=1 after r1", "ARI=1 at end", "eps spent", "M", "MSS", "E_c", "min/run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in names:
        rs = runs[a]
        from raysim.metrics.report import METRIC_DP, NO_DP
        from raysim.metrics.results import warning_label
        from raysim.privacy.report import both_epsilons

        warnings = sorted({warning_label(r["warning"]) for r in rs if r.get("warning")})
        label = f"{a} ({'; '.join(warnings)})" if warnings else a
        cells = [label, str(len(rs)), ",".join(sorted({str(r["rounds"]) for r in rs}))]
        if dropout:
            cells.append(_mean_std([r.get("reports_per_round") for r in rs], scale=1.0))
        if aborts:
            cells.append(_mean_std([r.get("aborted_rounds") for r in rs], scale=1.0))
        cells += [_mean_std([r.get(key) for r in rs]) for _, key in ACCURACY_COLUMNS]
        for key in ("ari_round1", "ari"):
            vals = [r.get(key) for r in rs if r.get(key) is not None]
            cells.append(f"{sum(np.isclose(v, 1.0) for v in vals)}/{len(vals)}" if vals else "-")
        if all(r.get("privacy_mode") == "none" for r in rs):
            cells.append(NO_DP)  # nothing accounted: not "0", which reads as private
        elif all(r.get("privacy_mode") == "dprivacy" for r in rs):
            cells.append(METRIC_DP)
        elif all(r.get("epsilon_unamplified") is not None for r in rs):  # distributed
            amplified = _mean_std([r.get("epsilon_spent") for r in rs], scale=1.0)
            unamplified = _mean_std([r.get("epsilon_unamplified") for r in rs], scale=1.0)
            cells.append(both_epsilons(amplified, unamplified))
        else:
            cells.append(_mean_std([r.get("epsilon_spent") for r in rs], scale=1.0))
        ms = [r.get("num_clusters") for r in rs if r.get("num_clusters") is not None]
        cells.append(",".join(str(int(m)) for m in ms) if ms else "-")
        cells.append(_mean_std([r.get("gmm_mss") for r in rs], scale=1.0))
        ecs = [r.get("switch_round") for r in rs if r.get("switch_round") is not None]
        cells.append(",".join(str(int(e)) for e in ecs) if ecs else "-")
        cells.append(_mean_std([r.get("rounds_seconds") for r in rs], scale=1 / 60))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\nAccuracies in % (mean, and std over seeds when more than one); "
        "eps spent: the largest per-client eps; min/run: minutes of rounds per run (summed "
        "over its rounds, across resumes)."
    )
    if any(r.get("epsilon_unamplified") is not None for a in names for r in runs[a]):
        lines += ["", DISTRIBUTED_EPS_NOTE]
    shared = shared_client_seeds(runs, names)
    for line in ([shared] if shared else []) + machines(runs, names):  # paragraphs of their own
        lines += ["", line]
    return "\n".join(lines)


def machines(runs: dict[str, list[dict[str, Any]]], names: Sequence[str]) -> list[str]:
    """Which machine ran which rounds (rundir.machine), so that min/run is read against the CPU
    that took it; runs written before the stretches were recorded are named as such."""
    ran: dict[str, list[str]] = {}
    unknown: list[str] = []
    for a in names:
        for r in sorted(runs[a], key=lambda r: r["seed"]):
            stretches = r.get("stretches") or []
            if not stretches:
                unknown.append(f"{a} seed {r['seed']}")
                continue
            if stretches[0]["from_round"] > 1:  # begun before starts recorded their machine
                unknown.append(f"{a} seed {r['seed']} rounds 1-{stretches[0]['from_round'] - 1}")
            spans: list[list[Any]] = []  # [machine, first round, last round]
            for i, st in enumerate(stretches):
                end = stretches[i + 1]["from_round"] - 1 if i + 1 < len(stretches) else r["rounds"]
                where = f"{st.get('cpu')}, {st.get('cpus')} CPUs, torch {st.get('torch')}"
                if end < st["from_round"]:  # a start that ran no round
                    continue
                if spans and spans[-1][0] == where:  # continued on the same kind of machine
                    spans[-1][2] = end
                else:
                    spans.append([where, st["from_round"], end])
            for where, first, last in spans:
                ran.setdefault(where, []).append(f"{a} seed {r['seed']} rounds {first}-{last}")
    out = [f"Ran on {where}: {'; '.join(what)}." for where, what in ran.items()]
    if unknown:
        out.append(f"Machine not recorded: {'; '.join(unknown)}.")
    return out


# ------------------------------------------------------------------------------------ CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysim compare", description=__doc__.splitlines()[0])
    p.add_argument("config", help="experiment YAML")
    p.add_argument(
        "--algorithms", default="rdpcfl,ifca,fedavg,local", help="comma-separated (%(default)s)"
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (%(default)s)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--out", help="result directory (default: runs/compare-NAME-TIME)")
    p.add_argument("--inline", action="store_true", help="run in this process, without Ray")
    p.add_argument(
        "--jobs", type=int, default=1, help="with --inline: runs at once, one process each"
    )
    p.add_argument("--report-only", action="store_true", help="only re-read OUT's runs")
    p.add_argument("--overwrite", action="store_true", help="replace runs already in OUT")
    p.add_argument(
        "--resume",
        action="store_true",
        help="with --out: keep OUT's finished runs, continue its unfinished ones from their "
        "checkpoints, start the missing ones",
    )
    return p


def compare_main(argv: Sequence[str] | None = None) -> int:
    from raysim.compose import check_budgets

    args = parser().parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        msg = f"--seeds: expected comma-separated integers, got {args.seeds!r}"
        raise ConfigError(msg) from None
    for flag, values in (("--algorithms", algorithms), ("--seeds", seeds)):
        if not values:
            raise ConfigError(f"{flag}: give at least one (comma-separated)")
        if len(set(values)) < len(values):
            raise ConfigError(f"{flag}: each at most once, got {getattr(args, flag[2:])!r}")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out!r} is a file, not a directory")
    for item in args.set or []:  # --seeds and --algorithms replace them: said, not unseen
        key = item.split("=", 1)[0].strip()
        if key in ("seed", "algorithm.name"):
            flag = "--seeds" if key == "seed" else "--algorithms"
            print(f"raysim compare: --set {item.strip()}: replaced by {flag}", file=sys.stderr)
    from raysim.limits import check_schedule
    from raysim.state import rundir

    rundir.out_flag(args.out)
    if args.report_only and not args.out:
        raise ConfigError("--report-only re-reads an earlier compare: give its --out DIR")
    if args.report_only and not Path(args.out).is_dir():
        raise ConfigError(f"--report-only: --out {args.out!r} does not exist")
    if args.jobs < 1 or (args.jobs > 1 and not args.inline):
        msg = f"--jobs: expected 1, or a count above 1 with --inline; got {args.jobs}"
        raise ConfigError(msg + ("" if args.inline else " without --inline"))
    if args.out:
        rundir.check_place(Path(args.out))
    configs = configs_of(args.config, list(args.set or []), algorithms, seeds)
    for cfg in configs[:: len(seeds)]:  # a schedule this machine cannot hold: refused now
        check_schedule(cfg)
    if args.resume and (args.overwrite or not args.out):
        raise ConfigError(
            "--resume: continues the runs in --out DIR; give --out, and not --overwrite"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / f"compare-{configs[0].name}-{stamp}"
    rundir.check_home(out)  # its compare.md is written in a directory of raysim's only
    failed: list[str] = []
    if not args.report_only:
        # never overwrite results unasked, and refuse before anything runs
        jobs = [_job(cfg, out, args.overwrite, args.resume) for cfg in configs]
        by_name: dict[str, list[Any]] = {}  # each algorithm's first run: its seeds prepare alike
        for job in filter(None, jobs):
            by_name.setdefault(job.cfg.algorithm.name, []).append(job.cfg)
        firsts = [
            (f"{a} (seeds {', '.join(str(c.seed) for c in cs)})", cs[0])
            for a, cs in by_name.items()
        ]
        check_budgets(firsts, what="algorithms")
        fresh = not out.exists()
        try:
            rundir.mark_home(out)
            failed = run_all([j for j in jobs if j], out, args.inline, args.overwrite, args.jobs)
        except ConfigError:
            if fresh:
                rundir.remove_if_unused(out)
            raise
        except KeyboardInterrupt:
            given = _without_out(list(argv if argv is not None else sys.argv[1:]))
            again = ["raysim", "compare", *given, "--out", str(out), "--resume"]
            print(f"raysim compare: continue with `{shlex.join(again)}`", file=sys.stderr)
            raise
    runs = collect(out)
    # every run under OUT: a compare of some of its algorithms keeps the others' rows, each
    # where the table OUT held had it
    order = [*table_order(out), *algorithms, *sorted(set(runs) - set(algorithms))]
    text = table(runs, list(dict.fromkeys(order)))
    from raysim.state.rundir import find_runs

    unfinished = find_runs(out)[1] if out.is_dir() else []
    if unfinished:  # a table of a campaign part done must say so, and how it goes on
        text += "\n\nNot in the table, unfinished (continue them: `raysim compare` with this "
        text += "--out and --resume):"
        text += "".join(f"\n- {u.path}: after round {u.rounds_done}" for u in unfinished)
    rundir.mark_home(out)
    (out / "compare.md").write_text(text + "\n")
    (out / "compare.json").write_text(json.dumps(runs, indent=1, default=str))
    print(text)
    if failed:
        print(f"raysim compare: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _without_out(argv: list[str]) -> list[str]:
    """A compare's arguments less --out DIR, --overwrite and --resume (the hint adds its own)."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--out":
            skip = True
        elif not token.startswith("--out=") and token not in ("--overwrite", "--resume"):
            kept.append(token)
    return kept


def configs_of(config: str, sets: list[str], algorithms: list[str], seeds: list[int]) -> list:
    """The config of each run a compare makes, algorithm by algorithm, seed by seed."""
    from raysim.compose import for_algorithm

    return [  # the keys an algorithm leaves out said once, not once per seed
        for_algorithm(
            load_config(config, [*sets, f"algorithm.name={a}", f"seed={s}"]), s != seeds[0]
        )
        for a in algorithms
        for s in seeds
    ]


def _job(cfg: Any, out: Path, overwrite: bool, resume: bool) -> Job | None:
    """The run to do for ``cfg`` under OUT: None if ``resume`` finds it finished, a continuation
    if it finds it unfinished (refused if it was started with other settings)."""
    from raysim.config import dump_config
    from raysim.state import rundir

    target = out / cfg.algorithm.name / f"seed{cfg.seed}"
    stage = rundir.staging_dir(target)
    label = f"{cfg.algorithm.name} seed {cfg.seed}"
    if not resume:
        if stage.is_dir() and not overwrite:
            raise ConfigError(
                f"an unfinished run is in {str(stage)!r}: continue OUT's unfinished runs by "
                "adding --resume to this command, or pass --overwrite to start over"
            )
        rundir.check_target(target, overwrite)
        return Job(cfg, False)

    def same_settings(run: Path) -> Any:  # cfg as the run in ``run`` was made, else refused
        saved = load_config(run / "config.yaml") if (run / "config.yaml").is_file() else None
        if saved is None:
            return cfg
        made = cfg
        if cfg.privacy.client_seed is None:  # the one it drew and recorded
            made = with_client_seed(cfg, saved.privacy.client_seed)
        changed = changed_keys(dump_config(saved), dump_config(made))
        if changed:
            raise ConfigError(
                f"--resume: {label} in {str(run)!r} was made with other settings "
                f"({', '.join(changed)}): use the same config and --set values, or another --out"
            )
        return made

    if not stage.is_dir():
        if (target / "summary.json").is_file():
            same_settings(target)
            print(f"raysim compare: {label}: finished, kept ({target})", file=sys.stderr)
            return None
        rundir.check_target(target, overwrite=False)  # anything else there: refused
        return Job(cfg, False)
    rundir.date_recorded_draws(stage)
    cfg = same_settings(stage)
    done = rundir.unfinished(stage).rounds_done  # a staging directory: never None
    print(f"raysim compare: {label}: continuing after round {done}", file=sys.stderr)
    return Job(cfg, True)


class Job(NamedTuple):
    cfg: Any
    resuming: bool  # continue the run's staging directory (from its checkpoint, if any)


def run_all(
    jobs: list[Job], out: Path, inline: bool, overwrite: bool = False, parallel: int = 1
) -> list[str]:
    """Every run, one after another (or ``parallel`` inline runs at once); the runs that
    failed."""
    if not jobs:
        return []
    if inline and parallel > 1:
        return _run_parallel(jobs, out, overwrite, parallel)
    from raysim.engine import zygote

    started = forked_here = False
    kept: Any = contextlib.nullcontext()
    try:
        if not inline:  # one Ray for all the runs, and their actors kept from one run to the next
            if jobs[0].cfg.runtime.forks_workers:  # before Ray loads and any torch operation
                forked_here = zygote.fork_here()
            from raysim.runtime.resources import check_before_local_ray
            from raysim.runtime.reuse import kept_actors
            from raysim.runtime.session import ensure_ray

            for job in jobs:  # workers this machine can never place: refused before Ray starts
                check_before_local_ray(job.cfg.runtime, job.cfg.data.num_clients)
            started = ensure_ray(jobs[0].cfg.runtime)
            kept = kept_actors()
        failed = []
        with kept:
            for job in jobs:
                try:
                    _run_job(job, out, inline, overwrite)
                except ConfigError:
                    raise
                except Exception as exc:  # noqa: BLE001 - named, as with --jobs: the others go on
                    from raysim.state.rundir import error_text

                    label = f"{job.cfg.algorithm.name} seed {job.cfg.seed}"
                    print(f"{label} failed: {error_text(exc)}", file=sys.stderr)
                    failed.append(label)
    finally:
        if started:
            import ray

            ray.shutdown()
        if forked_here:
            zygote.release()
    return failed


def _run_job(job: Job, out: Path, inline: bool, overwrite: bool, lines: bool = False) -> None:
    from algorithms import Environment, get_algorithm
    from raysim.cli.common import run_one
    from raysim.engine.experiment import prepare
    from raysim.state.checkpoint import check_config, check_decodes, load_checkpoint
    from raysim.state.rundir import staging_dir

    cfg = job.cfg
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    run_dir = out / cfg.algorithm.name / f"seed{cfg.seed}"
    blob = load_checkpoint(staging_dir(run_dir)) if job.resuming else None
    if blob is not None:  # a checkpoint of another config, or one that holds code: refused
        check_config(blob, dump_config(prep.recorded_config()), str(staging_dir(run_dir)))
        check_decodes(blob, type(prep.algorithm), staging_dir(run_dir))
    from raysim.runtime.inline import run_inline

    t0 = time.perf_counter()
    # a paper-scale inline run takes hours: it writes checkpoints as a Ray run does
    run_one(
        prep,
        run_dir,
        resume=blob,
        overwrite=overwrite,
        resuming=job.resuming,
        session=run_inline if inline else None,
        label=f"{cfg.algorithm.name} seed {cfg.seed}",
        lines=lines,
    )
    print(
        f"{cfg.algorithm.name} seed {cfg.seed}: {time.perf_counter() - t0:.0f} s -> {run_dir}",
        file=sys.stderr,
        flush=True,
    )


def _run_parallel(jobs: list[Job], out: Path, overwrite: bool, parallel: int) -> list[str]:
    """Inline runs, ``parallel`` at a time, each in a fresh process (spawned: CUDA cannot be
    forked). A run that fails is named, the others go on. Ctrl-C stops every run (each marks
    its run interrupted, resumable) and starts no other: a process pool would have gone on to
    the queued runs."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")
    queue, running, failed = list(jobs), {}, []
    try:
        while queue or running:
            while queue and len(running) < parallel:
                job = queue.pop(0)
                proc = context.Process(target=_run_job_apart, args=(job, out, overwrite))
                proc.start()
                running[proc.sentinel] = (proc, job)
            for sentinel in wait(list(running)):
                proc, job = running.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    failed.append(f"{job.cfg.algorithm.name} seed {job.cfg.seed}")
    except KeyboardInterrupt as stop:
        from raysim.state.rundir import stopped_by_sigterm

        procs = [proc for proc, _ in running.values()]
        if not stopped_by_sigterm(stop):  # a terminal's Ctrl-C reached them too: let them end
            for proc in procs:
                proc.join(timeout=30)
        for proc in procs:  # `kill` of this process alone did not reach them: pass it on as
            if proc.is_alive():  # SIGTERM, which they take as Ctrl-C (once) and write their state
                proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        raise
    return failed


def _run_job_apart(job: Job, out: Path, overwrite: bool) -> None:
    """``_run_job`` as a process's whole work: a failure is reported in one line and the exit
    code, an interruption quietly (the run's status says it)."""
    from raysim.state.rundir import stop_on_sigterm

    stop_on_sigterm()
    try:
        _run_job(job, out, True, overwrite, lines=True)  # runs side by side: no bars
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - reported, the other runs go on
        from raysim.state.rundir import error_text

        label = f"{job.cfg.algorithm.name} seed {job.cfg.seed}"
        print(f"{label} failed: {error_text(exc)}", file=sys.stderr, flush=True)
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return compare_main(argv)
    except ConfigError as exc:
        print(f"raysim compare: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ray is shut down by run_all's finally
        print("raysim compare: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from raysim.state.rundir import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
