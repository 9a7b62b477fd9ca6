"""Model zoo: every model is Opacus-compatible (no BatchNorm) and built by name.

``build_model`` takes an optional ``seed`` so the engine can create the same initial weights
on any worker without touching the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raysim.models.cnn import CNN
from raysim.models.mlp import MLP, Linear
from raysim.models.params import flat_params, load_flat_, num_params
from raysim.models.resnet import ResNet18GN

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "cnn": CNN,
    "mlp": MLP,
    "linear": Linear,
    "resnet18": ResNet18GN,
}
MODELS: tuple[str, ...] = tuple(_BUILDERS)


def model_kwargs(model_cfg: Any) -> dict[str, Any]:
    """The builder keywords a ``ModelConfig`` asks for (``hidden`` of mlp, ``bias`` of linear).

    One place for every caller that builds the configured model, so the engine, the workers
    and the algorithms cannot build different architectures from one config.
    """
    if model_cfg.name == "mlp":
        return {"hidden": model_cfg.hidden}
    if model_cfg.name == "linear":
        return {"bias": model_cfg.bias}
    return {}


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    seed: int | None = None,
    **kwargs,
) -> nn.Module:
    """Build model ``name`` for inputs of shape ``input_shape`` (no batch dim, channels first).

    ``num_classes=0`` means regression: one output. ``kwargs`` go to the model (``hidden`` for
    mlp, ``groups``/``stem`` for resnet18). With ``seed`` the initial weights are a function
    of the seed alone (the global RNG is saved and restored).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    shape = tuple(int(d) for d in input_shape)
    if seed is None:
        return _BUILDERS[name](shape, num_classes, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](shape, num_classes, **kwargs)


__all__ = [
    "MODELS",
    "CNN",
    "MLP",
    "Linear",
    "ResNet18GN",
    "build_model",
    "model_kwargs",
    "flat_params",
    "load_flat_",
    "num_params",
]
