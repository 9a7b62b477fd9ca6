"""Per-sample gradients of one client's batch by layer rules, for models made of Conv2d and Linear.

The generic path (``VectorizedTrainer``) runs the forward pass on a per-sample copy of the
weights under ``vmap``: every convolution becomes a grouped convolution in PyTorch's default
layout, where the pooling after it is slow on CPU (a 2x2 max-pool of a batch of 16 feature maps:
~4 ms against ~0.3 ms in channels-last). Here the forward pass is the ordinary batched one, in
channels-last on CPU; autograd gives the gradient of each layer's output; and each sample's
weight gradient comes from its own input and output gradient:

- ``Linear``: ``g_i^T a_i`` (summed over any extra dims), bias ``sum g_i``;
- ``Conv2d``: one grouped ``convolution_backward`` with the batch folded into the groups (the
  rule ``vmap`` itself applies to a convolution's weight gradient), bias ``sum_hw g_i``.

A batch-16 DP-SGD step of the Table-2 CNN takes ~8 ms instead of ~13 (one thread).

Written here, not taken from Opacus (the reference implementation, still used per client): its
convolution rule unfolds the input (slower than the grouped convolution) and its hooks give wrong
per-sample gradients on channels-last weights (tests/test_training.py). torch's
``ExpandedWeights`` fails on channels-last tensors too.

The rules see a parameter only through its module's call. Refused by :func:`unsupported` (they
keep the ``vmap`` path): models with a BatchNorm (it mixes the samples), trainable parameters
outside Conv2d and Linear modules (norms, embeddings; LoRA adapters are Linear and Conv2d
modules, so they are in), a parameter shared by two modules. A parameter used outside its
module's call (``F.linear(x, other.weight)``) cannot be seen in the structure: the first call
checks the per-sample gradients' sum against autograd's batch gradient and raises
:class:`LayerRulesMissed` if they differ, so the trainer goes back to ``vmap``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from raysim.training.losses import per_sample_loss

_RULES = (nn.Conv2d, nn.Linear)


class LayerRulesMissed(RuntimeError):
    """The layer rules' per-sample gradients do not add up to the batch gradient."""


def unsupported(model: nn.Module, names: list[str]) -> str | None:
    """Why per-sample gradients of ``model`` cannot come from the layer rules (None: they can)."""
    layers = dict(model.named_modules())
    for name, module in layers.items():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"{name or 'model'} is a BatchNorm (mixes the samples of a batch)"
    for k in names:
        owner, _, leaf = k.rpartition(".")
        module = layers.get(owner)
        if not isinstance(module, _RULES) or leaf not in ("weight", "bias"):
            return f"parameter {k} is not a Conv2d's or Linear's weight or bias"
        if isinstance(module, nn.Conv2d) and (
            module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            return f"{owner} pads with {module.padding_mode!r} / {module.padding!r}"
    seen: dict[int, str] = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and p.requires_grad:
            return f"parameter {k} is shared with {seen[id(p)]}"
        seen[id(p)] = k
    return None


class LayerGrads:
    """Built once per trainer, for the trainable parameters ``names`` of ``model``."""

    def __init__(self, model: nn.Module, task: str, names: list[str], channels_last: bool):
        self.model, self.task, self.names = model, task, names
        self.channels_last = channels_last
        layers = dict(model.named_modules())
        owners = dict.fromkeys(k.rpartition(".")[0] for k in names)
        self.layers = {owner: layers[owner] for owner in owners}
        self.checked = False  # the first call checks the sum against the batch gradient

    def __call__(
        self, params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-sample gradients ``[B, *shape]`` of each parameter, and the per-sample losses,
        for one client's weights ``params`` (unbatched) on its batch ``xb``."""
        calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

        def record(owner: str):
            return lambda module, args, out: calls.append((owner, args[0], out))

        hooks = [m.register_forward_hook(record(o)) for o, m in self.layers.items()]
        try:
            leaves = {k: self._layout(v.detach()).requires_grad_() for k, v in params.items()}
            check = [leaves[k] for k in self.names] if not self.checked else []
            with torch.enable_grad():
                out = functional_call(self.model, leaves, (xb,))
                losses = per_sample_loss(self.task, out, yb)
                grads = torch.autograd.grad(
                    losses.sum(), [o for _, _, o in calls] + check, allow_unused=True
                )
        finally:
            for h in hooks:
                h.remove()
        per_sample: dict[str, torch.Tensor] = {}
        grads_out, batch_grads = grads[: len(calls)], grads[len(calls) :]
        for (owner, a, _), g in zip(calls, grads_out, strict=True):
            if g is None:  # the output does not reach the loss
                continue
            module = self.layers[owner]
            if isinstance(module, nn.Conv2d):
                grads_of = _conv2d(module, a.detach(), g, self.channels_last)
            else:
                grads_of = _linear(module, a.detach(), g)
            for leaf, grad in grads_of.items():
                k = f"{owner}.{leaf}"
                if k in params:  # a layer called twice (shared weights) sums its calls
                    per_sample[k] = per_sample[k] + grad if k in per_sample else grad
        b = xb.shape[0]
        for k, v in params.items():  # a layer not called, or not reaching the loss
            if k not in per_sample:
                per_sample[k] = v.new_zeros((b, *v.shape))
        if batch_grads:
            self._check(per_sample, batch_grads)
        return per_sample, losses.detach()

    def _check(self, per_sample: dict[str, torch.Tensor], batch_grads) -> None:
        for k, g in zip(self.names, batch_grads, strict=True):
            total = per_sample[k].sum(0)
            g = torch.zeros_like(total) if g is None else g
            if float((total - g).norm()) > 1e-4 * (float(g.norm()) + 1e-6):
                raise LayerRulesMissed(
                    f"per-sample gradients of {k} do not add up to its batch gradient "
                    "(is it used outside its module's call?)"
                )
        self.checked = True

    def _layout(self, t: torch.Tensor) -> torch.Tensor:
        # .to, not .contiguous: a one-channel weight counts as contiguous in both formats and
        # .contiguous would keep its default strides, from which oneDNN picks the default format
        if self.channels_last and t.dim() == 4:
            return t.to(memory_format=torch.channels_last)
        return t


def _linear(module: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    b = a.shape[0]
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    out = {"weight": torch.bmm(g3.transpose(1, 2), a3)}
    if module.bias is not None:
        out["bias"] = g3.sum(1)
    return out


def _conv2d(
    module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, channels_last: bool
) -> dict[str, torch.Tensor]:
    b, c_in = a.shape[:2]
    c_out = g.shape[1]
    folded_shape = (b * c_out, c_in // module.groups, *module.kernel_size)
    # One input channel per group (a first layer on grey images) makes the folded convolution
    # depthwise-like, and oneDNN's channels-last kernels for it are faster than the default
    # layout's; with more channels the default layout is faster (the timings: CHANGELOG.md,
    # "Speed: the measurement history").
    nhwc = channels_last and folded_shape[1] == 1
    fold = _fold_channels_last if nhwc else _fold
    layout = torch.channels_last if nhwc else torch.contiguous_format
    weight_like = torch.empty(folded_shape, dtype=g.dtype, device=g.device, memory_format=layout)
    _, weight, _ = torch.ops.aten.convolution_backward(
        fold(g),
        fold(a),
        weight_like,
        None,
        module.stride,
        module.padding,
        module.dilation,
        False,
        [0, 0],
        b * module.groups,
        [False, True, False],
    )
    out = {"weight": weight.reshape(b, c_out, *folded_shape[1:])}
    if module.bias is not None:
        out["bias"] = g.sum((2, 3))
    return out


def _fold(t: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [1, B*C, H, W], the batch folded into the channels (default layout)."""
    return t.contiguous().reshape(1, -1, *t.shape[2:])


def _fold_channels_last(t: torch.Tensor) -> torch.Tensor:
    """The same fold, in channels-last memory: [H, W, B*C] underneath."""
    b, c, h, w = t.shape
    return t.permute(2, 3, 0, 1).reshape(1, h, w, b * c).permute(0, 3, 1, 2)
