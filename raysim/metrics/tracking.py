"""Experiment tracking: a run's params, per-round metrics and result files also logged to
TensorBoard or MLflow (``tracking.backend``), so that runs can be browsed and compared in the
tools people already use. The run directory stays the record; a tracker holds a copy of it.

Both libraries are optional (``pip install -e '.[tracking]'``): their absence is refused by
``check_available`` before Ray starts, and nothing here imports them until a tracker is made.
Sweeps use Ray Tune's own callbacks instead (``sweep_callbacks``), which log what each trial
reports to Tune.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import yaml

from raysim.config import ConfigError, ExperimentConfig, TrackingConfig, dotted, dump_config

INSTALL = "pip install -e '.[tracking]'"
# the modules each backend imports (the distributions of the `tracking` extra)
MODULES = {"tensorboard": ("tensorboardX",), "mlflow": ("mlflow",)}
TENSORBOARD_DIR = "tensorboard"  # under the run directory, where tracking.dir is not given
MLFLOW_DIR = "mlruns"  # MLflow's own default store, beside the command
ARTIFACTS = ("summary.json", "config.yaml")  # with every *.png of the run directory


def check_available(tracking: TrackingConfig) -> None:
    """ConfigError naming ``tracking.backend`` and the install command where the backend's
    package is missing: said before Ray starts, not after the rounds ran."""
    missing = [m for m in MODULES.get(tracking.backend, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"tracking.backend: {tracking.backend} needs the package {', '.join(missing)}, "
            f"which is not installed: {INSTALL} (or choose tracking.backend: none)"
        )


def flat_params(cfg: ExperimentConfig) -> dict[str, str]:
    """The config as dotted keys and text values (``training.lr: '0.1'``), as trackers keep
    params; lists and nulls as JSON."""
    leaves = dotted(yaml.safe_load(dump_config(cfg)))
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in leaves.items()}


def round_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers (the row as metrics.parquet gets it), the round itself aside:
    the round is the step they are logged at."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "round" and isinstance(v, int | float) and not isinstance(v, complex)
    }


def artifact_files(run_dir: Path) -> list[Path]:
    """What a run's tracker gets as files once the run is written: summary, config, plots."""
    files = [run_dir / name for name in ARTIFACTS]
    return [f for f in files if f.is_file()] + sorted(run_dir.glob("*.png"))


class Tracker(Protocol):
    """Where a run is logged beside its directory."""

    def log_params(self, params: dict[str, str]) -> None: ...

    def log_round(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_files(self, files: Iterable[Path]) -> None: ...

    def close(self, status: str) -> None:
        """``status``: FINISHED, FAILED or KILLED (an interruption), as MLflow names them."""


class TensorBoardTracker:
    """tensorboardX's SummaryWriter: scalars per round, the config and summary as text, the
    plots as images."""

    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(logdir=str(logdir))

    def log_params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("config", f"| key | value |\n|---|---|\n{table}", global_step=0)
        self.writer.flush()

    def log_round(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a live TensorBoard shows each round as it ends

    def log_files(self, files: Iterable[Path]) -> None:
        from matplotlib.image import imread

        for path in files:
            if path.suffix == ".png":
                image = imread(path)[..., :3]  # RGBA floats in [0, 1]: the colours
                self.writer.add_image(path.stem, image, dataformats="HWC")
            else:
                self.writer.add_text(path.name, f"```\n{path.read_text()}\n```")
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def allow_file_store(uri: str) -> None:
    """MLflow 3 refuses a file store (./mlruns) unless told it is wanted: it is the one that
    needs no server or database package, and raysim's default."""
    if "://" not in uri or uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def mlflow_uri(tracking: TrackingConfig) -> str:
    """``tracking.uri``, or the file store ./mlruns as an absolute file URI (a sweep's trials
    and a compare's runs all write to the store beside the command)."""
    uri = tracking.uri or (Path.cwd() / MLFLOW_DIR).resolve().as_uri()
    allow_file_store(uri)
    return uri


class MlflowTracker:
    """An MLflow run (MlflowClient, which mlflow-skinny ships) per raysim run, in the experiment
    ``tracking.experiment`` (default: the config's name)."""

    def __init__(self, tracking: TrackingConfig, experiment: str, run_name: str, tags: dict):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=mlflow_uri(tracking))
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(experiment)
            except Exception:  # noqa: BLE001 - made meanwhile by another run of a compare
                again = self.client.get_experiment_by_name(experiment)
                if again is None:
                    raise
                experiment_id = again.experiment_id
        run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_round(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(1000 * time.time())
        batch = [Metric(k, v, stamp, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_files(self, files: Iterable[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def run_name(out_dir: Path) -> str:
    """A run's name in a tracker: its directory from the working directory (runs/demo-...,
    cmp/fedavg/seed0), or elsewhere its last two parts: a compare's runs are ALG/seedN, so
    the last part alone would name them all alike."""
    path = out_dir.absolute()
    try:
        return path.relative_to(Path.cwd().absolute()).as_posix()
    except ValueError:
        return "/".join(path.parts[-2:])


def make_tracker(cfg: ExperimentConfig, out_dir: Path, stage: Path) -> Tracker | None:
    """The tracker of the run that goes to ``out_dir`` (written meanwhile in ``stage``), or
    None where tracking is off. TensorBoard's default log directory lies in the run's own
    (the staging one, renamed with it); a given ``tracking.dir`` gets one folder per run."""
    tracking = cfg.tracking
    if tracking.backend == "none":
        return None
    check_available(tracking)
    name = run_name(out_dir)
    if tracking.backend == "tensorboard":
        root = Path(tracking.dir) / name if tracking.dir else stage / TENSORBOARD_DIR
        return TensorBoardTracker(root)
    tags = {"raysim.run_dir": str(out_dir.absolute()), "raysim.algorithm": cfg.algorithm.name}
    return MlflowTracker(tracking, tracking.experiment or cfg.name, name, tags)


class RunTracking:
    """A run's tracker fed as the run goes: params at the start, each round's metrics as it
    ends, the result files at the end. Rows of rounds it did not see (those a resumed run
    restored from its checkpoint) are logged with the files."""

    def __init__(self, tracker: Tracker, cfg: ExperimentConfig) -> None:
        self.tracker = tracker
        self.seen: set[int] = set()
        tracker.log_params(flat_params(cfg))

    def on_round(self, then: Callable[[dict], None] | None) -> Callable[[dict], None]:
        """A round callback that logs the row, then calls ``then``."""

        def logged(row: dict[str, Any]) -> None:
            self.log_row(row)
            if then is not None:
                then(row)

        return logged

    def log_row(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        self.seen.add(step)
        self.tracker.log_round(step, round_metrics(row))

    def finish(self, history: list[dict[str, Any]], run_dir: Path) -> None:
        for row in history:
            if int(row["round"]) not in self.seen:
                self.log_row(row)
        self.tracker.log_files(artifact_files(run_dir))
        self.tracker.close("FINISHED")

    def fail(self, exc: BaseException) -> None:
        """Close the tracker as the run stopped; a tracker that fails too (a lost MLflow
        server) is said, never raised over the run's own error."""
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        try:
            self.tracker.close(status)
        except Exception as err:  # noqa: BLE001 - the run's error is the one to raise
            print(f"raysim: closing the {status} run's tracker failed: {err}", file=sys.stderr)


def sweep_callbacks(tracking: TrackingConfig, sweep_name: str) -> list[Any]:
    """Ray Tune's own logger callbacks for ``tracking.backend``: each trial's reports (round,
    epsilon, accuracy, ...) per training iteration, and its swept values as params. TensorBoard
    writes into each trial's directory (OUT/tune/NAME/TRIAL); MLflow gets one run per trial."""
    if tracking.backend == "tensorboard":
        from ray.tune.logger import TBXLoggerCallback

        return [TBXLoggerCallback()]
    if tracking.backend == "mlflow":
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        return [
            MLflowLoggerCallback(
                tracking_uri=mlflow_uri(tracking),
                experiment_name=tracking.experiment or sweep_name,
                save_artifact=True,
            )
        ]
    return []
