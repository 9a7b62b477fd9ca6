"""Checkpoints and `raysim run --resume`: a run that died after round k, resumed, ends with the
same files as one that never stopped (timings aside)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.cli.main import main
from raysim.config import dump_config, load_config
from raysim.engine.experiment import prepare
from raysim.runtime.run import run_prepared
from raysim.state.checkpoint import CHECKPOINT
from raysim.state.rundir import staging_dir, unfinished

ROUNDS = 3
SETTINGS = {
    "rounds": ROUNDS,
    "model.name": "mlp",
    "algorithm.name": "ifca",
    "training.local_epochs": 16,  # rounds of about a second: a fault can land inside one
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
    for name in ("metrics.parquet", "clients.parquet", "privacy.parquet", "assignments.parquet"):
        ta, tb = _table(a, name), _table(b, name)
        assert ta.equals(tb), (name, ta, tb)


@pytest.fixture(scope="module")
def whole(ray_session, tmp_path_factory):
    """The uninterrupted run every other run must reproduce."""
    out = tmp_path_factory.mktemp("resume") / "whole"
    run_prepared(_prep(), out)
    return out


def test_each_rounds_assignment_is_recorded_and_the_last_is_the_final_one(whole):
    rounds = _table(whole, "assignments.parquet")
    clients = _table(whole, "clients.parquet")
    assert sorted(set(rounds["round"])) == list(range(1, ROUNDS + 1))
    assert len(rounds) == ROUNDS * len(clients)
    last = rounds[rounds["round"] == ROUNDS].sort_values("client_id")
    assert last["cluster"].tolist() == clients.sort_values("client_id")["assigned_cluster"].tolist()


def test_killed_run_resumes_to_identical_results(whole, tmp_path, capsys):
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

    # its noise and budget were planned for the saved config: more rounds or another budget
    # are refused before anything runs, and nothing is lost
    for change in ("rounds=8", "privacy.epsilon=2"):
        assert main(["run", "--resume", str(died), "--set", change]) == 2
        assert change.split("=")[0] in capsys.readouterr().err
    assert (stage / CHECKPOINT).is_file()
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
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
    # a directory of the user's that happens to hold a config.yaml is refused, and not moved
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("rounds: 2\n")
    (mine / "notes.txt").write_text("precious")
    assert main(["run", "--resume", str(mine)]) == 2
    assert "no run raysim started" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (mine / "notes.txt").read_text() == "precious"


# ---------------------------------------------------------------- raysim compare, inline too


def _compare_argv(tmp_path, out, *sets):
    """`raysim compare` of the module's run (ifca, seed 0; its config written out), inline, into
    tmp_path/out."""
    config = tmp_path / "ifca.yaml"
    config.write_text(dump_config(_prep().cfg))
    argv = [str(config), "--inline", "--out", str(tmp_path / out)]
    argv += ["--algorithms", "ifca", "--seeds", "0"]
    for s in sets:
        argv += ["--set", s]
    return argv


def test_inline_run_killed_resumes_on_ray_to_identical_results(whole, tmp_path):
    """An inline run writes the checkpoints a Ray run writes, in the same format: one that died
    after round 2 is continued by `raysim run --resume` (on Ray) to the uninterrupted Ray run's
    files."""
    from raysim.runtime.inline import run_inline

    died = tmp_path / "died"

    def die_after_round_2(row):
        if row["round"] == 2:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_prepared(_prep(), died, on_round=die_after_round_2, session=run_inline)
    state = unfinished(died)
    assert (state.status, state.rounds_done) == ("failed", 2)
    assert (staging_dir(died) / CHECKPOINT).is_file()
    assert main(["run", "--resume", str(died)]) == 0
    _assert_same(whole, died)


def test_compare_resume_continues_keeps_and_refuses(whole, tmp_path, capsys):
    """`raysim compare --out OUT --resume`: an unfinished inline run is continued from its
    checkpoint to the uninterrupted run's files; a finished one is kept as it is; a run begun
    with other settings, or an unfinished one met without --resume, is refused."""
    from raysim.cli.compare import main as compare_main
    from raysim.runtime.inline import run_inline

    out = tmp_path / "table"
    run_dir = out / "ifca" / "seed0"

    def die_after_round_1(row):
        if row["round"] == 1:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_prepared(_prep(), run_dir, on_round=die_after_round_1, session=run_inline)
    assert compare_main(_compare_argv(tmp_path, "table")) == 2  # not resumed unasked
    assert "--resume" in capsys.readouterr().err
    assert compare_main([*_compare_argv(tmp_path, "table"), "--report-only"]) == 0
    assert f"{staging_dir(run_dir)}: after round 1" in capsys.readouterr().out
    changed = _compare_argv(tmp_path, "table", "training.lr=0.05")
    assert compare_main([*changed, "--resume"]) == 2
    assert "training.lr" in capsys.readouterr().err
    assert (staging_dir(run_dir) / CHECKPOINT).is_file()  # the refusals lost nothing

    assert compare_main([*_compare_argv(tmp_path, "table"), "--resume"]) == 0
    assert "continuing after round 1" in capsys.readouterr().err
    assert not staging_dir(run_dir).exists()
    _assert_same(whole, run_dir)
    # the run's cost counts the round done before it died (wall_seconds: since resuming)
    seconds = pq.read_table(run_dir / "metrics.parquet").column("round_seconds").to_pylist()
    assert len(seconds) == ROUNDS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_seconds"] == pytest.approx(sum(seconds))
    assert [st["from_round"] for st in summary["stretches"]] == [1, 2]  # where each start ran
    table = (out / "compare.md").read_text()
    assert "min/run" in table and f"ifca seed 0 rounds 1-{ROUNDS}." in table

    summary = (run_dir / "summary.json").stat().st_mtime_ns
    assert compare_main([*_compare_argv(tmp_path, "table"), "--resume"]) == 0
    assert "finished, kept" in capsys.readouterr().err
    assert (run_dir / "summary.json").stat().st_mtime_ns == summary
    assert compare_main([*changed, "--resume"]) == 2  # a finished one made otherwise: refused too
    assert "made with other settings (training.lr)" in capsys.readouterr().err
    assert (run_dir / "summary.json").stat().st_mtime_ns == summary
    assert compare_main([*_compare_argv(tmp_path, "other"), "--resume", "--overwrite"]) == 2


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_interrupt_stops_every_parallel_inline_run_and_starts_no_other(tmp_path, stop):
    """Ctrl-C on `raysim compare --inline --jobs 2` with six runs (SIGINT to the whole process
    group, as a terminal sends it), or `kill` of the command alone (SIGTERM to its process only:
    it passes the stop on): the two running ones are marked interrupted (resumable), no other
    starts, and the command exits 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sets = small_config(**{"rounds": 500, "data.samples_per_client": 40})
    out = tmp_path / "table"
    argv = [str(Path(__file__).parents[1] / "raysim" / "demo.yaml"), "--inline", "--jobs", "2"]
    argv += ["--algorithms", "fedavg,local,fedprox", "--seeds", "0,1", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli.main", "compare", *argv],
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (`pytest ... &` from a script) has SIGINT ignored,
        # and a child inherits that: Python then never installs its Ctrl-C handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        started = [staging_dir(out / "fedavg" / f"seed{s}") / "metrics.parquet" for s in (0, 1)]
        deadline = time.monotonic() + 240
        while not all(p.is_file() for p in started):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 130
    finally:  # a failed test leaves no 500-round runs behind to slow the rest of the suite
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert "Traceback" not in proc.stderr.read()
    for seed in (0, 1):
        assert unfinished(out / "fedavg" / f"seed{seed}").status == "interrupted"
    assert not (out / "local").exists() and not (out / "fedprox").exists()  # none started after
