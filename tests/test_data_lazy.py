"""Lazy populations (``runtime.population``): each client's rows made from (seed, client) alone,
the very rows the table holds; per-client draws; and what a population-scale run reads."""

from __future__ import annotations

import statistics
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import inline_run

from raysim.config import DataConfig
from raysim.data import FederatedDataset, LazyPopulation, build_population
from raysim.data.partition import split_train_test
from raysim.data.seeding import rng_for

CASES = {
    "fits, rotation": dict(
        dataset="digits", num_clients=30, cluster_sizes=[10, 20], shift="rotation"
    ),
    "fits, public slice, label flip": dict(
        dataset="fmnist",
        num_clients=300,
        samples_per_client=70,
        cluster_sizes=[100, 200],
        shift="label_flip",
        public_pretrain_samples=1000,
    ),
    "shared samples, rotation": dict(
        dataset="digits",
        num_clients=700,
        samples_per_client=9,
        cluster_sizes=[300, 200, 200],
        shift="rotation",
    ),
}


def both(kw: dict, seed: int = 3) -> tuple[FederatedDataset, LazyPopulation]:
    cfg = DataConfig(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shared samples: said, and tested below
        table, lazy = build_population(cfg, seed, "table"), build_population(cfg, seed, "lazy")
    assert isinstance(table, FederatedDataset) and isinstance(lazy, LazyPopulation)
    return table, lazy


@pytest.mark.parametrize("case", CASES)
def test_a_lazy_client_has_the_tables_rows(case: str) -> None:
    table, lazy = both(CASES[case])
    assert np.array_equal(table.true_cluster, lazy.true_cluster)
    assert np.array_equal(table.train_sizes, lazy.train_sizes)
    assert np.array_equal(table.test_sizes, lazy.test_sizes)
    assert table.meta["shared_samples"] == lazy.meta["shared_samples"]
    for i in range(table.num_clients):
        assert np.array_equal(table.client_source_index(i), lazy.client_source_index(i))
        for a, b in zip(
            table.client_train(i) + table.client_test(i),
            lazy.client_train(i) + lazy.client_test(i),
            strict=True,
        ):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a, b)
        assert np.array_equal(table.client_pixels(i), lazy.client_pixels(i))


def test_shared_samples_are_said_and_recorded() -> None:
    cfg = DataConfig(**CASES["shared samples, rotation"])
    with pytest.warns(UserWarning, match="reused across clients"):
        lazy = build_population(cfg, 0, "auto")
    assert isinstance(lazy, LazyPopulation) and lazy.meta["shared_samples"]
    rows = lazy.client_source_index(5)
    assert len(np.unique(rows)) == len(rows)  # distinct within a client


def test_auto_keeps_the_table_where_the_clients_fit_the_pool() -> None:
    cfg = DataConfig(**CASES["fits, rotation"])
    assert isinstance(build_population(cfg, 0, "auto"), FederatedDataset)


def test_a_clients_rows_do_not_depend_on_the_population_size() -> None:
    """Per-client draws: where clients share the pool, client i's rows are its own draw."""
    kw = dict(dataset="digits", samples_per_client=9, shift="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = build_population(DataConfig(num_clients=500, **kw), 1, "lazy")
        large = build_population(DataConfig(num_clients=50_000, **kw), 1, "lazy")
    for i in (0, 7, 499):
        assert np.array_equal(small.client_source_index(i), large.client_source_index(i))


def test_a_lazy_population_grows_by_its_true_cluster_only() -> None:
    """Memory independent of the clients but for one int64 a client (its true cluster)."""
    kw = dict(dataset="digits", samples_per_client=5, shift="rotation")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sizes = {
            n: build_population(DataConfig(num_clients=n, **kw), 0, "lazy").nbytes
            for n in (10_000, 1_000_000)
        }
    assert sizes[1_000_000] - sizes[10_000] == 8 * (1_000_000 - 10_000)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(dataset="digits", num_clients=20, dirichlet_alpha=0.5), "data.dirichlet_alpha"),
        (dict(dataset="synthetic_linear", num_clients=20), "synthetic_linear"),
        (dict(dataset="digits", num_clients=20, draws="sequential"), "data.draws=sequential"),
    ],
)
def test_lazy_is_refused_where_clients_are_drawn_together(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"runtime.population=lazy: {field}"):
        build_population(DataConfig(**kw), 0, "lazy")
    assert isinstance(build_population(DataConfig(**kw), 0, "auto"), FederatedDataset)


def test_sequential_draws_are_the_earlier_populations() -> None:
    """``data.draws: sequential``: one split generator, client after client, as before."""
    cfg = DataConfig(dataset="digits", num_clients=12, shift="none", draws="sequential")
    fd = build_population(cfg, 4, "table")
    alloc = rng_for(4, "allocate").permutation(1797)[: 12 * 149].reshape(12, 149)
    rows, offsets, _ = split_train_test(list(alloc), 0.8, rng_for(4, "split"))
    got = np.concatenate([fd.client_source_index(i) for i in range(12)])
    assert np.array_equal(got, rows)
    per_client = build_population(cfg.model_copy(update={"draws": "per_client"}), 4, "table")
    assert not np.array_equal(per_client.client_source_index(0), fd.client_source_index(0))


# ------------------------------------------------------------------- population-scale reading


def test_ledger_summary_and_epsilons_read_distinct_histories() -> None:
    """Against the brute force over every client (statistics.median of each one's epsilon)."""
    from dp_accounting import dp_event

    from raysim.privacy.ledger import PrivacyLedger

    rng = np.random.default_rng(0)
    ledger = PrivacyLedger(delta=1e-5, num_clients=50)
    for r in range(1, 6):
        clients = rng.choice(50, size=int(rng.integers(1, 20)), replace=False).tolist()
        event = dp_event.GaussianDpEvent(float(rng.choice([1.0, 2.0])))
        ledger.charge(r, clients, "gaussian", event)
    each = [ledger.epsilon(c) for c in range(50)]
    s = ledger.summary()
    assert s["max_epsilon"] == max(each)
    assert s["median_epsilon"] == statistics.median(each)
    assert s["clients"] == 50
    assert np.array_equal(ledger.epsilons(), np.array(each))


@pytest.mark.parametrize(
    "privacy",
    [
        {"privacy.mode": "none", "privacy.epsilon": "null"},
        # an untrusted server: the clients' side judges, and checks the cohort is the run's
        {"privacy.mode": "distributed", "privacy.epsilon": 8, "privacy.delta": 1e-3},
    ],
)
def test_an_evaluation_cohort_is_judged_with_its_interval(tmp_path, privacy: dict) -> None:
    """``training.eval_clients``: the same sampled clients judged each time, the accuracy with
    its 95% interval, and only they have an accuracy in clients.parquet."""
    metrics = inline_run(
        tmp_path,
        {
            **privacy,
            "data.num_clients": 20,
            "data.cluster_sizes": "[10, 10]",
            "model.name": "linear",
            "training.eval_clients": 6,
        },
    )
    last = metrics.iloc[-1]
    assert last["evaluated_clients"] == 6
    assert 0 < last["accuracy_ci95"] < 1
    clients = pq.read_table(tmp_path / "clients.parquet").to_pandas()
    judged = clients["accuracy"].notna()
    assert judged.sum() == 6
    assert np.isclose(clients.loc[judged, "accuracy"].mean(), last["accuracy"])


def test_a_shipped_config_runs_to_the_same_bits_from_a_table_and_lazily(ray_session, tmp_path):
    """configs/bench_w.yaml (workload W), shortened: its table population in this process and
    its lazy population on Ray's workers write the same metrics and clients, bit for bit."""
    from algorithms import Environment, get_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.runtime.inline import run_inline
    from raysim.runtime.run import run_prepared

    shipped = Path(__file__).parents[1] / "configs" / "bench_w.yaml"
    sets = ["rounds=2", "data.num_clients=300", "training.eval_clients=40"]

    def run(population: str, out: Path, **session) -> dict:
        cfg = load_config(shipped, [*sets, f"runtime.population={population}"])
        prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
        assert type(prep.dataset).__name__ == kinds[population]
        run_prepared(prep, out, **session)
        tables = {
            n: pq.read_table(out / f"{n}.parquet").to_pandas() for n in ("metrics", "clients")
        }
        tables["metrics"] = tables["metrics"].drop(columns="round_seconds")
        return tables

    kinds = {"table": "FederatedDataset", "lazy": "LazyPopulation"}
    table = run("table", tmp_path / "table", session=run_inline)
    lazy = run("lazy", tmp_path / "lazy")
    for name in table:
        assert table[name].equals(lazy[name]), name
