"""Attack targets: the LeNet of the DLG paper and the project's CNN, with seeded weights.

The DLG LeNet (Zhu et al. 2019, their reference code) is three 5x5 convolutions with 12 channels
(strides 2, 2, 1, 'same' padding) and sigmoids, then one linear layer; every weight and bias is
drawn from U(-0.5, 0.5). Smooth activations and that wide init are what make DLG work on it, so
it is kept exactly rather than replaced by a project model.
"""

from __future__ import annotations

import torch
from torch import nn

from raysim.models import build_model
from raysim.seeding import SERVER, torch_generator

TARGETS = ("lenet", "cnn")


class DLGLeNet(nn.Module):
    """Conv(5x5,12,s2)-Sigmoid-Conv(5x5,12,s2)-Sigmoid-Conv(5x5,12,s1)-Sigmoid-Linear."""

    def __init__(self, channels: int = 1, size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        side = (size + 1) // 2
        side = (side + 1) // 2
        self.fc = nn.Linear(12 * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


def build_target(name: str, seed: int, shape: tuple[int, int, int] = (1, 28, 28)) -> nn.Module:
    """The attacked model, its weights a function of ``seed`` alone (global RNG untouched)."""
    if name == "lenet":
        model = DLGLeNet(shape[0], shape[1])
        gen = torch_generator(seed, 0, SERVER, "attack/model")
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
        return model
    if name == "cnn":
        return build_model("cnn", shape, 10, seed=seed)
    raise ValueError(f"unknown attack target {name!r}; allowed: {', '.join(TARGETS)}")
