"""Preparing and running one experiment: everything that can fail on user input fails here,
before Ray starts; then the session runs the rounds and the results are written.

The caller passes the algorithm class (the CLI and Tune look it up in `algorithms`): the engine
never imports an algorithm.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raysim import privacy as privacy_lib
from raysim.config import ConfigError, ExperimentConfig
from raysim.data import FederatedDataset, build_federated_dataset
from raysim.models import build_from_spec, flat_params, init_seed, model_spec
from raysim.privacy import BudgetError, PrivacyConfigError


@dataclass
class Prepared:
    cfg: ExperimentConfig
    dataset: FederatedDataset
    algorithm: Any
    env: Any

    @property
    def truth(self) -> np.ndarray:
        """The true clusters: for the engine's metrics, never for the algorithm."""
        return np.asarray(self.dataset.true_cluster)


def initial_weights(cfg: ExperimentConfig, ds: FederatedDataset) -> torch.Tensor:
    """Model initialisation drawn from the (seed, 0, server, "model_init") generator."""
    try:
        spec = model_spec(cfg)
        model = build_from_spec(spec, ds.feature_shape, ds.num_classes, init_seed(cfg.seed))
    except ValueError as exc:  # a bad model.* value (the builders name the key)
        raise ConfigError(str(exc)) from None
    return flat_params(model)


def check_against_data(cfg: ExperimentConfig, ds: FederatedDataset) -> None:
    """The checks that need the population, e.g. delta < 1/n for sample-level DP."""
    if ds.task == "regression" and cfg.model.name not in ("linear", "mlp"):
        raise ConfigError(f"model.name: {cfg.data.dataset} is a regression task; use linear or mlp")
    if cfg.privacy.mode == "sample":
        try:
            privacy_lib.check_sample_level_delta(cfg.privacy.delta, int(np.min(ds.train_sizes)))
        except (PrivacyConfigError, BudgetError) as exc:
            raise ConfigError(str(exc)) from None


def build_dataset(cfg: ExperimentConfig) -> FederatedDataset:
    try:
        return build_federated_dataset(cfg.data, cfg.seed)
    except ValueError as exc:  # DataNotFoundError and impossible partitions: user input
        raise ConfigError(str(exc)) from None


def prepare(cfg: ExperimentConfig, algorithm_cls: Callable[[Any], Any], env_cls: Any) -> Prepared:
    """Build data, model initialisation and the algorithm (which calibrates its noise)."""
    ds = build_dataset(cfg)
    check_against_data(cfg, ds)
    oracle = getattr(algorithm_cls, "uses_ground_truth", False)
    env = env_cls(
        cfg=cfg,
        train_sizes=np.asarray(ds.train_sizes),
        init_weights=initial_weights(cfg, ds),
        feature_shape=tuple(ds.feature_shape),
        num_classes=int(ds.num_classes),
        ground_truth=np.asarray(ds.true_cluster) if oracle else None,
    )
    try:
        algorithm = algorithm_cls(env)
    except (BudgetError, PrivacyConfigError) as exc:  # the request cannot be met: refuse
        raise ConfigError(str(exc)) from None
    return Prepared(cfg, ds, algorithm, env)


def run_prepared(
    prep: Prepared,
    out_dir: Path,
    on_round: Callable[[dict], None] | None = None,
    resume: bytes | None = None,
    overwrite: bool = False,
    resuming: bool | None = None,
):
    """Run and write the results into ``OUT.incomplete`` (config.yaml first, metrics.parquet and
    the checkpoint as rounds finish), then move it to ``out_dir`` (raysim.rundir). A run that
    stops is marked in its status.json and `raysim run --resume out_dir` continues it; an
    existing ``out_dir`` is refused unless ``overwrite`` (ConfigError). ``resuming`` (default:
    a checkpoint is given) continues the existing staging directory."""
    from raysim import rundir
    from raysim.config import dump_config
    from raysim.metrics.results import write_results
    from raysim.runtime.session import run_session

    stage = rundir.begin(
        out_dir,
        dump_config(prep.cfg),
        prep.cfg.rounds,
        overwrite,
        resume=resume is not None if resuming is None else resuming,
    )
    try:
        results = run_session(prep, on_round=on_round, out_dir=stage, resume=resume)
        write_results(stage, prep, results)
    except ConfigError as exc:  # refused before a round ran (e.g. workers that cannot fit)
        if not (stage / "metrics.parquet").exists() and resume is None:
            shutil.rmtree(stage)
        else:
            rundir.mark_interrupted(stage, exc)
        raise
    except BaseException as exc:
        rundir.mark_interrupted(stage, exc)
        raise
    rundir.commit(stage, out_dir)
    return results
