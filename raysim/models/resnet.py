"""ResNet-18 with GroupNorm instead of BatchNorm, so that per-sample gradients exist (Opacus).

BatchNorm mixes samples within a batch, which breaks per-sample clipping; GroupNorm has the
same parameter count, so the model keeps ResNet-18's size. torchvision is deliberately not a
dependency: this is the standard BasicBlock [2, 2, 2, 2] network written out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    g = min(groups, channels)
    while channels % g:
        g -= 1
    return nn.GroupNorm(g, channels)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = _norm(cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.gn2 = _norm(cout, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(cout, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 (GroupNorm). ``stem="cifar"``: 3x3 conv, no max-pool (11,173,962 params on
    3x32x32, 10 classes); ``stem="imagenet"``: torchvision's 7x7/2 conv + max-pool, which is the
    11,181,642-parameter model counted in the R-DPCFL appendix's Table 3."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        groups: int = 32,
        stem: str = "cifar",
    ):
        super().__init__()
        cin = input_shape[0] if len(input_shape) == 3 else 1
        self.chw = (cin, *input_shape[-2:])
        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(cin, 64, 3, padding=1, bias=False), _norm(64, groups), nn.ReLU()
            )
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(cin, 64, 7, stride=2, padding=3, bias=False),
                _norm(64, groups),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        else:
            raise ValueError(f"unknown stem {stem!r}; allowed: cifar, imagenet")
        blocks, c = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(c, cout, stride, groups), BasicBlock(cout, cout, 1, groups)]
            c = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, max(num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.chw)
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))
