"""raysim: run | report | data | privacy | compare | sweep | attack | audit | list
(`raysim COMMAND -h`).

This is the composition root: it looks algorithms up by name and hands them to the engine.
User mistakes exit with code 2 and a one-paragraph message (no traceback); other failures with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raysim.cli.common import config_from_args, run_one
from raysim.config import (
    DEMO_CONFIG,
    ConfigError,
    ExperimentConfig,
    changed_keys,
    dump_config,
    load_config,
)
from raysim.limits import check_schedule

DEMO_ALGORITHMS = ("fedavg", "local", "rdpcfl")  # `raysim run` with no CONFIG: the demo


def _load_run_modules() -> None:
    """What the driver runs with, loaded while the prepare child works (on two cores, on the
    core it leaves idle): Ray, the session, the result writers (~0.4 s); the dashboard's packages,
    which a local ``ray.init`` imports to see if they are installed (~0.3 s); pandas, which pyarrow
    loads at the first metrics.parquet (~0.3 s, or the workers' CPU in round 2); matplotlib's
    pyplot, which the plots need after the last round (~0.35 s of the run's serial tail)."""
    import matplotlib
    import pandas  # noqa: F401
    import tqdm  # noqa: F401

    import raysim.metrics.results  # noqa: F401
    import raysim.runtime.session  # noqa: F401

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    try:  # what ray.init imports to learn whether the dashboard's packages are there (~0.3 s)
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        pass


def _print_results(dirs: Sequence[Path], plot_to: Path | None = None) -> None:
    from raysim.metrics.report import comparison_plot, comparison_table

    print(comparison_table(dirs), flush=True)
    if plot_to is not None:
        comparison_plot(dirs, plot_to)
        print(f"plot: {plot_to}", file=sys.stderr)


def _prepare_checked(cfg: ExperimentConfig, blob: bytes | None, stage: Path):
    """``prepare_named``, and the checkpoint to continue (in ``stage``) decoded under the
    algorithm's allowlist (state.checkpoint): one holding anything else is refused here, naming
    its file, before Ray starts."""
    from raysim.compose import prepare_named

    prep = prepare_named(cfg)
    if blob is not None:
        from raysim.state.checkpoint import check_decodes

        check_decodes(blob, type(prep.algorithm), stage)
    return prep


def _resume_dir(given: str) -> Path:
    """The run directory ``--resume`` names, refused where it cannot be one."""
    if not given.strip():
        raise ConfigError("--resume: give the run directory to continue (it is empty)")
    path = Path(given).resolve()
    if path.parent == path:
        raise ConfigError(
            f"--resume {given!r}: the file system's root is not a run directory; give the "
            "directory of the run (the --out it was started with)"
        )
    return path


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a run from its checkpoint (in OUT.incomplete), with the config it started with.
    Before Ray starts, under the run's lock: the checkpoint is checked (format, checksums,
    decodable as data), and config.yaml must be the config the run started with."""
    from raysim.state import rundir
    from raysim.state.checkpoint import (
        CHECKPOINT,
        LEGACY,
        PREVIOUS,
    )

    if args.config or args.algorithms or args.out:
        raise ConfigError("--resume takes the run directory only (its config.yaml is used)")
    target = rundir.target_of(_resume_dir(args.resume))
    stage = rundir.staging_dir(target)
    if not stage.is_dir():
        if not target.exists():
            raise ConfigError(f"--resume: {str(target)!r} does not exist")
        if (target / "summary.json").is_file():
            raise ConfigError(f"run {str(target)!r} is finished: there is nothing to resume")
        if not (target / "config.yaml").is_file():
            raise ConfigError(f"run directory {str(target)!r} has no config.yaml")
        if not any((target / f).is_file() for f in ("status.json", CHECKPOINT, PREVIOUS, LEGACY)):
            raise ConfigError(
                f"--resume: {str(target)!r} holds a config.yaml but no run raysim started (no "
                "status.json or checkpoint): nothing to resume; start one with raysim run CONFIG"
            )
        load_config(target / "config.yaml", list(args.set or []))  # refused before it moves
        rundir.lock(target)  # a run left in place by an older raysim: continue it there
        try:
            os.replace(target, stage)
        finally:
            rundir.release(target)
    rundir.lock(stage)  # one writer: a second --resume, or a run onto it, is refused
    try:
        rundir.date_recorded_draws(stage)
        return _resume_locked(args, target, stage)
    finally:
        rundir.release(stage)


def _resume_locked(args: argparse.Namespace, target: Path, stage: Path) -> int:
    from raysim.state import rundir
    from raysim.state.checkpoint import (
        check_config,
        config_digest,
        config_record,
        load_checkpoint,
    )

    status = rundir.unfinished(stage)
    if target.exists() and not (args.overwrite or rundir.read_status(stage).get("overwrite")):
        rundir.check_target(target, overwrite=False)  # started without --overwrite: refuse
    from raysim.engine.experiment import prepare_apart

    sets = list(args.set or [])
    saved = (stage / "config.yaml").read_text()
    resolved = dump_config(load_config(stage / "config.yaml", sets))
    changed = changed_keys(saved, resolved)
    if changed:  # its noise and its ledger's budget were planned for the saved config
        raise ConfigError(
            f"--resume continues a run as it started: --set would change {', '.join(changed)}; "
            "only runtime.* keys may be set (start a new run for other settings)"
        )
    blob = load_checkpoint(stage)  # format and checksums; a damaged one is refused
    if blob is not None:  # config.yaml edited since the checkpoint was written: refused
        check_config(blob, resolved, f"--resume {target}")
    recorded = rundir.read_status(stage)
    record = config_record(resolved)
    if recorded.get("config_sha256") not in (None, config_digest(record)):
        import yaml

        keys = changed_keys(yaml.safe_dump(recorded.get("config") or {}), yaml.safe_dump(record))
        raise ConfigError(
            f"--resume {target}: config.yaml differs from the config the run started with "
            f"({', '.join(keys) or 'its checksum'}): put the old values back to continue, or "
            "start a new run for the new ones"
        )
    build = lambda: [_prepare_checked(load_config(stage / "config.yaml", sets), blob, stage)]  # noqa: E731
    prep = prepare_apart(build, meanwhile=_load_run_modules)[0]
    if blob is None:
        print(f"raysim: {stage} has no checkpoint: starting from round 1", file=sys.stderr)
    elif status is not None:
        print(f"raysim: continuing {target} after round {status.rounds_done}", file=sys.stderr)
    run_one(prep, target, resume=blob, resuming=True)
    print(f"results: {target}", file=sys.stderr)
    _print_results([target])
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume is not None:  # `--resume ''` too: refused, never the demo
        return cmd_resume(args)
    run_experiments(args)
    return 0


def run_experiments(args: argparse.Namespace) -> list[Path]:
    """`raysim run` (not ``--resume``): the run directories it wrote, one per algorithm."""
    from raysim.compose import prepare_named
    from raysim.engine.experiment import prepare_apart
    from raysim.state import rundir

    rundir.out_flag(args.out)
    if args.out:
        rundir.check_place(Path(args.out))
    demo = args.config is None
    named = any(item.startswith("algorithm.name=") for item in args.set or [])
    default = DEMO_ALGORITHMS if demo and not named else []
    given = args.algorithms is not None
    algorithms = [a for a in args.algorithms.split(",") if a] if given else default
    if given and not algorithms:
        raise ConfigError("--algorithms: give at least one (comma-separated)")
    if len(set(algorithms)) < len(algorithms):
        raise ConfigError(f"--algorithms: each at most once, got {args.algorithms!r}")

    # Every config, validated here without torch (the model's own keys aside) and sized against
    # this machine: a mistake in one, an impossible --out or a schedule that cannot fit is
    # refused in a fraction of a second, before the prepare child and Ray's modules load.
    path, sets = args.config or DEMO_CONFIG, list(args.set or [])
    lean = [load_config(path, [*sets, f"algorithm.name={a}"], lean=True) for a in algorithms]
    lean = lean or [load_config(path, sets, lean=True)]
    for cfg in lean:
        check_schedule(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.out) if args.out else Path("runs") / f"{lean[0].name}-{stamp}"
    dirs = [base / c.algorithm.name for c in lean] if len(lean) > 1 else [base]
    if len(dirs) > 1:  # base gets comparison.png: new, empty, or raysim's
        rundir.check_home(base)
    for out in dirs:  # refuse to overwrite results before anything runs
        rundir.check_target(out, args.overwrite)

    def build() -> list[Any]:
        """Every config, prepared: every user mistake surfaces here, before Ray starts. Apart
        from this process (a forked child), which so never imports torch (docs/speed.md)."""
        named_configs = [config_from_args(args, [f"algorithm.name={a}"]) for a in algorithms]
        return [prepare_named(cfg) for cfg in named_configs or [config_from_args(args)]]

    preps = prepare_apart(build, meanwhile=_load_run_modules)
    configs = [prep.cfg for prep in preps]
    from raysim.runtime.resources import check_before_local_ray
    from raysim.runtime.reuse import kept_actors
    from raysim.runtime.session import ensure_ray

    for prep in preps:  # workers this machine can never place: refused before Ray starts
        check_before_local_ray(prep.cfg.runtime, len(prep.truth))
    t0 = time.perf_counter()
    # the directories this command makes (base, and runs/ above it the first time): removed
    # again if it stops with them empty
    made = [d for d in [base, *base.parents] if not d.exists()]
    started = ensure_ray(configs[0].runtime)  # one Ray session for all the runs
    try:
        if len(dirs) > 1:
            rundir.mark_home(base)
        with kept_actors():  # and one set of actors, renewed for each run
            for prep, out in zip(preps, dirs, strict=True):
                run_one(prep, out, overwrite=args.overwrite)
                print(f"results: {out}", file=sys.stderr)
    except KeyboardInterrupt:  # where the results are, and how they go on
        for out in dirs:
            if (state := rundir.unfinished(out)) is not None:
                print(f"raysim: {state.describe()}", file=sys.stderr)
        rest = [str(d) for d in dirs if not d.exists() and rundir.unfinished(d) is None]
        if rest:
            print(f"raysim: not started: {', '.join(rest)}", file=sys.stderr)
        raise
    finally:
        if started:
            import ray

            ray.shutdown()
        for d in made:  # innermost first; e.g. a run refused once Ray was up
            rundir.remove_if_unused(d)
    _print_results(dirs, base / "comparison.png" if len(dirs) > 1 else None)
    print(f"{len(dirs)} run(s) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return dirs


def cmd_report(args: argparse.Namespace) -> int:
    from raysim.audit.report import audit_line
    from raysim.metrics.html_report import check_out, output_path, write_report
    from raysim.metrics.results import load_run
    from raysim.state import rundir

    fmt = args.format
    if fmt == "html":
        out = output_path(args.run_dirs, args.out, args.overwrite)  # refused before any reading
    else:
        out = None if args.out is None else check_out(Path(args.out), args.run_dirs, args.overwrite)
    dirs: list[Path] = []
    for d in map(Path, args.run_dirs):
        if (line := audit_line(d)) is not None:  # an audit's directory (raysim audit)
            print(line)
            continue
        done, unfinished = rundir.find_runs(d)
        for u in unfinished:
            print(f"raysim: {u.describe()}", file=sys.stderr)
        if not d.exists():
            raise ConfigError(f"{str(d)!r} does not exist")
        if not done and not unfinished:
            raise ConfigError(f"{str(d)!r} holds no run (no summary.json in it or below it)")
        dirs += done
    if not dirs and all(audit_line(Path(d)) for d in args.run_dirs):
        return 0  # audits only: their lines are printed
    readable = []
    for d in dirs:  # a run whose files cannot be read is named and left out, not fatal
        try:
            load_run(d)
        except Exception as exc:  # noqa: BLE001 - any damage to a run's files
            print(
                f"raysim: skipped {d}: cannot read it ({rundir.error_text(exc)})", file=sys.stderr
            )
        else:
            readable.append(d)
    if not readable:
        raise ConfigError("no finished run to report (see above)")
    if len(readable) < len(dirs):
        print(
            f"raysim: reporting {len(readable)} of {len(dirs)} runs "
            f"({len(dirs) - len(readable)} skipped, named above)",
            file=sys.stderr,
        )
    if fmt != "html":
        from raysim.metrics.tables import render

        text = render(readable, fmt)
        if out is None:
            sys.stdout.write(text)
        else:
            out.write_text(text, encoding="utf-8")
            print(f"report: {out}", file=sys.stderr)
        return 0
    _print_results(readable)
    write_report(readable, [Path(d) for d in args.run_dirs], out)
    print(f"report: {out}", file=sys.stderr)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from raysim.data import describe
    from raysim.engine.experiment import build_dataset

    if args.data_command == "export":
        out = Path(args.out)
        check_export(out, args.overwrite)  # before the data is built
        return _export(build_dataset(config_from_args(args)), out, args.overwrite)
    print(describe(build_dataset(config_from_args(args))))
    return 0


def check_export(out: Path, overwrite: bool) -> None:
    """``data export --out``: an .npz file in an existing directory of the user's, replaced
    only with ``--overwrite``."""
    from raysim.state.rundir import check_place

    if out.suffix != ".npz":
        raise ConfigError(f"--out: an .npz file, got {str(out)!r}")
    check_place(out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out: directory {str(out.parent)!r} does not exist")
    if out.is_dir() or (out.exists() and not out.is_file()):
        raise ConfigError(f"--out {str(out)!r} exists and is not a file")
    if out.exists() and not overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already exists: pass --overwrite to replace it, or choose "
            "another --out"
        )


def _export(population: Any, out: Path, overwrite: bool = False) -> int:
    import tempfile

    import numpy as np

    from raysim.data.arrays import population_arrays

    check_export(out, overwrite)
    arrays = population_arrays(population)
    # beside the target (one file system, so the rename is atomic), under a name of its own
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial.npz", dir=out.parent)
    partial = Path(name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as a file the user writes (mkstemp's is 0600)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        partial.replace(out)  # a reader sees the whole file or none
    except BaseException:  # a full disk, Ctrl-C: no partial file is left behind
        partial.unlink(missing_ok=True)
        raise
    n = population.num_clients
    print(
        f"{out}: {len(arrays['y_train']) + len(arrays['y_test'])} rows of {n} clients; read it "
        f"back with --set data.dataset=npz --set data.root={out} --set data.num_clients={n} "
        "--set data.cluster_sizes=null --set data.shift=none"
    )
    return 0


def cmd_privacy(args: argparse.Namespace) -> int:
    from raysim.compose import prepare_named
    from raysim.privacy.report import format_report, privacy_report

    cfg = config_from_args(args)
    report = privacy_report(prepare_named(cfg), schedule=args.json)
    from raysim.state.rundir import json_safe  # JSON has no Infinity (eps without DP): null

    print(json.dumps(json_safe(report), allow_nan=False) if args.json else format_report(report))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from raysim.cli.catalog import listing

    print(listing(args.kind))
    return 0


def parser() -> argparse.ArgumentParser:
    from raysim import __version__
    from raysim.cli.catalog import KINDS

    p = argparse.ArgumentParser(prog="raysim", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"raysim {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", nargs="?", help="experiment YAML (default: the demo)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")

    run = sub.add_parser("run", help="run an experiment (no CONFIG: the demo)")
    with_config(run)
    run.add_argument("--out", help="result directory (default: runs/NAME-TIME)")
    run.add_argument("--algorithms", help="comma-separated: run the config under each")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its checkpoint")
    run.add_argument(
        "--overwrite", action="store_true", help="replace the results already in --out"
    )
    run.set_defaults(func=cmd_run)

    rep = sub.add_parser(
        "report",
        help="table (in %%) of finished runs, or a directory of runs, and one report.html",
    )
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run, or a directory of runs")
    rep.add_argument(
        "--out",
        help="the page to write (default: DIR-report.html beside DIR; several: report.html)",
    )
    rep.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    rep.add_argument(
        "--format",
        choices=("html", "json", "csv", "markdown"),
        default="html",
        help="html: the table and the page (default); json, csv, markdown: the summary (mean and "
        "std over seeds per group) to stdout, or to --out",
    )
    rep.set_defaults(func=cmd_report)

    data = sub.add_parser("data", help="inspect the federated population")
    dsub = data.add_subparsers(dest="data_command", metavar="{describe,export}", required=True)
    desc = dsub.add_parser("describe", help="clients per cluster, samples, label histogram")
    with_config(desc)
    desc.set_defaults(func=cmd_data)
    export = dsub.add_parser(
        "export", help="the population as an .npz file (data.dataset: npz reads it back)"
    )
    with_config(export)
    export.add_argument("--out", required=True, help="the .npz file to write")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export.set_defaults(func=cmd_data)

    priv = sub.add_parser("privacy", help="calibrated noise and planned eps, without training")
    with_config(priv)
    priv.add_argument("--json", action="store_true", help="everything, with the eps schedule")
    priv.set_defaults(func=cmd_privacy)

    sub.add_parser(
        "compare", help="one config under several algorithms and seeds (raysim compare -h)"
    )

    comp = sub.add_parser("completion", help='shell completion: eval "$(raysim completion bash)"')
    comp.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    comp.set_defaults(func=cmd_completion)

    lst = sub.add_parser("list", help="what a config can name: " + ", ".join(KINDS))
    lst.add_argument("kind", choices=KINDS)
    lst.set_defaults(func=cmd_list)

    from raysim.cli.attack import add_attack_parser
    from raysim.cli.audit import add_audit_parser
    from tune.sweep import add_sweep_parser

    add_attack_parser(sub)
    add_audit_parser(sub)
    add_sweep_parser(sub)
    return p


def full_parser() -> argparse.ArgumentParser:
    """``parser()`` with ``compare``'s own options in place of its stub (``compare`` parses its
    arguments itself): what the reference page and shell completion describe."""
    from raysim.cli.compare import parser as compare_parser

    top = parser()
    for action in top._actions:  # argparse keeps its subparsers here (no public accessor)
        if isinstance(action, argparse._SubParsersAction):
            full = compare_parser()
            full.prog = "raysim compare"
            action.choices["compare"] = full
    return top


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script of ``args.shell`` (made by shtab from the parsers, so every
    command, option and choice is offered, and files where a config or run directory goes)."""
    import shtab

    top = full_parser()
    paths = {"config": shtab.FILE, "out": shtab.FILE, "run_dirs": shtab.DIRECTORY}
    paths["resume"] = shtab.DIRECTORY
    stack = [top]
    while stack:
        for action in stack.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += action.choices.values()
            elif action.dest in paths:
                action.complete = paths[action.dest]  # type: ignore[attr-defined]
    print(shtab.complete(top, shell=args.shell))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:  # its own parser and error handling: raysim/cli/compare.py
        from raysim.cli.compare import main as compare_main

        return compare_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"raysim: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raysim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`raysim list | head`): nothing failed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except Exception as exc:  # noqa: BLE001 - a failure of the run, not of the input
        from raysim.config import shorten
        from raysim.state.rundir import error_text

        what = " ".join(w for w in (argv[0], getattr(args, "data_command", None)) if w)
        print(f"raysim: {what} failed: {shorten(error_text(exc))}", file=sys.stderr)
        return 1


def _say_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """raysim's own warnings (e.g. clients sharing the dataset's images) as a line in its
    words; any other library's as Python shows them."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        print(f"raysim: {message}", file=sys.stderr if file is None else file)
    else:
        _show_warning(message, category, filename, lineno, file, line)


_show_warning = warnings.showwarning


def entry() -> None:
    """The `raysim` command (and `python -m raysim.cli.main`). It leaves without tearing the
    interpreter down, which takes ~1 s once torch and Ray are loaded: when `main` returns,
    everything is written and moved into place, so only a connection to a cluster and the
    standard streams are left to close."""
    from raysim.state.rundir import stop_on_sigterm

    stop_on_sigterm()
    warnings.showwarning = _say_warning
    code = main()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():  # connected to `runtime.address`: disconnect cleanly
            ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
