"""Vectorized groups through the engine: the same bits for 1, 2 and 3 workers (groups are cut
from the cohort, never from the shards)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.experiment import prepare, run_prepared
from raysim.protocol import ClientTask
from raysim.rounds import client_groups
from raysim.runtime.pool import balance_groups


def _run(tmp_path, name, **overrides):
    cfg = load_config(None, small_config(**overrides))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    x_before = prep.dataset.client_train(0)[0].copy()
    run_prepared(prep, tmp_path / name)
    # the driver read the object store during the run; afterwards it holds a private copy again
    assert np.array_equal(prep.dataset.client_train(0)[0], x_before)
    table = pq.read_table(tmp_path / name / "metrics.parquet").to_pandas()
    return table.drop(columns=["round_seconds"])


@pytest.mark.parametrize(
    ("algorithm", "mode", "group"),
    [
        ("fedavg", "sample", 3),  # groups of 3, 3, 2 clients: padding and a short group
        ("local", "none", 3),
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
    }
    runs = [_run(tmp_path, f"w{w}", **common, **{"runtime.num_workers": w}) for w in (1, 2, 3)]
    assert runs[0].equals(runs[1]) and runs[0].equals(runs[2]), runs
    # the coordinator trains shard 0 itself by default; every shard on its own actor instead:
    apart = _run(tmp_path, "apart", **common, **{"runtime.coordinator_trains": False})
    assert runs[0].equals(apart), (runs[0], apart)
    other = _run(tmp_path, "seed1", **common, seed=1)
    assert not runs[0].equals(other)


def test_groups_are_cut_from_client_ids_and_shards_keep_them_whole():
    tasks = [ClientTask(c, weight=w) for c, w in zip([7, 2, 9, 4, 1], [5, 1, 1, 8, 2], strict=True)]
    groups = client_groups(tasks, 2)
    assert [[t.client_id for t in g] for g in groups] == [[1, 2], [4, 7], [9]]
    for n in (1, 2, 3):
        shards = balance_groups(groups, n)
        got = sorted(tuple(t.client_id for t in g) for s in shards for g in s)
        assert got == [(1, 2), (4, 7), (9,)]
    loads = sorted(sum(t.weight for g in s for t in g) for s in balance_groups(groups, 2))
    assert loads == [4, 13]
