"""The Tune trainable: one simulation per trial, reported round by round.

The trial's placement group reserves a tiny bundle for the trial itself (the driver loop and the
zero-CPU coordinator) and one bundle per client worker; Tune makes the trial's actors use it
(child tasks are captured), so concurrent trials never over-subscribe the cluster or deadlock
waiting for each other's workers. The run's checkpoint goes to Tune with the round's report, so
a restored sweep continues an unfinished trial from its last round instead of from round 1.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from raysim.state.checkpoint import CHECKPOINT
from tune.space import REPORTED, trial_config

TRIAL_BUNDLE = {"CPU": 0.01}


def placement(base: dict[str, Any]):
    """`tune.with_resources` callable: the bundles follow the trial's own runtime settings."""
    from ray import tune

    def resources(params: dict[str, Any]):
        import ray

        from raysim.runtime.resources import gpus_per_worker

        rt = trial_config(base, params).runtime
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
        gpu = gpus_per_worker(rt, cluster_gpus)
        worker = {"CPU": rt.cpus_per_worker, **({"GPU": gpu} if gpu else {})}
        return tune.PlacementGroupFactory([TRIAL_BUNDLE] + [worker] * rt.num_workers)

    return resources


def make_trainable(base: dict[str, Any]):
    """A function trainable closed over the base config; `params` are the dotted-key values."""

    def simulate(params: dict[str, Any]) -> None:
        from ray import tune

        from algorithms import Environment, get_algorithm
        from raysim.compose import for_algorithm
        from raysim.engine.experiment import prepare
        from raysim.metrics.results import write_results
        from raysim.runtime.session import run_session

        cfg = for_algorithm(trial_config(base, params), quiet=True)  # as `raysim compare`
        cfg.runtime.progress = False
        bundles = tune.get_context().get_trial_resources().bundles
        gpus = float(bundles[-1].get("GPU", 0.0)) if len(bundles) > 1 else 0.0
        prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
        # NaN until the first evaluation (eval_every > 1): every report carries the metrics the
        # sweep's metric and schedulers such as ASHA look for.
        last: dict[str, Any] = dict.fromkeys(REPORTED, float("nan"))
        trial_dir = Path(tune.get_context().get_trial_dir()) / "run"
        every = cfg.runtime.checkpoint_every

        def report(row: dict[str, Any]) -> None:
            last.update({k: row[k] for k in REPORTED if k in row})
            metrics = {"round": row["round"], "epsilon": row["epsilon"], **last}
            ckpt = trial_dir / CHECKPOINT
            if every and row["round"] % every == 0 and ckpt.is_file():
                # Tune keeps it with the trial: a restored sweep continues the trial from here.
                with tempfile.TemporaryDirectory() as d:
                    shutil.copy(ckpt, d)
                    tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
            else:
                tune.report(metrics)

        resume = None
        if (saved := tune.get_checkpoint()) is not None:
            with saved.as_directory() as d:
                resume = (Path(d) / CHECKPOINT).read_bytes()
        results = run_session(prep, report, out_dir=trial_dir, resume=resume, gpus=gpus)
        write_results(trial_dir, prep, results)

    from ray import tune

    return tune.with_resources(simulate, placement(base))
