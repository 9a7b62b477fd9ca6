"""Flat-vector views of a model's weights: the engine moves, averages and noises 1-D tensors."""

from __future__ import annotations

import torch
from torch import nn


def num_params(model: nn.Module) -> int:
    """Number of trainable scalars (the length of ``flat_params``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def flat_params(model: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """1-D float32 CPU copy of the trainable parameters, in ``model.parameters()`` order.

    ``out`` (a float32 CPU tensor of the right length) is filled instead of allocating.
    """
    params = [p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]
    if out is None:
        out = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    elif out.numel() != sum(p.numel() for p in params):
        raise ValueError(f"out has {out.numel()} elements, model has {num_params(model)}")
    off = 0
    with torch.no_grad():
        for p in params:
            out[off : off + p.numel()].copy_(p)
            off += p.numel()
    return out


@torch.no_grad()
def load_flat_(model: nn.Module, vec: torch.Tensor) -> nn.Module:
    """Copy ``vec`` into the existing parameter tensors (no reallocation; any device/dtype)."""
    vec = vec.reshape(-1)
    n = num_params(model)
    if vec.numel() != n:
        raise ValueError(f"weight vector has {vec.numel()} elements, model has {n}")
    off = 0
    for p in model.parameters():
        if p.requires_grad:
            p.copy_(vec[off : off + p.numel()].view_as(p))
            off += p.numel()
    return model
