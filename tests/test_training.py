"""Local training without DP, evaluation, schedules, determinism and input handling."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from raysim.models import build_model, flat_params, load_flat_
from raysim.training import LocalTrainer, TrainConfig, sampling_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def blobs(n: int = 120, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three separable Gaussian blobs on 8x8 'images' (float32, int64)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = rng.normal(size=(3, 64)).astype(np.float32) * 2
    x = centers[y] + rng.normal(size=(n, 64)).astype(np.float32) * 0.5
    return x.reshape(n, 1, 8, 8).astype(np.float32), y.astype(np.int64)


def trainer(name: str = "mlp", seed: int = 0, task: str = "classification", **kw) -> LocalTrainer:
    shape = (1, 8, 8) if task == "classification" else (5,)
    classes = 3 if task == "classification" else 0
    return LocalTrainer(build_model(name, shape, classes, seed=seed, **kw), task)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_sampling_plan():
    p = sampling_plan(100, TrainConfig(lr=0.1, batch_size=32, local_epochs=2))
    assert (p.q, p.steps_per_epoch, p.total_steps, p.expected_batch_size) == (0.32, 4, 8, 32)
    p = sampling_plan(100, TrainConfig(lr=0.1, batch_size=32, local_epochs=3, full_batch=True))
    assert (p.q, p.steps_per_epoch, p.total_steps, p.expected_batch_size) == (1.0, 1, 3, 100)
    p = sampling_plan(10, TrainConfig(lr=0.1, batch_size=32, local_epochs=5, max_steps=2))
    assert (p.q, p.steps_per_epoch, p.total_steps) == (1.0, 1, 2)


def test_plain_sgd_decreases_loss_and_reports():
    x, y = blobs()
    t = trainer()
    w0 = flat_params(t.model)
    before = t.evaluate(w0, x, y)
    cfg = TrainConfig(lr=0.1, batch_size=16, local_epochs=5, momentum=0.5)
    res = t.train(w0, x, y, cfg, gen(0))
    after = t.evaluate(w0 + res.update, x, y)
    assert res.steps == 5 * 8 and res.num_samples == 120
    assert after.loss < 0.5 * before.loss and after.accuracy > 0.9
    assert res.update.dtype == torch.float32 and res.update.shape == w0.shape
    assert res.update_norm == pytest.approx(float(res.update.norm()), rel=1e-6)
    assert np.isfinite(res.train_loss) and res.train_loss < before.loss


def test_regression_and_losses():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6, dtype=np.float32) + 0.5).astype(np.float32)
    t = trainer("linear", task="regression")
    w0 = flat_params(t.model)
    res = t.train(w0, x, y, TrainConfig(lr=0.05, batch_size=20, local_epochs=20), gen(0))
    w1 = w0 + res.update
    ev = t.evaluate(w1, x, y)
    assert ev.accuracy is None and ev.n == 200 and ev.loss < 0.01
    losses, _ = t.scores([w0, w1], x, y)
    assert losses.shape == (2,) and losses[1] < losses[0]
    assert losses[0] == pytest.approx(t.evaluate(w0, x, y).loss, rel=1e-6)


def test_full_batch_plain_is_one_gradient_step_and_chunking_agrees():
    x, y = blobs(50)
    cfg = TrainConfig(lr=0.5, batch_size=1, full_batch=True, physical_batch_size=7)
    t = trainer()
    w0 = flat_params(t.model)
    a = t.train(w0, x, y, cfg, gen(0))
    b = t.train(w0, x, y, TrainConfig(lr=0.5, batch_size=1, full_batch=True), gen(1))
    assert a.steps == b.steps == 1
    torch.testing.assert_close(a.update, b.update, rtol=1e-5, atol=1e-7)
    # the same step by hand, from the initial weights
    load_flat_(t.model, w0)
    t.model.zero_grad()
    torch.nn.functional.cross_entropy(t.model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    g = torch.cat([p.grad.reshape(-1) for p in t.model.parameters()])
    torch.testing.assert_close(a.update, -0.5 * g, rtol=1e-5, atol=1e-7)


def test_same_seed_same_bits_across_trainers_and_global_rng_untouched():
    x, y = blobs()
    cfg = TrainConfig(lr=0.1, batch_size=16, local_epochs=2)
    t1, t2 = trainer(seed=0), trainer(seed=5)  # separate instances, different resident weights
    w0 = flat_params(build_model("mlp", (1, 8, 8), 3, seed=9))
    state = torch.get_rng_state()
    r1 = t1.train(w0, x, y, cfg, gen(42))
    r2 = t2.train(w0, x, y, cfg, gen(42))
    r3 = t1.train(w0, x, y, cfg, gen(43))
    assert torch.equal(r1.update, r2.update) and not torch.equal(r1.update, r3.update)
    assert torch.equal(torch.get_rng_state(), state)


def test_update_clip_bounds_norm():
    x, y = blobs()
    t = trainer()
    w0 = flat_params(t.model)
    res = t.train(w0, x, y, TrainConfig(lr=0.5, batch_size=8, update_clip=0.05), gen(0))
    assert res.update_norm > 0.05
    assert float(res.update.norm()) <= 0.05 * (1 + 1e-5)
    free = t.train(w0, x, y, TrainConfig(lr=0.5, batch_size=8), gen(0))
    torch.testing.assert_close(res.update, free.update * (0.05 / free.update_norm))


def test_prox_term_pulls_towards_center():
    x, y = blobs(40)
    t = trainer()
    w0 = flat_params(t.model)
    center = w0 + 1.0
    base = TrainConfig(lr=0.1, batch_size=1, full_batch=True)
    prox = TrainConfig(lr=0.1, batch_size=1, full_batch=True, prox_mu=0.5)
    a = t.train(w0, x, y, base, gen(0))
    b = t.train(w0, x, y, prox, gen(0), prox_center=center)
    # one step: the prox gradient mu (w0 - center) = -0.5 adds +lr*0.5 to every coordinate
    torch.testing.assert_close(b.update - a.update, torch.full_like(w0, 0.05), atol=1e-6, rtol=0)
    # without a center the proximal term pulls towards the received weights (FedProx)
    two = dataclasses.replace(prox, batch_size=10, full_batch=False, local_epochs=2)
    c = t.train(w0, x, y, two, gen(0))
    assert torch.equal(c.update, t.train(w0, x, y, two, gen(0), prox_center=w0.clone()).update)
    assert not torch.equal(c.update, t.train(w0, x, y, two, gen(0), prox_center=center).update)


def test_max_steps_and_weight_decay():
    x, y = blobs()
    t = trainer()
    w0 = flat_params(t.model)
    assert t.train(w0, x, y, TrainConfig(lr=0.1, batch_size=8, max_steps=3), gen(0)).steps == 3
    a = t.train(w0, x, y, TrainConfig(lr=0.1, batch_size=1, full_batch=True), gen(0))
    b = t.train(
        w0, x, y, TrainConfig(lr=0.1, batch_size=1, full_batch=True, weight_decay=0.1), gen(0)
    )
    torch.testing.assert_close(b.update - a.update, -0.1 * 0.1 * w0, atol=1e-6, rtol=1e-4)


def test_read_only_inputs_work_without_warnings():
    x, y = blobs()
    x.setflags(write=False)
    y = y.astype(np.int32)
    y.setflags(write=False)
    t = trainer("cnn")
    w0 = flat_params(t.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = t.train(w0, x, y, TrainConfig(lr=0.1, batch_size=16), gen(0))
        t.evaluate(w0 + res.update, x, y)
        dp = TrainConfig(lr=0.1, batch_size=16, dp_noise_multiplier=1.0, physical_batch_size=8)
        t.train(w0, x, y, dp, gen(0))
    assert torch.isfinite(res.update).all()


def test_bad_inputs():
    x, y = blobs()
    t = trainer()
    w0 = flat_params(t.model)
    with pytest.raises(ValueError):
        t.train(w0[:-1], x, y, TrainConfig(lr=0.1, batch_size=8), gen(0))
    with pytest.raises(ValueError):
        t.train(w0, x, y[:-1], TrainConfig(lr=0.1, batch_size=8), gen(0))
    with pytest.raises(ValueError):
        LocalTrainer(build_model("mlp", (4,), 2), "ranking")


def test_channels_last_matches_default_format_and_leaves_opacus_exact():
    """Convolutions train channels-last on CPU (faster); the update equals the default format's
    to float rounding, and a DP-SGD client (Opacus, default format) after a plain one gets the
    same bits as on a fresh trainer."""
    x, y = blobs()
    cfg = TrainConfig(lr=0.1, batch_size=16, local_epochs=2, momentum=0.9)
    fast, plain = trainer("cnn"), trainer("cnn")
    plain.channels_last = False
    w = flat_params(fast.model)
    a = fast.train(w, x, y, cfg, gen(3))
    b = plain.train(w, x, y, cfg, gen(3))
    assert fast.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert plain.model.conv1.weight.is_contiguous()
    torch.testing.assert_close(a.update, b.update, rtol=1e-4, atol=1e-6)
    assert fast.evaluate(w, x, y).loss == pytest.approx(plain.evaluate(w, x, y).loss, rel=1e-5)

    dp = dataclasses.replace(cfg, momentum=0.0, dp_noise_multiplier=1.0, dp_clip=1.0)
    after_plain = fast.train(w, x, y, dp, gen(4))
    default = trainer("cnn")
    default.channels_last = False  # Opacus' conv per-sample gradients are wrong channels-last
    assert torch.equal(after_plain.update, default.train(w, x, y, dp, gen(4)).update)


def test_a_gpu_worker_turns_tf32_off(monkeypatch):
    """cuDNN's TF32 convolutions, PyTorch's default, put the Table-2 CNN's gradient 3e-2 off
    float64 on an H200 (README "On a GPU"): a worker that picks CUDA turns TF32 off; one on the
    CPU leaves the process alone. CUDA is pretended here; the flags are what is read."""
    from raysim.runtime.worker import pick_device

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = cudnn.allow_tf32, matmul.allow_tf32
    try:
        cudnn.allow_tf32 = matmul.allow_tf32 = True
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert pick_device(1.0).type == "cpu" and cudnn.allow_tf32
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert pick_device(0.0).type == "cpu" and cudnn.allow_tf32
        assert pick_device(0.25).type == "cuda"
        assert not cudnn.allow_tf32 and not matmul.allow_tf32
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = before
