"""A prepared experiment run to its result directory: staged, its rounds run (on Ray by
default, or by the in-process loop), its results written and tracked, then moved into place."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from raysim.config import ConfigError
from raysim.engine.experiment import Prepared


def run_prepared(
    prep: Prepared,
    out_dir: Path,
    on_round: Callable[[dict], None] | None = None,
    resume: bytes | None = None,
    overwrite: bool = False,
    resuming: bool | None = None,
    session: Callable[..., dict] | None = None,
):
    """Run and write the results into ``OUT.incomplete`` (config.yaml first, metrics.parquet and
    the checkpoint as rounds finish), then move it to ``out_dir`` (raysim.state.rundir). A run that
    stops is marked in its status.json and `raysim run --resume out_dir` continues it; an
    existing ``out_dir`` is refused unless ``overwrite`` (ConfigError). ``resuming`` (default:
    a checkpoint is given) continues the existing staging directory. ``session`` runs the rounds
    (default: ``runtime.session.run_session``, on Ray; ``raysim compare --inline`` passes its
    in-process loop), called as ``session(prep, on_round=, out_dir=, resume=)``. With
    ``tracking.backend`` set, the run is also logged there (raysim.metrics.tracking)."""
    from raysim.config import dump_config
    from raysim.metrics.results import write_results
    from raysim.metrics.tracking import RunTracking, make_tracker
    from raysim.runtime.session import run_session
    from raysim.state import rundir

    stage = rundir.begin(
        out_dir,
        dump_config(prep.recorded_config()),
        prep.cfg.rounds,
        overwrite,
        resume=resume is not None if resuming is None else resuming,
    )
    tracking = None
    try:
        tracker = make_tracker(prep.cfg, out_dir, stage)
        if tracker is not None:
            tracking = RunTracking(tracker, prep.recorded_config())
            on_round = tracking.on_round(on_round)
        results = (session or run_session)(prep, on_round=on_round, out_dir=stage, resume=resume)
        write_results(stage, prep, results)
        if tracking is not None:  # closed before the rename: its files move with the run
            tracking.finish(results["history"], stage)
            tracking = None
        rundir.commit(stage, out_dir)
    except ConfigError as exc:  # refused before a round ran (e.g. workers that cannot fit)
        if tracking is not None:
            tracking.fail(exc)
        if not (stage / "metrics.parquet").exists() and resume is None:
            shutil.rmtree(stage)
            rundir.release(stage)
        else:
            rundir.stop(stage, exc)
        raise
    except BaseException as exc:  # the status says why; the lock is given back
        if tracking is not None:
            tracking.fail(exc)
        if stage.is_dir():
            rundir.stop(stage, exc)
        else:
            rundir.release(stage)
        raise
    return results
