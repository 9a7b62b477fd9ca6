"""What the commands share: the config a command line names (with its algorithm's keys only),
and a run with its progress."""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raysim.config import DEMO_CONFIG, ExperimentConfig, load_config


def config_from_args(args: argparse.Namespace, extra: Sequence[str] = ()) -> ExperimentConfig:
    """The named config, or the demo's when none is named, with the --set overrides, without
    the algorithm.* keys that belong to another algorithm (one file serves several)."""
    from raysim.compose import for_algorithm

    sets = list(args.set or []) + list(extra)
    return for_algorithm(load_config(args.config or DEMO_CONFIG, sets))


def _progress(cfg: ExperimentConfig, label: str):
    from tqdm import tqdm

    bar = tqdm(total=cfg.rounds, desc=label, unit="round", disable=not cfg.runtime.progress)

    def update(row: dict[str, Any]) -> None:
        post = {"eps": f"{row['epsilon']:.2f}" if cfg.privacy.mode != "none" else "∞"}
        if "accuracy" in row:
            post["acc"] = f"{100 * row['accuracy']:.1f}%"
        bar.set_postfix(post)
        bar.update(row["round"] - bar.n)  # a resumed run's first row is not round 1

    return bar, update


class ProgressLines:
    """A line now and then instead of a bar, for runs side by side in one terminal (`compare
    --jobs N`: N bars would garble it) that take hours: each must still show that it moves, how
    fast, and how long it has left. The rate is that of the last ``window`` rounds: a run's
    rounds change cost as it goes (R-DPCFL's after E_c score every cluster model, ~2x), and a
    mean over the whole run would keep promising the earlier rate for hours."""

    window = 20  # two evaluation cycles at eval_every=10

    def __init__(self, cfg: ExperimentConfig, label: str, every: float = 60.0):
        self.cfg, self.label, self.every = cfg, label, every
        self.last = time.monotonic()
        # the last `window` rounds of this process (a resumed run's first is later)
        self.seconds: deque[float] = deque(maxlen=self.window)
        self.evaluated: tuple[int, float] | None = None

    def update(self, row: dict[str, Any]) -> None:
        self.seconds.append(float(row.get("round_seconds", 0.0)))
        if "accuracy" in row:
            self.evaluated = (row["round"], row["accuracy"])
        done, total = row["round"], self.cfg.rounds
        quiet = time.monotonic() - self.last < self.every and done < total
        if quiet or not self.cfg.runtime.progress:
            return
        self.last = time.monotonic()
        per_round = sum(self.seconds) / len(self.seconds)
        parts = [f"{self.label}: round {done}/{total}", f"{per_round:.1f} s/round"]
        if self.evaluated is not None:
            parts.append(f"accuracy {100 * self.evaluated[1]:.1f}% at round {self.evaluated[0]}")
        if self.cfg.privacy.mode != "none":
            parts.append(f"eps {row['epsilon']:.2f}")
        if done < total:
            parts.append(f"~{(total - done) * per_round / 60:.0f} min left")
        print(", ".join(parts), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def run_one(
    prep: Any,
    out: Path,
    resume: bytes | None = None,
    overwrite: bool = False,
    label: str | None = None,
    lines: bool = False,
    **kw: Any,
) -> None:
    """``run_prepared`` with a progress bar, or with ``lines`` a line a minute (a long run must
    show that it moves, and how fast); ``kw``: its other options."""
    from raysim.runtime.run import run_prepared

    cfg = prep.cfg
    label = label or cfg.algorithm.name
    if lines:
        bar = ProgressLines(cfg, label)
        update = bar.update
    else:
        bar, update = _progress(cfg, label)
    try:
        run_prepared(prep, out, on_round=update, resume=resume, overwrite=overwrite, **kw)
    finally:
        bar.close()
