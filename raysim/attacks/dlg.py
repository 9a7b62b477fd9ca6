"""Deep Leakage from Gradients (Zhu et al. 2019) and iDLG (Zhao et al. 2020) on one client.

The server sees one client's gradient on a single image, either as is or sanitized as in
Galli et al.'s Algorithm 2, and optimizes a dummy image (DLG: also a dummy soft label) until the
dummy's gradient matches it: L-BFGS with learning rate 1, up to 300 steps (each step is
torch's default of at most 20 function evaluations, as in both reference implementations),
stopping once the matching loss is below 1e-6.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raysim.privacy import d_privacy_epsilon, laplace_euclidean

METHODS = ("dlg", "idlg")
STOP_LOSS = 1e-6


def client_gradient(model: nn.Module, image: torch.Tensor, label: int) -> list[torch.Tensor]:
    """The gradient of the cross-entropy of one labelled image, one tensor per parameter."""
    loss = F.cross_entropy(model(image), torch.tensor([label]))
    return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]


def sanitize_gradient(
    grads: list[torch.Tensor], nu: float, rng: np.random.Generator, lr: float = 1.0
) -> tuple[list[torch.Tensor], float]:
    """What the server recovers from one SGD step released through Algorithm 2.

    The client steps ``theta_c = theta - lr * g``, so ``delta = -lr * g``; it releases
    ``theta_c + rho`` with ``rho ~ L_{0, eps}``, ``eps = n / (nu * ||delta||)``; the server, who
    knows ``theta`` and ``lr``, reads the gradient ``(theta - theta_hat) / lr = g - rho / lr``.
    Computed on ``delta`` directly (float64) so no rounding of ``theta`` blurs a small noise.
    The law of the result does not depend on ``lr``: ``||rho|| / lr ~ Gamma(n, nu*||g||/n)``.
    Returns the sanitized gradient and ``||rho|| / ||delta||`` (about ``nu``).
    """
    flat = np.concatenate([g.double().reshape(-1).numpy() for g in grads])
    delta = -lr * flat
    radius = float(np.linalg.norm(delta))
    n = flat.size
    rho = laplace_euclidean(n, d_privacy_epsilon(n, nu, radius), rng)
    seen = -(delta + rho) / lr
    out, start = [], 0
    for g in grads:
        out.append(torch.from_numpy(seen[start : start + g.numel()]).reshape(g.shape).float())
        start += g.numel()
    return out, float(np.linalg.norm(rho) / radius) if radius > 0 else 0.0


def idlg_label(grads: list[torch.Tensor]) -> int:
    """iDLG's label: the row of the last layer's weight gradient with the negative sum.

    For cross-entropy on one sample the row of the true class is ``(p_y - 1) * h`` and every
    other row ``p_j * h``; with non-negative features ``h`` (sigmoid or ReLU before the last
    layer, true of both targets) only the true row sums below zero.
    """
    return int(torch.argmin(grads[-2].sum(dim=-1)))


@dataclass(frozen=True)
class AttackResult:
    reconstruction: np.ndarray  # (C, H, W), clamped to [0, 1]
    label: int  # the label the attack settled on
    loss: float  # final gradient-matching loss (of the returned reconstruction)
    steps: int  # L-BFGS steps taken
    seconds: float


def _matching_loss(
    model: nn.Module,
    params: list[torch.Tensor],
    target: list[torch.Tensor],
    dummy: torch.Tensor,
    label: int | torch.Tensor,
) -> torch.Tensor:
    out = model(dummy)
    if isinstance(label, int):
        loss = F.cross_entropy(out, torch.tensor([label]))
    else:  # DLG's soft label: cross-entropy against softmax of the dummy logits
        loss = torch.sum(-F.softmax(label, dim=-1) * F.log_softmax(out, dim=-1))
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))


def run_attack(
    model: nn.Module,
    target: list[torch.Tensor],
    shape: tuple[int, ...],
    method: str,
    generator: torch.Generator,
    max_steps: int = 300,
    num_classes: int = 10,
) -> AttackResult:
    """Reconstruct one image from ``target`` (a gradient list) by gradient matching.

    The dummy image (and DLG's dummy label logits) start as N(0, 1) draws from ``generator``.
    The returned reconstruction is the one with the lowest matching loss seen after any step
    (what an attacker, who can evaluate that loss, would keep); it is the last one unless the
    optimization diverged.
    """
    if method not in METHODS:
        raise ValueError(f"unknown attack {method!r}; allowed: {', '.join(METHODS)}")
    t0 = time.perf_counter()
    params = list(model.parameters())
    dummy = torch.randn((1, *shape), generator=generator).requires_grad_(True)
    if method == "idlg":
        label: int | torch.Tensor = idlg_label(target)
        variables = [dummy]
    else:
        label = torch.randn((1, num_classes), generator=generator).requires_grad_(True)
        variables = [dummy, label]
    opt = torch.optim.LBFGS(variables, lr=1.0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _matching_loss(model, params, target, dummy, label)
        loss.backward()
        return loss

    def snapshot() -> tuple[np.ndarray, int]:
        lab = label if isinstance(label, int) else int(label.detach().argmax())
        return dummy.detach()[0].clamp(0, 1).numpy().copy(), lab

    best_loss, best, steps = math.inf, snapshot(), 0
    for steps in range(1, max_steps + 1):  # noqa: B007 - steps is reported
        opt.step(closure)
        loss = float(_matching_loss(model, params, target, dummy, label).detach())
        if not math.isfinite(loss):
            break
        if loss < best_loss:
            best_loss, best = loss, snapshot()
        if loss < STOP_LOSS:
            break
    return AttackResult(best[0], best[1], best_loss, steps, time.perf_counter() - t0)
