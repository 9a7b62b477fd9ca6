"""raysim.api: `raysim run` from Python, and a run directory's files as tables."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import RAY_TIMEOUT_S

from raysim.api import audit, compare, load, privacy, run, runs, summaries, sweep
from raysim.config import ConfigError

SMALL = {
    "rounds": 2,
    "data.dataset": "digits",
    "data.num_clients": 6,
    "data.cluster_sizes": [3, 3],  # a Python list, as YAML's
    "data.samples_per_client": 40,
    "model.name": "mlp",
    "privacy.mode": "sample",
    "privacy.epsilon": 4,
    "privacy.delta": 1e-3,
    "runtime.num_workers": 2,
    "runtime.progress": False,
    "runtime.round_timeout_s": RAY_TIMEOUT_S,
}


def test_run_returns_each_algorithms_finished_run_as_tables(ray_session, tmp_path):
    done = run(None, SMALL, algorithms=["fedavg", "local"], out=tmp_path / "runs")
    assert list(done) == ["fedavg", "local"]
    for name, r in done.items():
        assert r.path == tmp_path / "runs" / name
        assert r.config["algorithm"]["name"] == name
        assert r.config["data"]["cluster_sizes"] == [3, 3]
        assert r.summary == json.loads((r.path / "summary.json").read_text())
        assert list(r.metrics["round"]) == [1, 2]
        assert r.metrics.equals(pq.read_table(r.path / "metrics.parquet").to_pandas())
        assert len(r.clients) == 6 and set(r.privacy["client"]) == set(range(6))
        assert 0 < r.summary["epsilon"] <= 4 + 1e-9
    assert load(tmp_path / "runs" / "local").summary == done["local"].summary
    assert [r.path for r in runs(tmp_path)] == [done["fedavg"].path, done["local"].path]
    table = summaries(tmp_path / "runs")
    assert list(table["algorithm"]) == ["fedavg", "local"] and list(table["rounds"]) == [2, 2]
    for name, r in done.items():  # the summary's values, and the final round's metrics
        row = table[table["algorithm"] == name].iloc[0]
        assert row["final_accuracy"] == r.summary["final_accuracy"]
        assert row["accuracy_cluster_1"] == r.metrics["accuracy_cluster_1"].iloc[-1]


def test_a_mistake_raises_the_commands_message_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        run(None, {**SMALL, "privacy.epsilon": 0}, algorithms=["fedavg"], out=tmp_path / "o")
    with pytest.raises(ConfigError, match="--algorithms: each at most once"):
        run(None, SMALL, algorithms=["fedavg", "fedavg"], out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="holds no finished run"):
        load(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        summaries(tmp_path / "nothing")


def _as_sections(flat: dict) -> dict:
    """SMALL's dotted keys as the nested sections a YAML file holds."""
    nested: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def test_compare_takes_a_dict_and_returns_each_run_by_algorithm_and_seed(tmp_path):
    config = _as_sections({**SMALL, "rounds": 1})
    done = compare(
        config,
        {"model.name": "linear"},
        algorithms=["fedavg", "local"],
        seeds=[0, 1],
        out=tmp_path / "c",
        inline=True,
    )
    assert sorted(done) == [("fedavg", 0), ("fedavg", 1), ("local", 0), ("local", 1)]
    for (name, seed), r in done.items():
        assert r.path == tmp_path / "c" / name / f"seed{seed}"
        assert r.config["model"]["name"] == "linear" and r.config["rounds"] == 1
    assert (tmp_path / "c" / "compare.md").read_text().count("\n| fedavg") == 1


def test_privacy_is_the_commands_report_for_a_config_object(capsys):
    from raysim.cli.main import main
    from raysim.config import DEMO_CONFIG, load_config

    sets = {"privacy.epsilon": 2, "algorithm.name": "fedavg"}
    report = privacy(load_config(DEMO_CONFIG), sets)
    assert (
        main(["privacy", "--json", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
        == 0
    )
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    assert report["target_epsilon"] == 2 and report["noise_multiplier"] > 0
    with pytest.raises(ConfigError, match="config: a YAML path, a dict"):
        privacy(42)  # type: ignore[arg-type]


def test_sweep_takes_a_dict_whose_base_is_a_dict(ray_session, tmp_path):
    base = _as_sections({**SMALL, "rounds": 1, "model.name": "linear", "runtime.num_workers": 1})
    base["runtime"]["cpus_per_worker"] = 0.45
    spec = {"name": "api-eps", "base": base, "space": {"privacy.epsilon": {"grid": [2, 8]}}}
    from raysim.engine import zygote

    kept = zygote.forked()  # the test session's (tests/conftest.py)
    done = sweep(spec, {"algorithm.name": "fedavg"}, out=tmp_path / "s")
    assert zygote.forked() == kept  # a zygote the sweep did not fork outlives it
    assert done.path == (tmp_path / "s").resolve()
    assert sorted(done.trials["privacy.epsilon"]) == [2, 8]
    assert done.selection["trials"] == 2 and "Papernot" in done.selection["note"]
    assert {r.config["privacy"]["epsilon"] for r in done.runs} == {2, 8}
    with pytest.raises(ConfigError, match="sweep: a sweep file's path or a dict"):
        sweep(3)  # type: ignore[arg-type]


def test_audit_returns_the_bound_and_the_scores(tmp_path):
    from pathlib import Path

    config = Path(__file__).parents[1] / "configs" / "audit_digits.yaml"
    done = audit(config, {"privacy.epsilon": 8}, runs=200, out=tmp_path / "a")
    assert done.result["claimed_epsilon"] == pytest.approx(8, rel=1e-3)
    assert 0 <= done.result["lower_bound"] <= done.result["claimed_epsilon"]
    assert len(done.scores) == 200 and set(done.scores["included"]) == {True, False}
    with pytest.raises(ConfigError, match="--runs"):
        audit(config, runs=0, out=tmp_path / "b")
