"""DP-SGD through Opacus: clipping, noise scale, Poisson sampling, accumulation, determinism."""

from __future__ import annotations

import dataclasses

import numpy as np
import opacus.optimizers.optimizer as opacus_optimizer
import pytest
import torch

from raysim.models import build_model, flat_params, load_flat_
from raysim.training import GRAD_SAMPLE_MODES, LocalTrainer, TrainConfig
from raysim.training.per_sample import PerSampleGrads

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(3, 64)).astype(np.float32)[y] * 2 + rng.normal(size=(n, 64)) * 0.5
    return x.reshape(n, 1, 8, 8).astype(np.float32), y.astype(np.int64)


def cnn_trainer(mode: str = "hooks", seed: int = 0) -> LocalTrainer:
    return LocalTrainer(build_model("cnn", (1, 8, 8), 3, seed=seed), "classification", "cpu", mode)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def clipped_grads(model, w0, x, y, clip) -> torch.Tensor:
    """Per-sample gradients by a plain per-sample loop, each clipped as Opacus does."""
    load_flat_(model, w0)
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        out = model(torch.from_numpy(x[i : i + 1]))
        torch.nn.functional.cross_entropy(out, torch.from_numpy(y[i : i + 1])).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        rows.append(g * min(1.0, clip / (float(g.norm()) + 1e-6)))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# lr large so that (w0 + step) - w0 in float32 keeps the step's digits
DP = TrainConfig(lr=100.0, batch_size=4, dp_noise_multiplier=0.0, dp_clip=1e-3, max_steps=1)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_full_batch_step_is_mean_of_clipped_grads(mode):
    x, y = blobs(16)
    t = cnn_trainer(mode)
    w0 = flat_params(t.model)
    res = t.train(w0, x, y, dataclasses.replace(DP, full_batch=True), gen(0))
    ref = clipped_grads(build_model("cnn", (1, 8, 8), 3), w0, x, y, 1e-3)
    assert (ref.norm(dim=1) > 0.99e-3).all()  # every sample really is clipped
    assert res.steps == 1 and rel_err(res.update, -100 * ref.mean(0)) < 1e-4


def test_poisson_step_divides_by_expected_batch_size():
    x, y = blobs(16)
    for seed in range(100):  # a seed whose first Poisson batch is not of the expected size
        mask = torch.rand(16, generator=gen(seed)) < 0.25
        if mask.sum() not in (0, 4):
            break
    t = cnn_trainer()
    w0 = flat_params(t.model)
    res = t.train(w0, x, y, DP, gen(seed))
    ref = clipped_grads(build_model("cnn", (1, 8, 8), 3), w0, x, y, 1e-3)[mask]
    assert rel_err(res.update, -100 * ref.sum(0) / 4) < 1e-4


def test_noise_std_is_z_clip_over_expected_batch():
    x, y = blobs(64)
    t = LocalTrainer(build_model("cnn", (1, 28, 28), 10, seed=0), "classification")
    x = np.repeat(np.repeat(x, 4, axis=2), 4, axis=3)[:, :, :28, :28].copy()
    w0 = flat_params(t.model)
    cfg = TrainConfig(lr=1.0, batch_size=8, dp_noise_multiplier=1.5, dp_clip=0.7, max_steps=1)
    noisy = t.train(w0, x, y, cfg, gen(3))
    clean = t.train(w0, x, y, dataclasses.replace(cfg, dp_noise_multiplier=0.0), gen(3))
    noise = noisy.update - clean.update  # same Poisson mask: only the noise differs
    assert noise.numel() == 28_938
    assert float(noise.std()) == pytest.approx(1.5 * 0.7 / 8, rel=0.03)
    assert abs(float(noise.mean())) < 4 * 1.5 * 0.7 / 8 / noise.numel() ** 0.5


def test_poisson_batch_sizes_average_qn(monkeypatch):
    sizes: list[int] = []
    call = PerSampleGrads.__call__
    empty = PerSampleGrads.set_empty

    def spy(self, xb, yb):
        sizes.append(xb.shape[0])
        return call(self, xb, yb)

    def spy_empty(self):
        sizes.append(0)
        empty(self)

    monkeypatch.setattr(PerSampleGrads, "__call__", spy)
    monkeypatch.setattr(PerSampleGrads, "set_empty", spy_empty)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 20)).astype(np.float32)
    y = rng.integers(0, 2, 200)
    t = LocalTrainer(build_model("linear", (20,), 2, seed=0), "classification")
    cfg = TrainConfig(lr=0.1, batch_size=20, local_epochs=40, dp_noise_multiplier=1.0)
    res = t.train(flat_params(t.model), x, y, cfg, gen(0))
    assert res.steps == 400 == len(sizes)  # ceil(n / b) steps per epoch
    assert np.mean(sizes) == pytest.approx(20, abs=1.0)  # q n, q = b / n
    assert np.std(sizes) == pytest.approx((200 * 0.1 * 0.9) ** 0.5, rel=0.15)


def test_empty_poisson_batch_takes_a_noise_only_step():
    x, y = blobs(10)
    seed = next(s for s in range(1000) if not (torch.rand(10, generator=gen(s)) < 0.1).any())
    t = cnn_trainer()
    w0 = flat_params(t.model)
    cfg = TrainConfig(lr=1.0, batch_size=1, dp_noise_multiplier=0.0, max_steps=1)
    res = t.train(w0, x, y, cfg, gen(seed))
    assert res.steps == 1 and not res.update.any() and np.isnan(res.train_loss)
    res = t.train(
        w0, x, y, dataclasses.replace(cfg, dp_noise_multiplier=2.0, dp_clip=0.5), gen(seed)
    )
    g = gen(seed)
    torch.rand(10, generator=g)  # the mask draw, then one N(0, (zC)^2) draw per parameter
    noise = torch.cat([torch.normal(0, 1.0, p.shape, generator=g).reshape(-1) for p in t.params])
    torch.testing.assert_close(res.update, -noise)  # divided by b = 1


def _record_noise(monkeypatch) -> list[torch.Tensor]:
    draws: list[torch.Tensor] = []
    real = opacus_optimizer._generate_noise

    def spy(*args, **kwargs):
        draws.append(real(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr(opacus_optimizer, "_generate_noise", spy)
    return draws


def test_full_batch_accumulation_equals_one_big_batch(monkeypatch):
    x, y = blobs(50)
    t = cnn_trainer()
    w0 = flat_params(t.model)
    cfg = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=0.1)
    big = t.train(w0, x, y, cfg, gen(0))
    small = t.train(w0, x, y, dataclasses.replace(cfg, physical_batch_size=7), gen(0))
    torch.testing.assert_close(small.update, big.update, rtol=1e-5, atol=1e-8)
    assert small.train_loss == pytest.approx(big.train_loss, rel=1e-6)

    draws = _record_noise(monkeypatch)
    g1, g2 = gen(5), gen(5)
    cfg = dataclasses.replace(cfg, dp_noise_multiplier=1.0, local_epochs=2)
    big = t.train(w0, x, y, cfg, g1)
    n_big = len(draws)
    small = t.train(w0, x, y, dataclasses.replace(cfg, physical_batch_size=7), g2)
    assert n_big == len(draws) - n_big == 2 * len(t.params)  # noise once per logical step
    assert all(torch.equal(a, b) for a, b in zip(draws[:n_big], draws[n_big:], strict=True))
    assert torch.equal(g1.get_state(), g2.get_state())
    torch.testing.assert_close(small.update, big.update, rtol=1e-4, atol=1e-6)


def test_poisson_logical_batch_larger_than_physical_is_accumulated():
    x, y = blobs(60)
    t = cnn_trainer()
    w0 = flat_params(t.model)
    cfg = TrainConfig(lr=0.5, batch_size=20, local_epochs=2, dp_noise_multiplier=0.5)
    a = t.train(w0, x, y, cfg, gen(1))
    b = t.train(w0, x, y, dataclasses.replace(cfg, physical_batch_size=3), gen(1))
    assert a.steps == b.steps == 6
    torch.testing.assert_close(b.update, a.update, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_same_seed_same_bits_across_trainers(mode):
    x, y = blobs(40)
    w0 = flat_params(build_model("cnn", (1, 8, 8), 3, seed=7))
    cfg = TrainConfig(lr=0.2, batch_size=8, local_epochs=2, momentum=0.9, dp_noise_multiplier=1.0)
    r1 = cnn_trainer(mode, seed=0).train(w0, x, y, cfg, gen(11))
    r2 = cnn_trainer(mode, seed=1).train(w0, x, y, cfg, gen(11))
    r3 = cnn_trainer(mode, seed=0).train(w0, x, y, cfg, gen(12))
    assert torch.equal(r1.update, r2.update) and not torch.equal(r1.update, r3.update)
    if mode != "hooks":  # modes agree up to float rounding (same masks, same noise bits)
        ref = cnn_trainer("hooks").train(w0, x, y, cfg, gen(11))
        torch.testing.assert_close(r1.update, ref.update, rtol=1e-4, atol=1e-6)


def test_dp_leaves_no_state_behind():
    x, y = blobs(40)
    t, fresh = cnn_trainer(), cnn_trainer()
    w0 = flat_params(t.model)
    plain = TrainConfig(lr=0.1, batch_size=8)
    t.train(w0, x, y, dataclasses.replace(plain, dp_noise_multiplier=1.0, momentum=0.9), gen(0))
    a = t.train(w0, x, y, plain, gen(1))
    b = fresh.train(w0, x, y, plain, gen(1))
    assert torch.equal(a.update, b.update)
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in t.params)
    assert not any(m._forward_hooks or m._backward_hooks for m in t.model.modules())


def test_dp_prox_and_update_clip():
    x, y = blobs(20)
    t = cnn_trainer()
    w0 = flat_params(t.model)
    cfg = TrainConfig(lr=0.1, batch_size=1, full_batch=True, dp_noise_multiplier=0.0)
    a = t.train(w0, x, y, cfg, gen(0))
    b = t.train(w0, x, y, dataclasses.replace(cfg, prox_mu=2.0), gen(0), prox_center=w0 - 1)
    torch.testing.assert_close(b.update - a.update, torch.full_like(w0, -0.2), atol=1e-6, rtol=0)
    c = t.train(w0, x, y, dataclasses.replace(cfg, update_clip=1e-3), gen(0))
    assert float(c.update.norm()) <= 1e-3 * (1 + 1e-5) < c.update_norm


def test_resnet18_groupnorm_dp_step_clips():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 3, 16, 16)).astype(np.float32)
    y = np.array([0, 1, 2])
    t = LocalTrainer(build_model("resnet18", (3, 16, 16), 10, seed=0), "classification")
    cfg = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=0.1)
    res = t.train(flat_params(t.model), x, y, cfg, gen(0))
    assert 0 < res.update_norm <= 0.1 + 1e-6
