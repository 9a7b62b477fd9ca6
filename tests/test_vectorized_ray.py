"""Vectorized groups through the engine: the same bits for 1, 2 and 3 workers (groups are cut
from the cohort, never from the shards), in fresh actors and in actors kept from the run before."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.engine.rounds import client_groups
from raysim.protocol import ClientTask
from raysim.runtime import reuse
from raysim.runtime.pool import MIN_PIECE_WEIGHT, cut_pieces
from raysim.runtime.run import run_prepared


def _run(tmp_path, name, **overrides):
    cfg = load_config(None, small_config(**overrides))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    x_before = prep.dataset.client_train(0)[0].copy()
    run_prepared(prep, tmp_path / name)
    # the driver read the object store during the run; afterwards it holds a private copy again
    assert np.array_equal(prep.dataset.client_train(0)[0], x_before)
    table = pq.read_table(tmp_path / name / "metrics.parquet").to_pandas()
    return table.drop(columns=["round_seconds"])


SEEDED = ("fedavg", 3)


@pytest.mark.parametrize(
    ("algorithm", "mode", "group"),
    [
        ("fedavg", "sample", 3),  # groups of 3, 3, 2 clients: padding and a short group
        # local under none: worker-count invariance is test_runtime's too (run with -m slow)
        pytest.param("local", "none", 3, marks=pytest.mark.slow),
        ("ifca", "sample", 3),
        ("fedavg", "sample", 1),  # groups of one: DP-SGD's per-sample gradients by layer rules
    ],
)
def test_one_two_three_workers_identical(ray_session, tmp_path, algorithm, mode, group):
    common = {
        "algorithm.name": algorithm,
        "privacy.mode": mode,
        "runtime.client_group_size": group,
        "training.sampling_rate": 0.9,
        "training.sampling": "without_replacement",
        "data.samples_per_client": 40,
        "runtime.cpus_per_worker": 0.5,  # 3 workers on the 2-CPU test Ray
        "runtime.eval_group_size": 3,  # evaluation groups of 3, 3, 2 clients, shared passes
    }
    # as `raysim compare` runs them: each run renews the actors the last one left that fit it
    # (raysim.runtime.reuse), so the first run's are fresh and the others' partly kept
    with reuse.kept_actors():
        runs = [_run(tmp_path, f"w{w}", **common, **{"runtime.num_workers": w}) for w in (1, 2, 3)]
        # the coordinator trains shard 0 itself by default; every shard on its own actor instead:
        apart = _run(tmp_path, "apart", **common, **{"runtime.coordinator_trains": False})
        # that another seed gives other bits (the comparison can fail): once, not per case
        other = _run(tmp_path, "seed1", **common, seed=1) if (algorithm, group) == SEEDED else None
    assert runs[0].equals(runs[1]) and runs[0].equals(runs[2]), runs
    assert runs[0].equals(apart), (runs[0], apart)
    assert other is None or not runs[0].equals(other)


def test_groups_are_cut_from_client_ids_and_pieces_keep_them_whole():
    tasks = [ClientTask(c, weight=w) for c, w in zip([7, 2, 9, 4, 1], [5, 1, 1, 8, 2], strict=True)]
    groups = client_groups(tasks, 2)
    assert [[t.client_id for t in g] for g in groups] == [[1, 2], [4, 7], [9]]
    for n in (1, 2, 3):
        pieces = cut_pieces(groups, n)
        got = sorted(tuple(t.client_id for t in g) for p in pieces for g in p)
        assert got == [(1, 2), (4, 7), (9,)]
    ids = [[t.client_id for g in p for t in g] for p in cut_pieces(groups, 2)]
    assert ids == [[4, 7], [1, 2, 9]]
    # a round lighter than the floor (unit weights) still splits between the workers
    light = [[ClientTask(c)] for c in range(6)]
    assert [len(p) for p in cut_pieces(light, 3)] == [2, 2, 2]


def test_pieces_shrink_to_the_floor_as_the_round_goes_on():
    """A W round: 100 clients of 60 samples on 2 workers. Each piece is 1/4 of what is left
    (rounded up to whole clients), down to the floor, so the round ends on small pieces."""
    groups = [[ClientTask(c, weight=60)] for c in range(100)]
    sizes = [sum(t.weight for g in p for t in g) // 60 for p in cut_pieces(groups, 2)]
    assert sizes == [25, 19, 14, 11, 8, 6, 5, 3, 3, 3, 3]
    assert sum(sizes) == 100
    # never a piece below the floor but the last one
    pieces = cut_pieces([[ClientTask(c, weight=6)] for c in range(100)], 2)
    assert all(sum(t.weight for g in p for t in g) >= MIN_PIECE_WEIGHT for p in pieces[:-1])
