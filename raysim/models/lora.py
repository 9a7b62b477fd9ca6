"""LoRA (Hu et al. 2022) for Linear and Conv2d layers, written by hand on purpose.

peft would pull in transformers, accelerate and the Hugging Face hub, none of which helps an
engine that moves one flat vector of trainable parameters: here a wrapper freezes the base layer
``W`` and adds ``scale * B A x`` with ``A`` Kaiming-uniform (as peft and loralib), ``B = 0`` and
``scale = alpha / rank``. So at initialisation the wrapped model computes exactly the base's
logits, and only ``A``, ``B`` (and optionally the head) have ``requires_grad``: they alone make
up the flat vector the engine moves, clips and noises.

The adapters are ordinary ``nn.Linear`` / ``nn.Conv2d`` modules, so Opacus computes their
per-sample gradients with its stock grad samplers and skips the frozen base.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def _check(rank: int, alpha: float) -> None:
    if rank < 1:
        raise ValueError(f"model.rank must be >= 1, got {rank}")
    if not alpha > 0:
        raise ValueError(f"model.alpha must be > 0, got {alpha}")


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(x))`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        _check(rank, alpha)
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return self.scale * (self.lora_B.weight @ self.lora_A.weight)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain Linear with ``W + scale * B A`` (for serving, and to check the wrapper)."""
        b = self.base
        out = nn.Linear(b.in_features, b.out_features, bias=b.bias is not None)
        out.weight.copy_(b.weight + self.delta_weight())
        if b.bias is not None:
            out.bias.copy_(b.bias)
        return out


class LoRAConv2d(nn.Module):
    """``base(x) + scale * B(A(x))``: A is a rank-channel conv with the base's geometry, B a 1x1
    conv (peft's construction), so ``B A`` is the rank-``r`` kernel update ``W_B @ W_A``."""

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float):
        super().__init__()
        _check(rank, alpha)
        if base.groups != 1 or base.padding_mode != "zeros":
            raise ValueError("LoRAConv2d supports groups=1 and zero padding only")
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Conv2d(
            base.in_channels,
            rank,
            base.kernel_size,
            stride=base.stride,
            padding=base.padding,
            dilation=base.dilation,
            bias=False,
        )
        self.lora_B = nn.Conv2d(rank, base.out_channels, 1, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

    def delta_weight(self) -> torch.Tensor:
        a = self.lora_A.weight.flatten(1)  # (r, cin*kh*kw)
        b = self.lora_B.weight.flatten(1)  # (cout, r)
        return self.scale * (b @ a).view_as(self.base.weight)

    @torch.no_grad()
    def merged(self) -> nn.Conv2d:
        b = self.base
        out = nn.Conv2d(
            b.in_channels,
            b.out_channels,
            b.kernel_size,
            stride=b.stride,
            padding=b.padding,
            dilation=b.dilation,
            bias=b.bias is not None,
        )
        out.weight.copy_(b.weight + self.delta_weight())
        if b.bias is not None:
            out.bias.copy_(b.bias)
        return out


LORA_TYPES = (LoRALinear, LoRAConv2d)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_lora(
    model: nn.Module,
    targets: Iterable[str],
    rank: int,
    alpha: float,
    trainable: Iterable[str] = (),
) -> nn.Module:
    """Freeze ``model`` and wrap every Linear/Conv2d whose name ends with one of ``targets``
    (a dotted suffix: ``"attn.q"`` matches ``blocks.0.attn.q``). The modules named in
    ``trainable`` (e.g. the head) become trainable as a whole. Adapters are created in module
    order, drawing their ``A`` from the global RNG (seed it: see ``build_from_spec``)."""
    model.requires_grad_(False)
    suffixes = tuple(targets)
    hits = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv2d)
        and any(name == s or name.endswith("." + s) for s in suffixes)
    ]
    if not hits:
        raise ValueError(f"model.targets: no Linear/Conv2d layer matches {list(suffixes)}")
    for name, m in hits:
        wrapper = (
            LoRALinear(m, rank, alpha) if isinstance(m, nn.Linear) else LoRAConv2d(m, rank, alpha)
        )
        _set_submodule(model, name, wrapper)
    for name in trainable:
        model.get_submodule(name).requires_grad_(True)
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRA wrapper by its merged layer, in place (the result has no adapters)."""
    wrappers = [(n, m) for n, m in model.named_modules() if isinstance(m, LORA_TYPES)]
    for name, m in wrappers:
        _set_submodule(model, name, m.merged())
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
