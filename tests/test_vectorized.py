"""The vectorized trainer against the per-client reference (LocalTrainer: torch.optim / Opacus)
on the same batches: same updates, same clipped-gradient sums, same noise."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from raysim.models import build_model, flat_params
from raysim.training import LocalTrainer, TrainConfig
from raysim.training.vectorized import VectorizedTrainer, unsupported

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SIZES = [24, 17, 40, 9]  # different data sizes: padding, different step counts


def blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(3, 64)).astype(np.float32)[y] * 2 + rng.normal(size=(n, 64)) * 0.5
    return x.reshape(n, 1, 8, 8).astype(np.float32), y.astype(np.int64)


def setup(model: str = "cnn"):
    data = [blobs(n, i) for i, n in enumerate(SIZES)]
    init = flat_params(build_model(model, (1, 8, 8), 3, seed=0))
    # different start weights per client (as `local` has): perturb the common init
    rng = torch.Generator().manual_seed(5)
    weights = [init + 0.01 * i * torch.randn(init.shape, generator=rng) for i in range(len(data))]
    ref = LocalTrainer(build_model(model, (1, 8, 8), 3), "classification")
    vec = VectorizedTrainer(build_model(model, (1, 8, 8), 3), "classification")
    return data, weights, ref, vec


def gens(seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 * seed + i) for i in range(len(SIZES))]


def both(cfgs, seed=0, model="cnn"):
    data, weights, ref, vec = setup(model)
    a = [
        ref.train(w, x, y, c, g)
        for w, (x, y), c, g in zip(weights, data, cfgs, gens(seed), strict=True)
    ]
    b = vec.train_group(weights, data, cfgs, gens(seed))
    return a, b


def assert_same(a, b, atol=2e-6):
    for ra, rb in zip(a, b, strict=True):
        assert ra.steps == rb.steps and ra.num_samples == rb.num_samples
        torch.testing.assert_close(rb.update, ra.update, atol=atol, rtol=1e-5)
        assert np.isclose(ra.train_loss, rb.train_loss, rtol=1e-5, equal_nan=True)
        assert np.isclose(ra.update_norm, rb.update_norm, rtol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"local_epochs": 2, "momentum": 0.9, "weight_decay": 1e-3},
        {"full_batch": True, "local_epochs": 3},
        {"max_steps": 3, "prox_mu": 0.5, "update_clip": 0.05},
    ],
)
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_plain_sgd_matches_local_trainer(kw, model):
    cfg = TrainConfig(lr=0.1, batch_size=8, **kw)
    assert_same(*both([cfg] * len(SIZES), model=model))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"local_epochs": 2, "momentum": 0.5, "prox_mu": 0.1, "update_clip": 0.5},
        {"full_batch": True},
    ],
)
def test_dp_sgd_matches_opacus_same_draws(kw):
    """Poisson masks and noise replayed from each client's generator: with z = 1 the updates
    equal Opacus' to float tolerance (so the noise is the very same draws)."""
    cfgs = [
        TrainConfig(lr=0.1, batch_size=8, dp_noise_multiplier=z, dp_clip=0.5, **kw)
        for z in (1.0, 0.7, 1.3, 1.0)  # per-client z (R-DPCFL calibrates per client)
    ]
    assert_same(*both(cfgs, seed=3))


@pytest.mark.parametrize("model", ["cnn", "mlp"])
@pytest.mark.parametrize("kw", [{}, {"local_epochs": 2, "momentum": 0.5, "update_clip": 0.5}])
def test_dp_sgd_group_of_one_matches_opacus(kw, model):
    """A group of one (every DP-SGD client on CPU) takes the layer rules, channels-last: the
    same updates as Opacus on the same draws."""
    cfgs = [
        TrainConfig(lr=0.1, batch_size=8, dp_noise_multiplier=z, dp_clip=0.5, **kw)
        for z in (1.0, 0.7, 1.3, 1.0)
    ]
    data, weights, ref, vec = setup(model)
    assert vec._layer_grads is not None
    for i, (w, (x, y), c) in enumerate(zip(weights, data, cfgs, strict=True)):
        a = ref.train(w, x, y, c, torch.Generator().manual_seed(i))
        b = vec.train_group([w], [(x, y)], [c], [torch.Generator().manual_seed(i)])
        assert_same([a], b)
    assert vec._layer_grads is not None and vec._layer_grads.checked


def test_clipped_gradient_sum_matches_opacus_to_1e5():
    """z = 0, one full-batch step, lr = 1: update = -(sum of clipped per-sample grads) / n."""
    cfg = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=0.1)
    a, b = both([cfg] * len(SIZES))
    for ra, rb, n in zip(a, b, SIZES, strict=True):
        sum_a, sum_b = -ra.update * n, -rb.update * n
        assert float((sum_a - sum_b).abs().max()) < 1e-5
        assert float(sum_a.norm()) <= 0.1 * n * (1 + 1e-5)  # clipping bites: each <= C


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_clipped_gradient_sum_of_one_client_matches_opacus_to_1e5(model):
    """The same for a group of one (every DP-SGD client on CPU: LayerGrads.clipped_sum)."""
    cfg = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=0.1)
    data, weights, ref, vec = setup(model)
    for (x, y), w, n in zip(data, weights, SIZES, strict=True):
        a = ref.train(w, x, y, cfg, torch.Generator().manual_seed(0))
        b = vec.train_group([w], [(x, y)], [cfg], [torch.Generator().manual_seed(0)])[0]
        sum_a, sum_b = -a.update * n, -b.update * n
        assert float((sum_a - sum_b).abs().max()) < 1e-5
        assert float(sum_a.norm()) <= 0.1 * n * (1 + 1e-5)
    assert vec._layer_grads is not None and vec._layer_grads.checked


@pytest.mark.parametrize("dp", [False, True])
def test_float64_group_matches_plain_autograd(dp):
    """In float64 (the dtype of the cross-device check, scripts/gpu_check_vectorized.py) one
    full-batch step equals a hand-made one: each client's batch gradient from plain autograd
    (SGD), or the sum of its per-sample gradients, one backward pass each, clipped to C = 0.1
    (DP-SGD at z = 0), divided by n."""
    data, weights, _, _ = setup()
    vec = VectorizedTrainer(build_model("cnn", (1, 8, 8), 3), "classification", dtype=torch.float64)
    extra = {"dp_noise_multiplier": 0.0, "dp_clip": 0.1} if dp else {}
    cfg = TrainConfig(lr=1.0, batch_size=1, full_batch=True, **extra)
    out = vec.train_group(weights, data, [cfg] * len(SIZES), gens())
    model = build_model("cnn", (1, 8, 8), 3).double()
    for (x, y), w, r in zip(data, weights, out, strict=True):
        start = w.double()
        grads = []
        for rows in [range(len(y))] if not dp else [[i] for i in range(len(y))]:
            torch.nn.utils.vector_to_parameters(start, model.parameters())
            model.zero_grad()
            xb, yb = torch.from_numpy(x[list(rows)]).double(), torch.from_numpy(y[list(rows)])
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            grads.append(g * min(1.0, 0.1 / (float(g.norm()) + 1e-6)) if dp else g)
        expected = -sum(grads) / (len(y) if dp else 1)
        assert r.update.dtype == torch.float64
        torch.testing.assert_close(r.update, expected, atol=1e-12, rtol=1e-10)


def test_empty_poisson_batch_takes_noise_only_step():
    """q = 1/40 on a tiny client: many empty Poisson batches; still equal to Opacus."""
    cfg = TrainConfig(lr=0.1, batch_size=1, dp_noise_multiplier=1.0, dp_clip=1.0, max_steps=6)
    assert_same(*both([cfg] * len(SIZES), seed=7))


def _noise(trainer_kind: str, seeds: range) -> np.ndarray:
    """Noise part of one full-batch DP step (z = 2, C = 0.5, lr = 1): update(z) - update(0)."""
    data, weights, ref, vec = setup()
    cfg0 = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=0.5)
    cfg = dataclasses.replace(cfg0, dp_noise_multiplier=2.0)
    out = []
    for s in seeds:
        if trainer_kind == "opacus":
            x, y = data[0]
            u = ref.train(weights[0], x, y, cfg, torch.Generator().manual_seed(s)).update
            u0 = ref.train(weights[0], x, y, cfg0, torch.Generator().manual_seed(s)).update
        else:
            g = [torch.Generator().manual_seed(s)]
            u = vec.train_group(weights[:1], data[:1], [cfg], g)[0].update
            u0 = vec.train_group(weights[:1], data[:1], [cfg0], [torch.Generator()])[0].update
        out.append((u - u0).numpy())
    return np.concatenate(out)


def test_noise_distribution_is_opacus_gaussian():
    """The noise of a step is N(0, (zC/b)^2) per coordinate (b = n under full batch), and its
    distribution matches the one Opacus draws from independent seeds (two-sample KS)."""
    n = SIZES[0]
    vec = _noise("vectorized", range(3))
    opa = _noise("opacus", range(100, 103))
    sd = 2.0 * 0.5 / n
    assert stats.kstest(vec / sd, "norm").pvalue > 1e-3
    assert stats.ks_2samp(vec, opa).pvalue > 1e-3
    assert abs(vec.std() / sd - 1) < 0.02


def test_unsupported_configs_are_named():
    cfg = TrainConfig(lr=0.1, batch_size=8)
    assert "different training configs" in unsupported([cfg, dataclasses.replace(cfg, lr=0.2)], 10)
    assert "parameters" in unsupported([cfg], 10**8)
    big = TrainConfig(lr=0.1, batch_size=64, physical_batch_size=16, dp_noise_multiplier=1.0)
    assert "physical" in unsupported([big], 10)
    assert unsupported([cfg, cfg], 10) is None


def test_train_many_falls_back_to_the_per_client_path():
    """Different configs in one group: LocalTrainer per client, bit for bit."""
    data, weights, ref, _ = setup()
    cfgs = [TrainConfig(lr=0.1 * (i + 1), batch_size=8) for i in range(len(SIZES))]
    a = [
        ref.train(w, x, y, c, g)
        for w, (x, y), c, g in zip(weights, data, cfgs, gens(), strict=True)
    ]
    b = ref.train_many(weights, data, cfgs, gens())
    for ra, rb in zip(a, b, strict=True):
        assert torch.equal(ra.update, rb.update)
    # a vectorizable group goes through the vectorized trainer and agrees
    cfg = [TrainConfig(lr=0.1, batch_size=8)] * len(SIZES)
    a = [
        ref.train(w, x, y, c, g) for w, (x, y), c, g in zip(weights, data, cfg, gens(), strict=True)
    ]
    assert_same(a, ref.train_many(weights, data, cfg, gens()))
    assert ref._vec is not None


def test_group_size_setting():
    from raysim.config import ConfigError, load_config
    from raysim.engine.rounds import group_size

    with pytest.raises(ConfigError, match="runtime.client_group_size"):
        load_config(None, ["runtime.client_group_size=0"])
    assert load_config(None, ["runtime.client_group_size=8"]).runtime.client_group_size == 8
    assert group_size("auto", 0.0) == 1 and group_size("auto", 0.5) == 32
    assert group_size(5, 0.0) == 5


WITHOUT_REPLACEMENT = {"training.sampling": "without_replacement", "training.sampling_rate": 0.5}


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        ("ifca", {}),
        ("rdpcfl", {}),
        ("rr_cluster", {"privacy.mode": "client", "algorithm.B": 2, **WITHOUT_REPLACEMENT}),
    ],
)
def test_clustered_algorithms_train_a_group_at_once(monkeypatch, algorithm, overrides):
    """IFCA, R-DPCFL and RR-Cluster (clients that choose their model privately, or are told it)
    train the group as one vectorized group: the same choices as one client at a time and, to
    float rounding, the same models."""
    from conftest import small_config

    from algorithms import Environment, get_algorithm
    from algorithms.clustered import ClusteredAlgorithm
    from raysim.compose import for_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.runtime.inline import inline_loop

    sizes: list[int] = []
    train_many = LocalTrainer.train_many

    def counting(self, weights, *args):
        sizes.append(len(weights))
        return train_many(self, weights, *args)

    monkeypatch.setattr(LocalTrainer, "train_many", counting)
    chosen: list[int] = []  # models the clients chose themselves (private selections)
    choose = ClusteredAlgorithm.choose

    def recording(self, task, ctx):
        m, choice = choose(self, task, ctx)
        if choice is not None:
            chosen.append(m)
        return m, choice

    monkeypatch.setattr(ClusteredAlgorithm, "choose", recording)

    def run(group: int):
        sets = small_config(
            **{
                "algorithm.name": algorithm,
                "algorithm.num_clusters": 2,
                "rounds": 4,
                "runtime.client_group_size": group,
                "data.samples_per_client": 40,
                **overrides,
            }
        )
        cfg = for_algorithm(load_config(None, sets), quiet=True)
        loop = inline_loop(prepare(cfg, get_algorithm(cfg.algorithm.name), Environment))
        for _ in range(cfg.rounds):
            loop.step()
        return loop.state

    one = run(1)
    assert set(sizes) == {1}
    chosen_one = chosen.copy()
    sizes.clear()
    chosen.clear()
    grouped = run(8)
    assert max(sizes) > 1  # the cohort at once (8, or 4 at q = 0.5)
    assert chosen, "no round in which the clients chose"
    assert chosen == chosen_one
    assert np.array_equal(one.assigned, grouped.assigned)
    for a, b in zip(one.models, grouped.models, strict=True):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


def test_the_gpu_check_runs_dry_on_the_cpu():
    """scripts/gpu_check_vectorized.py is what a session lent a GPU runs; its CPU dry run keeps
    it working between such sessions (every check printed, each passing)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_vectorized.py"
    args = ["--device", "cpu", "--group", "4", "--samples", "20"]
    run = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "PASS"
    checks = [line for line in lines if line.endswith((" ok", "MISMATCH")) or "ok; " in line]
    assert len(checks) == 23 and not any("MISMATCH" in line for line in lines)
    assert sum("float64 cpu vs cpu" in line for line in lines) == 4
