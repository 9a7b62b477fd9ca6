"""Per-sample losses for the two tasks, and zero-copy numpy -> torch conversion."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.nn import functional as F

TASKS = ("classification", "regression")


def per_sample_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unreduced loss, one value per sample: cross-entropy, or squared error (MSE)."""
    if task == "classification":
        if out.dim() == 2 and not y.is_floating_point():
            # -log_softmax[y]: the same bits as F.cross_entropy(reduction="none"), forward and
            # backward. Under vmap cross_entropy goes through nll_loss's decomposition, whose
            # first call imports sympy and torch.fx (~0.4 s and ~50 MiB in every worker).
            return -out.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return F.cross_entropy(out, y, reduction="none")
    if out.dim() == y.dim() + 1 and out.shape[-1] == 1:
        out = out.squeeze(-1)
    loss = F.mse_loss(out, y, reduction="none")
    return loss if loss.dim() == 1 else loss.flatten(1).mean(1)


def as_tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``a``'s memory where possible.

    Ray hands out read-only zero-copy views of the object store; torch warns about those
    because it cannot mark a tensor read-only. We never write to the inputs (batches are
    gathered into fresh tensors), so the warning is silenced rather than paid for with a copy.
    """
    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def targets(task: str, y: torch.Tensor) -> torch.Tensor:
    """Class indices as int64, regression targets as float32 (no copy if already so)."""
    return y.long() if task == "classification" else y.float()
