from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import small_config

from raysim.cli.main import main
from raysim.metrics.results import RESULT_FILES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--set", "data.dataset=imagenet"], "data.dataset"),
        (["--set", "model.name=vgg"], "model.name"),
        (["--set", "algorithm.name=magic"], "algorithm.name"),
        (["--set", "privacy.epsilon=0"], "privacy.epsilon"),
        (["--set", "privacy.delta=2"], "privacy.delta"),
        (["--set", "privacy.delta=0.01"], "privacy.delta"),  # >= 1/smallest client (~144)
        (["--set", "training.sampling_rate=0"], "training.sampling_rate"),
        (["--set", "rounds=-1"], "rounds"),
        (["--set", "data.num_clients=0"], "data.num_clients"),
        (["--set", "data.cluster_sizes=[1,2]"], "cluster_sizes"),
        (["--set", "runtime.gpus_per_worker=2"], "runtime.gpus_per_worker"),
        (["--set", "data.root=/no/such/dir"], "data.root"),
        (["--set", "algorithm.name=local", "--set", "privacy.mode=client"], "privacy.mode"),
    ],
)
def test_bad_input_exits_2_naming_the_field(args, field, capsys, tmp_path):
    code = main(
        [
            "run",
            "--out",
            str(tmp_path / "out"),
            *sum((["--set", s] for s in small_config()), []),
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert field in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--out", ""], "--out: give a directory (it is empty)"),
        (["sweep", "tune/sweeps/rdpcfl_m_candidates.yaml", "--out", " "], "--out: give a"),
        (["attack", "dlg", "--out", ""], "--out: give a directory"),
        (["compare", "raysim/demo.yaml", "--out", ""], "--out: give a directory"),
        # refused for the empty --out; the keys compare sets itself are said to be replaced
        (["compare", "raysim/demo.yaml", "--set", "seed=3", "--out", ""], "seed=3: replaced by"),
        (["compare", "raysim/demo.yaml", "--set", "algorithm.name=ifca", "--out", ""], "ifca: r"),
    ],
)
def test_an_empty_out_is_refused_and_keys_compare_sets_itself_replaced(
    argv, message, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_out_below_a_file_and_an_empty_algorithm_list_are_refused(tmp_path, capsys):
    afile = tmp_path / "afile.txt"
    afile.write_text("kept")
    # the demo's three runs would go below it: refused before Ray, the file kept
    assert main(["run", "--out", str(afile), "--set", "rounds=2"]) == 2
    assert f"--out: {str(afile)!r} exists and is not a directory" in capsys.readouterr().err
    assert afile.read_text() == "kept"
    assert main(["run", "--algorithms", "", "--out", str(tmp_path / "o")]) == 2
    assert "--algorithms: give at least one" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_config_file_and_bad_yaml(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {dataset: digits\n")
    assert main(["run", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_no_traceback_from_the_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "raysim.cli.main", "run", "--set", "privacy.epsilon=-2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "privacy.epsilon" in proc.stderr and "Traceback" not in proc.stderr


def test_privacy_command_json(capsys):
    args = ["privacy", *sum((["--set", s] for s in small_config(rounds=5)), []), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["delta"] == 1e-3
    assert report["noise_multiplier"] > 0
    assert report["epsilon"] == pytest.approx(4.0, rel=0.01)
    assert report["epsilon"] <= 4.0 + 1e-9


def test_data_describe(capsys):
    assert main(["data", "describe", *sum((["--set", s] for s in small_config()), [])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dataset digits: classification, 10 classes")
    assert "8 clients in 2 clusters [4, 4]" in out[1]
    # per cluster: 4 equal clients, whose label counts add up to their train + test rows
    rows = [line.split(maxsplit=4) for line in out[4:6]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 4), (1, 4)]
    for r in rows:
        (train,), (test,) = ({int(v) for v in part.split("/")} for part in r[2:4])
        labels = json.loads(r[4])
        assert len(labels) == 10 and sum(labels) == 4 * (train + test) == 1792 // 2


def test_run_end_to_end_writes_every_result_file(ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), *sum((["--set", s] for s in small_config()), [])])
    assert code == 0, capsys.readouterr().err
    for name in RESULT_FILES:
        assert (out / name).is_file(), name
    metrics = pq.read_table(out / "metrics.parquet").to_pandas()
    assert list(metrics["round"]) == [1, 2]
    assert {"accuracy", "loss", "epsilon", "accuracy_cluster_0", "accuracy_cluster_1"} <= set(
        metrics
    )
    assert metrics["epsilon"].is_monotonic_increasing
    assert metrics["epsilon"].iloc[-1] == pytest.approx(4.0, rel=0.02)
    clients = pq.read_table(out / "clients.parquet").to_pandas()
    assert len(clients) == 8
    assert {"client_id", "true_cluster", "assigned_cluster", "accuracy", "loss", "epsilon"} <= set(
        clients
    )
    summary = json.loads((out / "summary.json").read_text())
    for key in ("final_accuracy", "rounds", "epsilon", "delta", "wall_seconds", "algorithm"):
        assert key in summary
    assert 0 <= summary["final_accuracy"] <= 1
    steps = ["ray_start", "ray_ready", "data_in_store", "workers_ready", "first_round"]
    startup = summary["startup_seconds"]  # from this process's start, in the order they happen
    assert set(steps[2:]) <= set(startup) and set(startup) <= set(steps)  # Ray: the suite's
    assert list(startup) == [k for k in steps if k in startup]
    assert list(startup.values()) == sorted(startup.values())
    privacy = pq.read_table(out / "privacy.parquet").to_pandas()
    assert set(privacy["client"]) == set(range(8))
    # report re-reads the run into a page beside it, and writes nothing into the run
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    assert main(["report", str(out)]) == 0
    assert (tmp_path / "run-report.html").is_file()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    assert "fedavg" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["sample", "client"])
def test_fixed_noise_over_budget_is_refused_before_start(mode, tmp_path, capsys):
    delta = 0.01 if mode == "client" else 1e-3  # below 1/num_clients resp. 1/smallest client
    sets = small_config(**{"privacy.mode": mode, "privacy.delta": delta, "rounds": 20})
    sets += ["privacy.noise_multiplier=0.3", "privacy.epsilon=1"]
    code = main(["run", "--out", str(tmp_path / "o"), *sum((["--set", s] for s in sets), [])])
    err = capsys.readouterr().err
    assert code == 2
    assert "privacy.epsilon=1" in err and "privacy.noise_multiplier=0.3" in err
    assert not (tmp_path / "o").exists()


def test_compare_names_every_algorithm_whose_budget_cannot_be_met_before_any_run(tmp_path, capsys):
    # one reserved selection at eps 5 (rdpcfl; ifca selects each round): a budget of 1 is
    # refused for both, fedavg would run; all are refused before the first run starts
    sets = ["rounds=2", "privacy.epsilon=1", "algorithm.eps_select=5"]
    argv = ["compare", "raysim/demo.yaml", "--algorithms", "rdpcfl,fedavg,ifca", "--seeds", "0,1"]
    code = main([*argv, "--out", str(tmp_path / "o"), *sum((["--set", s] for s in sets), [])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "2 of 3 algorithms cannot start (nothing ran)" in err
    assert "rdpcfl (seeds 0, 1): epsilon=1.0" in err and "ifca (seeds 0, 1): epsilon=1.0" in err
    assert "fedavg (" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_progress_lines_say_round_rate_accuracy_and_time_left(capsys):
    """compare --jobs N: each run reports in lines, at most one a minute and always the last."""
    from raysim.cli.common import ProgressLines
    from raysim.config import load_config

    cfg = load_config(None, small_config(rounds=4, **{"runtime.progress": "true"}))
    lines = ProgressLines(cfg, "fedavg seed 3", every=3600)
    rows = [
        {"round": 1, "round_seconds": 30.0, "epsilon": 0.5},
        {"round": 2, "round_seconds": 50.0, "epsilon": 0.7, "accuracy": 0.5234},
        {"round": 3, "round_seconds": 40.0, "epsilon": 0.9},
        {"round": 4, "round_seconds": 40.0, "epsilon": 1.1, "accuracy": 0.61},
    ]
    for row in rows[:3]:
        lines.update(row)
    assert capsys.readouterr().err == ""  # within the minute: quiet
    lines.every = 0
    lines.update({"round": 3, "round_seconds": 40.0, "epsilon": 0.9})
    assert capsys.readouterr().err == (
        "fedavg seed 3: round 3/4, 40.0 s/round, accuracy 52.3% at round 2, eps 0.90, ~1 min left\n"
    )
    lines.every = 3600
    lines.update(rows[3])  # the last round, however soon
    assert capsys.readouterr().err.startswith(
        "fedavg seed 3: round 4/4, 40.0 s/round, accuracy 61.0%"
    )


def test_progress_lines_time_left_follows_the_recent_rounds(capsys):
    """R-DPCFL's rounds after E_c cost ~2x the earlier ones: after `window` slower rounds the
    rate and the time left are theirs, not the mean since the start."""
    from raysim.cli.common import ProgressLines
    from raysim.config import load_config

    cfg = load_config(None, small_config(rounds=200, **{"runtime.progress": "true"}))
    lines = ProgressLines(cfg, "rdpcfl seed 0", every=3600)
    for r in range(1, 101):
        lines.update({"round": r, "round_seconds": 40.0, "epsilon": 2.0})
    for r in range(101, 101 + lines.window):
        lines.update({"round": r, "round_seconds": 80.0, "epsilon": 3.0})
    lines.every = 0
    lines.update({"round": 121, "round_seconds": 80.0, "epsilon": 3.0})
    # 79 rounds left at 80 s: 105 min (the whole-process mean, 47 s, would say 62)
    assert capsys.readouterr().err == (
        "rdpcfl seed 0: round 121/200, 80.0 s/round, eps 3.00, ~105 min left\n"
    )


def test_process_age_counts_from_the_start_of_the_process():
    """The start-up timeline's clock, against the parent's watch of a child that sleeps first."""
    code = "import time; time.sleep(0.5); from raysim.runtime.session import process_age; "
    code += "print(process_age())"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    elapsed = time.time() - t0
    assert 0.5 <= float(out.stdout) <= elapsed + 0.02


def test_an_interrupted_compares_hint_replaces_its_out_and_adds_resume():
    from raysim.cli.compare import _without_out

    argv = ["c.yaml", "--out", "x", "--overwrite", "--out=y", "--resume", "--seeds", "0,1"]
    assert _without_out(argv) == ["c.yaml", "--seeds", "0,1"]


def test_a_reader_that_leaves_early_is_not_a_failure():
    """`raysim list | head -1`: the pipe closes before raysim has written; the command ends
    quietly as a shell reports SIGPIPE (141), without "failed" or a traceback."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    proc = subprocess.run(
        [sys.executable, "-m", "raysim.cli", "list", "datasets"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
