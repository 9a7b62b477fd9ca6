"""Sweep files: a base experiment config, `--set` overrides and a search space over dotted keys.

    base: ../../configs/rdpcfl_quick.yaml   # relative to this file
    name: eps-x-algorithm                    # optional (default: the file's stem)
    set: [rounds=6]                          # optional overrides of the base, as --set
    metric: accuracy                         # optional (default accuracy, mode max)
    num_samples: 1                           # optional: repeats of the grid / random draws
    space:
      privacy.epsilon: {grid: [2, 4, 8]}
      algorithm.name: {grid: [rdpcfl, ifca]}
      training.lr: {loguniform: [0.001, 0.1]}
      training.sampling_rate: {uniform: [0.5, 1.0]}
      algorithm.num_clusters: {choice: [2, 3, 4]}

The random (non-grid) values are drawn from a generator seeded by the base config's `seed`:
the same sweep file and seed try the same hyperparameters.

Every combination of values a trial may take (ranges at their two ends) is validated against
the experiment schema here, before Ray starts; `raysim sweep` then prepares each one
(tune.sweep.check_trials_start).
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raysim.config import (
    DEMO_CONFIG,
    ConfigError,
    apply_overrides,
    build_config,
    format_validation_error,
    read_yaml_mapping,
)

KINDS = ("grid", "choice", "loguniform", "uniform", "randint")
# what every trial reports each round (tune.trainable), beside round and epsilon: a sweep's metric
REPORTED = (
    "accuracy",
    "loss",
    "ari",
    "accuracy_min",
    "accuracy_disparity",
    "accuracy_minority",  # the smallest true cluster's mean (where the clusters differ in size)
)
METRICS = (*REPORTED, "epsilon")
SCHEDULERS = ("fifo", "asha")
TOP_KEYS = {"base", "name", "set", "metric", "mode", "num_samples", "space", "scheduler"}
MAX_COMBINATIONS = 256  # checked against the schema; beyond it, each value on its own


@dataclass
class Sweep:
    name: str
    base: dict[str, Any]  # raw base config with the overrides applied
    space: dict[str, dict[str, Any]]  # dotted key -> {kind: values}
    metric: str = "accuracy"
    mode: str = "max"
    num_samples: int = 1
    scheduler: str | None = None
    overrides: list[str] = field(default_factory=list)

    def param_space(self) -> dict[str, Any]:
        from ray import tune

        out: dict[str, Any] = {}
        for key, spec in self.space.items():
            ((kind, values),) = spec.items()
            if kind == "grid":
                out[key] = tune.grid_search(list(values))
            elif kind == "choice":
                out[key] = tune.choice(list(values))
            else:
                out[key] = getattr(tune, kind)(*values)
        return out


def trial_config(base: dict[str, Any], params: dict[str, Any]):
    """The ExperimentConfig of one trial: base + the trial's dotted-key values."""
    raw = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    items = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in params.items()]
    items = [i.removesuffix("\n...").removesuffix(" ...") for i in items]
    return build_config(apply_overrides(raw, items))


def _values(key: str, spec: Any) -> list[Any]:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"space.{key}: expected one of {{{', '.join(KINDS)}: ...}}, got {spec!r}")
    ((kind, values),) = spec.items()
    if not isinstance(values, list) or not values:
        raise ConfigError(f"space.{key}.{kind}: expected a non-empty list")
    if kind in ("loguniform", "uniform", "randint"):
        if len(values) != 2 or not values[0] < values[1]:
            raise ConfigError(f"space.{key}.{kind}: expected [low, high] with low < high")
        if kind == "loguniform" and values[0] <= 0:
            raise ConfigError(f"space.{key}.loguniform: the low end must be > 0")
        if kind == "randint":  # Tune's upper end is exclusive
            return [values[0], values[1] - 1]
    return values


def variants(space: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials' values that can be named before the sweep runs: every combination of the
    grid and choice values, with each range at its two ends."""
    keys = list(space)
    ends = itertools.product(*(_values(key, space[key]) for key in keys))
    return [dict(zip(keys, combo, strict=True)) for combo in ends]


def one_at_a_time(space: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each key's values on their own, on the base: where the combinations are too many."""
    return [{key: v} for key, spec in space.items() for v in _values(key, spec)]


def label(params: dict[str, Any]) -> str:
    """A trial's values as the sweep file writes them."""
    return ", ".join(f"{k} = {v!r}" for k, v in params.items()) or "the base"


def combinations(space: dict[str, dict[str, Any]]) -> int:
    return math.prod(len(_values(key, spec)) for key, spec in space.items())


def trial_variants(space: dict[str, dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """``variants(space)``, or ``one_at_a_time(space)`` where they are more than ``most``."""
    return variants(space) if combinations(space) <= most else one_at_a_time(space)


def check_values(base: dict[str, Any], space: dict[str, dict[str, Any]]) -> set[str]:
    """Every trial's config valid for its algorithm (the combinations, or each value alone where
    they are more than MAX_COMBINATIONS), before Ray; the keys its algorithm leaves out."""
    from algorithms import get_algorithm
    from raysim.compose import for_algorithm

    dropped: set[str] = set()
    for params in trial_variants(space, MAX_COMBINATIONS):
        try:
            made = trial_config(base, params)
            cfg = for_algorithm(made, quiet=True)
            algo = get_algorithm(cfg.algorithm.name)
            algo.Params(**(cfg.algorithm.model_extra or {}))  # its own keys, before Ray
        except ConfigError as exc:
            raise ConfigError(f"space {label(params)}: {exc}") from None
        except ValidationError as exc:
            msg = format_validation_error(exc, algo.Params, prefix="algorithm")
            raise ConfigError(f"space {label(params)}: {msg}") from None
        extra = set(made.algorithm.model_extra or {})
        dropped |= {f"{cfg.algorithm.name}: {k}" for k in extra - set(algo.Params.model_fields)}
    return dropped


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    p = Path(path)
    raw = read_yaml_mapping(p, "sweep file")
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(
            f"sweep file: unknown keys {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}"
        )
    # left out: the demo, as `raysim run` without CONFIG (not the built-in defaults)
    base_path = (p.parent / raw["base"]).resolve() if raw.get("base") else DEMO_CONFIG
    base = read_yaml_mapping(base_path, "sweep base config")
    sets = list(raw.get("set") or []) + list(overrides or [])
    base = apply_overrides(base, sets)
    made = build_config(yaml.safe_load(yaml.safe_dump(base)))  # the base alone must be valid
    if made.data.root is not None:  # absolute: a trial runs in a directory of its own
        base["data"]["root"] = made.data.root
    space = raw.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise ConfigError("sweep file: `space` must map dotted config keys to {grid|choice|...}")
    dropped = check_values(base, space)
    for item in sorted(dropped):  # as `raysim compare`: one file serves every algorithm
        name, key = item.split(": ")
        print(f"raysim: {name} does not take algorithm.{key}: left out", file=sys.stderr)
    mode = raw.get("mode", "max")
    if mode not in ("max", "min"):
        raise ConfigError(f"sweep file: mode must be max or min, got {mode!r}")
    metric = str(raw.get("metric", "accuracy"))
    if metric not in METRICS:
        raise ConfigError(f"sweep file: metric {metric!r}: allowed: {', '.join(METRICS)}")
    scheduler = raw.get("scheduler")
    if scheduler is not None and scheduler not in SCHEDULERS:
        allowed = ", ".join(SCHEDULERS)
        raise ConfigError(f"sweep file: scheduler {scheduler!r}: allowed: {allowed}")
    num_samples = raw.get("num_samples", 1)
    if type(num_samples) is not int or num_samples < 1:
        raise ConfigError(f"sweep file: num_samples must be an integer >= 1, got {num_samples!r}")
    return Sweep(
        name=str(raw.get("name") or p.stem),
        base=base,
        space=space,
        metric=metric,
        mode=mode,
        num_samples=num_samples,
        scheduler=scheduler,
        overrides=sets,
    )
