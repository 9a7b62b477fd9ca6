"""A small Vision Transformer (patch 7, dim 64, depth 4, 4 heads by default), Opacus-compatible.

Built from modules Opacus computes per-sample gradients for (Conv2d, Linear, LayerNorm,
Embedding): no BatchNorm, no bare ``nn.Parameter`` on a container. The class token and the
position embedding are ``nn.Embedding`` tables looked up with per-sample index tensors for that
reason. q, k, v and the output projection are separate ``nn.Linear`` layers so a LoRA adapter can
wrap q and v by name (``blocks.<i>.attn.q``), as in Hu et al. 2022.

Parameters on 1x28x28 with 10 classes at the defaults: 139,018 (tests/test_lora.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _chw(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) == 2:
        return (1, input_shape[0], input_shape[1])
    if len(input_shape) == 3:
        return (input_shape[0], input_shape[1], input_shape[2])
    raise ValueError(f"vit needs an image shape (C, H, W) or (H, W), got {input_shape}")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        # written out rather than F.scaled_dot_product_attention, which torch.func.vmap (the
        # trainer's "vmap" per-sample mode) has no batching rule for on CPU
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        out = att @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """Patch embedding (a strided conv) + class token + learned positions + ``depth`` blocks +
    LayerNorm + a linear head on the class token. Pixels beyond the last whole patch are
    dropped (32x32 with patch 7 uses 28x28)."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        patch: int = 7,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_dim: int = 128,
    ):
        super().__init__()
        for key, v in (("patch", patch), ("dim", dim), ("depth", depth), ("heads", heads)):
            if v < 1:
                raise ValueError(f"model.{key} must be >= 1, got {v}")
        self.chw = _chw(input_shape)
        c, h, w = self.chw
        if h < patch or w < patch:
            raise ValueError(f"model.patch={patch} is larger than the input {input_shape}")
        self.tokens = (h // patch) * (w // patch) + 1
        self.patch_embed = nn.Conv2d(c, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Embedding(1, dim)
        self.pos_embed = nn.Embedding(self.tokens, dim)
        nn.init.normal_(self.cls_token.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, max(num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.chw)
        b = x.shape[0]
        patches = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, T-1, D)
        cls = self.cls_token(torch.zeros(b, 1, dtype=torch.long, device=x.device))
        pos = torch.arange(self.tokens, device=x.device).expand(b, -1)
        z = torch.cat([cls, patches], dim=1) + self.pos_embed(pos)
        z = self.norm(self.blocks(z))
        return self.head(z[:, 0])
