"""LoRA wrappers and the LoRA models: exact base logits at init, merging, adapter sizes, what the
flat vector holds, Opacus per-sample gradients, and the pretrained base (cached, deterministic)."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from raysim.models import (
    LoRAConv2d,
    LoRALinear,
    PublicSlice,
    ViT,
    build_model,
    flat_params,
    frozen_state,
    load_flat_,
    merge_lora,
    num_params,
    param_layout,
)
from raysim.models import pretrain as pretrain_mod
from raysim.models.lora import adapter_names
from raysim.training.per_sample import PerSampleGrads

SHAPE = (1, 28, 28)


def _randomize_adapters(model: nn.Module, seed: int = 1) -> None:
    """Give B (zero at init) and A non-trivial values so the adapter changes the function."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _x(n: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, *SHAPE), np.float32))


def test_wrappers_start_as_the_base_and_merge_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(12, 5)
    conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)
    x_lin, x_conv = torch.randn(4, 12), torch.randn(4, 3, 9, 9)
    wl, wc = LoRALinear(copy.deepcopy(lin), 2, 4.0), LoRAConv2d(copy.deepcopy(conv), 2, 4.0)
    assert torch.equal(wl(x_lin), lin(x_lin)) and torch.equal(wc(x_conv), conv(x_conv))
    assert wl.scale == 2.0 and not wl.base.weight.requires_grad
    assert torch.count_nonzero(wl.lora_A.weight) > 0 and torch.count_nonzero(wl.lora_B.weight) == 0
    _randomize_adapters(wl)
    _randomize_adapters(wc)
    assert not torch.allclose(wl(x_lin), lin(x_lin))
    torch.testing.assert_close(wl.merged()(x_lin), wl(x_lin), atol=1e-5, rtol=0)
    torch.testing.assert_close(wc.merged()(x_conv), wc(x_conv), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["vit_lora", "cnn_lora"])
def test_logits_at_init_equal_the_frozen_base_exactly(name):
    from raysim.models.cnn import CNN
    from raysim.models.lora_zoo import frozen_base
    from raysim.models.pretrain import PretrainSettings

    model = build_model(name, SHAPE, 10, seed=5, base="random")
    cls = ViT if name == "vit_lora" else CNN
    arch = {"patch": 7, "dim": 64, "depth": 4, "heads": 4, "mlp_dim": 128} if cls is ViT else {}
    base = frozen_base(name[:3], cls, arch, SHAPE, 10, "random", 0, PretrainSettings(), None)
    model.eval(), base.eval()
    with torch.no_grad():
        assert torch.equal(model(_x()), base(_x()))


@pytest.mark.parametrize("name", ["vit_lora", "cnn_lora"])
def test_merged_weights_reproduce_the_lora_logits(name):
    model = build_model(name, SHAPE, 10, seed=0, base="random")
    _randomize_adapters(model)
    merged = merge_lora(copy.deepcopy(model))
    assert not adapter_names(merged)
    with torch.no_grad():
        lora_out, merged_out = model(_x()), merged(_x())
        base_out = build_model(name, SHAPE, 10, seed=0, base="random")(_x())
    assert (lora_out - base_out).abs().max() > 1e-2  # the adapter really changed the function
    torch.testing.assert_close(merged_out, lora_out, atol=1e-5, rtol=0)


def test_default_vit_adapter_size_and_what_the_flat_vector_holds():
    full = build_model("vit", SHAPE, 10, seed=0)
    assert num_params(full) == 139_018  # documented in raysim/models/vit.py
    model = build_model("vit_lora", SHAPE, 10, seed=0, base="random")
    # 4 blocks x {q, v} x (A: 4x64 + B: 64x4) = 4,096 (documented in raysim/models/lora_zoo.py)
    assert num_params(model) == 4 * 2 * (4 * 64 + 64 * 4) == 4096
    names = [s.name for s in param_layout(model)]
    assert names == adapter_names(model) and len(names) == 16
    assert all(".attn.q." in n or ".attn.v." in n for n in names)
    with_head = build_model("vit_lora", SHAPE, 10, seed=0, base="random", train_head=True)
    assert num_params(with_head) == 4096 + 64 * 10 + 10
    assert [s.name for s in param_layout(with_head)][-2:] == ["head.weight", "head.bias"]
    assert num_params(build_model("cnn_lora", SHAPE, 10, seed=0, base="random")) == 8204

    # What crosses the object store per client is the flat trainable vector: the adapter only.
    flat = flat_params(model).numpy()
    sent = len(pickle.dumps(flat, protocol=5))
    assert 4096 * 4 <= sent < 4096 * 4 + 512
    whole = sum(p.numel() for p in model.parameters())
    assert whole == 139_018 + 4096 and sent < whole * 4 / 30


def test_frozen_part_ignores_the_init_seed_and_the_flat_vector_roundtrips():
    a = build_model("vit_lora", SHAPE, 10, seed=1, base="random")
    b = build_model("vit_lora", SHAPE, 10, seed=2, base="random")
    fa, fb = frozen_state(a), frozen_state(b)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert not torch.equal(flat_params(a), flat_params(b))  # A is drawn from the init seed
    load_flat_(b, flat_params(a))
    with torch.no_grad():
        assert torch.equal(a(_x()), b(_x()))


@pytest.mark.parametrize("name", ["vit", "vit_lora", "cnn_lora"])
def test_opacus_per_sample_gradients_match_autograd(name):
    kwargs = {"base": "random"} if name.endswith("_lora") else {}
    model = build_model(name, SHAPE, 10, seed=0, **kwargs)
    if kwargs:
        _randomize_adapters(model)
    x, y = _x(4), torch.arange(4)
    psg = PerSampleGrads(model, "classification", "hooks")
    psg.enable()
    psg(x, y)
    psg.disable()
    got = {n: p.grad_sample.clone() for n, p in model.named_parameters() if p.requires_grad}
    for i in range(4):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got[n][i], p.grad, atol=1e-5, rtol=1e-4)
            else:
                assert p.grad is None


def test_pretrained_base_is_trained_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(pretrain_mod.CACHE_ENV, str(tmp_path))
    public = PublicSlice("digits", None, 400)
    kwargs = dict(public=public, pretrain_epochs=2, pretrain_lr=3e-3)
    shape = (1, 8, 8)
    a = build_model("cnn_lora", shape, 10, seed=0, **kwargs)
    (meta_file,) = tmp_path.glob("*.json")
    meta = json.loads(meta_file.read_text())
    assert meta["samples"] == 400 and meta["train_accuracy"] > 0.5  # it learnt something
    assert len(list(tmp_path.glob("*.pt"))) == 1

    def no_training(*args, **kw):
        raise AssertionError("the cached base must be loaded, not retrained")

    monkeypatch.setattr(pretrain_mod, "pretrain", no_training)
    b = build_model("cnn_lora", shape, 10, seed=3, **kwargs)
    fa, fb = frozen_state(a), frozen_state(b)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    rand = frozen_state(build_model("cnn_lora", shape, 10, seed=0, base="random"))
    assert not torch.equal(fa["conv1.base.weight"], rand["conv1.base.weight"])
    # other settings are another cache entry (and would train)
    with pytest.raises(AssertionError, match="cached base"):
        build_model("cnn_lora", shape, 10, seed=0, **{**kwargs, "pretrain_epochs": 3})


def test_pretraining_is_deterministic(tmp_path, monkeypatch):
    public = PublicSlice("digits", None, 300)
    states = []
    for sub in ("a", "b"):
        monkeypatch.setenv(pretrain_mod.CACHE_ENV, str(tmp_path / sub))
        torch.manual_seed(len(sub) * 17 + ord(sub))  # the global RNG must not matter
        m = build_model("cnn_lora", (1, 8, 8), 10, seed=0, public=public, pretrain_epochs=1)
        states.append(frozen_state(m))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_pretrained_base_needs_a_public_slice():
    with pytest.raises(ValueError, match="data.public_pretrain_samples"):
        build_model("cnn_lora", SHAPE, 10, seed=0)
