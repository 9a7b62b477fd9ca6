"""raysim from Python (a notebook, a script of one's own): ``raysim run`` through its own code
path, and a run directory's results as pandas tables.

    from raysim.api import load, run, summaries

    done = run("configs/rdpcfl_quick.yaml", {"privacy.epsilon": 2}, algorithms=["rdpcfl", "ifca"])
    done["rdpcfl"].metrics[["round", "accuracy", "epsilon"]]
    summaries("runs/compare-x").groupby("algorithm")["final_accuracy"].agg(["mean", "std"])

A user mistake raises ``raysim.config.ConfigError`` (the message the command prints) before Ray
starts; the tables are the run directory's files, read when first asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from raysim.config import ConfigError


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
        import pyarrow.parquet as pq

        return pq.read_table(self.path / name).to_pandas()


def load(path: str | Path) -> Run:
    """The finished run in ``path``."""
    run_dir = Path(path)
    if not (run_dir / "summary.json").is_file():
        from raysim import rundir

        state = rundir.unfinished(run_dir)
        why = state.describe() if state is not None else "no summary.json in it"
        raise ConfigError(f"{str(run_dir)!r} holds no finished run ({why})")
    return Run(run_dir)


def runs(path: str | Path) -> list[Run]:
    """Every finished run at or under ``path`` (a run, a compare's or a sweep's directory)."""
    from raysim import rundir

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
    config: str | Path | None = None,
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
    from raysim.cli import parser, run_experiments

    argv = ["run"] + ([str(config)] if config is not None else [])
    for key, value in (overrides or {}).items():
        argv += ["--set", f"{key}={_yaml_value(value)}"]
    if algorithms is not None:
        argv += ["--algorithms", ",".join(algorithms)]
    if out is not None:
        argv += ["--out", str(out)]
    if overwrite:
        argv += ["--overwrite"]
    finished = [Run(d) for d in run_experiments(parser().parse_args(argv))]
    return {r.config["algorithm"]["name"]: r for r in finished}


def _yaml_value(value: Any) -> str:
    """A value as ``--set`` reads it (YAML): JSON is YAML, and a string is taken as written."""
    return value if isinstance(value, str) else json.dumps(value)
