"""The sample-level baselines of the R-DPCFL paper (ifca, kmeans_cfl, mr_mtl, oracle) and a
short end-to-end run of every algorithm through the in-process runner (no Ray)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import releaser_of, small_config, view_of
from sklearn.metrics import adjusted_rand_score
from test_rdpcfl import N, OneClient, env_for  # noqa: I001

from algorithms import Environment, get_algorithm
from algorithms.clustered import ClusterState
from algorithms.ifca import IFCA
from algorithms.kmeans_cfl import KMeansCFL
from algorithms.mr_mtl import MRMTL
from algorithms.oracle import Oracle
from raysim.cli.compare import collect, table
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.metrics.results import write_results
from raysim.models import build_model, flat_params
from raysim.privacy import Phase
from raysim.protocol import ClientContext, Message, RoundPlan
from raysim.runtime.inline import run_inline


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------ ifca


def test_ifca_random_inits_and_selection_every_round():
    algo = IFCA(env_for())
    st = algo.init_state(rng())
    assert len(st.models) == 4  # the stated default when algorithm.num_clusters is unset
    assert all(not torch.equal(st.models[0], m) for m in st.models[1:])
    assert algo.reserved_selections() == 10  # a choice in every round
    plan = algo.plan_round(st, 1, rng())
    assert all(t.extra.get("select") and t.cluster is None for t in plan.tasks)
    assert len(plan.models) == 4
    same = IFCA(env_for("algorithm.random_init=false")).init_state(rng())
    assert all(torch.equal(m, same.models[0]) for m in same.models)


def test_ifca_server_groups_by_choice_and_charges_the_choices():
    algo = IFCA(env_for("algorithm.num_clusters=2"))
    st = algo.init_state(rng())
    p = st.models[0].numel()
    reps = [
        Message(0, torch.ones(p), N, 1, extra={"selected": True}),
        Message(5, 3 * torch.ones(p), N, 1, extra={"selected": True}),
    ]
    res = algo.server_step(st, RoundPlan([], st.models, round=1), view_of(algo, reps), rng())
    assert torch.allclose(res.state.models[1], st.models[1] + 2.0)
    assert torch.equal(res.state.models[0], st.models[0])
    assert res.state.assigned[[0, 5]].tolist() == [1, 1]
    # after the selection window, clients keep their last choice
    late = IFCA(env_for("algorithm.selection_fraction=0.2"))
    plan = late.plan_round(ClusterState(st.models, np.arange(21) % 4), 5, rng())
    assert [t.cluster for t in plan.tasks] == (np.arange(21) % 4).tolist()


# ---------------------------------------------------------------------------------- oracle


def test_oracle_trains_the_true_clusters():
    algo = Oracle(env_for())
    st = algo.init_state(rng())
    assert np.array_equal(algo.assignments(st), algo.env.ground_truth)
    plan = algo.plan_round(st, 1, rng())
    assert [t.cluster for t in plan.tasks] == algo.env.ground_truth.tolist()
    assert algo.reserved_selections() == 0


# -------------------------------------------------------------------------------- kmeans


def test_kmeans_cfl_charges_m_trainings_and_clusters_the_updates():
    algo = KMeansCFL(env_for())
    one = Phase(32 / N, math.ceil(N / 32))
    assert algo.dpsgd_schedule(N)[0] == Phase(one.sampling_rate, 4 * one.steps)
    st = algo.init_state(rng())
    p = st.models[0].numel()
    g = np.random.default_rng(1)
    centres = g.normal(size=(4, p))
    reps = []
    for c, k in enumerate(algo.env.ground_truth):
        upd = np.stack([centres[k] + 0.1 * g.normal(size=p) for _ in range(4)])
        reps.append(Message(c, torch.tensor(upd, dtype=torch.float32), N))
    res = algo.server_step(st, RoundPlan([], st.models, round=1), view_of(algo, reps), rng())
    assert adjusted_rand_score(algo.env.ground_truth, res.state.assigned) == 1.0
    k0 = res.state.assigned[0]  # cluster model k moved by its members' updates at model k
    mean = torch.stack([r.update[k0] for r in reps[:3]]).mean(0)
    assert torch.allclose(res.state.models[k0], st.models[k0] + mean, atol=1e-5)


# ---------------------------------------------------------------------------------- mr-mtl


def blobs(n: int = 64, seed: int = 0):
    g = np.random.default_rng(seed)
    y = g.integers(0, 3, n)
    x = (np.eye(3)[y] @ g.normal(size=(3, 64)) * 2 + g.normal(size=(n, 64))).astype(np.float32)
    return x.reshape(n, 1, 8, 8), y


def test_mr_mtl_keeps_personal_models_pulled_to_the_mean():
    from raysim.training import LocalTrainer

    x, y = blobs()
    trainer = LocalTrainer(build_model("cnn", (1, 8, 8), 3, seed=0), "classification")
    mean = flat_params(trainer.model).clone()
    personal = mean + 0.5
    outs = {}
    for lam in (0.0, 10.0):
        algo = MRMTL(env_for("privacy.mode=none", f"algorithm.lam={lam}", sizes=[1], n=64))
        task = algo.plan_round(algo.init_state(rng()), 1, rng()).tasks[0]
        assert task.train.prox_mu == lam
        task.state = personal
        rep = algo.client_step(
            task, ClientContext(0, 1, 0, trainer, OneClient(x, y), [mean], releaser_of(algo))
        )
        assert torch.allclose(rep.update, rep.state - mean)  # what the server averages
        outs[lam] = rep.state
    # the pull towards the mean keeps the personal model closer to it
    assert (outs[10.0] - mean).norm() < (outs[0.0] - mean).norm()
    algo = MRMTL(env_for("privacy.mode=none"))
    st = algo.init_state(rng())
    reps = [
        Message(0, torch.ones_like(st.model), 1),
        Message(1, 3 * torch.ones_like(st.model), 1),
    ]
    res = algo.server_step(st, RoundPlan([], [st.model], round=1), view_of(algo, reps), rng())
    assert torch.allclose(res.state.model, st.model + 2.0)  # w_bar: the mean personal model


# ------------------------------------------------------------------- every algorithm, inline


@pytest.mark.parametrize("name", ["rdpcfl", "ifca", "kmeans_cfl", "mr_mtl", "oracle"])
def test_short_inline_run(name, tmp_path):
    cfg = load_config(None, small_config(**{"algorithm.name": name, "rounds": 3}))
    prep = prepare(cfg, get_algorithm(name), Environment)
    res = run_inline(prep, device="cpu")
    rows = res["history"]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    assert max(res["client_epsilon"]) <= cfg.privacy.epsilon * (1 + 1e-6)
    if name != "mr_mtl":
        assert "ari" in rows[-1]
    if name == "rdpcfl":
        assert {"gmm_mss", "gmm_mpo", "switch_round", "num_clusters"} <= set(rows[0])
    write_results(tmp_path / name / "seed0", prep, res)
    runs = collect(tmp_path)
    text = table(runs)
    assert name in text and "±" not in text  # one seed: no "± 0.00"


def test_the_table_says_which_seeds_shared_the_clients_seed(tmp_path):
    """A pinned privacy.client_seed gives every seed the same clients' noise: the table says so
    for those runs, and not for runs that drew their own."""
    for name, client_seed in (("fedavg", "11"), ("local", "null")):
        for seed in (0, 1):
            sets = {"algorithm.name": name, "rounds": 1, "model.name": "linear", "seed": seed}
            cfg = load_config(None, small_config(**sets, **{"privacy.client_seed": client_seed}))
            prep = prepare(cfg, get_algorithm(name), Environment)
            write_results(tmp_path / name / f"seed{seed}", prep, run_inline(prep, device="cpu"))
    runs = collect(tmp_path)
    assert runs["local"][0]["client_seed"] != runs["local"][1]["client_seed"]  # drawn, recorded
    text = table(runs)
    assert "one clients' seed (privacy.client_seed, pinned): fedavg (11). Their" in text
    assert "local (" not in text
    assert "pinned" not in table({"fedavg": runs["fedavg"][:1]})  # one seed: nothing shared


@pytest.mark.parametrize("name", ["rdpcfl", "ifca"])
def test_ari_every_round_even_between_evaluations(name):
    """The assignment is the server's: its ARI needs no evaluation, so a run evaluated every
    other round still reports round 1's (compare's "ARI=1 after r1")."""
    from sklearn.metrics import adjusted_rand_score

    cfg = load_config(
        None, small_config(**{"algorithm.name": name, "rounds": 3, "training.eval_every": 2})
    )
    prep = prepare(cfg, get_algorithm(name), Environment)
    res = run_inline(prep, device="cpu")
    rows = res["history"]
    assert ["accuracy" in r for r in rows] == [False, True, True]
    assert all("ari" in r for r in rows)
    assert rows[-1]["ari"] == pytest.approx(adjusted_rand_score(prep.truth, res["assignments"]))


def test_compare_cli_reports_finished_runs(tmp_path, capsys):
    from raysim.cli.compare import main

    cfg = load_config(None, small_config(**{"algorithm.name": "oracle", "rounds": 2}))
    prep = prepare(cfg, get_algorithm("oracle"), Environment)
    write_results(tmp_path / "out" / "oracle" / "seed0", prep, run_inline(prep, device="cpu"))
    (tmp_path / "c.yaml").write_text("rounds: 2\n")
    argv = [str(tmp_path / "c.yaml"), "--algorithms", "oracle", "--seeds", "0"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--report-only"]) == 0
    text = capsys.readouterr().out
    assert "| oracle | 1 | 2 |" in text and "1/1" in text  # ARI = 1 after round 1
    assert (tmp_path / "out" / "compare.md").read_text().strip() == text.strip()
    assert main([*argv[:3], "--seeds", "x", "--report-only"]) == 2


def test_a_failing_run_of_compare_is_named_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    """One run by one (no --jobs): a run that fails is named in one line, the others still
    run, the table is written, and the exit code is 1."""
    from raysim.cli.compare import main

    (tmp_path / "failing_algo.py").write_text(
        "from algorithms.fedavg import FedAvg\n\n\n"
        "class Failing(FedAvg):\n"
        "    def server_step(self, *args):\n"
        "        raise RuntimeError('boom in server_step')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = small_config(rounds=1, **{"model.name": "linear"})
    argv = [str(Path(__file__).parents[1] / "raysim" / "demo.yaml"), "--inline"]
    argv += ["--algorithms", "failing_algo:Failing,fedavg", "--seeds", "0"]
    argv += [a for s in sets for a in ("--set", s)] + ["--out", str(tmp_path / "out")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "failing_algo:Failing seed 0 failed: RuntimeError: boom in server_step" in err
    assert "Traceback" not in err
    assert (tmp_path / "out" / "fedavg" / "seed0" / "summary.json").is_file()
    assert (tmp_path / "out" / "compare.md").is_file()
    sys.modules.pop("failing_algo", None)


def test_compare_inline_jobs_run_in_parallel_with_the_same_numbers(tmp_path, capfd):
    """--jobs 2 runs the inline runs in two processes: the same final numbers as one by one,
    and a progress line from each (not a bar each)."""
    import json

    from raysim.cli.compare import main

    sets = small_config(**{"rounds": 2, "data.samples_per_client": 40, "runtime.progress": "true"})
    argv = [str(Path(__file__).parents[1] / "raysim" / "demo.yaml"), "--inline"]
    argv += ["--algorithms", "fedavg,local", "--seeds", "0"]
    for s in sets:
        argv += ["--set", s]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    capfd.readouterr()
    assert main([*argv, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 0
    err = capfd.readouterr().err
    assert "fedavg seed 0: round 2/2, " in err and "local seed 0: round 2/2, " in err
    assert "\r" not in err  # no bar
    for algorithm in ("fedavg", "local"):
        a, b = (
            json.loads((tmp_path / o / algorithm / "seed0" / "summary.json").read_text())["final"]
            for o in ("one", "two")
        )
        assert a.pop("round_seconds") > 0 and b.pop("round_seconds") > 0
        assert a == b
    assert main([*argv, "--out", str(tmp_path / "x"), "--jobs", "0"]) == 2
    assert "--jobs" in capfd.readouterr().err
