"""The papers' CNNs, sized from the input shape: R-DPCFL's two-layer CNN of Table 2 (its
appendix B.2), and Galli et al.'s of Table 3 (their FEMNIST experiment, appendix B.3)."""

from __future__ import annotations

import torch
from torch import nn


def _chw(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Channels-first (C, H, W); a 2-D shape (H, W) means one channel."""
    if len(input_shape) == 2:
        return (1, input_shape[0], input_shape[1])
    if len(input_shape) == 3:
        return (input_shape[0], input_shape[1], input_shape[2])
    raise ValueError(f"cnn needs an image shape (C, H, W) or (H, W), got {input_shape}")


class CNN(nn.Module):
    """Conv(5x5, 16) - ReLU - MaxPool2 - Conv(5x5, 32) - ReLU - MaxPool2 - Linear.

    28,938 parameters on 1x28x28 with 10 classes, as in Table 2. 'same' padding keeps
    the spatial size through each conv, so an 8x8 input flattens to 32*2*2 = 128.
    The table lists a ReLU on the dense layer; we output raw logits instead, because a
    ReLU before cross-entropy only clamps logits (the parameter count is unchanged).
    Inputs of shape (B, C, H, W), (B, H, W) or (B, C*H*W) are all accepted.

    Each ReLU runs after its max-pooling: ReLU is monotone, so max-pooling commutes with it,
    with the same values and gradients to the bit (tests/test_models.py), and the ReLU and its
    backward touch a quarter of the elements (a batch-16 step ~10% faster on CPU). And each
    ReLU works in place on the pooling's output, a tensor nothing else reads (max-pooling's
    backward keeps its indices, ReLU's its output): the same bits, one buffer fewer a layer (a
    batch-16 step ~3% faster on CPU).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.chw = _chw(input_shape)
        c, h, w = self.chw
        self.conv1 = nn.Conv2d(c, 16, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU(inplace=True)
        flat = 32 * ((h // 2) // 2) * ((w // 2) // 2)
        if flat == 0:
            raise ValueError(f"input {input_shape} too small for two 2x2 poolings")
        self.fc = nn.Linear(flat, max(num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.chw)
        x = self.relu(self.pool(self.conv1(x)))
        x = self.relu(self.pool(self.conv2(x)))
        return self.fc(x.flatten(1))


class GalliCNN(nn.Module):
    """Galli et al.'s Table 3: Conv(2x2, 32) - ReLU - Conv(2x2, 64) - ReLU - MaxPool2 -
    Linear(128) - ReLU - Linear(classes), stride 1 and no padding.

    1,394,282 parameters on 1x28x28 with 10 classes (the paper's 62 FEMNIST classes give
    1,400,990; it states n0 = 1,206,590, which no padding or input size of 28x28 matches, so
    the table's layers are what is built). As for ``CNN``, the last layer outputs raw logits
    (the table's ReLU there would only clamp them) and the pooling's ReLU is the conv's.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.chw = _chw(input_shape)
        c, h, w = self.chw
        self.conv1 = nn.Conv2d(c, 32, kernel_size=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=2)
        self.pool = nn.MaxPool2d(2)
        flat = 64 * ((h - 2) // 2) * ((w - 2) // 2)
        if flat == 0:
            raise ValueError(f"input {input_shape} too small for two 2x2 convolutions and a pool")
        self.fc1 = nn.Linear(flat, 128)
        self.fc2 = nn.Linear(128, max(num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.chw)
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.pool(self.conv2(x)))  # ReLU commutes with max-pooling (CNN's note)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)
