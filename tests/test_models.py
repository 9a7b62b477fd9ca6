"""Model zoo: Table 2 sizes, shapes, Opacus compatibility, flat-vector helpers."""

from __future__ import annotations

import pytest
import torch
from opacus.validators import ModuleValidator
from torch.nn import functional as F

from raysim.models import MODELS, build_model, flat_params, load_flat_, num_params


def test_cnn_matches_table_2():
    m = build_model("cnn", (1, 28, 28), 10)
    assert num_params(m) == 28_938
    assert [p.numel() for p in m.parameters()] == [400, 16, 12_800, 32, 15_680, 10]


@pytest.mark.parametrize("channels_last", [False, True])
def test_cnn_pools_before_relu_with_table_2_bits(channels_last):
    """The CNN applies each ReLU after its max-pooling; Table 2's order (conv, ReLU, pool),
    written out here with torch.nn.functional, gives the same logits and gradients to the bit.
    Sparse images make ties (regions where a conv outputs its bias) and all-negative windows."""
    torch.manual_seed(0)
    m = build_model("cnn", (1, 28, 28), 10)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    x = torch.randn(32, 1, 28, 28) * (torch.rand(32, 1, 28, 28) < 0.3)
    y = torch.randint(0, 10, (32,))

    def table_2(x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(F.conv2d(x, m.conv1.weight, m.conv1.bias, padding=2)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, m.conv2.weight, m.conv2.bias, padding=2)), 2)
        return F.linear(h.flatten(1), m.fc.weight, m.fc.bias)

    results = []
    for forward in (m, table_2):
        m.zero_grad()
        logits = forward(x)
        F.cross_entropy(logits, y).backward()
        results.append([logits.detach()] + [p.grad.clone() for p in m.parameters()])
    for ours, reference in zip(*results, strict=True):
        assert torch.equal(ours, reference)
    assert (results[0][1] != 0).any()


@pytest.mark.parametrize(
    "name, shape, classes, fc_in",
    [
        ("cnn", (1, 28, 28), 10, 1568),
        ("cnn", (1, 8, 8), 10, 128),
        ("cnn", (8, 8), 10, 128),
        ("cnn", (3, 32, 32), 10, 2048),
    ],
)
def test_cnn_adapts_to_input(name, shape, classes, fc_in):
    m = build_model(name, shape, classes)
    assert m.fc.in_features == fc_in
    assert m.conv1.in_channels == (shape[0] if len(shape) == 3 else 1)
    assert m(torch.randn(4, *shape)).shape == (4, classes)
    # flattened inputs are reshaped to the image shape
    assert m(torch.randn(4, torch.Size(shape).numel())).shape == (4, classes)


@pytest.mark.parametrize(
    "name, shape, classes, out",
    [
        ("mlp", (64,), 10, 10),
        ("mlp", (1, 8, 8), 10, 10),
        ("mlp", (5,), 0, 1),
        ("linear", (10,), 0, 1),
        ("linear", (1, 8, 8), 10, 10),
        ("resnet18", (3, 32, 32), 10, 10),
    ],
)
def test_forward_shapes(name, shape, classes, out):
    m = build_model(name, shape, classes)
    assert m(torch.randn(2, *shape)).shape == (2, out)


def test_mlp_hidden_and_linear_sizes():
    assert num_params(build_model("mlp", (64,), 10, hidden=32)) == 64 * 32 + 32 + 32 * 10 + 10
    assert num_params(build_model("linear", (10,), 0)) == 11


def test_resnet18_groupnorm_is_opacus_valid():
    m = build_model("resnet18", (3, 32, 32), 10)
    assert num_params(m) == 11_173_962  # CIFAR stem; ~11.2M
    assert ModuleValidator.validate(m, strict=False) == []
    assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
    # the paper's count (Table 3) is torchvision's ImageNet stem
    assert num_params(build_model("resnet18", (3, 32, 32), 10, stem="imagenet")) == 11_181_642


@pytest.mark.parametrize("name", [n for n in MODELS if n != "resnet18"])
def test_small_models_are_opacus_valid(name):
    image = name in ("cnn", "galli_cnn", "vit", "cnn_lora", "vit_lora")
    shape = (1, 28, 28) if image else (20,)
    kwargs = {"base": "random"} if name.endswith("_lora") else {}  # no pretraining here
    assert ModuleValidator.validate(build_model(name, shape, 10, **kwargs), strict=False) == []


def test_seeded_build_is_deterministic_and_keeps_global_rng():
    state = torch.get_rng_state()
    a = flat_params(build_model("cnn", (1, 8, 8), 10, seed=3))
    b = flat_params(build_model("cnn", (1, 8, 8), 10, seed=3))
    c = flat_params(build_model("cnn", (1, 8, 8), 10, seed=4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)


def test_flat_roundtrip_in_place():
    m = build_model("cnn", (1, 8, 8), 10, seed=0)
    v = flat_params(m)
    assert v.dtype == torch.float32 and v.dim() == 1 and v.numel() == num_params(m)
    ptrs = [p.data_ptr() for p in m.parameters()]
    w = torch.randn_like(v)
    load_flat_(m, w)
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    assert torch.equal(flat_params(m), w)
    v.zero_()  # a copy, not a view
    assert torch.equal(flat_params(m), w)
    with pytest.raises(ValueError):
        load_flat_(m, w[:-1])


def test_unknown_model():
    with pytest.raises(ValueError, match="allowed"):
        build_model("vgg", (3, 32, 32), 10)


def test_galli_cnn_has_the_layers_of_table_3():
    """Conv 2x2 (32), conv 2x2 (64), max-pool 2, dense 128, dense classes, no padding: on
    28x28 the features are 64 * 13 * 13 = 10,816."""
    m = build_model("galli_cnn", (1, 28, 28), 62)
    convs = [x for x in m.modules() if isinstance(x, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (32, (2, 2), (0, 0)),
        (64, (2, 2), (0, 0)),
    ]
    assert m.fc1.in_features == 10_816 and m.fc2.out_features == 62
    assert num_params(m) == 1_400_990
    assert m(torch.zeros(3, 784)).shape == (3, 62)
