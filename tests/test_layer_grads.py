"""Per-sample gradients by layer rules against torch.func's vmap(grad) (an independent
implementation: per-sample autograd through the whole model), and the models they refuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from raysim.models import build_model
from raysim.models.lora import apply_lora
from raysim.training import TrainConfig
from raysim.training.layer_grads import LayerGrads, LayerRulesMissed, clip_sum, unsupported
from raysim.training.losses import per_sample_loss
from raysim.training.vectorized import VectorizedTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Odd(nn.Module):
    """Strided, dilated, grouped conv without bias; a Linear on [B, T, d]; a Linear called
    twice; a layer never called."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, dilation=2, groups=2, bias=False)
        self.tok = nn.Linear(4, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x.reshape(x.shape[0], 2, 9, 9)))
        t = self.tok(h.flatten(2).transpose(1, 2))
        t = self.mix(torch.tanh(self.mix(t)))
        return self.head(t.mean(1))


class Grey(nn.Module):
    """Two convolutions of one input channel on the same input (the case the rules fold in
    channels-last memory): a rectangular kernel with unequal padding, and a strided one."""

    def __init__(self):
        super().__init__()
        self.rect = nn.Conv2d(1, 3, (3, 2), padding=(1, 0))
        self.strided = nn.Conv2d(1, 2, 3, stride=2)
        self.head = nn.Linear(3 * 9 * 8 + 2 * 4 * 4, 3)

    def forward(self, x):
        a, b = torch.tanh(self.rect(x)), torch.tanh(self.strided(x))
        return self.head(torch.cat([a.flatten(1), b.flatten(1)], 1))


class Hidden(nn.Module):
    """fc2's weight is also used outside fc2's call: invisible to the layer rules."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x.reshape(x.shape[0], 8)))
        return self.fc2(h) + F.linear(h, self.fc2.weight)


def reference(model, names, xb, yb):
    params = {k: p.detach() for k, p in model.named_parameters() if k in names}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return per_sample_loss("classification", out, yi.unsqueeze(0)).sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, xb, yb)


def trainable(model):
    return [k for k, p in model.named_parameters() if p.requires_grad]


CASES = {
    "cnn": (lambda: build_model("cnn", (1, 12, 12), 5, seed=1), (1, 12, 12), 5),
    "mlp": (lambda: build_model("mlp", (20,), 4, seed=1), (20,), 4),
    "odd": (lambda: Odd(), (2, 9, 9), 3),
    "grey": (lambda: Grey(), (1, 9, 9), 3),
    "cnn_lora": (
        lambda: apply_lora(build_model("cnn", (1, 12, 12), 5, seed=1), ["conv2", "fc"], 2, 4.0),
        (1, 12, 12),
        5,
    ),
    "vit_lora": (  # adapters on q and v (Linear on [B, T, d] inside attention), trained head
        lambda: build_model(
            "vit_lora", (1, 14, 14), 4, seed=1, base="random", train_head=True, dim=16, depth=2
        ),
        (1, 14, 14),
        4,
    ),
}


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_sample_gradients_match_vmap_grad(case, channels_last):
    build, shape, classes = CASES[case]
    torch.manual_seed(3)
    model = build()
    if case.endswith("_lora"):  # B = 0 at initialisation: give the adapters a gradient through B
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.3)
    names = trainable(model)
    assert unsupported(model, names) is None
    xb, yb = torch.randn(7, *shape), torch.randint(0, classes, (7,))
    ref = reference(model, names, xb, yb)
    params = {k: p.detach() for k, p in model.named_parameters() if k in names}
    rules = LayerGrads(model, "classification", names, channels_last=channels_last)
    for _ in range(2):  # the first call also checks the sum against the batch gradient
        got, losses = rules(params, xb, yb)
        assert set(got) == set(names)
        for k in names:
            assert got[k].shape == (7, *params[k].shape)
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            expected = per_sample_loss("classification", model(xb), yb)
        torch.testing.assert_close(losses, expected)
    if case == "odd":
        assert float(got["unused.weight"].abs().max()) == 0.0


def clipped_reference(ref: dict, names: list[str], clip: float) -> dict:
    """Opacus' clipping written out on vmap(grad)'s per-sample gradients: one norm per sample
    over every parameter, factor min(1, C / (norm + 1e-6)), summed over the batch."""
    flat = torch.cat([ref[k].reshape(ref[k].shape[0], -1) for k in names], dim=1)
    factor = (clip / (flat.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("i,i...->...", factor, ref[k]) for k in names}


@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_matches_clipping_vmap_grad(case):
    """LayerGrads.clipped_sum (a Linear on [B, d] by ||g_i|| ||a_i||, never built per sample;
    the rest by the rules) against clipping the reference's per-sample gradients, at a clip
    that bites on some samples and not on others."""
    build, shape, classes = CASES[case]
    torch.manual_seed(4)
    model = build()
    if case.endswith("_lora"):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.3)
    names = trainable(model)
    xb, yb = torch.randn(9, *shape), torch.randint(0, classes, (9,))
    ref = reference(model, names, xb, yb)
    norms = torch.cat([ref[k].reshape(9, -1) for k in names], dim=1).norm(2, dim=1)
    clip = float(norms.median())
    want = clipped_reference(ref, names, clip)
    params = {k: p.detach() for k, p in model.named_parameters() if k in names}
    rules = LayerGrads(model, "classification", names, channels_last=True)
    for _ in range(2):  # the first call also checks the sums against the batch gradient
        got, losses = rules.clipped_sum(params, xb, yb, clip)
        assert set(got) == set(names)
        for k in names:
            assert got[k].shape == params[k].shape
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)
    assert rules.checked
    with torch.no_grad():
        expected = per_sample_loss("classification", model(xb), yb)
    torch.testing.assert_close(losses, expected)


def test_clipped_sum_counts_a_sample_without_a_finite_norm_as_zero():
    """A sample whose gradient overflows (an inf input here) adds nothing, in the factored
    Linear as in the rules' layers; the other samples are clipped as usual."""
    torch.manual_seed(5)
    model = build_model("cnn", (1, 12, 12), 5, seed=1)
    names = trainable(model)
    xb, yb = torch.randn(6, 1, 12, 12), torch.randint(0, 5, (6,))
    bad = xb.clone()
    bad[2] = float("inf")
    params = {k: p.detach() for k, p in model.named_parameters()}
    rules = LayerGrads(model, "classification", names, channels_last=True)
    rules.checked = True  # the check compares sums that the inf sample makes NaN
    got, _ = rules.clipped_sum(params, bad, yb, 0.5)
    keep = [0, 1, 3, 4, 5]
    want = clipped_reference(reference(model, names, xb[keep], yb[keep]), names, 0.5)
    for k in names:
        assert torch.isfinite(got[k]).all()
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)


def test_clip_sum_of_dense_and_factored_gradients_agree():
    """clip_sum on a Linear's per-sample gradients as [B, out, in] and as (g, a) factors."""
    torch.manual_seed(6)
    g, a, bias = torch.randn(5, 3), torch.randn(5, 4), torch.randn(5, 3)
    dense = {"w": g[:, :, None] * a[:, None, :], "b": bias}
    one = clip_sum(dense, ["w", "b"], 0.7)
    two = clip_sum({"b": bias}, ["w", "b"], 0.7, {"w": (g, a)})
    for k in ("w", "b"):
        torch.testing.assert_close(one[k], two[k], atol=1e-6, rtol=1e-5)
    assert clip_sum({}, ["w"], 1.0) == {}


def test_models_the_rules_cannot_see_are_refused():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    assert "BatchNorm" in unsupported(bn, trainable(bn))
    vit = build_model("vit", (1, 28, 28), 10, seed=0)
    assert "not a Conv2d's or Linear's" in unsupported(vit, trainable(vit))
    same = nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"))
    assert "pads with" in unsupported(same, trainable(same))
    reflect = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"))
    assert "'reflect'" in unsupported(reflect, trainable(reflect))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert "shared with 0.weight" in unsupported(tied, trainable(tied))


def test_a_parameter_used_outside_its_module_is_caught_and_vmap_takes_over():
    torch.manual_seed(0)
    model = Hidden()
    names = trainable(model)
    assert unsupported(model, names) is None  # not visible in the structure
    xb, yb = torch.randn(5, 8), torch.randint(0, 3, (5,))
    params = {k: p.detach() for k, p in model.named_parameters()}
    with pytest.raises(LayerRulesMissed, match="fc2.weight"):
        LayerGrads(model, "classification", names, channels_last=False)(params, xb, yb)

    # the trainer falls back to the vmap path, whose updates are the reference here
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    data = [(torch.randn(12, 8).numpy(), torch.randint(0, 3, (12,)).numpy())]
    cfg = TrainConfig(lr=0.1, batch_size=4, dp_noise_multiplier=1.0, dp_clip=0.5)
    vec = VectorizedTrainer(model, "classification")
    assert vec._layer_grads is not None
    got = vec.train_group([w], data, [cfg], [torch.Generator().manual_seed(1)])[0]
    assert vec._layer_grads is None
    ref_vec = VectorizedTrainer(Hidden(), "classification")
    ref_vec._layer_grads = None
    want = ref_vec.train_group([w], data, [cfg], [torch.Generator().manual_seed(1)])[0]
    torch.testing.assert_close(got.update, want.update)
