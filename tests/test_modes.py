"""The trust boundary (raysim.privacy.modes): the mode registry, charges derived from what was
released against the calibrated plan, the run-time refusal of unsanitized reports, the secure sum,
and the one round loop run in-process and on Ray."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import RAY_TIMEOUT_S, mode_of, small_config

from algorithms import Environment, get_algorithm
from algorithms.fedavg import FedAvg
from raysim.compose import for_algorithm, prepare_named
from raysim.config import PRIVACY_MODES, ConfigError, load_config
from raysim.engine.experiment import prepare
from raysim.metrics.results import write_results
from raysim.privacy import PrivacyLedger
from raysim.privacy.modes import MODES, TrustBoundaryError
from raysim.privacy.modes.secure import COUNT_WEIGHT, SecureAggregator, client_noise_share
from raysim.protocol import ClientReport, HiddenData, RoundPlan, SecureContribution, SecureSums
from raysim.runtime.inline import inline_loop, run_inline
from raysim.runtime.run import run_prepared

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "rounds=2",
    "data.dataset=digits",
    "data.num_clients=12",
    "data.cluster_sizes=[6,6]",
    "model.name=linear",
    "training.batch_size=16",
    "runtime.progress=false",
    "algorithm.num_clusters=2",
]


def prep_for(*sets: str):
    cfg = for_algorithm(load_config(None, TINY + list(sets)))
    return prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)


# --------------------------------------------------------------------------------- registry


def test_every_configurable_mode_is_registered_and_named_alike():
    assert set(MODES) == set(PRIVACY_MODES)
    for name, cls in MODES.items():
        assert cls.name == name
    assert not MODES["distributed"].trusted_server and not MODES["dprivacy"].trusted_server
    plain = MODES["none"].view  # the exact aggregations; client noises, distributed sums apart
    assert MODES["client"].view is not plain and MODES["distributed"].view is not plain


def test_an_algorithm_refuses_a_mode_it_does_not_support():
    from raysim.config import ConfigError

    # per-round k-means on individual updates cannot run behind secure aggregation
    with pytest.raises(ConfigError, match="privacy.mode: algorithm 'kmeans_cfl' does not support"):
        prep_for(
            "algorithm.name=kmeans_cfl", "privacy.mode=distributed", "privacy.noise_cohort_size=5"
        )


# ------------------------------------------------------------- charges from what was released


def shipped_configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml")) + [ROOT / "raysim" / "demo.yaml"]


def replayed_rows(prep) -> tuple[list, list]:
    """Run two rounds; return the ledger rows charged from releases, and the rows of a ledger
    charged from the calibrated plan for the same participants and choices."""
    loop = inline_loop(prep)
    seen: list[list] = []
    execute = loop.execute

    def recording(kind, round, models, tasks):
        if kind == "train":
            seen.append(copy.copy(tasks))
        return execute(kind, round, models, tasks)

    loop.execute = recording
    for _ in range(prep.cfg.rounds):
        loop.step()
    p, algo = prep.cfg.privacy, prep.algorithm
    plan = PrivacyLedger(delta=p.delta, accountant=p.accountant, num_clients=loop.num_clients)
    for r, tasks in enumerate(seen, start=1):
        ids = sorted(t.client_id for t in tasks)
        selecting = [
            t.client_id for t in sorted(tasks, key=lambda t: t.client_id) if t.extra.get("select")
        ]
        for ch in mode_of(algo).planned_charges(r, ids, selecting):
            plan.charge(r, ch.clients, ch.mechanism, ch.event, ch.params)

    def key(row):
        return (row["round"], row["mechanism"], -1 if row["client"] is None else row["client"])

    return sorted(loop.ledger.rows(), key=key), sorted(plan.rows(), key=key)


# What data.samples_per_client=None divides among the clients: train and test files pooled.
POOLED_IMAGES = {"cifar10": 60_000, "fmnist": 70_000, "mnist": 70_000}


def installed(data) -> bool:
    """Whether an image dataset's files are on this machine (looked up; no download tried)."""
    from raysim.data import sources

    if data.dataset == "cifar10":
        try:
            sources._cifar_dir(data.root)  # the loader's own lookup
        except sources.DataNotFoundError:
            return False
        return True
    if data.dataset in ("fmnist", "mnist"):
        dirs = [data.root] if data.root is not None else sources.SEARCH_DIRS[data.dataset]
        return any(sources.find_idx_files(d, data.dataset) for d in dirs)
    return True  # digits and the synthetic data come with the code


def stand_in(data) -> list[str]:
    """Overrides putting synthetic data in place of a missing image dataset: the same clients,
    clusters and per-client sizes, all that the privacy schedule reads of the data (when this
    was written, every image config found here gave the same ledgers on either)."""
    from raysim.data.partition import resolve_samples_per_client

    pool = POOLED_IMAGES[data.dataset] - data.public_pretrain_samples
    n = resolve_samples_per_client(pool, data.num_clients, data.samples_per_client)
    return [
        "data.dataset=synthetic_linear",
        f"data.samples_per_client={n}",
        "data.public_pretrain_samples=0",  # it only shrank the pool, counted in n
        "data.dirichlet_alpha=null",  # equal sizes either way; synthetic data has no labels
    ]


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.stem)
def test_charges_from_releases_equal_the_plan_on_every_shipped_config(path):
    """Each shipped config, cut to two rounds and a linear model (the privacy schedule does not
    depend on the model) and, for the heavy ones, with fewer samples; an image dataset not
    installed here (CIFAR-10 never is) is replaced by synthetic data of the same sizes."""
    cfg = load_config(path)
    # two rounds, or the fewest the algorithm runs (PINA: stage 1, initialisation, one more)
    rounds = 6 if cfg.algorithm.name in ("pina", "kmeans_cfl_sketch") else 2
    # the whole model section: a linear model takes none of the others' keys (rank, patch, ...)
    sets = [f"rounds={rounds}", "model={name: linear}", "runtime.progress=false"]
    if cfg.data.dataset in ("fmnist", "mnist") and cfg.data.num_clients <= 50:
        sets.append("data.samples_per_client=200")
    data = load_config(path, sets).data
    if not installed(data):
        sets += stand_in(data)
    cfg = for_algorithm(load_config(path, sets))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    released, planned = replayed_rows(prep)
    if cfg.privacy.mode in ("none", "dprivacy"):  # nothing for dp_accounting (dprivacy: metric
        assert released == planned == []  # leakage, in its own ledger)
        return
    assert len(released) == len(planned) > 0
    for a, b in zip(released, planned, strict=True):
        assert (a["client"], a["round"], a["mechanism"]) == (
            b["client"],
            b["round"],
            b["mechanism"],
        )
        assert json.loads(a["params"]) == json.loads(b["params"])
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-9)


@pytest.mark.parametrize(
    "sets",
    [
        ("algorithm.name=ifca", "privacy.mode=sample", "privacy.delta=1e-3"),
        (
            "algorithm.name=fedavg",
            "privacy.mode=client",
            "privacy.delta=0.01",
            "training.sampling_rate=0.5",
        ),
        (
            "algorithm.name=rr_cluster",
            "privacy.mode=client",
            "privacy.delta=0.01",
            "training.sampling_rate=0.5",
            "training.sampling=without_replacement",
            "algorithm.B=1",
            "algorithm.base=fedcam",
        ),
        ("algorithm.name=ifca", "privacy.mode=distributed", "privacy.noise_cohort_size=6"),
    ],
    ids=["ifca-sample", "fedavg-client", "rr-fedcam-client", "ifca-distributed"],
)
def test_charges_from_releases_equal_the_plan_per_mode(sets):
    released, planned = replayed_rows(prep_for(*sets))
    assert [r["epsilon"] for r in released] == pytest.approx([r["epsilon"] for r in planned])
    assert [r["mechanism"] for r in released] == [r["mechanism"] for r in planned]


# -------------------------------------------------------------------- refusing raw reports


class LeakyFedAvg(FedAvg):
    """A broken algorithm: sends the raw update (and its loss) whatever the mode."""

    name = "leaky"

    def client_step(self, task, ctx):
        x, y = ctx.train_data()
        res = ctx.trainer.train(ctx.models[0], x, y, task.train, ctx.generator("train"))
        return ClientReport(task.client_id, res.update, res.num_samples, 0, res.train_loss)


@pytest.mark.parametrize(
    "mode",
    [("privacy.mode=distributed", "privacy.noise_cohort_size=6"), ("privacy.mode=dprivacy",)],
)
def test_an_unsanitized_report_is_refused_naming_algorithm_and_field(mode):
    cfg = load_config(None, TINY + ["algorithm.name=fedavg", *mode])
    prep = prepare(cfg, LeakyFedAvg, Environment)
    loop = inline_loop(prep)
    with pytest.raises(TrustBoundaryError, match="algorithm 'leaky': report field 'update'"):
        loop.step()
    # the honest algorithm passes the same boundary
    inline_loop(prep_for("algorithm.name=fedavg", *mode)).step()


class SmugglingFedAvg(FedAvg):
    """A broken algorithm: sanitizes its update but slips the raw one into ``extra``."""

    name = "smuggling"

    def client_step(self, task, ctx):
        x, y = ctx.train_data()
        report = super().client_step(task, ctx)
        res = ctx.trainer.train(ctx.models[0], x, y, task.train, ctx.generator("train"))
        report.extra["raw"] = res.update
        return report


def test_dprivacy_refuses_anything_but_flags_in_extra():
    prep = prepare(
        load_config(None, TINY + ["privacy.mode=dprivacy"]), SmugglingFedAvg, Environment
    )
    with pytest.raises(TrustBoundaryError, match="algorithm 'smuggling': report field 'extra'"):
        inline_loop(prep).step()


def test_dprivacy_sends_sanitized_vectors_with_exact_leakage():
    prep = prep_for("algorithm.name=ifca", "privacy.mode=dprivacy", "privacy.nu=5")
    res = run_inline(prep)
    dim = prep.env.init_weights.numel()
    rows = res["metric_ledger_rows"]
    assert rows and all(r["leakage"] == pytest.approx(dim / 5) for r in rows)
    per_client = np.bincount([r["client"] for r in rows], minlength=12)
    assert res["client_leakage"] == pytest.approx(list(per_client * dim / 5))
    assert res["ledger_rows"] == []  # metric DP is not a dp_accounting event


def test_leakage_cap_makes_a_client_skip_the_round():
    dim_leak = 650 / 5  # linear on digits: 64 * 10 + 10 parameters, nu = 5
    prep = prep_for(
        "algorithm.name=fedavg",
        "privacy.mode=dprivacy",
        "privacy.nu=5",
        f"privacy.leakage_cap={1.5 * dim_leak}",
    )
    res = run_inline(prep)
    assert max(res["client_leakage"]) <= 1.5 * dim_leak
    assert res["history"][1]["skipped_over_cap"] == 12 and res["history"][1]["participants"] == 0


# --------------------------------------------------------------------------- secure sums


def contributions(vectors: list[np.ndarray], slots: list[int]) -> list[SecureContribution]:
    return [
        SecureContribution(s, torch.tensor(v, dtype=torch.float32))
        for v, s in zip(vectors, slots, strict=True)
    ]


def test_server_output_depends_only_on_the_slot_sums():
    """Under distributed DP the server step cannot see individual updates: changing them while
    keeping every slot's sum leaves its output bit-identical (dyadic values: exact sums)."""
    prep = prep_for(
        "algorithm.name=ifca",
        "privacy.mode=distributed",
        "privacy.noise_cohort_size=6",
        "privacy.clip=100",
    )
    algo = prep.algorithm
    state = algo.init_state(np.random.default_rng(0))
    plan = RoundPlan([], state.models, round=1)
    dim = state.models[0].numel()
    g = np.random.default_rng(1)
    a = [np.round(g.normal(size=dim) * 8) / 64 for _ in range(4)]
    shift = np.round(g.normal(size=dim) * 8) / 64
    b = [a[0] + shift, a[1] - shift, a[2] - shift, a[3] + shift]  # same sum in each slot
    outs = []
    for vectors in (a, b):
        reports = [ClientReport(c) for c in range(4)]
        for r, con in zip(reports, contributions(vectors, [0, 0, 1, 1]), strict=True):
            r.contribution = con
        view = mode_of(algo).admit(algo.name, plan, reports, np.random.default_rng(7))
        assert view.sums is not None  # the server's view: the slot sums alone
        outs.append(algo.server_step(state, plan, view, np.random.default_rng(3)).state.models)
    assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _summed_shares(members: int, dim: int, std: float, share_cohort: float) -> SecureSums:
    """The secure sum of ``members`` zero vectors whose noise shares were sized for
    ``share_cohort`` members, the aggregator drawing any shortfall."""
    shares = [
        SecureContribution(
            0,
            torch.zeros(dim),
            client_noise_share(1, dim, std, share_cohort, np.random.default_rng(c)),
        )
        for c in range(members)
    ]
    agg = SecureAggregator(1, dim, clip=1.0, std=std, share_cohort=share_cohort)
    return agg.aggregate(shares, np.random.default_rng(10_000))  # not a share's seed


@pytest.mark.parametrize("members", [50, 10])
def test_client_noise_shares_and_a_server_draw_have_the_same_std(members):
    """Shares drawn for an expected cohort of 50: with 50 members they add up to the calibrated
    std, with 10 (a small round) the aggregator adds what 40 missing shares would have."""
    dim, std, cohort = 100_000, 0.7, 50
    agg = SecureAggregator(1, dim, clip=1.0, std=std)
    zero = [SecureContribution(0, torch.zeros(dim)) for _ in range(members)]
    server = agg.aggregate(zero, np.random.default_rng(0))
    clients = _summed_shares(members, dim, std, cohort)
    for sums in (server, clients):
        assert float(sums.sums[0].double().std()) == pytest.approx(std, rel=0.02)
        # the count: the members, noised at std / (COUNT_WEIGHT * clip)
        assert abs(sums.counts[0] - members) < 6 * std / COUNT_WEIGHT


@pytest.mark.parametrize(("members", "std_ratio"), [(40, (40 / 25) ** 0.5), (10, 1.0)])
def test_shares_sized_for_the_survivors_are_never_less_noisy_than_calibrated(members, std_ratio):
    """privacy.dropout_tolerance 0.5 of an expected cohort of 50: each share is N(0, std^2/25).
    40 members add up to std * sqrt(40/25) (more than calibrated, nothing added); 10 members
    lack what 15 shares would carry, and the aggregator adds exactly that."""
    sums = _summed_shares(members, 100_000, 0.7, 25.0)
    assert float(sums.sums[0].double().std()) == pytest.approx(0.7 * std_ratio, rel=0.02)


def test_distributed_calibration_and_noise_cohort_scaling():
    """z from dp_accounting for q = noise_cohort / population (the PINA setup's numbers), and the
    real cohort's noise std scaled by m / noise_cohort."""
    sets = [
        "algorithm.name=fedavg",
        "privacy.mode=distributed",
        "data.num_clients=12",
        "privacy.population=1000000",
        "privacy.noise_cohort_size=10000",
        "privacy.epsilon=2",
        "rounds=100",
        "privacy.clip=1",
        "training.sampling_rate=0.5",
    ]
    prep = prep_for(*sets)
    mode = prep.mode
    assert prep.cfg.privacy.delta == pytest.approx(1e6**-1.1)
    assert mode.plan.noise == pytest.approx(0.933, rel=5e-3)
    assert mode.std == pytest.approx(
        mode.plan.noise * math.sqrt(1 + COUNT_WEIGHT**2) * 6 / 10000, rel=1e-12
    )
    assert "noise-cohort" in mode.summary()["caveat"]


def test_distributed_noise_is_sized_for_the_real_cohort_by_default():
    """With the population simulated in full and no privacy.noise_cohort_size, the accountant's
    rate is the real sampling rate and the sum's noise is z * S (no cohort scaling): the
    epsilon, checked with dp_accounting directly, is the run's own; no convention caveat. A
    population beyond the simulated clients keeps the convention's 10,000."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    sets = [
        "algorithm.name=fedavg",
        "privacy.mode=distributed",
        "data.num_clients=12",
        "privacy.epsilon=2",
        "rounds=100",
        "privacy.clip=1",
        "training.sampling_rate=0.5",
    ]
    mode = prep_for(*sets).mode
    z = mode.plan.noise
    assert mode.noise_rate == 0.5
    assert mode.std == pytest.approx(z * math.sqrt(1 + COUNT_WEIGHT**2), rel=1e-12)
    assert mode.summary()["caveat"] is None
    event = dp_event.PoissonSampledDpEvent(0.5, dp_event.GaussianDpEvent(z))
    acc = RdpAccountant()
    acc.compose(event, 100)
    assert acc.get_epsilon(12**-1.1) == pytest.approx(2, rel=2e-3)
    convention = prep_for(*sets, "privacy.population=1000000").mode
    assert convention.noise_cohort.noise_cohort == 10000
    assert "noise-cohort" in convention.summary()["caveat"]


# ----------------------------------------------------------------- one loop: inline and Ray


def _files(run: Path) -> dict:
    out = {}
    for name in ("metrics", "clients", "privacy"):
        table = pq.read_table(run / f"{name}.parquet").to_pydict()
        table.pop("round_seconds", None)
        out[name] = table
    summary = json.loads((run / "summary.json").read_text())
    for volatile in ("wall_seconds", "rounds_seconds", "workers", "gpus_per_worker"):
        summary.pop(volatile)
    # where and when it ran, and how long Ray took to start: records of the run, not results
    summary.pop("stretches", None)
    summary.pop("startup_seconds", None)
    summary["final"].pop("round_seconds")
    out["summary"] = summary
    return out


@pytest.mark.parametrize("algorithm", ["ifca", "rdpcfl"])
def test_inline_and_ray_write_identical_results(ray_session, tmp_path, algorithm):
    sets = small_config(**{"algorithm.name": algorithm, "runtime.round_timeout_s": RAY_TIMEOUT_S})
    cfg = for_algorithm(load_config(None, sets + ["algorithm.num_clusters=2"]))
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    run_prepared(prep, tmp_path / "ray")
    write_results(tmp_path / "inline", prep, run_inline(prep))
    assert _files(tmp_path / "ray") == _files(tmp_path / "inline")
    (stretch,) = json.loads((tmp_path / "ray" / "summary.json").read_text())["stretches"]
    assert stretch["from_round"] == 1


IFCA_SECURE = ("algorithm.name=ifca", "privacy.mode=distributed", "privacy.noise_cohort_size=6")


def test_under_secure_aggregation_ifca_claims_no_assignment_it_cannot_know():
    """The server never learns the clients' choices: it reports no ARI or cluster sizes (an
    all-zero 'assignment' scored ARI 0), and the clients choose in every round."""
    loop = inline_loop(prep_for(*IFCA_SECURE, "rounds=3"))
    rows = [loop.step() for _ in range(3)]
    assert loop.algorithm.assignments(loop.state) is None
    for row in rows:
        assert not {"ari", "clustered_correctly", "clusters_nonempty"} & set(row), row
    # nor does the evaluation carry the clients' hidden choices back to the server's process
    assert loop.judge.last and all(
        set(vars(ev)) == {"client_id", "loss", "accuracy", "num_samples"} for ev in loop.judge.last
    )


def test_ifca_behind_secure_aggregation_refuses_a_selection_window():
    """After a window the server would plan each client on the cluster it 'knows' (none)."""
    with pytest.raises(ConfigError, match="algorithm.selection_fraction=0.5: under"):
        prep_for(*IFCA_SECURE, "algorithm.selection_fraction=0.5")


def test_register_mode_names_a_mode_of_ones_own_and_refuses_a_clash():
    from raysim.privacy.modes import mode_class, register_mode
    from raysim.privacy.modes.none import NoPrivacy

    class Registered(NoPrivacy):
        name = "registered_for_a_test"
        serves_as = "none"

    with pytest.raises(ConfigError, match="unknown mode 'registered_for_a_test'"):
        load_config(None, ["privacy.mode=registered_for_a_test"])
    assert register_mode(Registered) is Registered
    try:
        cfg = load_config(None, ["privacy.mode=registered_for_a_test"])
        assert mode_class(cfg.privacy.mode) is Registered and Registered.contract() == "none"
        clash = type("Clash", (NoPrivacy,), {"name": "sample", "serves_as": "none"})
        with pytest.raises(ValueError, match="registered already"):
            register_mode(clash)
        with pytest.raises(ValueError, match="serves_as must name a built-in mode"):
            register_mode(type("Loose", (NoPrivacy,), {"name": "loose", "serves_as": "x"}))
        with pytest.raises(TypeError):
            register_mode(int)
    finally:
        MODES.pop("registered_for_a_test")
        PRIVACY_MODES.remove("registered_for_a_test")
    with pytest.raises(ConfigError, match="privacy.mode: os:path is not a PrivacyMode"):
        mode_class("os:path")


def test_an_untrusted_server_builds_public_pretrained_models_from_the_engines_spec():
    """IFCA's random cluster models under `distributed` with a base pretrained on the public
    slice (configs/pina_quick.yaml's `--algorithms ...,ifca`): the server's config holds no data
    config, so the engine hands the algorithm the model spec, made where the data config is
    (it names the public slice only). Before, the server's build was refused mid-run."""
    sets = [
        *small_config(rounds=2),
        "algorithm.name=ifca",
        "model.name=cnn_lora",
        "data.public_pretrain_samples=200",
        "privacy.mode=distributed",
        "privacy.noise_cohort_size=8",
    ]
    prep = prepare_named(for_algorithm(load_config(None, sets)))
    assert isinstance(prep.algorithm.env.cfg.data, HiddenData)  # the server's view
    assert prep.algorithm.env.model_spec() == prep.spec  # the experimenter's spec
    state = prep.algorithm.init_state(np.random.default_rng(0))
    assert len(state.models) == prep.algorithm.num_clusters() > 1
    assert not torch.equal(state.models[0], state.models[1])
