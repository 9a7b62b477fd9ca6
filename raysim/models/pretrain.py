"""Central, deterministic pretraining of a frozen base on the public slice, cached on disk.

The base of a LoRA model must be the same on the driver and on every worker, and it must come
from real training. It is trained once, centrally, on the public slice (``raysim.data.public``:
the last ``data.public_pretrain_samples`` training images, unrotated, never given to a client),
with Adam, a seeded shuffle and one torch thread (thread count can change float reductions), and
stored at ``~/.cache/raysim/pretrained/<key>.pt`` (``RAYSIM_PRETRAINED_DIR`` overrides the
folder). ``<key>`` hashes everything the weights depend on: architecture and its arguments,
input shape, classes, dataset (an npz file's contents), slice size, the training settings and
the torch version. Any process that needs the base loads that file, or trains it (same bits)
when it is missing; writes are atomic, so two processes racing to create it are harmless.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

CACHE_ENV = "RAYSIM_PRETRAINED_DIR"
DEFAULT_CACHE = "~/.cache/raysim/pretrained"
_FORMAT = 1  # bump when the training procedure changes


@dataclass(frozen=True)
class PublicSlice:
    """The public, unrotated slice a frozen base is pretrained on (``data.public_pretrain_samples``
    images at the end of the dataset's training file; the federated partition never uses them)."""

    dataset: str
    root: str | None
    samples: int


@dataclass(frozen=True)
class PretrainSettings:
    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"model.pretrain_epochs must be >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise ValueError(f"model.pretrain_lr must be > 0, got {self.lr}")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)).expanduser()


def cache_key(
    arch: str,
    arch_kwargs: Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    public: PublicSlice,
    settings: PretrainSettings,
) -> str:
    desc = {
        "format": _FORMAT,
        "arch": arch,
        "arch_kwargs": dict(sorted(arch_kwargs.items())),
        "input_shape": list(input_shape),
        "num_classes": num_classes,
        "dataset": public.dataset,
        "samples": public.samples,
        "settings": asdict(settings),
        "torch": torch.__version__,
    }
    if public.dataset == "npz" and public.root is not None:  # a file is named by its bytes
        desc["file"] = hashlib.sha256(Path(public.root).expanduser().read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:20]


def pretrained_state(
    arch: str,
    build: Callable[[], nn.Module],
    arch_kwargs: Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    public: PublicSlice,
    settings: PretrainSettings,
) -> dict[str, torch.Tensor]:
    """The pretrained base's state dict: from the cache, or trained now and cached.

    ``build`` returns a freshly initialised base (seeded by the caller).
    """
    key = cache_key(arch, arch_kwargs, input_shape, num_classes, public, settings)
    path = cache_dir() / f"{key}.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    model = build()
    info = pretrain(model, public, settings)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(path, lambda f: torch.save(state, f))
    meta = {"arch": arch, "arch_kwargs": dict(arch_kwargs), "public": asdict(public)}
    meta.update(settings=asdict(settings), **info)
    _atomic(path.with_suffix(".json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return state


def _atomic(path: Path, write: Callable[[Any], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pretrain(model: nn.Module, public: PublicSlice, settings: PretrainSettings) -> dict[str, Any]:
    """Train ``model`` in place on the public slice; returns its final training loss/accuracy."""
    from raysim.data.public import load_public_slice

    x_np, y_np = load_public_slice(public.dataset, public.root, public.samples)
    x, y = torch.from_numpy(x_np), torch.from_numpy(np.asarray(y_np, dtype=np.int64))
    gen = torch.Generator().manual_seed(settings.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the bits must not depend on the process's thread count
    try:
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
        for _ in range(settings.epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), settings.batch_size):
                idx = order[i : i + settings.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            out = torch.cat([model(x[i : i + 1024]) for i in range(0, len(y), 1024)])
        loss = float(F.cross_entropy(out, y))
        acc = float((out.argmax(1) == y).float().mean())
    finally:
        torch.set_num_threads(threads)
    model.zero_grad(set_to_none=True)
    return {"train_loss": loss, "train_accuracy": acc, "samples": len(y)}
