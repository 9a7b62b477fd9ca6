"""An untrusted server's process holds no client's state or secure input (runtime.client_side).

Under ``distributed`` the coordinator actor is the server. The clients' persistent state (PINA's
base update and hidden slot) and their secure-aggregation inputs (clipped vectors without noise)
must not exist in its process, let alone reach the server step: a probe algorithm looks for them
from inside ``server_step``, in its own process, as any server code could.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import time
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import RAY_TIMEOUT_S

from algorithms import ALGORITHMS, Environment
from algorithms.pina import PINA
from raysim.compose import for_algorithm
from raysim.config import load_config
from raysim.engine.driver import read_snapshot
from raysim.engine.experiment import prepare
from raysim.metrics.evaluation import Judge
from raysim.protocol import ClientReport, EvalReport, SecureContribution
from raysim.runtime.inline import inline_loop, run_inline
from raysim.runtime.run import run_prepared

CLIENT_SEED = 98765432109876543210  # the clients' own: never in the server's process

TINY_PINA = [
    "rounds=5",
    "data.dataset=digits",
    "data.num_clients=12",
    "data.cluster_sizes=[6,6]",
    "data.shift=rotation",
    "model.name=linear",
    "training.batch_size=16",
    "training.lr=0.1",
    "algorithm.name=pina",
    "algorithm.num_clusters=2",
    "algorithm.sketch_dim=8",
    "privacy.mode=distributed",
    "privacy.epsilon=8",
    "privacy.clip=1",
    "privacy.noise_cohort_size=6",
    f"privacy.client_seed={CLIENT_SEED}",  # the same clients' draws in every run compared
    "training.sampling_rate=0.75",
    "training.eval_every=2",
    "runtime.progress=false",
    f"runtime.round_timeout_s={RAY_TIMEOUT_S}",
]


# objects of the kinds the probe looks for that were alive before a probe's run began (other
# tests' leftovers in the test process), by probe; held here, so that their ids stay theirs
_BEFORE: dict[int, list] = {}


def _client_material(objects: list) -> tuple[list, list, list]:
    """Secure inputs, reports that carry one, a client state or a training loss, and scores
    of an evaluation, among ``objects``."""
    with warnings.catch_warnings():  # isinstance on some of torch's module objects warns
        warnings.simplefilter("ignore")
        inputs = [o for o in objects if isinstance(o, SecureContribution)]
        reports = [
            o
            for o in objects
            if isinstance(o, ClientReport)
            and (o.state is not None or o.contribution is not None or not math.isnan(o.loss))
        ]
        scores = [o for o in objects if isinstance(o, EvalReport)]
    return inputs, reports, scores


def what_this_process_holds(probe) -> dict[str, float]:
    """Clients' secure inputs, states and scores of ``probe``'s run anywhere in this process's
    heap."""
    from raysim.engine.rounds import RoundLoop

    gc.collect()
    objects = gc.get_objects()
    before = {id(o) for o in _BEFORE.get(id(probe), [])}
    inputs, reports, scores = (
        [o for o in found if id(o) not in before] for found in _client_material(objects)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loops = [o for o in objects if isinstance(o, RoundLoop) and o.algorithm is probe]
    kept = sum(len(loop.client_states) for loop in loops)
    return {
        "probe_inputs": len(inputs),
        "probe_report_states": len(reports),
        "probe_kept": kept,
        "probe_scores": len(scores),
    }


def places_holding(value: int, objects: list) -> int:
    """How many containers, objects' attributes and seed sequences among ``objects`` hold the
    int ``value`` (this module's globals aside: the probe's own copy, ``CLIENT_SEED``)."""
    found = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in objects:
            if o is globals():
                continue
            try:
                if isinstance(o, dict):
                    items = list(o.values())
                elif isinstance(o, list | tuple | set | frozenset):
                    items = list(o)
                elif isinstance(o, np.random.SeedSequence):
                    items = list(np.atleast_1d(o.entropy))
                else:
                    items = list(getattr(o, "__dict__", {}).values())
                found += any(type(v) is int and v == value for v in items)
            except Exception:  # an object that will not be looked into: skip it
                continue
    return found


def noise_regenerated_from_the_run_seed(algorithm, plan, view) -> bool:
    """The attack the run's seed would allow: draw the secure sum's noise as the engine did,
    from (seed, round, server, "secure"), and take it off the member counts. Where that is the
    real noise, every count comes back a whole number."""
    from raysim.privacy.modes import make_mode  # the calibration is public: anyone can redo it
    from raysim.privacy.modes.secure import COUNT_WEIGHT
    from raysim.seeding import SERVER, numpy_rng

    p = make_mode(algorithm.cfg, algorithm.env.train_sizes, algorithm.privacy_needs())
    dim = int(plan.models[0].numel())
    noise = numpy_rng(algorithm.cfg.seed, plan.round, SERVER, "secure").normal(
        0.0, p.std, size=(len(plan.models), dim + 1)
    )
    counts = np.asarray(view.counts) - noise[:, dim] / (COUNT_WEIGHT * p.privacy.clip)
    return bool(np.all(np.abs(counts - np.round(counts)) < 1e-6))


class ProbingPINA(PINA):
    """PINA whose server step reports what its process holds and what its plan carries."""

    name = "probing_pina"

    def init_state(self, rng):  # in the server's process, as its round loop starts
        gc.collect()
        _BEFORE[id(self)] = [o for found in _client_material(gc.get_objects()) for o in found]
        return super().init_state(rng)

    def server_step(self, state, plan, view, rng):
        found = what_this_process_holds(self)
        found["probe_plan_states"] = sum(t.state is not None for t in plan.tasks)
        found["probe_client_seed"] = places_holding(CLIENT_SEED, gc.get_objects())
        if getattr(view, "sums", None) is not None:
            found["probe_regenerated"] = noise_regenerated_from_the_run_seed(self, plan, view.sums)
        result = super().server_step(state, plan, view, rng)
        result.metrics.update({k: float(v) for k, v in found.items()})
        return result


PROBED = ("probe_inputs", "probe_report_states", "probe_kept", "probe_plan_states", "probe_scores")


def _prep(*sets: str, algorithm: type = ProbingPINA):
    """A probe run writes no checkpoint: a checkpoint pickles the algorithm by reference, and
    Ray's workers cannot import this module (its classes travel by value)."""
    probe = ["runtime.checkpoint_every=0"] if algorithm is ProbingPINA else []
    cfg = for_algorithm(load_config(None, TINY_PINA + probe + list(sets)))
    return prepare(cfg, algorithm, Environment)


@pytest.fixture(scope="module", autouse=True)
def probe_by_value():
    """Ray's workers cannot import this test module: its classes travel by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _metrics(run_dir):
    df = pq.read_table(run_dir / "metrics.parquet").to_pandas()
    return df.drop(columns=["round_seconds"])


def test_the_server_step_never_gets_a_client_state_in_one_process():
    """With the clients in the server's process (the library's inline loop) the states are the
    round loop's, but the plan the server step receives never carries them."""
    loop = inline_loop(_prep())
    rows = [loop.step() for _ in range(3)]
    assert loop.client_states  # PINA keeps each client's base update and slot
    assert all(row["probe_plan_states"] == 0 for row in rows), rows
    # the probe finds what is there: round 2's scores, judged in this process (12 clients)
    assert [row["probe_scores"] for row in rows] == [0, 0, 12]


def test_without_ray_the_clients_run_in_a_child_process():
    """raysim compare --inline (run_inline) keeps an untrusted server's clients in a child
    process: the server's process holds none of their inputs or states."""
    res = run_inline(_prep())
    assert res["workers"][0]["clients_apart"] is True
    for row in res["history"]:
        for col in PROBED:
            assert row[col] == 0, (col, row)
    assert [row.get("probe_regenerated") for row in res["history"]] == [None, 0, 0, 0, 0]


UNTRUSTED = ("sample", "distributed", "dprivacy")
# every registered algorithm under every untrusted mode it takes, and each kind of stage 1 of
# the algorithms that have one (Lloyd's rounds send sketch centroids, not models)
STAGE1 = [["algorithm.init=kmeans"], ["algorithm.init=lloyd", "algorithm.lloyd_iters=2"]]
STAGES = {"pina": STAGE1, "kmeans_cfl_sketch": STAGE1}
APART = [
    pytest.param(name, mode, sets, id="-".join([name, mode, *(s.split("=")[1] for s in sets)]))
    for name, cls in sorted(ALGORITHMS.items())
    for mode in cls.privacy_modes
    if mode in UNTRUSTED
    for sets in STAGES.get(name, [[]])
]


@pytest.mark.parametrize("name, mode, sets", APART)
def test_every_algorithm_runs_with_its_clients_apart_as_in_one_process(name, mode, sets):
    """What the clients' devices take and check (raysim.privacy.modes.device) is what each algorithm
    sends and releases: its run with the clients in a child process, behind the device rules,
    gives every round's metrics as with the clients in this process."""
    sets = [
        "rounds=5",
        "data.dataset=digits",
        "data.num_clients=8",
        "data.cluster_sizes=[4,4]",
        "model.name=linear",
        "training.batch_size=16",
        "training.eval_every=2",
        f"algorithm.name={name}",
        f"privacy.mode={mode}",
        "privacy.epsilon=8",
        "privacy.delta=1e-7",
        "privacy.population=1000000",  # distributed: its noise-cohort convention
        f"privacy.client_seed={CLIENT_SEED}",
        "runtime.progress=false",
        *sets,
    ]
    rows = []
    for apart in (False, True):
        cfg = for_algorithm(load_config(None, sets), quiet=True)
        res = run_inline(prepare(cfg, ALGORITHMS[name], Environment), apart=apart)
        assert res["workers"][0]["clients_apart"] is apart
        rows.append(res["history"])
    assert rows[1][-1]["participants"] > 0 and "accuracy" in rows[1][-1]

    def comparable(row: dict) -> dict:  # nan (metric DP's eps) is not equal to itself
        return {k: "nan" if v != v else v for k, v in row.items() if k != "round_seconds"}

    assert [comparable(r) for r in rows[0]] == [comparable(r) for r in rows[1]]


def test_the_clients_seed_is_what_keeps_the_noise_from_the_server():
    """With the clients' seed set to the run's (which the server holds), the probe's attack
    takes the secure sums' noise off exactly: the check the runs above pass can fail."""
    rows = run_inline(_prep("privacy.client_seed=0"))["history"]
    assert [row.get("probe_regenerated") for row in rows] == [None, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def on_ray(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("apart")
    run_prepared(_prep("runtime.num_workers=2"), out / "two")
    return out


def test_on_ray_the_servers_process_holds_no_client_input_or_state(on_ray):
    df = _metrics(on_ray / "two")
    for col in PROBED:
        assert (df[col] == 0).all(), (col, df[col].tolist())
    # nor the clients' seed, and the run's seed does not regenerate the secure sums' noise
    assert (df["probe_client_seed"] == 0).all(), df["probe_client_seed"].tolist()
    regenerated = df["probe_regenerated"].dropna()
    assert len(regenerated) == 4 and not regenerated.any()
    # the scores were judged on the clients' side, and the driver has the metrics
    assert df["accuracy"].notna().tolist() == [False, True, False, True, True]


def test_the_experimenter_stops_early_on_scores_the_server_never_holds(ray_session, tmp_path):
    """``training.early_stop_patience`` under an untrusted server: the clients' side judges
    the scores, and the run stops where the loss series says, the first evaluation whose mean
    test loss is no lower than the best before it, on Ray as in one process."""
    every = "training.eval_every=1"
    loss = [r["loss"] for r in run_inline(_prep(every, algorithm=PINA), apart=False)["history"]]
    stop = next(k for k in range(2, len(loss) + 1) if loss[k - 1] >= min(loss[: k - 1]))
    assert stop < 5  # the series has a stop to find
    sets = (every, "training.early_stop_patience=1")
    for rows in (
        run_inline(_prep(*sets, algorithm=PINA))["history"],
        run_prepared(_prep(*sets, algorithm=PINA), tmp_path / "ray")["history"],
    ):
        assert [r["round"] for r in rows] == list(range(1, stop + 1))
        assert rows[-1]["early_stopped"] is True
        assert [r["loss"] for r in rows] == loss[:stop]
    assert _metrics(tmp_path / "ray")["loss"].tolist() == loss[:stop]


def test_the_clients_side_computes_the_same_bits_as_one_process(on_ray, tmp_path):
    """The secure sums on the clients' side actor equal the in-process aggregator's, for one or
    two workers; a run from a checkpoint equals one that never stopped."""
    inline = run_inline(_prep())
    ray_rows = _metrics(on_ray / "two")
    for row, ref in zip(ray_rows.to_dict("records"), inline["history"], strict=True):
        for key in ("accuracy", "loss", "epsilon", "count_0", "count_1"):
            if key in ref:
                assert row[key] == ref[key] or (np.isnan(row[key]) and np.isnan(ref[key])), key
    run_prepared(_prep("runtime.num_workers=1"), tmp_path / "one")
    assert (
        _metrics(tmp_path / "one")
        .drop(columns=[c for c in ray_rows if "probe" in c])
        .equals(ray_rows.drop(columns=[c for c in ray_rows if "probe" in c]))
    )


class DriverDied(Exception):
    pass


@pytest.fixture(scope="module")
def whole(ray_session, tmp_path_factory):
    """PINA's uninterrupted run on Ray, which every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("apart") / "whole"
    run_prepared(_prep(algorithm=PINA), out)
    return out


def test_a_resumed_run_restores_the_clients_states(whole, tmp_path):
    from raysim.state.checkpoint import load_checkpoint, split_checkpoint
    from raysim.state.rundir import staging_dir

    died = tmp_path / "died"

    def die_after_round_2(row):
        if row["round"] == 2:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_prepared(_prep(algorithm=PINA), died, on_round=die_after_round_2)
    blob = load_checkpoint(staging_dir(died))
    assert split_checkpoint(blob)[1] is not None  # the clients' states beside the loop's
    run_prepared(_prep(algorithm=PINA), died, resume=blob, resuming=True)
    assert _metrics(died).equals(_metrics(whole))
    # one process continues it too, the clients' states back in its round loop
    inline = run_inline(_prep(algorithm=PINA), resume=blob)["history"]
    assert [r["round"] for r in inline] == [1, 2, 3, 4, 5]
    assert inline[-1]["accuracy"] == _metrics(whole)["accuracy"].iloc[-1]


@pytest.mark.parametrize("lost", ["ClientSide", "Coordinator"])
def test_a_lost_actor_is_restarted_from_the_checkpoint(whole, tmp_path, lost):
    """The clients' side actor, or the server's, dies after round 1 (round 2 already asked
    for): the session restarts the server from round 1's checkpoint, and the run ends as if
    nothing happened. A lost server leaves the clients' side as it was, with its memory of what
    the clients released (a device outlives a server's crash); a lost clients' side is new."""
    from multinode_driver import actor_pids

    killed: list[int] = []
    sides: set[int] = set()

    def kill(row):
        sides.update(actor_pids("ClientSide"))
        if row["round"] == 1:
            (pid,) = actor_pids(lost)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    res = run_prepared(_prep(algorithm=PINA), tmp_path / "lost", on_round=kill)
    assert killed and res["coordinator_restarts"] == 1
    assert len(sides) == (2 if lost == "ClientSide" else 1)
    assert _metrics(tmp_path / "lost").equals(_metrics(whole))
    # nothing is left: not the new clients' side, nor the old server or the new one
    deadline = time.monotonic() + 20  # ray.kill returns before the process has gone
    while (left := actor_pids("ClientSide") + actor_pids("Coordinator")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert left == []


def test_the_clients_seed_is_drawn_recorded_and_never_the_servers(capsys):

    unset = [s for s in TINY_PINA if not s.startswith("privacy.client_seed")]
    a, b = (prepare(for_algorithm(load_config(None, unset)), PINA, Environment) for _ in "ab")
    assert a.client_seed != b.client_seed and a.client_seed.bit_length() > 64  # from the OS
    assert a.cfg.privacy.client_seed is None  # the config the server's process gets
    assert a.algorithm.cfg.privacy.client_seed is None
    assert a.recorded_config().privacy.client_seed == a.client_seed  # config.yaml's
    given = _prep(algorithm=PINA)
    assert given.client_seed == CLIENT_SEED and given.cfg.privacy.client_seed is None
    from algorithms import get_algorithm

    sets = [*unset, "algorithm.name=fedavg", "privacy.mode=client", "privacy.delta=1e-3"]
    trusted = for_algorithm(load_config(None, [*sets, "privacy.client_seed=3"]), quiet=True)
    assert prepare(trusted, get_algorithm("fedavg"), Environment).client_seed is None
    assert "privacy.client_seed is for an untrusted server's clients" in capsys.readouterr().err
    # the reproduction mode is the run's seed where the server is untrusted; a trusted one's
    # clients draw from the run's seed anyway
    same = [*unset, "privacy.client_seed=same_as_seed", "seed=4"]
    assert prepare(for_algorithm(load_config(None, same)), PINA, Environment).client_seed == 4
    reproduced = for_algorithm(load_config(None, [*sets, "privacy.client_seed=same_as_seed"]))
    assert prepare(reproduced, get_algorithm("fedavg"), Environment).client_seed is None


def test_a_resumed_run_continues_with_the_clients_seed_it_drew(ray_session, tmp_path):
    """A run that drew its clients' seed (none configured), stopped and continued from its
    checkpoint by a run prepared afresh (as a restored Tune trial is: it draws another) ends as
    one run with the first seed."""
    from raysim.state.checkpoint import load_checkpoint
    from raysim.state.rundir import staging_dir

    unset = [s for s in TINY_PINA if not s.startswith("privacy.client_seed")]

    def fresh(*sets):
        return prepare(for_algorithm(load_config(None, [*unset, *sets])), PINA, Environment)

    died, first = tmp_path / "died", fresh()

    def die_after_round_2(row):
        if row["round"] == 2:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_prepared(first, died, on_round=die_after_round_2)
    again = fresh()
    assert again.client_seed != first.client_seed
    run_prepared(again, died, resume=load_checkpoint(staging_dir(died)), resuming=True)
    assert again.client_seed == first.client_seed
    assert load_config(died / "config.yaml").privacy.client_seed == first.client_seed
    whole = tmp_path / "whole"
    run_prepared(fresh(f"privacy.client_seed={first.client_seed}"), whole)
    assert _metrics(died).equals(_metrics(whole))


def test_a_client_key_is_needed_to_read_the_clients_side(ray_session):
    import ray

    from raysim.runtime.client_side import ClientSide, client_key

    key = client_key()
    side = ray.remote(ClientSide).options(num_cpus=0).remote(key, {}, (), True, 7)
    ray.get(side.keep.remote(key, 1, {3: "state"}, {}), timeout=RAY_TIMEOUT_S)
    newest = side.admit.remote(key, "evaluate", 1, {3: b"", 4: b""})
    assert ray.get(newest, timeout=RAY_TIMEOUT_S) == ({3: "state"}, [3, 4])
    with pytest.raises(PermissionError):
        ray.get(side.admit.remote(client_key(), "evaluate", 1, {3: b""}), timeout=RAY_TIMEOUT_S)
    with pytest.raises(PermissionError):
        ray.get(side.snapshot.remote(b"", 1), timeout=RAY_TIMEOUT_S)
    ray.kill(side)


def test_the_clients_side_judges_the_scores_and_a_restore_takes_its_judge_back():
    """The clients' side reads each evaluation against the truth and counts evaluations without
    a lower mean loss (patience 2, scores written out below). A snapshot after round 1 holds
    the judge as it was then: a restore (a lost server) takes the count back to it, and gives
    the driver the metrics judged up to round 1."""
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    side = ClientSide(key, {}, (), True, 7, None, Judge(np.array([0, 0, 1]), patience=2))

    def judged(round: int, losses: list[float]) -> dict:
        scores = [EvalReport(c, loss, 1 - loss / 4, 10) for c, loss in enumerate(losses)]
        side.keep_evaluations(key, round, scores[::-1])
        return side.judge(key, round)

    first = judged(1, [1.0, 2.0, 3.0])
    assert first["loss"] == 2.0 and first["accuracy_min"] == 0.25
    assert first["accuracy_cluster_0"] == 0.625 and first["accuracy_minority"] == 0.25
    assert "early_stopped" not in first
    blob = side.snapshot(key, 1)
    assert "early_stopped" not in judged(2, [2.0, 2.0, 2.0])  # no lower: one stale
    assert judged(3, [3.0, 3.0, 3.0])["early_stopped"] is True  # two
    assert side.restore(key, blob, 1) == {1: first}
    assert "early_stopped" not in judged(2, [2.0, 2.0, 2.0])  # one stale again
    assert [r.client_id for r in side.evaluations(key)] == [0, 1, 2]
    with pytest.raises(PermissionError):
        side.judge(b"", 2)
    side.keep_evaluations(key, 4, [EvalReport(0, 1.0, 0.5, 10), EvalReport(2, 1.0, 0.5, 10)])
    with pytest.raises(RuntimeError, match=r"round 4: .* \(clients \[1\] missing"):
        side.judge(key, 4)  # a server that had only the clients it chose scored


def test_the_clients_side_judges_the_runs_evaluation_cohort_only():
    """With training.eval_clients, the cohort drawn from the run's seed is judged: a server
    that has other clients of the same number scored is refused."""
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    cohort = np.array([1, 3])
    side = ClientSide(key, {}, (), True, 7, None, Judge(np.array([0, 0, 1, 1]), 2, cohort=cohort))
    side.keep_evaluations(key, 1, [EvalReport(c, 1.0, 0.5, 10) for c in (1, 3)])
    assert side.judge(key, 1)["evaluated_clients"] == 2
    side.keep_evaluations(key, 2, [EvalReport(c, 1.0, 0.5, 10) for c in (0, 3)])
    with pytest.raises(RuntimeError, match=r"round 2: .* \(clients \[1, 0\] missing"):
        side.judge(key, 2)


def test_a_snapshot_is_the_states_after_its_round_even_when_the_next_round_wrote():
    from raysim.engine.driver import read_snapshot
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    side = ClientSide(key, {}, (), True, 7)
    side.keep(key, 1, {0: "a1", 1: "b1"}, {})
    side.keep(key, 2, {0: "a2"}, {})  # round 2's workers wrote before round 1's snapshot came

    assert read_snapshot(side.snapshot(key, 1)).states == {0: "a1", 1: "b1"}
    assert side.admit(key, "evaluate", 2, {0: b"", 1: b""})[0] == {0: "a2", 1: "b1"}
    side.keep(key, 3, {0: "a3"}, {})
    assert read_snapshot(side.snapshot(key, 3)).states == {0: "a3", 1: "b1"}
    side.restore(key, side.snapshot(key, 3), 3)
    assert side.admit(key, "evaluate", 3, {0: b"", 1: b""})[0] == {0: "a3", 1: "b1"}


def test_the_secure_sums_need_every_members_input():
    import torch

    from raysim.privacy.modes.secure import SecureAggregator
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    spec = {"clip": 1.0, "std": 0.0, "share_cohort": None, "releases": 3}
    side = ClientSide(key, {}, (), True, 7, spec)
    vec = torch.tensor([0.6, 0.0])
    side.keep(key, 1, {}, {0: SecureContribution(0, vec), 1: SecureContribution(1, vec)})
    agg = SecureAggregator(2, 2, clip=1.0, std=0.0)
    sums = side.secure_sums(1, [0, 1], agg)
    assert torch.equal(sums.sums[0], vec) and torch.equal(sums.sums[1], vec)
    assert sums.counts == pytest.approx([1.0, 1.0])
    side.keep(key, 2, {}, {0: SecureContribution(0, vec)})
    with pytest.raises(RuntimeError, match=r"no secure input from clients \[1\]"):
        side.secure_sums(2, [0, 1], agg)


def test_the_clients_side_sums_with_its_own_noise_once_a_round_within_the_plan():
    """The server names the members and the shape only: an aggregator it built with no noise,
    a second sum of a round (two member sets differenced would give a client's input) and a
    sum past the planned number are refused or ignored."""
    import torch

    from raysim.privacy.modes.secure import SecureAggregator
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    spec = {"clip": 1.0, "std": 0.5, "share_cohort": None, "releases": 2}
    side = ClientSide(key, {}, (), True, 7, spec)
    vec = torch.tensor([0.6, 0.0])
    for r in (1, 2, 3):
        side.keep(key, r, {}, {0: SecureContribution(0, vec), 1: SecureContribution(0, vec)})
    noiseless = SecureAggregator(1, 2, clip=1.0, std=0.0)
    sums = side.secure_sums(1, [0], noiseless)
    residual = sums.sums[0].double() - vec.double()
    assert float(residual.abs().min()) > 1e-6  # noised: the server's std of 0 was not used
    side.keep(key, 1, {}, {1: SecureContribution(0, vec)})
    with pytest.raises(PermissionError, match="round 1: no secure sum .summed already"):
        side.secure_sums(1, [1], noiseless)
    side.secure_sums(2, [0, 1], noiseless)
    with pytest.raises(PermissionError, match="past the 2 planned"):
        side.secure_sums(3, [0, 1], noiseless)
    no_sums = ClientSide(key, {}, (), True, 7)
    with pytest.raises(PermissionError, match="releases no secure sum"):
        no_sums.secure_sums(1, [0], noiseless)


def test_a_round_run_again_is_summed_over_the_same_members_only():
    """A round's noise comes from the same stream each time it is summed: after a restart (or a
    resume), a sum over fewer members would, less the first, give a client's input without
    noise. The members summed are kept with a snapshot and through a restore, and a round summed
    again over the same members gives the same bits, within the plan's count."""
    import torch

    from raysim.privacy.modes.secure import SecureAggregator
    from raysim.runtime.client_side import ClientSide

    key = b"k" * 16
    spec = {"clip": 1.0, "std": 0.5, "share_cohort": None, "releases": 2}
    victim = torch.tensor([0.0, 0.8])

    def deposit(side: ClientSide, r: int) -> None:
        v = torch.tensor([0.6, 0.0])
        side.keep(key, r, {}, {0: SecureContribution(0, v), 1: SecureContribution(0, victim)})

    agg = SecureAggregator(1, 2, clip=1.0, std=0.0)
    side = ClientSide(key, {}, (), True, 7, spec)
    for r in (1, 2):
        deposit(side, r)
    first = side.secure_sums(1, [0, 1], agg)
    blob = side.snapshot(key, 1)
    second = side.secure_sums(2, [0, 1], agg)
    side.restore(key, blob, 1)  # a lost coordinator: round 2 runs again
    deposit(side, 2)
    with pytest.raises(PermissionError, match="round 2: no secure sum .summed already, over other"):
        side.secure_sums(2, [0], agg)
    again = side.secure_sums(2, [1, 0], agg)  # the same members: the same bits, no new release
    assert torch.equal(again.sums[0], second.sums[0]) and again.counts == second.counts
    resumed = ClientSide(key, {}, (), True, 7, spec)  # a resumed run's, from the snapshot
    resumed.restore(key, blob, 1)
    deposit(resumed, 1)
    with pytest.raises(PermissionError, match="round 1: no secure sum .summed already"):
        resumed.secure_sums(1, [0], agg)
    assert torch.equal(resumed.secure_sums(1, [0, 1], agg).sums[0], first.sums[0])
    for r in (2, 3):
        deposit(resumed, r)
    resumed.secure_sums(2, [0, 1], agg)  # the snapshot's round 1, and this one: the plan's 2
    with pytest.raises(PermissionError, match="past the 2 planned"):
        resumed.secure_sums(3, [0, 1], agg)


def test_a_secure_sum_in_the_sketch_round_is_charged_too():
    """The sketch round's plan charges the sketch; a secure sum released in that round as well
    (PINA plans none there) is charged on top, never in its place."""
    import torch

    from raysim.protocol import RoundPlan

    prep = _prep(algorithm=PINA)
    algo, mode = prep.algorithm, prep.mode
    r = mode.needs.local_round
    assert [c.mechanism for c in mode.planned_charges(r, [0], [])] == ["local_gaussian_sketch"]
    contribution = SecureContribution(0, torch.zeros(8))
    plan = RoundPlan([], [torch.zeros(8)], round=r)
    report = ClientReport(0, contribution=contribution)
    mode.admit(algo.name, plan, [report], np.random.default_rng(0))
    assert [c.mechanism for c in mode.charges(r, [report])] == ["secure_gaussian"]


def test_kmeans_cfl_sketch_keeps_each_clients_stage1_cluster_and_weighs_no_normality():
    """The k-means-on-sketches baseline: every client trains, each round, in the slot its
    k-means label gave it (no loss-based re-selection), and every cluster's step has weight 1
    (the normality statistics are still reported, as diagnostics)."""
    from algorithms.pina import KMeansSketchCFL

    cfg = for_algorithm(load_config(None, [*TINY_PINA, "algorithm.name=kmeans_cfl_sketch"]))
    prep = prepare(cfg, KMeansSketchCFL, Environment)
    loop = inline_loop(prep)
    rows = [loop.step() for _ in range(cfg.rounds)]
    labels = loop.state.labels
    assert labels is not None and len(set(labels.tolist())) == 2
    slots = {c: s["slot"] for c, s in loop.client_states.items() if "slot" in s}
    assert slots and all(slots[c] == labels[c] for c in slots)
    weights = [v for row in rows for k, v in row.items() if k.startswith("weight_")]
    assert weights and all(w == 1.0 for w in weights)


def test_without_ray_a_checkpoint_carries_the_clients_states_too(tmp_path):
    from raysim.state.checkpoint import load_checkpoint, split_checkpoint

    whole = run_inline(_prep(algorithm=PINA))["history"]

    def die_after_round_2(row):
        if row["round"] == 2:
            raise DriverDied

    with pytest.raises(DriverDied):
        run_inline(_prep(algorithm=PINA), on_round=die_after_round_2, out_dir=tmp_path)
    blob = load_checkpoint(tmp_path)
    assert split_checkpoint(blob)[1] is not None  # the clients' part beside the loop's
    again = run_inline(_prep(algorithm=PINA), resume=blob)["history"]
    strip = [{k: v for k, v in r.items() if k != "round_seconds"} for r in whole]
    assert [{k: v for k, v in r.items() if k != "round_seconds"} for r in again] == strip


def test_a_checkpoint_of_the_servers_clients_continues_with_them_apart():
    """A plain checkpoint (the clients' states in the round loop's, as a trusted server keeps
    them; ``sample`` before it kept its clients apart) continues with the states moved to the
    clients' part and the run's seed, which its clients drew from."""
    from raysim.engine.rounds import CHECKPOINT_FIELDS
    from raysim.state.checkpoint import (
        clients_seed_of,
        decode_state,
        encode_state,
        join_checkpoint,
        kept_apart,
        split_checkpoint,
    )

    snap = dict.fromkeys(CHECKPOINT_FIELDS) | {"round": 3, "client_states": {0: "s0", 2: "s2"}}
    snap["judge"] = Judge(np.zeros(3), patience=2, best_loss=0.5, stale=1)
    blob = kept_apart(join_checkpoint(encode_state(snap), None, None, 3, "seed: 0\n"), run_seed=5)
    loop_blob, clients_blob, seed = split_checkpoint(blob)
    loop = decode_state(loop_blob)
    assert "judge" not in loop and loop == {k: v for k, v in snap.items() if k != "judge"} | {
        "client_states": {}
    }
    clients = read_snapshot(clients_blob)
    assert clients.states == {0: "s0", 2: "s2"}
    assert (clients.judge.best_loss, clients.judge.stale) == (0.5, 1)
    assert seed == 5 == clients_seed_of(blob, 5)
    assert kept_apart(blob, run_seed=9) is blob  # already apart: as it is


def test_the_clients_process_ends_quietly_when_the_server_stopped_mid_round(monkeypatch):
    """`kill` of an inline run's process (or a Ctrl-C it takes longer than its wait to finish)
    leaves the clients' process in a round: its reply then meets a closed pipe, and it ends
    without a traceback of its own (the run's status says it was interrupted)."""
    import multiprocessing

    from raysim.runtime import client_side

    server, clients = multiprocessing.Pipe()

    class Working:  # the round the clients' process is in when the server goes
        def __init__(self, *args, **kwargs) -> None:
            self.device = "cpu"

        def run(self, *args):
            server.close()
            return []

    monkeypatch.setattr("raysim.runtime.worker.ClientWorker", Working)
    server.send(("run", ("train", 1, None, [])))
    ctrl_c = signal.getsignal(signal.SIGINT)
    try:
        assert client_side._serve_clients(clients, b"key", (), False, 0, None, None) is None
    finally:
        signal.signal(signal.SIGINT, ctrl_c)
