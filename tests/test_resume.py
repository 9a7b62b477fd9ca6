"""Checkpoints and `raysim run --resume`: a run that died after round k, resumed, ends with the
same files as one that never stopped (timings aside)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.cli import main
from raysim.config import load_config
from raysim.experiment import prepare, run_prepared
from raysim.rundir import staging_dir, unfinished
from raysim.runtime.checkpoint import CHECKPOINT

ROUNDS = 3
SETTINGS = {
    "rounds": ROUNDS,
    "model.name": "mlp",
    "algorithm.name": "ifca",
    "training.local_epochs": 4,  # rounds of about a second: a fault can land inside one
}


class DriverDied(Exception):
    pass


def _prep(**extra):
    cfg = load_config(None, small_config(**{**SETTINGS, **extra}))
    return prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)


def _table(run_dir, name):
    df = pq.read_table(run_dir / name).to_pandas()
    return df.drop(columns=[c for c in df.columns if c == "round_seconds"])


def _assert_same(a, b):
    for name in ("metrics.parquet", "clients.parquet", "privacy.parquet"):
        ta, tb = _table(a, name), _table(b, name)
        assert ta.equals(tb), (name, ta, tb)


@pytest.fixture(scope="module")
def whole(ray_session, tmp_path_factory):
    """The uninterrupted run every other run must reproduce."""
    out = tmp_path_factory.mktemp("resume") / "whole"
    run_prepared(_prep(), out)
    return out


def test_killed_run_resumes_to_identical_results(whole, tmp_path):
    died = tmp_path / "died"

    def die_after_round_2(row):
        if row["round"] == 2:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_prepared(_prep(), died, on_round=die_after_round_2)
    stage = staging_dir(died)  # the run is written beside its target until it is complete
    assert not died.exists()
    assert (stage / CHECKPOINT).is_file()
    partial = _table(stage, "metrics.parquet")  # rounds already done are on disk
    assert list(partial["round"]) == [1, 2]
    assert not (stage / "summary.json").exists()
    state = unfinished(died)
    assert (state.status, state.rounds_done, state.rounds) == ("failed", 2, ROUNDS)
    assert "DriverDied" in state.error

    assert main(["run", "--resume", str(died)]) == 0
    assert not stage.exists()
    _assert_same(whole, died)


def test_killed_coordinator_restarts_from_its_checkpoint(whole, tmp_path):
    """The coordinator process dies in round 2: the session restarts it from round 1's
    checkpoint and the run ends as if nothing happened."""
    from multinode_driver import kill_a_worker, run

    info: dict = {}
    killed = tmp_path / "killed"
    result = run(killed, small_config(**SETTINGS), lambda: kill_a_worker(info, "Coordinator"))
    assert info["killed_pid"] and result["coordinator_restarts"] == 1
    _assert_same(whole, killed)


def test_resume_needs_a_run_directory(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2
    assert "config.yaml" in capsys.readouterr().err
