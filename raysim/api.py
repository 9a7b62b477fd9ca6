"""raysim from Python (a notebook, a script of one's own): ``raysim run``, ``compare``,
``sweep``, ``privacy`` and ``audit`` through their own code paths, and a run directory's results
as pandas tables.

    from raysim.api import audit, compare, load, privacy, run, summaries, sweep

    done = run("configs/rdpcfl_quick.yaml", {"privacy.epsilon": 2}, algorithms=["rdpcfl", "ifca"])
    done["rdpcfl"].metrics[["round", "accuracy", "epsilon"]]
    privacy("configs/rdpcfl_quick.yaml", {"privacy.epsilon": 2})["noise_multiplier"]
    compare("configs/rdpcfl_quick.yaml", algorithms=["rdpcfl", "ifca"], seeds=[0, 1], out="runs/c")
    summaries("runs/c").groupby("algorithm")["final_accuracy"].agg(["mean", "std"])
    sweep({"base": "configs/rdpcfl_quick.yaml", "space": {"privacy.epsilon": {"grid": [2, 8]}}})
    audit("configs/audit_digits.yaml", runs=1).result["lower_bound"]

A config is a YAML file's path, None (the demo), a dict of sections as the YAML holds them, or an
``ExperimentConfig``; ``overrides`` map dotted keys to Python values.

A user mistake raises ``raysim.config.ConfigError`` (the message the command prints) before Ray
starts; the tables are the run directory's files, read when first asked for.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from raysim.config import ConfigError, ExperimentConfig

Config = str | Path | Mapping[str, Any] | ExperimentConfig | None


@dataclass(frozen=True)
class Run:
    """A finished run's directory (``raysim run``, ``compare``, a sweep's trial)."""

    path: Path

    @cached_property
    def config(self) -> dict[str, Any]:
        """The resolved config (``config.yaml``)."""
        return yaml.safe_load((self.path / "config.yaml").read_text())

    @cached_property
    def summary(self) -> dict[str, Any]:
        """Final accuracy, eps spent, wall time... (``summary.json``)."""
        return json.loads((self.path / "summary.json").read_text())

    @cached_property
    def metrics(self) -> Any:
        """One row per round: accuracy, loss, eps, per-cluster accuracy (a DataFrame)."""
        return self._table("metrics.parquet")

    @cached_property
    def clients(self) -> Any:
        """One row per client: true and assigned cluster, accuracy, loss, eps."""
        return self._table("clients.parquet")

    @cached_property
    def privacy(self) -> Any:
        """The ledger: every charge, with its parameters and the eps spent so far."""
        return self._table("privacy.parquet")

    def _table(self, name: str) -> Any:
        return _read_table(self.path / name)


def _read_table(path: Path) -> Any:
    """A Parquet file as a DataFrame."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pandas()


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep's directory (``raysim sweep``)."""

    path: Path

    @cached_property
    def trials(self) -> Any:
        """One row per trial: its swept values, final metrics, eps (a DataFrame)."""
        return _read_table(self.path / "trials.parquet")

    @cached_property
    def selection(self) -> dict[str, Any]:
        """What choosing the best trial costs in privacy, beyond each trial's ledger."""
        return json.loads((self.path / "selection.json").read_text())

    @cached_property
    def runs(self) -> list[Run]:
        """Each trial's run directory."""
        return [Run(Path(p) / "run") for p in self.trials["path"]]


@dataclass(frozen=True)
class AuditResult:
    """A finished audit's directory (``raysim audit``)."""

    path: Path

    @cached_property
    def result(self) -> dict[str, Any]:
        """Claimed eps, the empirical lower bound, its confidence, method and view."""
        return json.loads((self.path / "audit.json").read_text())

    @cached_property
    def scores(self) -> Any:
        """One row per canary (one run) or per run (several): included, score."""
        return _read_table(self.path / "audit.parquet")


def load(path: str | Path) -> Run:
    """The finished run in ``path``."""
    run_dir = Path(path)
    if not (run_dir / "summary.json").is_file():
        from raysim.state import rundir

        state = rundir.unfinished(run_dir)
        why = state.describe() if state is not None else "no summary.json in it"
        raise ConfigError(f"{str(run_dir)!r} holds no finished run ({why})")
    return Run(run_dir)


def runs(path: str | Path) -> list[Run]:
    """Every finished run at or under ``path`` (a run, a compare's or a sweep's directory)."""
    from raysim.state import rundir

    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{str(root)!r} does not exist")
    return [Run(d) for d in rundir.find_runs(root)[0]]


def summaries(path: str | Path) -> Any:
    """One row per finished run at or under ``path``: its directory, its summary's values
    (algorithm, seed, eps spent, final accuracy...) and its final round's metrics (accuracy per
    cluster, ARI...): for a table over seeds, ``summaries(DIR).groupby("algorithm")``."""
    import pandas as pd

    rows = []
    for r in runs(path):
        row: dict[str, Any] = {"path": str(r.path)}
        row.update({k: v for k, v in r.summary.items() if not isinstance(v, dict | list)})
        final = r.summary.get("final") or {}
        row.update({k: v for k, v in final.items() if k not in row})
        rows.append(row)
    return pd.DataFrame(rows)


def run(
    config: Config = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    algorithms: Sequence[str] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Run]:
    """``raysim run CONFIG --set KEY=VALUE ... [--algorithms a,b] [--out DIR]``: the finished
    runs by algorithm name. ``config`` None is the demo (its three algorithms unless
    ``algorithms`` or an ``algorithm.name`` override says otherwise); ``overrides`` maps dotted
    keys to Python values (``{"data.cluster_sizes": [3, 6, 6, 6]}``)."""
    from raysim.cli.main import parser, run_experiments

    with _config_file(config) as path:
        argv = ["run", *path, *_set_flags(overrides)]
        if algorithms is not None:
            argv += ["--algorithms", ",".join(algorithms)]
        if out is not None:
            argv += ["--out", str(out)]
        if overwrite:
            argv += ["--overwrite"]
        finished = [Run(d) for d in run_experiments(parser().parse_args(argv))]
    return {r.config["algorithm"]["name"]: r for r in finished}


def compare(
    config: Config,
    overrides: Mapping[str, Any] | None = None,
    *,
    algorithms: Sequence[str],
    seeds: Sequence[int] = (0, 1, 2),
    out: str | Path | None = None,
    inline: bool = False,
    jobs: int = 1,
    overwrite: bool = False,
    resume: bool = False,
) -> dict[tuple[str, int], Run]:
    """``raysim compare CONFIG --algorithms ... --seeds ...``: the finished runs by (algorithm,
    seed), also in ``out`` with their table (``compare.md``). Where a run fails, RuntimeError
    names the directory, after the other runs have finished."""
    from raysim.cli.compare import compare_main
    from raysim.config import DEMO_CONFIG, load_config

    with _config_file(config) as path:
        path = path or [str(DEMO_CONFIG)]  # compare takes a file: the demo's
        if out is None:
            name = load_config(path[0], _overrides(overrides)).name
            out = Path("runs") / f"compare-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        argv = [*path, *_set_flags(overrides), "--out", str(out), "--jobs", str(jobs)]
        argv += ["--algorithms", ",".join(algorithms), "--seeds", ",".join(map(str, seeds))]
        flags = {"--inline": inline, "--overwrite": overwrite, "--resume": resume}
        argv += [flag for flag, on in flags.items() if on]
        if compare_main(argv) != 0:
            raise RuntimeError(f"raysim compare: some runs failed (see {out})")
    return {(r.config["algorithm"]["name"], r.config["seed"]): r for r in runs(out)}


def sweep(
    spec: str | Path | Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    *,
    out: str | Path | None = None,
    num_samples: int | None = None,
    scheduler: str | None = None,
    max_concurrent: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> SweepResult:
    """``raysim sweep SWEEP.yaml``: ``spec`` is a sweep file's path or its mapping (``base``
    may then be a path, a dict of sections or an ExperimentConfig); ``overrides`` apply to the
    base. RuntimeError, naming ``out``, where a trial failed or the sweep was interrupted."""
    from raysim.cli.main import parser

    with _sweep_file(spec) as (path, name):
        if out is None:
            out = Path("runs") / f"sweep-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        argv = ["sweep", path, *_set_flags(overrides), "--out", str(out)]
        flags = {"--num-samples": num_samples, "--scheduler": scheduler}
        flags["--max-concurrent"] = max_concurrent
        argv += [a for flag, v in flags.items() if v is not None for a in (flag, str(v))]
        argv += [flag for flag, on in {"--resume": resume, "--overwrite": overwrite}.items() if on]
        args = parser().parse_args(argv)
        if args.func(args) != 0:
            raise RuntimeError(f"raysim sweep: some trials failed or did not finish (see {out})")
    return SweepResult(Path(out).resolve())


def audit(
    config: Config,
    overrides: Mapping[str, Any] | None = None,
    *,
    runs: int | None = None,
    canaries: int | None = None,
    participation: str | None = None,
    confidence: float | None = None,
    seed: int | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    adversary: str | None = None,
) -> AuditResult:
    """``raysim audit CONFIG``: the configured mode's release path audited with canaries; the
    flags left None keep the command's defaults (``runs=1``: the one-run audit)."""
    from raysim.cli.main import parser

    with _config_file(config) as path:
        if not path:
            raise ConfigError("audit: needs a config (e.g. configs/audit_digits.yaml)")
        if out is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path("runs") / f"audit-{Path(path[0]).stem}-{stamp}"
        argv = ["audit", *path, *_set_flags(overrides), "--out", str(out)]
        flags = {"--runs": runs, "--canaries": canaries, "--participation": participation}
        flags.update({"--confidence": confidence, "--seed": seed, "--adversary": adversary})
        argv += [a for flag, v in flags.items() if v is not None for a in (flag, str(v))]
        argv += ["--overwrite"] if overwrite else []
        args = parser().parse_args(argv)
        args.func(args)
    return AuditResult(Path(out))


def privacy(config: Config = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``raysim privacy CONFIG --json``: the calibrated noise and the planned eps, per round
    too, without training (the noise is calibrated as a run would before it starts)."""
    from raysim.compose import for_algorithm, prepare_named
    from raysim.config import DEMO_CONFIG, load_config
    from raysim.privacy.report import privacy_report

    with _config_file(config) as path:
        cfg = load_config(path[0] if path else DEMO_CONFIG, _overrides(overrides))
    return privacy_report(prepare_named(for_algorithm(cfg, quiet=True)), schedule=True)


@contextmanager
def _config_file(config: Config) -> Iterator[list[str]]:
    """The command line's CONFIG argument for ``config`` ([] for the demo): a dict or an
    ExperimentConfig is written to a temporary YAML file for the command's duration."""
    if config is None or isinstance(config, str | Path):
        yield [] if config is None else [str(config)]
        return
    from raysim.config import dump_config

    if isinstance(config, ExperimentConfig):
        text = dump_config(config)
    elif isinstance(config, Mapping):
        text = yaml.safe_dump(dict(config), sort_keys=False)
    else:
        kind = type(config).__name__
        raise ConfigError(f"config: a YAML path, a dict, an ExperimentConfig or None; got {kind}")
    with tempfile.TemporaryDirectory(prefix="raysim-api-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        yield [str(path)]


@contextmanager
def _sweep_file(spec: str | Path | Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The sweep file's path and name for ``spec``: a mapping is written to a temporary file,
    its ``base`` with it (a relative path is taken from the current directory)."""
    if isinstance(spec, str | Path):
        yield str(spec), Path(spec).stem
        return
    if not isinstance(spec, Mapping):
        kind = type(spec).__name__
        raise ConfigError(f"sweep: a sweep file's path or a dict; got {kind}")
    raw = dict(spec)
    name = str(raw.get("name") or "api")
    with (
        tempfile.TemporaryDirectory(prefix="raysim-api-") as tmp,
        _config_file(raw.get("base")) as base,
    ):
        if isinstance(raw.get("base"), str | Path):
            base = [str(Path(base[0]).resolve())]
        if base:
            raw["base"] = base[0]
        path = Path(tmp) / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        yield str(path), name


def _overrides(overrides: Mapping[str, Any] | None) -> list[str]:
    """``--set`` values (KEY=VALUE) for a mapping of dotted keys to Python values."""
    return [f"{k}={_yaml_value(v)}" for k, v in (overrides or {}).items()]


def _set_flags(overrides: Mapping[str, Any] | None) -> list[str]:
    return [a for item in _overrides(overrides) for a in ("--set", item)]


def _yaml_value(value: Any) -> str:
    """A value as ``--set`` reads it (YAML): JSON is YAML, and a string is taken as written."""
    return value if isinstance(value, str) else json.dumps(value)
