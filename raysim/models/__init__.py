"""Model zoo: every model is Opacus-compatible (no BatchNorm) and built by name from a spec.

Build models with :func:`build_from_spec` (``raysim.models.spec``): one place for keyword
arguments, seeding and the frozen part. ``build_model(name, ...)`` is the same for a name and
keyword arguments given inline (tests, scripts).
"""

from __future__ import annotations

from torch import nn

from raysim.models.cnn import CNN
from raysim.models.lora import LoRAConv2d, LoRALinear, apply_lora, merge_lora
from raysim.models.lora_zoo import cnn_lora, vit_lora
from raysim.models.mlp import MLP, Linear
from raysim.models.params import (
    ParamSlot,
    flat_params,
    frozen_state,
    load_flat_,
    named_view,
    num_params,
    param_layout,
)
from raysim.models.pretrain import PublicSlice
from raysim.models.registry import BUILDERS, MODELS
from raysim.models.resnet import ResNet18GN
from raysim.models.spec import (
    ModelSpec,
    build_from_spec,
    check_model_kwargs,
    init_seed,
    model_keys,
    model_spec,
)
from raysim.models.vit import ViT


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    seed: int | None = None,
    **kwargs,
) -> nn.Module:
    """``build_from_spec(ModelSpec(name, kwargs), ...)``: see there."""
    return build_from_spec(ModelSpec(name, kwargs), input_shape, num_classes, seed)


__all__ = [
    "BUILDERS",
    "MODELS",
    "CNN",
    "MLP",
    "Linear",
    "LoRAConv2d",
    "LoRALinear",
    "ModelSpec",
    "ParamSlot",
    "PublicSlice",
    "ResNet18GN",
    "ViT",
    "apply_lora",
    "build_from_spec",
    "build_model",
    "check_model_kwargs",
    "cnn_lora",
    "flat_params",
    "frozen_state",
    "init_seed",
    "load_flat_",
    "merge_lora",
    "model_keys",
    "model_spec",
    "named_view",
    "num_params",
    "param_layout",
    "vit_lora",
]
