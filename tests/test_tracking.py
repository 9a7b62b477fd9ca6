"""tracking.backend: a 2-round run, a compare and a 2-trial sweep logged to TensorBoard and to
MLflow, read back with the libraries' own readers (TensorBoard's EventAccumulator, MLflow's
client on a file store) and checked against the run's metrics.parquet."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import RAY_TIMEOUT_S, inline_run, small_config

from raysim.cli.compare import compare_main
from raysim.cli.main import main
from raysim.config import changed_keys, dump_config, load_config
from raysim.state.checkpoint import load_checkpoint
from raysim.state.rundir import find_runs, staging_dir

pytest.importorskip("tensorboardX")
pytest.importorskip("mlflow")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

TINY_SWEEP = [  # two trials of a few seconds each, as tests/test_tune.py's
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


def _sets(items: list[str]) -> list[str]:
    return [token for item in items for token in ("--set", item)]


def _expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.parquet's numbers by column and round (a column's empty rounds left out)."""
    df = pd.read_parquet(run_dir / "metrics.parquet")
    out: dict[str, dict[int, float]] = {}
    for col in df.columns:
        if col == "round" or not (
            pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col])
        ):
            continue
        values = {
            int(r): float(v) for r, v in zip(df["round"], df[col], strict=True) if not pd.isna(v)
        }
        if values:
            out[col] = values
    return out


def _assert_same(logged: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]):
    assert set(logged) == set(expected)
    for key, series in expected.items():
        assert sorted(logged[key]) == sorted(series), key
        got = [logged[key][r] for r in sorted(series)]
        want = [series[r] for r in sorted(series)]
        np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True, err_msg=key)


def _accumulator(logdir: Path):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0}
    )
    acc.Reload()
    return acc


def _tb_scalars(acc, prefix: str = "") -> dict[str, dict[int, float]]:
    return {
        tag[len(prefix) :]: {e.step: e.value for e in acc.Scalars(tag)}
        for tag in acc.Tags()["scalars"]
        if tag.startswith(prefix)
    }


def _mlflow_client(store: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.resolve().as_uri())


def _histories(client, run) -> dict[str, dict[int, float]]:
    return {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }


def test_an_unknown_backend_exits_2_naming_the_field_and_the_choices(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["run", "--out", str(out), *_sets(small_config()), "--set", "tracking.backend=wb"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tracking.backend: got 'wb'; allowed: none, tensorboard, mlflow" in err
    assert "Traceback" not in err and not out.exists()


def test_a_missing_package_exits_2_with_the_install_command_before_ray(
    tmp_path, capsys, monkeypatch
):
    from raysim.metrics import tracking

    monkeypatch.setitem(tracking.MODULES, "mlflow", ("raysim_no_such_module",))
    out = tmp_path / "out"
    sets = _sets(small_config(**{"tracking.backend": "mlflow"}))
    assert main(["run", "--out", str(out), *sets]) == 2
    err = capsys.readouterr().err
    assert "tracking.backend: mlflow needs the package raysim_no_such_module" in err
    assert "pip install -e '.[tracking]'" in err and not out.exists()
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {"set": [*TINY_SWEEP, "tracking.backend=mlflow"], "space": {"seed": {"grid": [0]}}}
        )
    )
    assert main(["sweep", str(sweep), "--out", str(tmp_path / "sw")]) == 2
    assert "pip install -e '.[tracking]'" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_tracking_settings_may_change_when_a_run_resumes():
    plain = load_config(None, small_config())
    tracked = load_config(None, small_config(**{"tracking.backend": "mlflow"}))
    assert changed_keys(dump_config(plain), dump_config(tracked)) == []


def test_a_two_round_run_is_read_back_from_tensorboard(ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    sets = _sets(small_config(**{"tracking.backend": "tensorboard"}))
    assert main(["run", "--out", str(out), *sets]) == 0, capsys.readouterr().err
    acc = _accumulator(out / "tensorboard")
    expected = _expected(out)
    assert {"accuracy", "loss", "epsilon"} <= set(expected)
    assert {r for series in expected.values() for r in series} == {1, 2}
    _assert_same(_tb_scalars(acc), expected)
    tags = acc.Tags()
    assert {"accuracy"} <= set(tags["images"])  # accuracy.png
    texts = {t.removesuffix("/text_summary") for t in tags["tensors"]}
    assert {"config", "summary.json", "config.yaml"} <= texts
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| algorithm.name | fedavg |" in config and "| rounds | 2 |" in config
    assert find_runs(tmp_path)[0] == [out]


def test_each_run_of_a_compare_is_read_back_from_mlflow(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default store: ./mlruns, beside the command
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(load_config(None, small_config())))
    argv = [str(config), "--inline", "--out", str(tmp_path / "cmp"), "--seeds", "0"]
    argv += ["--algorithms", "fedavg,local", "--set", "tracking.backend=mlflow"]
    argv += ["--set", "tracking.experiment=tiny-compare"]
    assert compare_main(argv) == 0, capsys.readouterr().err
    runs, _ = find_runs(tmp_path)  # the artifacts' copies of summary.json are no runs
    assert len(runs) == 2 and all(tmp_path / "cmp" in r.parents for r in runs)
    client = _mlflow_client(tmp_path / "mlruns")
    experiment = client.get_experiment_by_name("tiny-compare")
    logged = client.search_runs([experiment.experiment_id])
    names = sorted(r.info.run_name for r in logged)
    assert names == ["cmp/fedavg/seed0", "cmp/local/seed0"]  # the run directories, from here
    for run in logged:
        run_dir = Path(run.data.tags["raysim.run_dir"])
        assert run_dir in runs and run.info.status == "FINISHED"
        _assert_same(_histories(client, run), _expected(run_dir))
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert run.data.params["algorithm.name"] == recorded["algorithm"]["name"]
        assert run.data.params["training.lr"] == str(recorded["training"]["lr"])
        assert run.data.params["data.cluster_sizes"] == "[4, 4]"
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"summary.json", "config.yaml", "accuracy.png"} <= files


def test_an_interrupted_run_is_killed_in_mlflow_and_its_resumption_logs_every_round(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    settings = {"tracking.backend": "mlflow", "tracking.experiment": "resumed"}
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        inline_run(out, settings, die_after=1)
    inline_run(out, settings, resume=load_checkpoint(staging_dir(out)))
    client = _mlflow_client(tmp_path / "mlruns")
    experiment = client.get_experiment_by_name("resumed")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]
    assert {step for series in _histories(client, runs[0]).values() for step in series} == {1}
    _assert_same(_histories(client, runs[1]), _expected(out))  # round 1 from the checkpoint


def _sweep(tmp_path: Path, backend: str, *extra: str) -> tuple[Path, pd.DataFrame]:
    path = tmp_path / "sweep.yaml"
    sets = [*TINY_SWEEP, f"tracking.backend={backend}", *extra]
    path.write_text(
        yaml.safe_dump(
            {"name": "tiny", "set": sets, "space": {"privacy.epsilon": {"grid": [1, 8]}}}
        )
    )
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 0
    trials = pd.read_parquet(out / "trials.parquet")
    assert len(trials) == 2 and trials["error"].isna().all()
    return out, trials


def _reported(run_dir: Path) -> dict[str, dict[int, float]]:
    """What a trial reported to Tune each round (tune.trainable): round, epsilon and, from the
    first evaluation on, accuracy and loss."""
    expected = _expected(run_dir)
    keys = ("epsilon", "accuracy", "loss")
    out = {k: expected[k] for k in keys}
    out["round"] = {r: float(r) for r in expected["epsilon"]}
    return out


def test_a_two_trial_sweep_is_read_back_from_tensorboard(ray_session, tmp_path, capsys):
    out, trials = _sweep(tmp_path, "tensorboard")
    assert "Trial status" in capsys.readouterr().out  # Tune's live table (runtime.progress)
    for path in trials["path"]:
        logged = _tb_scalars(_accumulator(Path(path)), "ray/tune/")
        want = _reported(Path(path) / "run")
        _assert_same({k: logged[k] for k in want}, want)


@pytest.mark.slow  # a sweep's tracking is read back from tensorboard above; mlflow: compare, resume
def test_a_two_trial_sweep_is_read_back_from_mlflow(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out, trials = _sweep(tmp_path, "mlflow", "runtime.progress=false")
    assert "Trial status" not in capsys.readouterr().out
    client = _mlflow_client(tmp_path / "mlruns")
    experiment = client.get_experiment_by_name("tiny")  # the sweep's name
    logged = client.search_runs([experiment.experiment_id])
    assert len(logged) == 2
    by_eps = {float(r.data.params["privacy.epsilon"]): r for r in logged}
    assert sorted(by_eps) == [1.0, 8.0]
    for _, trial in trials.iterrows():
        run = by_eps[float(trial["privacy.epsilon"])]
        want = _reported(Path(trial["path"]) / "run")
        history = {
            key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in want
        }
        _assert_same(history, want)
        assert math.isclose(run.data.metrics["epsilon"], trial["epsilon"])
        assert client.list_artifacts(run.info.run_id)  # the trial's directory
    assert find_runs(tmp_path / "mlruns")[0] == []  # copies of the trials' files, not runs
