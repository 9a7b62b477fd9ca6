"""Every ready sweep runs as written on a 2-CPU machine: its trials fit (sized to the machine),
every trial's config is valid for its algorithm (another algorithm's keys left out), and a failed
trial makes `raysim sweep` exit non-zero naming it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from conftest import RAY_TIMEOUT_S

from algorithms import get_algorithm
from raysim.cli.main import main
from raysim.compose import for_algorithm
from raysim.config import ConfigError, RuntimeConfig
from tune.space import load_sweep, trial_config
from tune.sweep import check_trials, check_trials_start, size_to_cluster

SWEEPS = sorted((Path(__file__).parents[1] / "tune" / "sweeps").glob("*.yaml"))
THIS_MACHINE = [{"CPU": 2.0}]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _grid(sweep):
    keys = list(sweep.space)
    values = [next(iter(spec.values())) for spec in sweep.space.values()]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_trial_fits_and_is_valid(path):
    sweep = load_sweep(path)
    with pytest.raises(ConfigError, match="a trial needs 2.01 CPUs"):  # as pinned before
        check_trials(load_sweep(path, ["runtime.cpus_per_worker=1"]), THIS_MACHINE)
    size_to_cluster(sweep, THIS_MACHINE)
    check_trials(sweep, THIS_MACHINE)  # raises if a trial could never be placed
    for params in _grid(sweep):
        cfg = for_algorithm(trial_config(sweep.base, params), quiet=True)
        algo = get_algorithm(cfg.algorithm.name)
        algo.Params(**(cfg.algorithm.model_extra or {}))  # e.g. fedavg without eps_select
        rt: RuntimeConfig = cfg.runtime
        assert rt.num_workers * rt.cpus_per_worker + 0.01 <= 2.0


TINY_RDPCFL = [
    "rounds=2",
    "algorithm.name=rdpcfl",
    "data.dataset=digits",
    "data.num_clients=6",
    "data.cluster_sizes=[3, 3]",
    "model.name=linear",
    "privacy.delta=1e-3",
    "runtime.num_workers=1",
    f"runtime.round_timeout_s={RAY_TIMEOUT_S}",
]


def test_a_trial_that_cannot_start_stops_the_sweep_before_ray(tmp_path, capsys):
    # one reserved selection at eps 5: a budget of 1 is refused, though eps 1 with selections at
    # 0.1 and selections at 5 with eps 50 each run: the combinations are prepared, not each value
    path = tmp_path / "s.yaml"
    space = {"privacy.epsilon": {"grid": [1, 50]}, "algorithm.eps_select": {"grid": [0.1, 5]}}
    path.write_text(yaml.safe_dump({"name": "fails", "set": TINY_RDPCFL, "space": space}))
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "1 of 4 trial configurations cannot start (nothing ran)" in err
    assert "algorithm.eps_select = 5, privacy.epsilon = 1: epsilon=1.0" in err
    assert "cannot be met" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    # --overwrite replaces an earlier sweep only once the new one is known to start
    earlier = tmp_path / "earlier"
    (earlier / "tune").mkdir(parents=True)
    (earlier / "trials.parquet").write_bytes(b"the earlier sweep's")
    assert main(["sweep", str(path), "--out", str(earlier), "--overwrite"]) == 2
    assert (earlier / "trials.parquet").read_bytes() == b"the earlier sweep's"
    assert (earlier / "tune").is_dir()


def test_past_64_combinations_each_value_is_prepared_alone(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    space = {
        "privacy.epsilon": {"grid": [20, 30, 40, 50, 60, 70, 80, 90, 100]},
        "training.lr": {"grid": [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]},
    }
    tiny = [*TINY_RDPCFL, "algorithm.eps_select=5", "privacy.epsilon=50"]
    path.write_text(yaml.safe_dump({"name": "many", "set": tiny, "space": space}))
    check_trials_start(load_sweep(path))
    err = capsys.readouterr().err
    # 9 + 8 values on the base, two of them the base itself (eps 50, the demo's lr 0.5)
    assert "preparing 16 trial configurations (of 72 combinations, each value alone)" in err


def test_failed_trials_make_the_sweep_fail_naming_them(ray_session, tmp_path, capsys, monkeypatch):
    # a failure only the trial meets (its node lost, say) must still be reported: the check
    # before Ray is switched off here so that the refused budget makes one
    monkeypatch.setattr("tune.sweep.check_trials_start", lambda sweep: None)
    path = tmp_path / "s.yaml"
    space = {"privacy.epsilon": {"grid": [1, 50]}}
    tiny = [*TINY_RDPCFL, "algorithm.eps_select=5"]
    path.write_text(yaml.safe_dump({"name": "fails", "set": tiny, "space": space}))
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 trials failed" in err
    assert "privacy.epsilon=1:" in err and "cannot be met" in err
    assert "privacy.epsilon=50" not in err


@pytest.mark.skipif(not FMNIST.is_dir(), reason="Fashion-MNIST not installed")
@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_trial_of_a_ready_sweep_can_start(path):
    check_trials_start(load_sweep(path))  # its data built and its noise calibrated


CUT = [  # rounds and clients cut down; everything else as the sweep file says
    "rounds=2",
    "data.num_clients=8",
    "data.cluster_sizes=[2, 2, 2, 2]",
    "data.cluster_ratios=null",
    "data.samples_per_client=60",
    "training.local_epochs=1",
    "training.sampling_rate=1.0",
    f"runtime.round_timeout_s={RAY_TIMEOUT_S}",
]

CUT_MORE = {  # what a sweep needs beyond the cut
    # B up to 12 needs q M / k >= 12 clients per group
    "rr_cluster_b_x_eps": ["data.num_clients=48", "data.cluster_sizes=[12, 12, 12, 12]"],
    # PINA's stage 1 takes lloyd_iters (>= 2) rounds and the next initialises: 4 rounds see
    # every phase (Lloyd's, initialisation, training)
    "pina_eps_x_c_x_normality": ["rounds=4", "algorithm.lloyd_iters=2"],
}


def test_every_cut_names_a_ready_sweep():
    assert set(CUT_MORE) <= {p.stem for p in SWEEPS}


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST.is_dir(), reason="Fashion-MNIST not installed")
@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_ready_sweep_runs_cut_down(path, ray_session, tmp_path, capsys):
    cut = [*CUT, *CUT_MORE.get(path.stem, [])]
    sets = sum((["--set", s] for s in cut), [])
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), *sets]) == 0
    assert (tmp_path / "out" / "trials.parquet").is_file()
