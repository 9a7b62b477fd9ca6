"""Models are built in one place: a spec (name + keyword arguments) -> a seeded ``nn.Module``.

Every worker, the driver and the algorithms build their model through :func:`build_from_spec`,
so the keyword arguments of a model reach every copy the same way and no call site special-cases
a model. Two contracts make a model safe to spread over workers that only exchange the flat
vector of *trainable* parameters (``raysim.models.params``):

* the trainable parameters are drawn from ``seed`` (the run's initial weights, or IFCA's random
  cluster models), in ``model.parameters()`` order;
* the frozen parameters (``requires_grad=False``: a LoRA base) are a function of the spec alone,
  never of ``seed`` or of the process, so every worker holds the same frozen part.

The keys a user may set under ``model:`` are the builder's keyword arguments (checked here with
their type hints, before anything runs); ``ENGINE_KEYS`` are filled in by :func:`model_spec` from
the rest of the config (the public pretraining slice) and cannot be set by hand.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from pydantic import ConfigDict, ValidationError, create_model
from torch import nn

from raysim.models.pretrain import PublicSlice
from raysim.seeding import SERVER, torch_generator
from raysim.validation import ConfigModel, error_message, import_named

# Keyword arguments the engine provides (from other config sections), never the user.
ENGINE_KEYS: frozenset[str] = frozenset({"public"})
_POSITIONAL = ("input_shape", "num_classes")


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a registered model name and its keyword arguments."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def _registry() -> dict[str, Callable[..., nn.Module]]:
    from raysim.models.registry import BUILDERS

    return BUILDERS


def _builder(name: str) -> Callable[..., nn.Module]:
    if ":" in name:
        return _import_builder(name)
    reg = _registry()
    if name not in reg:
        from raysim.validation import did_you_mean

        allowed = ", ".join(reg)
        hint = did_you_mean(name, reg)
        raise ValueError(f"model.name: unknown model {name!r}; allowed: {allowed}{hint}")
    return reg[name]


def _import_builder(path: str) -> Callable[..., nn.Module]:
    """``module:Builder``: a model of the user's own, built as the registered ones are, from
    ``(input_shape, num_classes, **kwargs)``; ``module`` must be importable where the clients run
    (the Ray workers: on their ``PYTHONPATH``), as for ``algorithm.name: module:Class``."""
    fn = import_named(path, "model.name")
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if not callable(fn) or params[:2] != list(_POSITIONAL):
        raise ValueError(
            f"model.name: {path!r} must be a class or function taken as "
            "(input_shape, num_classes, **its own keyword arguments) returning a torch.nn.Module"
        )
    return fn


class _BuilderKwargs(ConfigModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


@cache
def _params_model(name: str) -> tuple[type, tuple[str, ...], frozenset[str]]:
    """(pydantic model of the builder's keyword arguments, user keys, engine keys)."""
    fn = _builder(name)
    target = fn.__init__ if inspect.isclass(fn) else fn
    hints = typing.get_type_hints(target)
    fields: dict[str, Any] = {}
    engine: set[str] = set()
    for p in list(inspect.signature(fn).parameters.values()):
        if p.name in _POSITIONAL or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.name in ENGINE_KEYS:
            engine.add(p.name)
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hints.get(p.name, Any), default)
    model = create_model(f"{name}_params", __base__=_BuilderKwargs, **fields)
    return model, tuple(fields), frozenset(engine)


def model_keys(name: str) -> tuple[str, ...]:
    """The keys a user may set under ``model:`` for model ``name``."""
    return _params_model(name)[1]


def check_model_kwargs(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``kwargs`` against the builder's signature; ValueError naming ``model.<key>``."""
    params, keys, _ = _params_model(name)
    allowed = ", ".join(("name", *keys))
    for key in kwargs:
        if key not in keys:
            raise ValueError(f"model.{key}: unknown key for model {name!r}; allowed: {allowed}")
    try:
        return params(**kwargs).model_dump(include=set(kwargs))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        why = error_message(err, params, tuple(err["loc"]))
        raise ValueError(f"model.{key}: {why}; allowed keys: {allowed}") from None


def model_spec(cfg: Any) -> ModelSpec:
    """The spec of ``cfg.model`` (an ExperimentConfig), with the engine's keys filled in."""
    name = cfg.model.name
    kwargs = check_model_kwargs(name, dict(cfg.model.model_extra or {}))
    if "public" in _params_model(name)[2]:
        samples = int(getattr(cfg.data, "public_pretrain_samples", 0))
        kwargs["public"] = (
            PublicSlice(cfg.data.dataset, cfg.data.root, samples) if samples > 0 else None
        )
    return ModelSpec(name, kwargs)


def init_seed(run_seed: int) -> int:
    """The seed of the run's initial weights: the (seed, 0, server, "model_init") stream."""
    return int(torch_generator(run_seed, 0, SERVER, "model_init").initial_seed())


def build_from_spec(
    spec: ModelSpec,
    feature_shape: tuple[int, ...],
    num_classes: int,
    seed: int | None = None,
) -> nn.Module:
    """Build ``spec`` for inputs of ``feature_shape`` (channels first, no batch dim).

    ``num_classes=0`` means regression (one output). With ``seed`` the trainable initial weights
    are a function of the seed alone (the global RNG is saved and restored); without it they come
    from the global RNG. Frozen parameters never depend on ``seed`` (see the module docstring).
    """
    fn = _builder(spec.name)
    shape = tuple(int(d) for d in feature_shape)
    if seed is None:
        return _fits(fn(shape, num_classes, **spec.kwargs), spec.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _fits(fn(shape, num_classes, **spec.kwargs), spec.name)


def _fits(model: Any, name: str) -> nn.Module:
    """The engine moves a model's trainable parameters and nothing else, and DP-SGD clips each
    sample's gradient: a normalisation with running statistics (buffers no round averages) or
    that mixes a batch's samples (BatchNorm) has no place. GroupNorm or LayerNorm does."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.name: {name!r} built a {type(model).__name__}, not a torch.nn.Module"
        )
    for layer, module in model.named_modules():
        why = []
        if getattr(module, "track_running_stats", False):
            why.append("its running statistics are never averaged over clients")
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            why.append("it mixes the samples of a batch, which DP-SGD clips one by one")
        if why:
            raise ValueError(
                f"model.name: {name!r} has {type(module).__name__} {layer or '(the model)'}: "
                f"{' and '.join(why)}; use GroupNorm or LayerNorm"
            )
    return model
