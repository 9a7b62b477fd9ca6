"""Per-sample gradients for DP-SGD, written into ``p.grad_sample`` for Opacus' DPOptimizer.

Modes: Opacus' ``GradSampleModule`` with ``"hooks"`` (default), ``"ew"`` (expanded weights) or
``"functorch"`` (per-layer vmap), and ``"vmap"``: ``torch.func.vmap(grad(functional_call))`` over
the whole model, which skips the module hooks. All give the same gradients up to float
rounding; clipping, noise and scaling are always Opacus' ``DPOptimizer``.
"""

from __future__ import annotations

import warnings

import torch
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleExpandedWeights
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from raysim.training.config import GRAD_SAMPLE_MODES
from raysim.training.losses import per_sample_loss


class PerSampleGrads:
    """Built once per trainer; ``__call__`` fills ``p.grad_sample`` for one chunk and returns
    the chunk's per-sample losses (detached)."""

    def __init__(self, model: nn.Module, task: str, mode: str = "hooks"):
        if mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"unknown grad_sample_mode {mode!r}; allowed: {GRAD_SAMPLE_MODES}")
        self.model, self.task, self.mode = model, task, mode
        self.named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.gsm: nn.Module | None = None
        if mode == "ew":
            self.gsm = GradSampleModuleExpandedWeights(
                model, batch_first=True, loss_reduction="sum"
            )
        elif mode in ("hooks", "functorch"):
            self.gsm = GradSampleModule(
                model, batch_first=True, loss_reduction="sum", force_functorch=mode == "functorch"
            )
            self.gsm.remove_hooks()  # attached only inside DP training: plain SGD/eval pay nothing
        else:

            def one(params: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
                out = functional_call(model, params, (xi.unsqueeze(0),))
                return per_sample_loss(task, out, yi.unsqueeze(0)).sum()

            self._fn = vmap(grad_and_value(one), in_dims=(None, 0, 0))

    def enable(self) -> None:
        """Attach Opacus' hooks (about 0.1 ms on the CNN, 1 ms on ResNet-18)."""
        if self.mode in ("hooks", "functorch"):
            self.gsm.add_hooks(
                loss_reduction="sum", batch_first=True, force_functorch=self.mode == "functorch"
            )

    def disable(self) -> None:
        """Remove the hooks: disabled hooks would still wrap every forward (and warn)."""
        if self.mode in ("hooks", "functorch"):
            self.gsm.remove_hooks()

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if self.gsm is not None:
            losses = per_sample_loss(self.task, self.gsm(xb), yb)
            with warnings.catch_warnings():
                # the first layer's input needs no gradient: torch warns, harmlessly
                warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
                losses.sum().backward()
            return losses.detach()
        grads, losses = self._fn({k: p.detach() for k, p in self.named}, xb, yb)
        for k, p in self.named:
            p.grad_sample = grads[k]
        return losses

    def set_empty(self) -> None:
        """An empty Poisson batch: zero per-sample rows, so DPOptimizer adds noise only."""
        for _, p in self.named:
            p.grad_sample = p.new_zeros((0, *p.shape))
