"""Evaluation in groups: clients judged on the same broadcast model share forward passes
(LocalTrainer.evaluate_many, Algorithm.client_evaluations), against one client at a time."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.engine.rounds import task_groups
from raysim.models import build_model, flat_params
from raysim.runtime.worker import ClientWorker
from raysim.training import LocalTrainer


def _same(ours, alone) -> None:
    assert ours.n == alone.n
    if alone.n == 0:
        assert math.isnan(ours.loss) and (ours.accuracy is None or math.isnan(ours.accuracy))
        return
    assert ours.loss == pytest.approx(alone.loss, rel=1e-6, abs=1e-7)
    assert ours.accuracy == alone.accuracy


@pytest.mark.parametrize("batch_size", [None, 64])
def test_evaluate_many_matches_one_dataset_at_a_time(batch_size):
    """Datasets of 0, 1, a few and more rows than a batch, packed together or cut."""
    gen = torch.Generator().manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    trainer = LocalTrainer(model, "classification")
    weights = flat_params(model)
    data = []
    for n in [7, 0, 1, 300, 12, 64, 65, 3, 0, 40]:
        x = torch.randn(n, 1, 28, 28, generator=gen).numpy()
        y = torch.randint(0, 10, (n,), generator=gen).numpy()
        data.append((x, y))
    together = trainer.evaluate_many(weights, data, batch_size)
    assert len(together) == len(data)
    for ours, (x, y) in zip(together, data, strict=True):
        _same(ours, trainer.evaluate(weights, x, y))
    assert sum(r.accuracy * r.n for r in together if r.n) > 0  # the model predicts something


def test_evaluate_many_regression():
    gen = torch.Generator().manual_seed(1)
    model = build_model("linear", (5,), 1, seed=0)
    trainer = LocalTrainer(model, "regression")
    weights = flat_params(model)
    data = [
        (torch.randn(n, 5, generator=gen).numpy(), np.arange(n, dtype=np.float32)) for n in (4, 9)
    ]
    for ours, (x, y) in zip(trainer.evaluate_many(weights, data), data, strict=True):
        alone = trainer.evaluate(weights, x, y)
        assert ours.accuracy is None and ours.n == alone.n
        assert ours.loss == pytest.approx(alone.loss, rel=1e-6)


def _worker(**overrides):
    cfg = load_config(None, small_config(**overrides))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    worker = ClientWorker(prep.algorithm, prep.dataset, prep.spec, cfg.seed, 1, 0.0)
    return worker, prep


def _evaluate(worker, plan, groups):
    models = np.stack([m.numpy() for m in plan.models])
    return worker.run("evaluate", 1, models, groups)


def _count_shared(monkeypatch, worker) -> list[int]:
    calls: list[int] = []
    shared = worker.trainer.evaluate_many

    def counted(weights, data, *args):
        calls.append(len(data))
        return shared(weights, data, *args)

    monkeypatch.setattr(worker.trainer, "evaluate_many", counted)
    return calls


@pytest.mark.parametrize("algorithm", ["fedavg", "ifca"])
def test_clients_on_a_broadcast_model_share_passes(monkeypatch, algorithm):
    worker, prep = _worker(**{"algorithm.name": algorithm, "privacy.mode": "none"})
    algo = worker.algorithm
    state = prep.algorithm.init_state(np.random.default_rng(0))
    if algorithm == "ifca":  # the server's assignment: clients on two different models
        state.assigned = np.arange(algo.env.num_clients) % 2
    plan = algo.plan_evaluation(state)
    alone = _evaluate(worker, plan, [[t] for t in plan.tasks])
    calls = _count_shared(monkeypatch, worker)
    groups = task_groups("evaluate", plan.tasks, 1, 5)
    assert [len(g) for g in groups] == [5, 3]
    together = _evaluate(worker, plan, groups)
    # one shared call per (group, model): fedavg 5 + 3, ifca (3 + 2) + (2 + 1); the groups of
    # one above went through the same path, one client each
    expected = [5, 3] if algorithm == "fedavg" else [3, 2, 2, 1]
    assert sorted(calls) == sorted(expected)
    for ours, one in zip(together, alone, strict=True):
        assert (ours.client_id, ours.num_samples) == (one.client_id, one.num_samples)
        assert ours.accuracy == one.accuracy
        assert ours.loss == pytest.approx(one.loss, rel=1e-6)


@pytest.mark.parametrize(
    ("algorithm", "mode"),
    [("local", "none"), ("ifca", "distributed")],  # personal models; choices by train loss
)
def test_clients_judged_their_own_way_are_judged_alone(monkeypatch, algorithm, mode):
    extra = {"privacy.noise_cohort_size": 6} if mode == "distributed" else {}
    worker, prep = _worker(**{"algorithm.name": algorithm, "privacy.mode": mode}, **extra)
    algo = worker.algorithm
    state = prep.algorithm.init_state(np.random.default_rng(0))
    plan = algo.plan_evaluation(state)
    if algorithm == "local":  # each client judged on its own (here: perturbed) model
        for t in plan.tasks:
            t.state = plan.models[0] + 0.01 * t.client_id
    else:
        assert all(t.extra.get("select") for t in plan.tasks)
    calls = _count_shared(monkeypatch, worker)
    together = _evaluate(worker, plan, task_groups("evaluate", plan.tasks, 1, 8))
    assert calls == []
    one_by_one = [algo.client_evaluate(t, c) for t, c in _contexts(worker, plan)]
    assert together == one_by_one


def _contexts(worker, plan):
    from raysim.protocol import ClientContext

    models = [torch.from_numpy(m.numpy().copy()) for m in plan.models]
    for t in plan.tasks:
        yield t, ClientContext(t.client_id, 1, worker.seed, worker.trainer, worker.dataset, models)
