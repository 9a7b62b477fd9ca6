"""What a client's local training is told (TrainConfig) and what it reports (TrainResult)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Per-sample gradient modes of training.per_sample (kept here: that module imports opacus).
GRAD_SAMPLE_MODES = ("hooks", "ew", "functorch", "vmap")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one client's local training (the same for every client in a call)."""

    lr: float
    batch_size: int  # b; with DP: expected batch size, Poisson rate q = b / n
    local_epochs: int = 1  # K
    momentum: float = 0.0
    weight_decay: float = 0.0
    dp_noise_multiplier: float | None = None  # None: no DP-SGD
    dp_clip: float = 1.0  # per-sample L2 clip C
    full_batch: bool = False  # one step per epoch over the whole local dataset (q = 1)
    physical_batch_size: int = 256  # memory bound: larger logical batches are accumulated
    update_clip: float | None = None  # client-side L2 clip of the whole update (new - init)
    prox_mu: float = 0.0  # proximal / mean-regularisation term mu/2 ||w - center||^2
    max_steps: int | None = None  # optional cap on the total number of steps

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.physical_batch_size < 1 or self.local_epochs < 0:
            raise ValueError("batch sizes must be >= 1 and local_epochs >= 0")
        if self.dp_noise_multiplier is not None and (
            self.dp_noise_multiplier < 0 or self.dp_clip <= 0
        ):
            raise ValueError("need dp_noise_multiplier >= 0 and dp_clip > 0")
        if self.update_clip is not None and self.update_clip <= 0:
            raise ValueError("update_clip must be positive")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError("max_steps must be >= 0")

    @property
    def dp(self) -> bool:
        return self.dp_noise_multiplier is not None


@dataclass(frozen=True)
class SamplingPlan:
    """The batch schedule a client of n samples follows; privacy accounting must use these
    same numbers (q, total_steps)."""

    q: float  # Poisson inclusion probability per step (1.0 for full batch)
    steps_per_epoch: int
    total_steps: int  # local_epochs * steps_per_epoch, capped by max_steps
    expected_batch_size: int  # the DP-SGD denominator: q * n


def sampling_plan(n: int, cfg: TrainConfig) -> SamplingPlan:
    """Batch schedule for a client with ``n`` samples.

    Minibatch mode: ``b = min(batch_size, n)``, ``steps_per_epoch = ceil(n / b)`` (a DataLoader's
    length, which is what Opacus' DPDataLoader runs per epoch) and, with DP, Poisson rate
    ``q = b / n`` with expected batch size ``b``. Opacus itself uses ``q = 1 / ceil(n / b)``; the
    two agree whenever b divides n. Full batch: ``q = 1``, one step per epoch over all n samples.
    """
    if n < 1:
        raise ValueError("a client needs at least one sample")
    b = n if cfg.full_batch else min(cfg.batch_size, n)
    steps = math.ceil(n / b)
    total = cfg.local_epochs * steps
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return SamplingPlan(q=b / n, steps_per_epoch=steps, total_steps=total, expected_batch_size=b)


@dataclass
class TrainResult:
    """One client's contribution. ``train_loss`` is the mean per-sample loss over the forward
    passes of the last epoch run (under rmse: the batches' RMSEs, weighted by batch size; each
    sample's loss at the weights before that step; a partial epoch if ``max_steps`` stopped
    it); nan if that epoch saw no sample. It is not privatised: under DP do not send it to the
    server unless it is accounted for."""

    update: torch.Tensor  # flat float32 CPU, new - init (after update_clip)
    num_samples: int  # n, the client's dataset size (the FedAvg weight)
    steps: int  # optimizer steps taken (empty Poisson batches included)
    train_loss: float
    update_norm: float  # L2 norm before update clipping


@dataclass
class EvalResult:
    loss: float  # mean per-sample loss
    accuracy: float | None  # None for regression
    n: int


def clip_update(update: torch.Tensor, bound: float | None) -> float:
    """Clip ``update`` in place to L2 norm ``bound`` (None: as it is); returns the norm before.
    An update without a finite norm (training overflowed on a crafted broadcast) becomes zero
    where it is clipped: a clipped update must be bounded whatever came in."""
    norm = float(update.norm())
    if bound is not None and not math.isfinite(norm):
        update.zero_()
    elif bound is not None and norm > bound:
        update.mul_(bound / norm)
    return norm


def zero_nonfinite_samples(params: list[torch.Tensor]) -> None:
    """Set to zero the per-sample gradients (``grad_sample``) of every sample whose gradient has
    no finite norm, before DP-SGD clips them (Opacus' clipping would keep a NaN): a crafted
    broadcast that makes some sample overflow must not make the release non-finite, which would
    tell the server so without noise. A zero gradient is within the clip."""
    grads = [p.grad_sample for p in params if getattr(p, "grad_sample", None) is not None]
    if not grads:
        return
    norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grads]).norm(2, dim=0)
    bad = ~torch.isfinite(norms)
    if bool(bad.any()):
        for g in grads:
            g[bad] = 0
