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

from collections import Counter

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
        calls, batch_grads, losses = self._backward(params, xb, yb)
        per_sample = self._dense(calls, params, set(params))
        b = xb.shape[0]
        for k, v in params.items():  # a layer not called, or not reaching the loss
            if k not in per_sample:
                per_sample[k] = v.new_zeros((b, *v.shape))
        if batch_grads:
            self._check({k: v.sum(0) for k, v in per_sample.items()}, batch_grads)
        return per_sample, losses

    def clipped_sum(
        self, params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor, clip: float
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """DP-SGD's clipped sum for one client's batch: each sample's gradient scaled by
        Opacus' factor ``min(1, clip / (||g_i|| + 1e-6))`` and summed (a sample without a finite
        norm counts as zero, as ``training.config.zero_nonfinite_samples``), and the per-sample
        losses. The same numbers as clipping ``__call__``'s gradients, with less memory traffic:
        a Linear called once on [B, d] inputs has per-sample gradients ``g_i a_i^T``, whose norm
        is ``||g_i|| ||a_i||`` and whose clipped sum is one matmul, so they are never built (for
        the Table-2 CNN's last layer, 16 x 15,680 floats a step)."""
        calls, batch_grads, losses = self._backward(params, xb, yb)
        uses = Counter(owner for owner, _, _ in calls)
        outer: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # weight: (g [B, out], a [B, in])
        for owner, a, g in calls:
            k = f"{owner}.weight"
            if isinstance(self.layers[owner], nn.Linear) and a.dim() == 2 and uses[owner] == 1:
                if g is not None and k in params:
                    outer[k] = (g, a.detach())
        dense = self._dense(calls, params, set(params) - set(outer))
        if batch_grads:
            totals = {k: v.sum(0) for k, v in dense.items()}
            totals.update({k: g.t() @ a for k, (g, a) in outer.items()})
            self._check(totals, batch_grads)
        sums = clip_sum(dense, self.names, clip, outer)
        for k in self.names:  # a layer not called, or not reaching the loss
            if k not in sums:
                sums[k] = params[k].new_zeros(params[k].shape)
        return sums, losses

    def _backward(
        self, params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor
    ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor | None]], tuple, torch.Tensor]:
        """One batched forward pass recording each rule layer's input, then autograd: the
        gradient of each call's output (None where it does not reach the loss), the batch
        gradient of each parameter where this is the first call (for the check), and the
        per-sample losses."""
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
        outs = [(owner, a, g) for (owner, a, _), g in zip(calls, grads[: len(calls)], strict=True)]
        return outs, grads[len(calls) :], losses.detach()

    def _dense(self, calls, params: dict[str, torch.Tensor], keys: set[str]):
        """The per-sample gradients ``[B, *shape]`` of the parameters ``keys`` by the rules (a
        layer called twice sums its calls); parameters no call reaches are left out."""
        per_sample: dict[str, torch.Tensor] = {}
        for owner, a, g in calls:
            if g is None:  # the output does not reach the loss
                continue
            module = self.layers[owner]
            leaves = [leaf for leaf in ("weight", "bias") if f"{owner}.{leaf}" in keys]
            if not leaves:
                continue
            if isinstance(module, nn.Conv2d):
                grads_of = _conv2d(module, a.detach(), g, self.channels_last, leaves)
            else:
                grads_of = _linear(module, a.detach(), g, leaves)
            for leaf, grad in grads_of.items():
                k = f"{owner}.{leaf}"
                per_sample[k] = per_sample[k] + grad if k in per_sample else grad
        return per_sample

    def _check(self, totals: dict[str, torch.Tensor], batch_grads) -> None:
        """The per-sample gradients' sums (``totals``, a parameter no call reaches left out)
        against autograd's batch gradients."""
        for k, g in zip(self.names, batch_grads, strict=True):
            total = totals.get(k)
            if total is None:
                total = torch.zeros_like(g) if g is not None else None
            if total is None:
                continue
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


def clip_sum(
    dense: dict[str, torch.Tensor],
    names: list[str],
    clip: float,
    outer: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Opacus' clipped sum of per-sample gradients: ``dense`` holds them as ``[B, *shape]``,
    ``outer`` as the factors ``(g [B, out], a [B, in])`` of ``g_i a_i^T``. Each sample is scaled
    by ``min(1, clip / (||g_i|| + 1e-6))`` (its norm over every parameter, taken parameter by
    parameter in ``names`` order, as Opacus does); a sample without a finite norm counts as
    zero (as ``training.config.zero_nonfinite_samples``). One sum per parameter given."""
    outer = outer or {}
    if not dense and not outer:
        return {}
    b = next(iter(dense.values())).shape[0] if dense else next(iter(outer.values()))[0].shape[0]
    norms_of = []
    for k in names:
        if k in outer:
            g, a = outer[k]
            norms_of.append(g.norm(2, dim=-1) * a.norm(2, dim=-1))
        elif k in dense:
            norms_of.append(dense[k].reshape(b, -1).norm(2, dim=-1))
    norms = torch.stack(norms_of, dim=1).norm(2, dim=1)
    finite = torch.isfinite(norms)
    if not bool(finite.all()):
        norms = torch.where(finite, norms, 0)
        dense = {
            k: torch.where(finite.view(-1, *[1] * (v.dim() - 1)), v, 0) for k, v in dense.items()
        }
        keep = finite[:, None]
        outer = {
            k: (torch.where(keep, g, 0), torch.where(keep, a, 0)) for k, (g, a) in outer.items()
        }
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)  # Opacus' expression, to the bit
    sums = {}
    for k, (g, a) in outer.items():
        sums[k] = (g * factor[:, None]).t() @ a
    for k, v in dense.items():
        sums[k] = (factor @ v.reshape(b, -1)).view(v.shape[1:])
    return sums


def _linear(
    module: nn.Linear, a: torch.Tensor, g: torch.Tensor, leaves: list[str]
) -> dict[str, torch.Tensor]:
    b = a.shape[0]
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    out = {}
    if "weight" in leaves:
        out["weight"] = torch.bmm(g3.transpose(1, 2), a3)
    if "bias" in leaves and module.bias is not None:
        out["bias"] = g3.sum(1)
    return out


def _conv2d(
    module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, channels_last: bool, leaves: list[str]
) -> dict[str, torch.Tensor]:
    out = {}
    if "bias" in leaves and module.bias is not None:
        out["bias"] = g.sum((2, 3))
    if "weight" not in leaves:
        return out
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
    out["weight"] = weight.reshape(b, c_out, *folded_shape[1:])
    return out


def _fold(t: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [1, B*C, H, W], the batch folded into the channels (default layout)."""
    return t.contiguous().reshape(1, -1, *t.shape[2:])


def _fold_channels_last(t: torch.Tensor) -> torch.Tensor:
    """The same fold, in channels-last memory: [H, W, B*C] underneath."""
    b, c, h, w = t.shape
    return t.permute(2, 3, 0, 1).reshape(1, h, w, b * c).permute(0, 3, 1, 2)
