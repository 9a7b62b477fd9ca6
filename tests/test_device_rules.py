"""The rules each client's device enforces by itself (raysim.privacy.modes.device), whatever the
server asks: a round trained once (or again from the very same request, which gives the same bits),
only rounds 1..R, and no release costlier than the client's plan holds for that round. Run here
on a worker and a ``ClientSide`` in this process, as ``raysim compare --inline`` runs them in
the clients' child process; tests/test_sample_apart.py asks the same of a deviating server on
Ray."""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from algorithms import Environment, get_algorithm
from raysim.compose import for_algorithm
from raysim.config import load_config
from raysim.engine.driver import read_snapshot
from raysim.engine.experiment import prepare
from raysim.engine.rounds import group_size, task_groups
from raysim.models import model_spec
from raysim.privacy import Released
from raysim.privacy.distributed import local_gaussian_event
from raysim.privacy.modes.device import ReleaseRefused, vet_releases
from raysim.protocol import ClientReport
from raysim.runtime.client_side import ClientSide
from raysim.runtime.worker import ClientWorker
from raysim.seeding import SERVER, numpy_rng
from raysim.state.checkpoint import encode_state
from raysim.training.config import TrainConfig, sampling_plan

KEY = b"k" * 16
TINY = [
    "rounds=3",
    "data.dataset=digits",
    "data.num_clients=6",
    "data.cluster_sizes=[3,3]",
    "model.name=linear",
    "training.batch_size=16",
    "runtime.progress=false",
    "privacy.mode=sample",
    "privacy.epsilon=2",
    "privacy.delta=1e-5",
    "privacy.client_seed=77",
    "algorithm.name=fedavg",
]


def prep_for(*sets: str):
    cfg = for_algorithm(load_config(None, [*TINY, *sets]))
    return prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)


class Clients:
    """A worker and the clients' side in this process, asked as a server would ask them."""

    def __init__(self, prep) -> None:
        cfg, rt = prep.cfg, prep.cfg.runtime
        secure = prep.privacy_summary.get("secure_spec")
        self.side = ClientSide(KEY, {}, (), True, prep.client_seed, secure)
        args = (copy.deepcopy(prep.algorithm), prep.dataset, model_spec(cfg), cfg.seed, 1, 0.0)
        args += (rt.vectorize, prep.client_seed, copy.deepcopy(prep.mode))
        self.worker = ClientWorker(*args, client_side=(self.side, KEY))
        self.size, self.eval_size = group_size(rt.client_group_size, 0.0), rt.eval_group_size
        algo = prep.algorithm
        state = algo.init_state(numpy_rng(cfg.seed, 0, SERVER, "init"))
        self.plan = algo.plan_round(state, 1, numpy_rng(cfg.seed, 1, SERVER, "plan"))
        prep.mode.stamp(self.plan)

    def train(self, round: int, models=None, tasks=None) -> list[ClientReport]:
        models = self.plan.models if models is None else models
        tasks = copy.deepcopy(self.plan.tasks if tasks is None else tasks)
        stacked = np.stack([m.numpy() for m in models])
        groups = task_groups("train", tasks, self.size, self.eval_size)
        return sorted(self.worker.run("train", round, stacked, groups), key=lambda r: r.client_id)


def updates(reports: list[ClientReport]) -> list[torch.Tensor]:
    return [r.update.value for r in reports]


def test_a_client_trains_a_round_once_or_again_from_the_same_request():
    clients = Clients(prep_for())
    first = clients.train(1)
    assert first and all(isinstance(r.update, Released) for r in first)
    again = clients.train(1)  # a piece run again (its worker died): the same bits
    assert all(torch.equal(a, b) for a, b in zip(updates(first), updates(again), strict=True))
    # the same round from another broadcast: its noise would cancel in the difference
    moved = [m + 0.01 for m in clients.plan.models]
    with pytest.raises(ReleaseRefused, match="asked to train it again on other inputs"):
        clients.train(1, models=moved)
    faster = [replace(t, train=replace(t.train, lr=t.train.lr * 2)) for t in clients.plan.tasks]
    with pytest.raises(ReleaseRefused, match="again on other inputs"):
        clients.train(1, tasks=faster)
    # the same tasks grouped otherwise: vectorized with other clients, the bits could differ
    stacked = np.stack([m.numpy() for m in clients.plan.models])
    together = [copy.deepcopy(clients.plan.tasks)]
    assert len(task_groups("train", clients.plan.tasks, clients.size, 1)) > 1
    with pytest.raises(ReleaseRefused, match="again on other inputs"):
        clients.worker.run("train", 1, stacked, together)
    # the next round from the moved broadcast is a round of its own
    assert len(clients.train(2, models=moved)) == len(first)


def test_a_client_trains_no_round_outside_the_run_nor_twice_in_one_piece():
    clients = Clients(prep_for())
    for round in (0, 4):
        with pytest.raises(ReleaseRefused, match=r"rounds 1\.\.3"):
            clients.train(round)
    first = clients.plan.tasks[0]
    twice = [first, replace(first, cluster=1)]
    with pytest.raises(ReleaseRefused, match="two tasks in one piece"):
        clients.train(1, tasks=twice)


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda tc: {"dp_noise_multiplier": tc.dp_noise_multiplier / 2}, "z"),  # less noise
        (lambda tc: {"local_epochs": 3}, "steps"),  # more steps
        (lambda tc: {"batch_size": 2 * tc.batch_size}, "q"),  # a higher sampling rate
    ],
    ids=["noise", "steps", "rate"],
)
def test_a_client_releases_nothing_costlier_than_its_plan(change, what):
    clients = Clients(prep_for())
    tasks = [replace(t, train=replace(t.train, **change(t.train))) for t in clients.plan.tasks]
    with pytest.raises(ReleaseRefused, match="would release dpsgd") as refused:
        clients.train(1, tasks=tasks)
    assert f"'{what}'" in str(refused.value)
    # a refused piece released nothing and recorded nothing: the planned request is served
    assert len(clients.train(1)) == len(clients.plan.tasks)


def test_a_choice_is_released_only_where_and_as_the_plan_holds():
    prep = prep_for("algorithm.name=rdpcfl", "rounds=6")
    algo, mode = prep.algorithm, prep.mode
    eps = mode.needs.selections[1]
    assert eps > 0 and not algo.may_select(1) and algo.may_select(2)
    rng = np.random.default_rng(0)

    def choice(e: float) -> ClientReport:
        return ClientReport(3, cluster=mode.release_choice(np.array([0.0, 1.0]), 1.0, e, rng))

    vet_releases(mode, 2, [choice(eps)], algo.may_select(2))
    with pytest.raises(ReleaseRefused, match="its plan holds dpsgd"):  # one choice a round
        vet_releases(mode, 2, [choice(eps), choice(eps)], algo.may_select(2))
    with pytest.raises(ReleaseRefused, match="exponential_selection"):
        vet_releases(mode, 2, [choice(2 * eps)], algo.may_select(2))
    with pytest.raises(ReleaseRefused, match="exponential_selection.*its plan holds dpsgd"):
        vet_releases(mode, 1, [choice(eps)], algo.may_select(1))  # no choice in round 1


def test_a_sketch_is_released_only_in_its_round():
    sets = ["algorithm.name=pina", "privacy.mode=distributed", "privacy.epsilon=8"]
    sets += ["privacy.clip=1", "privacy.noise_cohort_size=6", "algorithm.sketch_dim=8"]
    sets += ["algorithm.num_clusters=2", "rounds=5"]
    mode = prep_for(*sets).mode
    r = mode.needs.local_round
    released = ClientReport(0)
    mode.release_sketch(released, np.ones(50), 8, 7, np.random.default_rng(1))
    sketch = released.update
    vet_releases(mode, r, [ClientReport(0, update=sketch)], False)
    with pytest.raises(ReleaseRefused, match="local_gaussian_sketch"):
        vet_releases(mode, r + 1, [ClientReport(0, update=sketch)], False)
    event = local_gaussian_event(0.5)
    weaker = Released(sketch.value, sketch.mechanism, event, {**sketch.params, "z": 0.5})
    with pytest.raises(ReleaseRefused, match="its plan holds local_gaussian_sketch"):
        vet_releases(mode, r, [ClientReport(0, update=weaker)], False)


def test_a_client_is_admitted_to_a_round_once_until_its_piece_released_nothing():
    """Two pieces of one client's round at once (two workers): the second is refused; a piece
    whose worker refused its releases (or failed) is withdrawn, and the round is the client's
    to train again."""
    side = ClientSide(KEY, {}, (), True, 7)
    assert side.admit(KEY, "train", 1, {0: b"a", 1: b"a"}) == ({}, [0, 1])
    with pytest.raises(ReleaseRefused, match=r"clients \[0\] were asked to train it again"):
        side.admit(KEY, "train", 1, {0: b"b"})
    assert side.admit(KEY, "train", 1, {0: b"a"}) == ({}, [])  # the same again: nothing new
    side.withdraw(KEY, "train", 1, [0])
    assert side.admit(KEY, "train", 1, {0: b"b"}) == ({}, [0])
    with pytest.raises(ReleaseRefused):
        side.admit(KEY, "train", 1, {1: b"b"})  # withdrawn for client 0 only
    with pytest.raises(PermissionError):
        side.withdraw(b"", "train", 1, [1])  # only with the key


def test_a_round_is_trained_from_the_state_before_it():
    """A round run again (its worker died after handing back) starts from the same state as the
    first time, so it is the same request."""
    side = ClientSide(KEY, {}, (), True, 7)
    side.keep(KEY, 1, {0: "s1"}, {})
    assert side.admit(KEY, "train", 2, {0: b"a"}) == ({0: "s1"}, [0])
    side.keep(KEY, 2, {0: "s2"}, {})
    assert side.admit(KEY, "train", 2, {0: b"a"}) == ({0: "s1"}, [])
    assert side.admit(KEY, "evaluate", 2, {0: b"a"}) == ({0: "s2"}, [0])  # after the round


def test_a_state_read_back_from_a_snapshot_is_the_same_request():
    """A lost server restarts from the checkpoint while the clients' side lives on with its
    memory: the round after it runs again from the snapshot's copy of each state (new tensors,
    the same values), which is the same request; a state with other values is not."""
    side = ClientSide(KEY, {}, (), True, 7)
    state = {"update": torch.arange(6.0).reshape(2, 3), "slot": 1}
    side.keep(KEY, 1, {0: state}, {})
    blob = side.snapshot(KEY, 1)
    side.admit(KEY, "train", 2, {0: b"a"})
    side.restore(KEY, blob, 1)  # the server's restart: states are the snapshot's copies
    again = side.admit(KEY, "train", 2, {0: b"a"})[0][0]
    assert again["update"] is not state["update"] and torch.equal(again["update"], state["update"])
    other = ClientSide(KEY, {}, (), True, 7)
    other.keep(KEY, 1, {0: state}, {})
    other.admit(KEY, "train", 2, {0: b"a"})
    state["update"][0, 0] = 0.5  # the state the round would start from is another one
    with pytest.raises(ReleaseRefused, match="again on other inputs"):
        other.admit(KEY, "train", 2, {0: b"a"})


def test_what_the_clients_trained_is_kept_with_a_snapshot():
    side = ClientSide(KEY, {}, (), True, 7)
    side.admit(KEY, "train", 1, {0: b"a"})
    side.keep(KEY, 1, {0: "s1"}, {})
    side.admit(KEY, "train", 2, {0: b"a"})  # after the snapshot's round: not in it
    blob = side.snapshot(KEY, 1)
    states, served = read_snapshot(blob)[:2]
    assert states == {0: "s1"} and list(served["train"][0]) == [1]
    fresh = ClientSide(KEY, {}, (), True, 7)  # a resumed run's
    fresh.restore(KEY, blob, 1)
    with pytest.raises(ReleaseRefused):
        fresh.admit(KEY, "train", 1, {0: b"b"})
    assert fresh.admit(KEY, "train", 2, {0: b"b"})[0] == {0: "s1"}
    legacy = encode_state({0: "s0"})  # a snapshot written before the clients kept what they trained
    assert read_snapshot(legacy) == ({0: "s0"}, {}, {}, None, {})
    fresh.restore(KEY, legacy, 1)
    assert fresh.admit(KEY, "evaluate", 1, {0: b""})[0] == {0: "s0"}


def test_a_client_trains_no_more_rounds_than_its_leakage_cap_allows():
    """Under dprivacy's cap the clients count their own releases, as the metric ledger adds
    them: a cap of 2.5 releases allows 2."""
    sets = ["privacy.mode=dprivacy", "privacy.nu=1000", "algorithm.name=fedavg", "rounds=5"]
    mode = prep_for(*sets, "privacy.leakage_cap=null").mode
    dim = 650
    assert mode.releases_per_client(dim) is None
    cap = 2.5 * mode.release_leakage(dim)
    mode = prep_for(*sets, f"privacy.leakage_cap={cap}").mode
    assert mode.releases_per_client(dim) == 2
    exact = prep_for(*sets, f"privacy.leakage_cap={2 * mode.release_leakage(dim)}")
    assert exact.mode.releases_per_client(dim) == 2
    side = ClientSide(KEY, {}, (), True, 7)
    for round in (1, 3):
        side.admit(KEY, "train", round, {0: b"a"}, limit=2)
    side.admit(KEY, "train", 3, {0: b"a"}, limit=2)  # the same again is no new release
    with pytest.raises(ReleaseRefused, match="the 2 rounds their leakage cap allows"):
        side.admit(KEY, "train", 4, {0: b"a"}, limit=2)


def test_the_broadcast_is_taken_only_as_float32_rows_of_the_clients_model():
    """The same bytes read as other weights (another dtype or width) could pass for the same
    request; so could an object array's pointers."""
    clients = Clients(prep_for())
    clients.train(1)
    stacked = np.stack([m.numpy() for m in clients.plan.models])
    wide = np.zeros((1, 2 * stacked.shape[1]), np.float32)
    wide[0, : stacked.shape[1]] = stacked[0]
    sent = {
        "as float64": stacked.view(np.float64),
        "wider": wide,
        "as objects": stacked.astype(object),
        "with a NaN": np.where(
            np.arange(stacked.size).reshape(stacked.shape) == 0, np.nan, stacked
        ),
    }
    groups = task_groups("train", copy.deepcopy(clients.plan.tasks), clients.size, 1)
    for name, models in sent.items():  # each refused before any training
        models = models.astype(np.float32) if name == "with a NaN" else models
        with pytest.raises(ReleaseRefused, match="broadcast"):
            clients.worker.run("train", 1, models, groups)


def test_a_client_is_evaluated_only_after_the_rounds_the_run_evaluates_once_each():
    """An evaluation reports a client's loss on models the server chooses: the clients allow
    only the planned evaluations, once each (as it was: served again)."""
    clients = Clients(prep_for("training.eval_every=2", "rounds=5"))
    stacked = np.stack([m.numpy() for m in clients.plan.models])

    def evaluate(round: int, models: np.ndarray) -> list:
        tasks = [replace(t, train=None) for t in clients.plan.tasks]
        groups = task_groups("evaluate", tasks, clients.size, clients.eval_size)
        return clients.worker.run("evaluate", round, models, groups)

    with pytest.raises(ReleaseRefused, match="every 2 rounds and after round 5"):
        evaluate(3, stacked)
    first = evaluate(2, stacked)
    assert [r.loss for r in evaluate(2, stacked)] == [r.loss for r in first]
    with pytest.raises(ReleaseRefused, match="evaluate it again on other inputs"):
        evaluate(2, stacked * 2)
    assert len(evaluate(5, stacked * 2)) == len(first)


@pytest.mark.parametrize("vectorize", ["true", "false"], ids=["vectorized", "opacus"])
def test_a_broadcast_that_makes_training_overflow_gives_a_release_like_any_other(vectorize):
    """Weights that overflow on some samples (their gradients have no finite norm) would make a
    release non-finite, and a non-finite release or a failure tells the server so without noise.
    The samples count as zero-gradient ones instead (bounded by the clip), so the release is
    finite and as noisy as planned."""
    clients = Clients(prep_for(f"runtime.vectorize={vectorize}"))
    huge = [m.clone() for m in clients.plan.models]
    for m in huge:
        m[:128] = 3e38  # classes 0 and 1 (the linear model's first rows): inf - inf, NaN
    reports = clients.train(1, models=huge)
    assert reports and all(torch.isfinite(r.update.value).all() for r in reports)
    # every sample counts as zero: the release is the noise alone (at 3e38 it rounds away)
    tc, n = clients.plan.tasks[0].train, len(clients.worker.dataset.client_train(0)[0])
    plan = sampling_plan(n, tc)
    std = tc.lr * tc.dp_noise_multiplier * tc.dp_clip / plan.expected_batch_size
    noise = reports[0].update.value[128:]
    assert float(noise.std()) == pytest.approx(std * plan.total_steps**0.5, rel=0.2)
    assert abs(float(noise.mean())) < 4 * float(noise.std()) / noise.numel() ** 0.5


def test_a_non_finite_release_is_refused_and_spends_the_round():
    mode = prep_for().mode
    bad = ClientReport(0, update=Released(torch.tensor([float("nan")]), "dpsgd", None, {}))
    with pytest.raises(ReleaseRefused, match="not finite") as refused:
        vet_releases(mode, 1, [bad], False)
    assert refused.value.spent


def test_a_clipped_vector_is_bounded_whatever_came_in():
    from raysim.privacy.mechanisms import clip_l2

    assert np.array_equal(clip_l2(np.array([np.nan, 1.0]), 1.0), [0.0, 0.0])
    rows = clip_l2(np.array([[3.0, 4.0], [np.inf, 0.0]]), 1.0)
    assert np.allclose(rows, [[0.6, 0.8], [0.0, 0.0]])


class TwoFaced(TrainConfig):
    """A train config whose noise reads one way for the trainer and another for the release."""


def test_a_task_of_the_servers_own_classes_is_refused():
    clients = Clients(prep_for())
    t = clients.plan.tasks[0]
    two_faced = TwoFaced(**{f.name: getattr(t.train, f.name) for f in fields(TrainConfig)})
    odd = [replace(t, train=two_faced), replace(t, extra={"select": object()})]
    odd.append(replace(t, train=replace(t.train, lr=torch.tensor(0.1))))
    for task in odd:
        with pytest.raises(ReleaseRefused, match="plain values"):
            clients.train(1, tasks=[task])
    assert len(clients.train(1)) == len(clients.plan.tasks)  # nothing was admitted
