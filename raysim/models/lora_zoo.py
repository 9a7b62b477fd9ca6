"""LoRA models of the zoo: a frozen base (pretrained on the public slice, or random) + adapters.

``vit_lora``: the small ViT with rank-4 adapters on q and v of every block (Hu et al. 2022's
choice). At the defaults (1x28x28, 10 classes) the adapter has 4 blocks x 2 layers x (4x64 +
64x4) = 4,096 parameters, the whole trainable vector unless ``train_head`` adds the head's 650.
``cnn_lora``: the Table-2 CNN with adapters on conv1, conv2 and fc (8,204 adapter parameters on
1x28x28, 10 classes), small and fast for tests.

The frozen base is built under its own seed (``base_seed``) inside a forked RNG, so it never
depends on the seed of the trainable initialisation: every worker and every cluster model shares
it. With ``base="pretrained"`` (the default) its weights come from
:func:`raysim.models.pretrain.pretrained_state` on the public slice the engine passes as
``public`` (set ``data.public_pretrain_samples``); ``base="random"`` keeps the seeded random
initialisation (unit tests, ablations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from raysim.models.cnn import CNN
from raysim.models.lora import apply_lora
from raysim.models.pretrain import PretrainSettings, PublicSlice, pretrained_state
from raysim.models.vit import ViT

Base = Literal["pretrained", "random"]


def frozen_base(
    arch: str,
    cls: Callable[..., nn.Module],
    arch_kwargs: Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    base: Base,
    base_seed: int,
    settings: PretrainSettings,
    public: PublicSlice | None,
) -> nn.Module:
    """The base network, identical in every process for the same arguments."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed)
            return cls(input_shape, num_classes, **arch_kwargs)

    model = build()
    if base == "random":
        return model
    if base != "pretrained":
        raise ValueError(f"model.base: unknown base {base!r}; allowed: pretrained, random")
    if public is None:
        raise ValueError(
            "model.base=pretrained needs a public slice to pretrain on: set "
            "data.public_pretrain_samples (e.g. 10000), or model.base=random"
        )
    state = pretrained_state(arch, build, arch_kwargs, input_shape, num_classes, public, settings)
    model.load_state_dict(state)
    return model


def vit_lora(
    input_shape: tuple[int, ...],
    num_classes: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("attn.q", "attn.v"),
    train_head: bool = False,
    base: Base = "pretrained",
    base_seed: int = 0,
    pretrain_epochs: int = 5,
    pretrain_lr: float = 1e-3,
    patch: int = 7,
    dim: int = 64,
    depth: int = 4,
    heads: int = 4,
    mlp_dim: int = 128,
    public: PublicSlice | None = None,
) -> nn.Module:
    """Small ViT, frozen, with LoRA on ``targets`` (q and v); ``train_head`` trains the head."""
    arch = {"patch": patch, "dim": dim, "depth": depth, "heads": heads, "mlp_dim": mlp_dim}
    settings = PretrainSettings(pretrain_epochs, pretrain_lr, seed=base_seed)
    model = frozen_base(
        "vit", ViT, arch, input_shape, num_classes, base, base_seed, settings, public
    )
    if train_head:
        targets = tuple(t for t in targets if t != "head")
    return apply_lora(model, targets, rank, alpha, ("head",) if train_head else ())


def cnn_lora(
    input_shape: tuple[int, ...],
    num_classes: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("conv1", "conv2", "fc"),
    train_head: bool = False,
    base: Base = "pretrained",
    base_seed: int = 0,
    pretrain_epochs: int = 3,
    pretrain_lr: float = 1e-3,
    public: PublicSlice | None = None,
) -> nn.Module:
    """Table-2 CNN, frozen, with LoRA on ``targets``; ``train_head`` trains fc as a whole."""
    settings = PretrainSettings(pretrain_epochs, pretrain_lr, seed=base_seed)
    model = frozen_base("cnn", CNN, {}, input_shape, num_classes, base, base_seed, settings, public)
    if train_head:  # fc trains as a whole: an adapter on it would duplicate its coordinates
        targets = tuple(t for t in targets if t != "fc")
    return apply_lora(model, targets, rank, alpha, ("fc",) if train_head else ())
