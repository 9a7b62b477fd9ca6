"""`raysim sweep`: sweep files are validated before Ray; a tiny sweep runs two trials in their
placement groups, writes one row per trial and the plots, and `--resume` restores it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import RAY_TIMEOUT_S

from algorithms import ALGORITHMS
from raysim.cli.main import main
from raysim.config import ConfigError
from tune.space import load_sweep, trial_config, trial_variants
from tune.trainable import TRIAL_BUNDLE

SWEEPS = sorted((Path(__file__).parents[1] / "tune" / "sweeps").glob("*.yaml"))
TINY = [  # over the demo, the base of a sweep file that names none
    "algorithm.name=fedavg",
    "rounds=2",
    "data.dataset=digits",
    "data.num_clients=6",
    "data.cluster_sizes=[3, 3]",
    "model.name=mlp",
    "privacy.mode=sample",
    "privacy.delta=1e-3",
    "training.batch_size=16",
    "runtime.num_workers=1",
    "runtime.cpus_per_worker=0.45",
    f"runtime.round_timeout_s={RAY_TIMEOUT_S}",
]


def _write(tmp_path: Path, space: dict, **extra) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "set": TINY, "space": space, **extra}))
    return path


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_ready_sweeps_load(path):
    raw = yaml.safe_load(path.read_text())
    needed = {v for k, s in raw["space"].items() if k == "algorithm.name" for v in s["grid"]}
    needed |= {s.split("=", 1)[1] for s in raw.get("set", []) if s.startswith("algorithm.name=")}
    assert not needed - set(ALGORITHMS), "the sweep names algorithms that are not registered"
    sweep = load_sweep(path)
    assert sweep.space and sweep.param_space()


@pytest.mark.parametrize(
    "space, message",
    [
        ({"privacy.epsilon": {"grid": [2, -1]}}, "privacy.epsilon = -1"),
        ({"privacy.nope": {"grid": [1]}}, "unknown field"),
        ({"training.lr": {"loguniform": [0, 1]}}, "low end"),
        ({"training.lr": {"between": [0, 1]}}, "expected one of"),
        ({"algorithm.name": {"choice": ["fedavg", "nope"]}}, "unknown algorithm"),
    ],
)
def test_bad_sweeps_fail_before_ray(tmp_path, space, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, space))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"metric": "acuracy"}, "metric 'acuracy': allowed: accuracy, loss"),
        ({"scheduler": "hyperband"}, "scheduler 'hyperband': allowed: fifo, asha"),
        ({"num_samples": 0}, "num_samples must be an integer >= 1"),
        ({"num_samples": "abc"}, "num_samples must be an integer >= 1"),
    ],
)
def test_bad_sweep_settings_fail_before_ray(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, {"privacy.epsilon": {"grid": [2]}}, **extra))


def test_sweep_files_that_are_not_yaml_and_bad_flags_fail_before_ray(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("space: [unclosed\n")
    assert main(["sweep", str(bad)]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    sweep = _write(tmp_path, {"privacy.epsilon": {"grid": [2]}})
    for flags, message in (
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--max-concurrent", "-1"], "--max-concurrent must be >= 1"),
        (["--resume"], "holds no sweep to continue"),
    ):
        assert main(["sweep", str(sweep), "--out", str(tmp_path / "new"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def _draws(path: Path, overrides: list[str], num_samples: int = 3) -> list[dict]:
    """The trial configs the sweep's Tune settings would run, without starting Ray."""
    import argparse

    from tune.sweep import tune_config

    sweep = load_sweep(path, overrides)
    args = argparse.Namespace(num_samples=num_samples, scheduler=None, max_concurrent=None)
    config = tune_config(sweep, args)
    gen = config.search_alg
    spec = {"config": sweep.param_space(), "num_samples": config.num_samples}
    gen.add_configurations({"draws": {"run": lambda _: None, **spec}})
    trials = iter(gen.next_trial, None)
    return [trial.config for trial in trials]


def test_a_sweep_without_a_base_sweeps_the_demo(tmp_path):
    """As `raysim run` without CONFIG runs the demo (not the built-in defaults)."""
    path = tmp_path / "s.yaml"
    path.write_text("space:\n  training.lr: {grid: [0.1]}\n")
    demo = yaml.safe_load((Path(__file__).parents[1] / "raysim" / "demo.yaml").read_text())
    assert load_sweep(path).base == demo


def test_a_relative_data_root_is_the_one_beside_the_command_in_every_trial(tmp_path, monkeypatch):
    """Trials run in directories of their own: the root is made absolute before they start."""
    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(_write(tmp_path, {"seed": {"grid": [0]}}), ["data.root=data"])
    assert sweep.base["data"]["root"] == str(tmp_path / "data")
    monkeypatch.chdir(tmp_path / "elsewhere")  # as a trial's working directory
    assert trial_config(sweep.base, {"seed": 0}).data.root == str(tmp_path / "data")


def test_the_trials_named_before_the_sweep_are_every_combination_at_the_ranges_ends():
    space = {
        "privacy.epsilon": {"grid": [2, 8]},
        "algorithm.num_clusters": {"randint": [2, 5]},  # Tune's upper end is exclusive: 2..4
        "training.lr": {"uniform": [0.01, 0.1]},
    }
    named = trial_variants(space, most=8)
    assert len(named) == 8 and len({tuple(d.items()) for d in named}) == 8
    assert {d["algorithm.num_clusters"] for d in named} == {2, 4}
    assert {d["training.lr"] for d in named} == {0.01, 0.1}
    assert {"privacy.epsilon": 8, "algorithm.num_clusters": 2, "training.lr": 0.1} in named
    alone = trial_variants(space, most=7)  # too many: each value on its own, on the base
    assert alone == [
        {"privacy.epsilon": 2},
        {"privacy.epsilon": 8},
        {"algorithm.num_clusters": 2},
        {"algorithm.num_clusters": 4},
        {"training.lr": 0.01},
        {"training.lr": 0.1},
    ]


def test_a_combination_that_the_schema_refuses_fails_before_ray(tmp_path):
    # each value passes on the base (mode sample, delta 1e-3); the combination does not (client-
    # level DP over 6 clients needs delta < 1/6): named as the sweep file writes it
    space = {"privacy.mode": {"grid": ["sample", "client"]}, "privacy.delta": {"grid": [1e-3, 0.2]}}
    named = "(?s)privacy.delta = 0.2, privacy.mode = 'client': .*below 1/num_clients"
    with pytest.raises(ConfigError, match=named):
        load_sweep(_write(tmp_path, space))


def test_random_draws_follow_the_seed(tmp_path):
    """Same base seed, same hyperparameters tried (Tune's default draws from np.random)."""
    path = _write(
        tmp_path,
        {
            "privacy.epsilon": {"grid": [1, 8]},
            "training.lr": {"loguniform": [0.001, 0.1]},
            "training.sampling_rate": {"uniform": [0.5, 1.0]},
        },
    )
    first = _draws(path, ["seed=3"])
    assert len(first) == 6  # num_samples repeats of the 2-point grid, as before
    assert sorted(d["privacy.epsilon"] for d in first) == [1, 1, 1, 8, 8, 8]
    assert _draws(path, ["seed=3"]) == first
    other = _draws(path, ["seed=4"])
    assert [d["training.lr"] for d in other] != [d["training.lr"] for d in first]


def test_tiny_sweep_runs_reports_and_resumes(ray_session, tmp_path, capsys):
    sweep = _write(
        tmp_path,
        {"privacy.epsilon": {"grid": [1, 8]}, "training.lr": {"loguniform": [0.01, 0.1]}},
    )
    out = tmp_path / "out"
    ctrl_c = signal.getsignal(signal.SIGINT)
    assert main(["sweep", str(sweep), "--out", str(out), "--scheduler", "asha"]) == 0
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Tune's handler would swallow Ctrl-C
    df = pd.read_parquet(out / "trials.parquet")
    assert len(df) == 2 and df["error"].isna().all()
    assert sorted(df["privacy.epsilon"]) == [1, 8]
    assert (df["epsilon"] <= df["privacy.epsilon"] + 1e-9).all()
    assert max(df["rounds_done"]) == 2 and min(df["rounds_done"]) >= 1  # ASHA may stop one
    assert {"accuracy", "loss", "ari"} <= set(df.columns) and df["accuracy"].notna().all()
    assert (out / "privacy_utility.png").is_file()
    assert (out / "knob_privacy_epsilon.png").is_file()
    for path in df["path"]:  # each trial also keeps a full run directory
        assert (Path(path) / "run" / "metrics.parquet").is_file()
    finished = df[df["rounds_done"] == 2]["path"]  # ASHA's last rung does not cut the results
    assert all((Path(path) / "run" / "summary.json").is_file() for path in finished)
    printed = capsys.readouterr().out
    assert "all 2 trials by accuracy" in printed and "accuracy %" in printed
    # the choice among the trials is charged to no ledger: the summary says what it costs
    cost = json.loads((out / "selection.json").read_text())
    assert cost["trials"] == 2 and cost["epsilon_selection"] == pytest.approx(df["epsilon"].sum())
    assert cost["delta_selection"] == pytest.approx(2e-3)  # privacy.delta=1e-3 per trial
    assert "picking the best of 2 private trials" in printed and "Papernot" in printed
    assert main(["report", str(out), "--out", str(tmp_path / "sweep.html")]) == 0
    assert 'id="selection-privacy"' in (tmp_path / "sweep.html").read_text()
    assert len(list(out.glob("tune/tiny/*/checkpoint_*/checkpoint.ckpt"))) >= 2  # kept by Tune

    # resumed, its trials are made as its first ones were: other settings are refused before Ray
    other = ["--resume", "--set", "training.momentum=0.5"]
    assert main(["sweep", str(sweep), "--out", str(out), *other]) == 2
    err = capsys.readouterr().err
    assert "was started with other settings (training.momentum)" in err
    assert "it started with none" in err
    assert main(["sweep", str(sweep), "--out", str(out), "--resume"]) == 0
    again = pd.read_parquet(out / "trials.parquet")
    assert sorted(again["trial_id"]) == sorted(df["trial_id"])
    # another sweep into the same --out is refused before Ray, and nothing there changes
    before = (out / "trials.parquet").read_bytes()
    assert main(["sweep", str(sweep), "--out", str(out), "--set", "training.momentum=0.5"]) == 2
    assert "already holds a sweep" in capsys.readouterr().err
    assert (out / "trials.parquet").read_bytes() == before


def test_a_trials_row_has_every_reported_metric_and_list_values_as_json(tmp_path):
    """trials.parquet holds what a sweep may rank by, and a swept list (one dropout rate per
    cluster) beside plain numbers: a Parquet column holds one type."""
    from types import SimpleNamespace

    from tune.space import REPORTED
    from tune.sweep import trial_rows

    rates = [0.0, [0.0, 0.5]]
    sweep = load_sweep(_write(tmp_path, {"training.client_dropout": {"grid": rates}}))
    metrics = {"trial_id": "t", "round": 2, "epsilon": 1.0}
    metrics.update({k: 0.25 for k in REPORTED})
    grid = [
        SimpleNamespace(
            config={"training.client_dropout": r}, metrics=metrics, error=None, path=str(tmp_path)
        )
        for r in rates
    ]
    pd.DataFrame(trial_rows(grid, sweep)).to_parquet(tmp_path / "trials.parquet")
    df = pd.read_parquet(tmp_path / "trials.parquet")
    assert list(df["training.client_dropout"]) == ["0.0", "[0.0, 0.5]"]
    assert (df[list(REPORTED)] == 0.25).all().all()  # accuracy_minority, accuracy_disparity too


def test_choosing_among_trials_costs_the_sum_of_their_budgets():
    """Basic composition by hand: the chosen trial is as private as all the trials together;
    trials without an (eps, delta) ledger (mode none, metric DP) are not in the sum."""
    from tune.selection import selection_cost, selection_note

    df = pd.DataFrame(
        {
            "epsilon": [1.0, 2.5, 0.5, None, 3.0],
            "delta": [1e-5, 1e-5, 2e-5, None, None],  # the last: a dprivacy trial
        }
    )
    cost = selection_cost(df)
    assert cost["trials"] == 3 and cost["epsilon_one_trial"] == 2.5
    assert cost["epsilon_selection"] == pytest.approx(4.0)
    assert cost["delta_selection"] == pytest.approx(4e-5)
    assert "(4, 4e-05)-DP by composition, not the eps 2.5" in selection_note(cost)
    assert selection_cost(df.iloc[3:4]) is None  # no private trial: nothing to say
    assert selection_note(selection_cost(df.iloc[:1])) is None  # one trial: nothing is chosen


def test_trial_bundles_reserve_the_workers(tmp_path):
    from tune.trainable import placement

    base = load_sweep(_write(tmp_path, {"seed": {"grid": [0]}})).base
    pgf = placement(base)({"runtime.num_workers": 3})
    assert pgf.bundles == [TRIAL_BUNDLE] + [{"CPU": 0.45}] * 3


def test_sigterm_stops_a_sweep_and_says_how_to_resume(tmp_path):
    """`kill` of a sweep started in the background (SIGINT ignored): Tune saves the sweep's
    state, the command exits 130 naming the unfinished trials and the `--resume` command."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sweep = tmp_path / "sweep.yaml"
    space = {"privacy.epsilon": {"grid": [1, 8]}}
    sweep.write_text(yaml.safe_dump({"name": "tiny", "set": TINY, "space": space}))
    out = tmp_path / "out"
    given = ["--set", "rounds=500", "--set", "data.cluster_sizes=[3, 3]"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli.main", "sweep", str(sweep), "--out", str(out), *given],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 240
    while not any(p.stat().st_size for p in out.glob("tune/tiny/*/result.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.5)  # 0.1 s lands the signal in Tune's first sync, which logs a traceback
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted with 2 trials unfinished" in err
    # the command to continue, with the --set values the sweep started with (quoted)
    assert f"--out {out} --resume --set rounds=500 --set 'data.cluster_sizes=[3, 3]'`" in err
    assert "Tuner.restore" not in err and "Failed to fetch metrics" not in err  # raysim says it
    assert "Traceback" not in err
    # a row for each trial that started, with its own values (not the base's for one that
    # never started)
    rows = pd.read_parquet(out / "trials.parquet")
    assert 1 <= len(rows) <= 2 and set(rows["privacy.epsilon"]) <= {1, 8}
    assert set(rows["epsilon_budget"]) <= {1, 8}


def test_an_untrusted_servers_trials_keep_the_clients_apart(ray_session, tmp_path):
    """Under distributed DP each trial starts its clients' side actor in its placement group
    (runtime.client_side): the trials run to the end."""
    sets = [*TINY, "privacy.mode=distributed", "privacy.noise_cohort_size=6", "rounds=1"]
    sets = [s for s in sets if not s.startswith("privacy.delta=")]
    sweep = tmp_path / "sweep.yaml"
    space = {"privacy.epsilon": {"grid": [2, 8]}}
    sweep.write_text(yaml.safe_dump({"name": "apart", "set": sets, "space": space}))
    out = tmp_path / "out"
    assert main(["sweep", str(sweep), "--out", str(out)]) == 0
    df = pd.read_parquet(out / "trials.parquet")
    assert len(df) == 2 and df["error"].isna().all() and (df["rounds_done"] == 1).all()
