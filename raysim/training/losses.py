"""Per-sample losses for the two tasks, and zero-copy numpy -> torch conversion."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.nn import functional as F

TASKS = ("classification", "regression")
REGRESSION_LOSSES = ("mse", "rmse")
# inside the square root of an RMSE: its gradient 1 / (2 sqrt(mse)) stays finite at a perfect fit
RMSE_EPS = 1e-12


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


def batch_loss(losses: torch.Tensor, regression_loss: str = "mse") -> torch.Tensor:
    """The loss one step minimises, from a batch's per-sample losses: their mean, or under
    ``rmse`` the root of the mean squared error (Galli et al.'s Eq. 14). RMSE is not a sum over
    samples: its gradient has about unit norm whatever the distance to the optimum, which is
    what keeps d-privacy's noise (norm ~ nu ||delta||) from swamping the signal near it."""
    if regression_loss == "rmse":
        return torch.sqrt(losses.mean() + RMSE_EPS)
    if regression_loss != "mse":
        raise ValueError(
            f"unknown regression loss {regression_loss!r}; allowed: {', '.join(REGRESSION_LOSSES)}"
        )
    return losses.mean()


def dataset_loss(sum_sq: float, n: int, regression_loss: str = "mse") -> float:
    """A client's loss on n samples from the sum of their per-sample losses: the mean, or under
    ``rmse`` Eq. 14 over the whole set (the root of the mean, not a mean of roots)."""
    if not n:
        return float("nan")
    mean = sum_sq / n
    return float(np.sqrt(mean)) if regression_loss == "rmse" else mean


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
