"""Under ``privacy.mode: sample`` the server is untrusted too: DP-SGD protects each sample from
it. A curious server that draws the clients' DP-SGD noise again, from the run's seed it holds, and
takes it off their updates recovers each client's clipped-gradient sum exactly when the clients
draw from the run's seed (``client_seed: same_as_seed``, the reproduction mode), and nothing when
they draw from their own seed, which its process never holds; it trains no client itself."""

from __future__ import annotations

import copy
import gc
import os
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import RAY_TIMEOUT_S
from test_clients_apart import places_holding

from algorithms import Environment
from algorithms.fedavg import FedAvg
from raysim.compose import for_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.models import build_from_spec, model_spec
from raysim.models.params import load_flat_, trainable
from raysim.runtime.run import run_prepared
from raysim.seeding import torch_generator
from raysim.training.config import sampling_plan

# An explicit clients' seed, looked for in the server's process: kept masked in this module,
# whose globals travel with the probe into that process.
MASK, MASKED_SEED = 0x5A5A_5A5A, 915_577_123 ^ 0x5A5A_5A5A
SETS = [
    "rounds=1",
    "data.dataset=digits",
    "data.num_clients=4",
    "data.cluster_sizes=[2,2]",
    "model.name=linear",
    "training.batch_size=100000",  # one full-batch step: the update is the noisy sum, scaled
    "runtime.progress=false",
    "runtime.checkpoint_every=0",  # the probe's class travels by value, a checkpoint by name
    "runtime.num_workers=2",
    f"runtime.round_timeout_s={RAY_TIMEOUT_S}",
    "privacy.mode=sample",
    "privacy.epsilon=1.0",
    "privacy.delta=1e-5",
    "algorithm.name=fedavg",
]


class CuriousFedAvg(FedAvg):
    """FedAvg whose server step draws each client's DP-SGD noise from its own config's seed, as
    the trainer would from the clients' (raysim.training: the Poisson mask, then one Gaussian
    per weight, from ("train", round, client)), and reports the clipped-gradient sums it gets
    by taking that noise off."""

    name = "curious_fedavg"

    def server_step(self, state, plan, reports, rng):
        model = build_from_spec(
            model_spec(self.cfg), self.env.feature_shape, self.env.num_classes, 0
        )
        shapes = [tuple(p.shape) for p in trainable(model)]
        result = super().server_step(state, plan, reports, rng)
        for m in reports:
            task = next(t for t in plan.tasks if t.client_id == m.client_id)
            tc, n = task.train, m.num_samples
            gen = torch_generator(self.cfg.seed, plan.round, m.client_id, "train")
            torch.rand(n, generator=gen)  # the Poisson mask (q = 1)
            std = tc.dp_noise_multiplier * tc.dp_clip
            noise = torch.cat(
                [torch.normal(0.0, std, s, generator=gen).reshape(-1) for s in shapes]
            )
            batch = sampling_plan(n, tc).expected_batch_size
            recovered = -m.update * batch / tc.lr - noise
            result.metrics[f"probe_sum_{m.client_id}"] = recovered.numpy().tolist()
        result.metrics["probe_pid"] = os.getpid()
        result.metrics["probe_client_seed"] = places_holding(MASKED_SEED ^ MASK, gc.get_objects())
        return result


class DeviatingFedAvg(FedAvg):
    """FedAvg whose server step deviates from the protocol. From its own process, through the
    round loop's hand-out to the workers, it asks the clients for round 1 again as it was, for
    round 1 from another broadcast (two releases sharing their noise), for a round the run does
    not have, and for round 2 at half the planned noise; then the run goes on."""

    name = "deviating_fedavg"

    def server_step(self, state, plan, reports, rng):
        result = super().server_step(state, plan, reports, rng)
        if plan.round != 1:
            return result
        loop = next(o for o in gc.get_objects() if type(o).__name__ == "RoundLoop")

        def ask(round: int, models: list, tasks: list) -> int:
            """1: served; 0: refused by the clients; -1: failed otherwise."""
            try:
                loop.execute("train", round, list(models), copy.deepcopy(tasks))
                return 1
            except Exception as exc:
                return 0 if "ReleaseRefused" in str(exc) else -1

        half = [
            replace(t, train=replace(t.train, dp_noise_multiplier=t.train.dp_noise_multiplier / 2))
            for t in plan.tasks
        ]
        moved = [m + 0.01 for m in plan.models]
        result.metrics["probe_same"] = ask(1, plan.models, plan.tasks)
        result.metrics["probe_moved"] = ask(1, moved, plan.tasks)
        result.metrics["probe_invented"] = ask(self.cfg.rounds + 1, plan.models, plan.tasks)
        result.metrics["probe_less_noise"] = ask(2, plan.models, half)
        return result


@pytest.fixture(scope="module", autouse=True)
def probe_by_value():
    """Ray's workers cannot import the test modules: the probe travels by value."""
    import ray.cloudpickle

    modules = [sys.modules[__name__], sys.modules["test_clients_apart"]]
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    yield
    for module in modules:
        ray.cloudpickle.unregister_pickle_by_value(module)


def clipped_sums(prep) -> dict[int, torch.Tensor]:
    """Each client's true clipped-gradient sum at the initial weights (the client's own)."""
    ds, clip = prep.dataset, prep.cfg.privacy.clip
    model = build_from_spec(prep.spec, ds.feature_shape, ds.num_classes, 0)
    load_flat_(trainable(model), prep.env.init_weights)
    out = {}
    for c in range(len(ds.train_sizes)):
        x, y = (np.array(a) for a in ds.client_train(c))  # writable copies
        grads = []
        for i in range(len(x)):
            model.zero_grad()
            logits = model(torch.as_tensor(x[i : i + 1]).float())
            F.cross_entropy(logits, torch.as_tensor(y[i : i + 1]).long()).backward()
            g = torch.cat([p.grad.reshape(-1) for p in trainable(model)])
            grads.append(g * min(1.0, clip / (float(g.norm()) + 1e-6)))
        out[c] = torch.stack(grads).sum(0)
    return out


def attack(tmp_path, client_seed: object) -> tuple[dict, list[float]]:
    cfg = for_algorithm(load_config(None, [*SETS, f"privacy.client_seed={client_seed}"]))
    prep = prepare(cfg, CuriousFedAvg, Environment)
    res = run_prepared(prep, tmp_path / str(client_seed))
    row = res["history"][0]
    truth = clipped_sums(prep)
    errors = [
        float((torch.tensor(row[f"probe_sum_{c}"]) - s).norm() / s.norm()) for c, s in truth.items()
    ]
    return res, row, errors


def test_the_server_cannot_take_the_dp_sgd_noise_off_without_the_clients_seed(
    ray_session, tmp_path
):
    res, row, errors = attack(tmp_path, MASKED_SEED ^ MASK)
    assert min(errors) > 0.5, errors  # off by more than the sum itself: the noise stayed on
    assert row["probe_client_seed"] == 0  # the server's process does not hold the clients' seed
    worker_pids = {w["pid"] for w in res["workers"]}
    assert row["probe_pid"] not in worker_pids  # nor did it train any client
    # the check can fail: with the clients drawing from the run's seed the sums come back whole
    _, _, exposed = attack(tmp_path, "same_as_seed")
    assert max(exposed) < 1e-4, exposed
    assert np.isfinite(errors).all()


def test_the_clients_refuse_a_server_that_deviates_from_the_protocol(ray_session, tmp_path):
    """raysim.privacy.modes.device on Ray: the workers and the clients' side refuse what the
    protocol does not hold, and serve what it does (the check can fail: the same request is
    served)."""
    sets = [s for s in SETS if not s.startswith("rounds=")] + ["rounds=2"]
    cfg = for_algorithm(load_config(None, [*sets, f"privacy.client_seed={MASKED_SEED ^ MASK}"]))
    prep = prepare(cfg, DeviatingFedAvg, Environment)
    res = run_prepared(prep, tmp_path / "deviating")
    first = res["history"][0]
    assert first["probe_same"] == 1  # a piece run again: the same bits, served
    assert first["probe_moved"] == 0  # round 1 again, from another broadcast
    assert first["probe_invented"] == 0  # round 3 of a 2-round run
    assert first["probe_less_noise"] == 0  # round 2 at half the planned noise
    assert len(res["history"]) == 2  # round 2 as planned was served: the refusal kept nothing
