"""Small dense models: an MLP and a linear model (regression or multinomial logistic)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _in_features(input_shape: tuple[int, ...]) -> int:
    return math.prod(input_shape)


class MLP(nn.Module):
    """Flatten - Linear(d, hidden) - ReLU - Linear(hidden, C); C=0 means one regression output."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"model.hidden must be >= 1, got {hidden}")
        self.fc1 = nn.Linear(_in_features(input_shape), hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, max(num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x.flatten(1))))


class Linear(nn.Module):
    """Flatten - Linear(d, C): linear regression for C=0 (one output), else logistic."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(_in_features(input_shape), max(num_classes, 1), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))
