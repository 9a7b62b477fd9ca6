"""The models by the names configs use (``model.name``): name -> builder(input_shape,
num_classes, **kwargs). Adding a model: one line here; its keyword arguments become the keys
allowed under ``model:`` in the config (``raysim.models.spec``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from raysim.models.cnn import CNN, GalliCNN
from raysim.models.lora_zoo import cnn_lora, vit_lora
from raysim.models.mlp import MLP, Linear
from raysim.models.resnet import ResNet18GN
from raysim.models.vit import ViT

BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "cnn": CNN,
    "galli_cnn": GalliCNN,
    "mlp": MLP,
    "linear": Linear,
    "resnet18": ResNet18GN,
    "vit": ViT,
    "cnn_lora": cnn_lora,
    "vit_lora": vit_lora,
}
MODELS: tuple[str, ...] = tuple(BUILDERS)
