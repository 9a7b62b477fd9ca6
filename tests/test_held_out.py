"""Held-out clients (``training.held_out_clients``, Galli et al.'s validation clients): drawn
once from the run's seed, kept out of every training plan, even one that names them, and the
only clients judged, on the server's side and on the clients' side of an untrusted server."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import inline_run, small_config

from algorithms import Environment
from algorithms.dp_group import DPGroup
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.metrics.evaluation import evaluation_cohort, held_out_clients
from raysim.runtime.inline import inline_loop

SETTINGS = {
    "data.num_clients": 20,
    "data.cluster_sizes": "[10, 10]",
    "model.name": "linear",
    "training.held_out_clients": 0.25,
}


@pytest.mark.parametrize(
    "privacy",
    [
        {"privacy.mode": "none"},
        # an untrusted server: the clients' side judges, and checks the cohort is the run's
        {"privacy.mode": "distributed", "privacy.epsilon": 8, "privacy.delta": 1e-3},
    ],
)
def test_held_out_clients_never_train_and_are_the_ones_judged(tmp_path, privacy: dict) -> None:
    """fedavg at sampling rate 1 plans every client each round, the held-out ones too: the
    engine takes them out, so they never report, and they alone have an accuracy."""
    settings = {**SETTINGS, **privacy}
    metrics = inline_run(tmp_path, settings)
    held = held_out_clients(load_config(None, small_config(**settings)), 20)
    assert held is not None and len(held) == 5

    clients = pq.read_table(tmp_path / "clients.parquet").to_pandas().set_index("client_id")
    judged = clients.index[clients["accuracy"].notna()].to_numpy()
    assert np.array_equal(judged, held)
    assert (clients.loc[held, "rounds_reported"] == 0).all()
    assert (clients.drop(index=held)["rounds_reported"] == 2).all()
    assert (metrics["participants"] == 15).all()
    last = metrics.iloc[-1]
    assert last["evaluated_clients"] == 5
    assert np.isclose(clients.loc[held, "accuracy"].mean(), last["accuracy"])


def test_the_held_out_set_depends_on_the_seed_and_eval_clients_samples_it() -> None:
    def cfg(*sets: str):
        return load_config(None, small_config(**SETTINGS) + list(sets))

    a, b = held_out_clients(cfg("seed=0"), 20), held_out_clients(cfg("seed=1"), 20)
    assert not np.array_equal(a, b)
    assert np.array_equal(evaluation_cohort(cfg("seed=0"), 20), a)
    cohort = evaluation_cohort(cfg("seed=0", "training.eval_clients=3"), 20)
    assert len(cohort) == 3 and set(cohort) <= set(a)


def test_a_share_that_holds_out_no_client_is_refused_naming_the_field() -> None:
    with pytest.raises(Exception, match=r"training\.held_out_clients=0\.01 .* holds out 0"):
        load_config(None, small_config(**{**SETTINGS, "training.held_out_clients": 0.01}))


def test_dp_group_judges_each_client_on_the_hypothesis_it_chooses() -> None:
    """A held-out client was never sampled: the server's record of choices has nothing for it
    (it would read cluster 0). Algorithm 1's validation users choose by loss, so every judged
    client does."""
    sets = [*small_config(**SETTINGS), "algorithm.name=dp_group", "algorithm.init=model"]
    cfg = load_config(None, [*sets, "privacy.mode=dprivacy", "privacy.nu=5"])
    loop = inline_loop(prepare(cfg, DPGroup, Environment))
    loop.step()
    assert loop.state.assigned is not None  # the server knows the trained clients' choices
    plan = loop.algorithm.plan_evaluation(loop.state, clients=loop.eval_cohort)
    assert [t.client_id for t in plan.tasks] == loop.eval_cohort.tolist()
    assert all(t.extra.get("select") for t in plan.tasks)


def test_ifca_judges_held_out_clients_on_the_model_they_choose() -> None:
    """IFCA judges a client on its server-recorded choice; a held-out client has none."""
    from algorithms.ifca import IFCA

    sets = [*small_config(**SETTINGS), "algorithm.name=ifca", "algorithm.num_clusters=2"]
    for held, selects in ((0.25, True), (None, False)):
        cfg = load_config(None, [*sets, f"training.held_out_clients={held or 'null'}"])
        loop = inline_loop(prepare(cfg, IFCA, Environment))
        loop.step()
        plan = loop.algorithm.plan_evaluation(loop.state, clients=[0, 1])
        assert all(bool(t.extra.get("select")) is selects for t in plan.tasks)


def test_ifca_judges_a_client_never_sampled_on_the_model_it_would_choose() -> None:
    """Under partial participation the server's record has no cluster for a client that never
    reported: it is judged as IFCA infers a new client's cluster (by its own train loss), not
    on model 0, and after the selection window it trains model 0 (a choice would be a release
    its plan lacks); the clients that reported are judged on their recorded choice."""
    from algorithms.ifca import IFCA

    sets = [
        *small_config(**{**SETTINGS, "training.held_out_clients": "null"}),
        "algorithm.name=ifca",
        "algorithm.num_clusters=2",
        "training.sampling_rate=0.2",
        "algorithm.selection_fraction=0.5",
        "rounds=4",
    ]
    loop = inline_loop(prepare(load_config(None, sets), IFCA, Environment))
    loop.step()
    assigned = loop.state.assigned
    reported = assigned >= 0
    assert 0 < reported.sum() < len(assigned)  # some clients chose, some were never sampled
    plan = loop.algorithm.plan_evaluation(loop.state)
    for t in plan.tasks:
        if reported[t.client_id]:
            assert not t.extra.get("select") and t.cluster == assigned[t.client_id]
        else:
            assert t.extra.get("select")
    assert np.array_equal(loop.algorithm.assignments(loop.state), np.maximum(assigned, 0))
    sizes = np.bincount(assigned[reported], minlength=2)  # the reported clients only
    row = loop.history[-1]
    assert row["cluster_size_min"] == sizes.min()
    assert row["clusters_nonempty"] == (sizes > 0).sum()
    after_window = loop.algorithm.plan_round(loop.state, 4, np.random.default_rng(1))
    for t in after_window.tasks:
        assert not t.extra.get("select")
        assert t.cluster == max(int(assigned[t.client_id]), 0)
