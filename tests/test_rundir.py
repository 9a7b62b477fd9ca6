"""Results are never lost or mixed: `--out` onto a run refuses, runs are staged beside their
target and moved into place when complete, unfinished runs are marked and reported."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from conftest import small_config

from raysim.cli.main import main
from raysim.config import ConfigError
from raysim.state import rundir
from raysim.state.checkpoint import CHECKPOINT


def _sets(**kw):
    return sum((["--set", s] for s in small_config(**kw)), [])


def _fake_run(path, **summary):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("rounds: 1\n")
    (path / "summary.json").write_text(json.dumps(summary))


def test_check_target_refuses_existing_runs_and_foreign_dirs(tmp_path):
    rundir.check_target(tmp_path / "new", overwrite=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    rundir.check_target(tmp_path / "empty", overwrite=False)  # empty: fine
    _fake_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="--overwrite"):
        rundir.check_target(tmp_path / "run", overwrite=False)
    rundir.check_target(tmp_path / "run", overwrite=True)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_text("x")
    for overwrite in (False, True):  # never replaced: it is not a run
        with pytest.raises(ConfigError, match="holds no run"):
            rundir.check_target(tmp_path / "photos", overwrite=overwrite)
    rundir.staging_dir(tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="--resume"):
        rundir.check_target(tmp_path / "half", overwrite=False)


def test_commit_swaps_a_whole_run_in(tmp_path):
    out = tmp_path / "out"
    _fake_run(out, algorithm="old")
    (out / "clients.parquet").write_text("old")
    stage = rundir.begin(out, "rounds: 2\n", 2, overwrite=True, resume=False)
    assert stage == rundir.staging_dir(out)
    assert json.loads((stage / rundir.STATUS).read_text())["status"] == "running"
    (stage / "summary.json").write_text('{"algorithm": "new"}')
    rundir.commit(stage, out)
    assert not stage.exists()
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "summary.json"]  # no mix
    assert json.loads((out / "summary.json").read_text())["algorithm"] == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old run is gone


def test_find_runs_and_unfinished(tmp_path):
    _fake_run(tmp_path / "a" / "fedavg")
    _fake_run(tmp_path / "a" / "local")
    stage = rundir.begin(tmp_path / "a" / "rdpcfl", "x: 1\n", 20, False, False)
    rundir.mark_interrupted(stage, KeyboardInterrupt())
    done, unfinished = rundir.find_runs(tmp_path / "a")
    assert [d.name for d in done] == ["fedavg", "local"]
    (u,) = unfinished
    assert (u.status, u.rounds_done, u.rounds) == ("interrupted", 0, 20)
    text = u.describe()
    assert "unfinished (interrupted" in text and "raysim run --resume" in text
    assert str(tmp_path / "a" / "rdpcfl") in text
    assert rundir.find_runs(tmp_path / "a" / "fedavg") == ([tmp_path / "a" / "fedavg"], [])


def test_run_onto_an_existing_run_refuses_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    _fake_run(out, algorithm="fedavg")
    before = sorted(p.name for p in out.iterdir())
    assert main(["run", "--out", str(out), *_sets()]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert not rundir.staging_dir(out).exists()


def test_overwrite_replaces_and_interrupt_leaves_old_run_intact(ray_session, tmp_path, capsys):
    from algorithms import Environment, get_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.runtime.run import run_prepared

    out = tmp_path / "out"
    assert main(["run", "--out", str(out), *_sets(rounds=1)]) == 0
    first = (out / "summary.json").read_text()

    def interrupt(row):
        raise KeyboardInterrupt

    cfg = load_config(None, small_config(rounds=2, seed=1))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    with pytest.raises(KeyboardInterrupt):
        run_prepared(prep, out, on_round=interrupt, overwrite=True)
    assert (out / "summary.json").read_text() == first  # the old run is untouched
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0  # the finished run, and a note on the other
    captured = capsys.readouterr()
    assert "unfinished (interrupted" in captured.err and "after round 1 of 2" in captured.err
    assert "fedavg" in captured.out
    assert main(["report", str(rundir.staging_dir(out))]) == 2  # only an unfinished run
    assert main(["run", "--resume", str(out)]) == 0  # finishes it and moves it into place
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 1 and summary["rounds"] == 2
    assert not rundir.staging_dir(out).exists()


def test_report_accepts_a_directory_of_runs(ray_session, tmp_path, capsys):
    out = tmp_path / "demo"
    sets = _sets(rounds=1, **{"privacy.mode": "none"})
    assert main(["run", "--out", str(out), "--algorithms", "fedavg,local", *sets]) == 0
    assert (out / "comparison.png").is_file()
    capsys.readouterr()
    (out / "comparison.png").unlink()
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert str(out / "fedavg") in text and str(out / "local") in text
    assert "All %" in text and "accuracy in %" in text
    assert "∞ (no DP)" in text and "0.00" not in text  # a non-private run is not "eps 0"
    assert not (out / "comparison.png").exists()  # nothing written into what it reads
    assert (tmp_path / "demo-report.html").is_file()  # the plots are in the page beside it
    # nor in its files: eps is missing (null, NaN), its ledger has its columns and no row
    summary = json.loads((out / "fedavg" / "summary.json").read_text())
    assert summary["epsilon"] is None and summary["epsilon_budget"] is None
    metrics = pq.read_table(out / "fedavg" / "metrics.parquet").to_pandas()
    assert metrics["epsilon"].isna().all()
    clients = pq.read_table(out / "fedavg" / "clients.parquet").to_pandas()
    assert clients["epsilon"].isna().all()
    assert not (out / "fedavg" / CHECKPOINT).exists()  # a finished run is not continued
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert f"{str(tmp_path / 'nope')!r} does not exist" in capsys.readouterr().err
    ledger = pq.read_table(out / "fedavg" / "privacy.parquet")
    assert ledger.num_rows == 0 and "mechanism" in ledger.column_names
    # `wall s` is the rounds' own time, summed over them (a resumed run's earlier ones too)
    row = next(line for line in text.splitlines() if str(out / "fedavg") in line)
    assert row.split()[-1] == f"{summary['rounds_seconds']:.0f}"


def test_compare_refuses_to_overwrite_its_runs(tmp_path, capsys):
    from raysim.cli.compare import main as compare_main

    _fake_run(tmp_path / "out" / "fedavg" / "seed0")
    argv = ["--algorithms", "fedavg", "--seeds", "0", "--out", str(tmp_path / "out")]
    assert compare_main([str(tmp_path / "none.yaml"), *argv]) == 2  # a missing config first
    (tmp_path / "c.yaml").write_text("rounds: 1\n")
    assert compare_main([str(tmp_path / "c.yaml"), *argv]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_each_start_of_a_run_records_its_machine_and_the_table_names_it(tmp_path, monkeypatch):
    """A run continued elsewhere took its minutes on two machines (and is not bit for bit the
    run one machine makes): each start records the round it starts from and the machine; the
    finished run keeps them in summary.json and compare's table says which machine ran what."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raysim.cli.compare import table

    out = tmp_path / "table" / "rdpcfl" / "seed0"
    monkeypatch.setattr(rundir, "machine", lambda: {"cpu": "CPU A", "cpus": 2, "torch": "2.0"})
    stage = rundir.begin(out, "rounds: 5\n", 5, overwrite=False, resume=False)
    pq.write_table(pa.table({"round": [1, 2]}), stage / "metrics.parquet")
    rundir.mark_interrupted(stage, KeyboardInterrupt())
    monkeypatch.setattr(rundir, "machine", lambda: {"cpu": "CPU B", "cpus": 16, "torch": "2.1"})
    assert rundir.begin(out, "rounds: 5\n", 5, overwrite=False, resume=True) == stage
    status = rundir.read_status(stage)
    assert status["pid"] == os.getpid()
    assert status["status"] == "running" and "error" not in status  # not the last stop's error
    assert [(s["from_round"], s["cpu"]) for s in status["stretches"]] == [
        (1, "CPU A"),
        (3, "CPU B"),
    ]
    (stage / "summary.json").write_text(json.dumps({"seed": 0, "rounds": 5, "final": {}}))
    rundir.commit(stage, out)
    kept = json.loads((out / "summary.json").read_text())
    assert [s["torch"] for s in kept["stretches"]] == ["2.0", "2.1"]
    assert kept["seed"] == 0
    _fake_run(tmp_path / "table" / "fedavg" / "seed0", seed=0, rounds=5, final={})
    (tmp_path / "table" / "fedavg" / "seed0" / "metrics.parquet").write_bytes(
        (out / "metrics.parquet").read_bytes()
    )
    from raysim.cli.compare import collect

    text = table(collect(tmp_path / "table"), ["rdpcfl", "fedavg"])
    assert "Ran on CPU A, 2 CPUs, torch 2.0: rdpcfl seed 0 rounds 1-2." in text
    assert "Ran on CPU B, 16 CPUs, torch 2.1: rdpcfl seed 0 rounds 3-5." in text
    assert "Machine not recorded: fedavg seed 0." in text
    status = rundir.read_status(rundir.begin(out.parent / "seed1", "r: 5\n", 5, False, False))
    status["stretches"][0]["from_round"] = 3  # begun by a raysim that did not record it
    (out.parent / "seed1").mkdir()
    summary = {"seed": 1, "rounds": 5, "final": {}, "stretches": status["stretches"]}
    (out.parent / "seed1" / "summary.json").write_text(json.dumps(summary))
    (out.parent / "seed1" / "metrics.parquet").write_bytes((out / "metrics.parquet").read_bytes())
    text = table(collect(tmp_path / "table"), ["rdpcfl"])
    assert (
        "Ran on CPU B, 16 CPUs, torch 2.1: rdpcfl seed 0 rounds 3-5; rdpcfl seed 1 rounds 3-5."
        in text
    )
    assert "Machine not recorded: rdpcfl seed 1 rounds 1-2." in text


def test_machine_names_this_cpu():
    m = rundir.machine()
    assert m["cpus"] == os.cpu_count() and m["torch"] and isinstance(m["cpu"], str) and m["cpu"]


def test_sigterm_does_what_ctrl_c_does_once():
    """SIGTERM raises Ctrl-C's KeyboardInterrupt, or runs a library's own Ctrl-C handler where one
    is set (Ray Tune's during a sweep); a second SIGTERM is ignored while the state is written."""
    import signal

    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        rundir.stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)  # ignored: neither raises nor ends the process

        calls = []
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
        rundir.stop_on_sigterm()
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: Ctrl-C cannot reach it
        rundir.stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])


def test_an_interrupt_says_whether_sigterm_sent_it():
    import signal

    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as Python sets it
        rundir.stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt) as by_kill:
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
    assert rundir.stopped_by_sigterm(by_kill.value)
    assert not rundir.stopped_by_sigterm(KeyboardInterrupt())  # Ctrl-C's


def test_a_regression_runs_table_shows_its_test_loss(tmp_path):
    """A regression task has no accuracy: its row shows the test loss instead, and a
    classification run's table gets no such column."""
    import pyarrow as pa

    from raysim.metrics.report import table_rows

    def run(name, final):
        path = tmp_path / name
        _fake_run(path, algorithm=name, rounds=3, privacy_mode="none", final=final)
        pq.write_table(pa.table({"round": [1, 2, 3]}), path / "metrics.parquet")
        return path

    header, rows = table_rows([run("regression", {"loss": 1.23456})])
    assert "test loss" in header and rows[0][header.index("test loss")] == "1.235"
    header, _ = table_rows([run("classes", {"accuracy": 0.5, "loss": 0.7})])
    assert "test loss" not in header and "All %" in header
