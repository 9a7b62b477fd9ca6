"""An algorithm named by a config, brought to the engine: the config with the named
algorithm's keys only, the experiment prepared with it, and many prepared at once (in a forked
child) to refuse a budget none of them can meet before any runs. The command line, sweeps and
the Python API use these; the engine never looks an algorithm up. The algorithms load where
they are used (they bring torch): a driver that only forks the preparing child never loads
them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from raysim.config import ConfigError, ExperimentConfig


def for_algorithm(cfg: Any, quiet: bool = False) -> Any:
    """The config without the ``algorithm.*`` keys its algorithm does not take, so one file can
    carry e.g. rdpcfl's keys and still run fedavg (``raysim run`` refuses unknown keys)."""
    from algorithms import ALGORITHMS, get_algorithm
    from raysim.config import build_config

    algorithm = get_algorithm(cfg.algorithm.name)
    fields = set(algorithm.Params.model_fields)
    # Only keys another algorithm takes: a typo stays, to be refused with a suggestion.
    known = {k for a in ALGORITHMS.values() for k in a.Params.model_fields}
    drop = [
        f"algorithm.{k}"
        for k in sorted(cfg.algorithm.model_extra or {})
        if k not in fields and k in known
    ]
    if not algorithm.moves_models:  # e.g. local beside fedavg with a server optimizer
        drop += cfg.algorithm.server_keys_set()
    if not drop:
        return cfg
    if not quiet:
        print(
            f"raysim: {cfg.algorithm.name} does not take {', '.join(drop)}: left out",
            file=sys.stderr,
        )
    raw = cfg.model_dump()
    for k in drop:
        raw["algorithm"].pop(k.removeprefix("algorithm."))
    return build_config(raw)


def prepare_named(cfg: ExperimentConfig, dataset: Any = None):
    """``cfg`` prepared (data built, noise calibrated) with the algorithm it names."""
    from algorithms import Environment, get_algorithm
    from raysim.engine.experiment import prepare

    return prepare(cfg, get_algorithm(cfg.algorithm.name), Environment, dataset)


def check_budgets(runs: Sequence[tuple[str, Any]], what: str = "runs") -> None:
    """Each (label, config) prepared (its data built, its noise calibrated) before any run
    starts: a budget or a split it cannot meet is refused now, not after the runs before it, and
    every such run is named in one ConfigError. In a forked child, which keeps torch out of this
    process (Ray and the zygote come after)."""
    from raysim.engine.experiment import prepare_apart

    if not runs:
        return

    def build() -> list:
        refused = []  # in the child: the algorithms (and torch) load here
        for label, cfg in runs:
            try:
                prepare_named(cfg)
            except ConfigError as exc:
                refused.append(f"\n  {label}: {exc}")
        if refused:
            head = f"{len(refused)} of {len(runs)} {what} cannot start (nothing ran):"
            raise ConfigError(head + "".join(refused))
        return []

    prepare_apart(build)
