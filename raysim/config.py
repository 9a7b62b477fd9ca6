"""Typed experiment configuration: YAML + ``--set dotted.key=value`` overrides, validated up front.

Validation happens here, before Ray starts, so a user mistake costs nothing and gets a message
naming the field and the allowed values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DATASETS = ("digits", "fmnist", "mnist", "synthetic_linear", "cifar10")
SHIFTS = ("none", "rotation", "label_flip")
PRIVACY_MODES = ("none", "sample", "client")


class ConfigError(ValueError):
    """A user mistake in the experiment config (CLI exit code 2)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    dataset: str = "digits"
    num_clients: int = Field(100, gt=0)
    cluster_sizes: list[int] | None = None
    cluster_ratios: list[float] | None = None
    shift: Literal["none", "rotation", "label_flip"] = "rotation"
    dirichlet_alpha: float | None = Field(None, gt=0)
    samples_per_client: int | None = Field(None, gt=0)
    train_fraction: float = Field(0.8, gt=0, lt=1)
    root: str | None = None
    # synthetic_linear only
    dim: int = Field(10, gt=0)
    noise_std: float = Field(0.1, ge=0)
    cluster_separation: float = Field(1.0, gt=0)

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        if v not in DATASETS:
            raise ValueError(f"unknown dataset {v!r}; allowed: {', '.join(DATASETS)}")
        return v

    @field_validator("cluster_sizes")
    @classmethod
    def _positive_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) <= 0):
            raise ValueError("cluster sizes must be a non-empty list of positive integers")
        return v

    @field_validator("cluster_ratios")
    @classmethod
    def _positive_ratios(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or min(v) <= 0):
            raise ValueError("cluster ratios must be a non-empty list of positive numbers")
        return v

    @field_validator("root")
    @classmethod
    def _root_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"data directory {v!r} does not exist")
        return v

    @model_validator(mode="after")
    def _sizes_add_up(self) -> DataConfig:
        if self.cluster_sizes is not None and self.cluster_ratios is not None:
            raise ValueError("give cluster_sizes or cluster_ratios, not both")
        if self.cluster_sizes is not None and sum(self.cluster_sizes) != self.num_clients:
            raise ValueError(
                f"cluster_sizes {self.cluster_sizes} add up to {sum(self.cluster_sizes)}, "
                f"not num_clients={self.num_clients}"
            )
        return self

    @property
    def num_clusters(self) -> int:
        sizes = self.cluster_sizes or self.cluster_ratios
        return len(sizes) if sizes else 1


class ModelConfig(_Section):
    name: str = "cnn"
    hidden: int = Field(64, gt=0)  # mlp width


class AlgorithmConfig(BaseModel):
    """`name` plus the algorithm's own parameters (validated by the algorithm's Params model)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = "fedavg"
    num_clusters: int | None = Field(None, gt=0)
    server_lr: float = Field(1.0, gt=0)


class PrivacyConfig(_Section):
    mode: Literal["none", "sample", "client"] = "sample"
    epsilon: float | None = Field(4.0, gt=0)
    delta: float = Field(1e-4, gt=0, lt=1)
    clip: float = Field(3.0, gt=0)  # per-sample clip C (sample) or update clip C_theta (client)
    noise_multiplier: float | None = Field(None, ge=0)  # set to skip calibration
    accountant: Literal["rdp", "pld"] = "rdp"

    @model_validator(mode="after")
    def _budget_given(self) -> PrivacyConfig:
        if self.mode != "none" and self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("privacy.epsilon or privacy.noise_multiplier is required under DP")
        return self


class TrainingConfig(_Section):
    lr: float = Field(0.05, gt=0)
    batch_size: int = Field(32, gt=0)
    local_epochs: int = Field(1, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    physical_batch_size: int = Field(256, gt=0)
    sampling_rate: float = Field(1.0, gt=0, le=1)  # client participation rate q
    sampling: Literal["poisson", "without_replacement"] = "poisson"
    eval_every: int = Field(1, gt=0)


class RuntimeConfig(_Section):
    num_workers: int = Field(2, gt=0)
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float | Literal["auto"] = "auto"
    threads_per_worker: int = Field(1, gt=0)  # torch threads; fixed so bits don't depend on it
    address: str | None = None  # "auto" or ray://...: connect instead of starting a local Ray
    actor_per_client: bool = False
    # Clients trained at once by the vectorized trainer (fixed from the cohort, see
    # runtime/pool.py); "auto": 32 on a GPU, 1 on CPU. vectorize=false: always the per-client
    # Opacus/torch.optim path (the reference implementation).
    client_group_size: int | Literal["auto"] = "auto"
    vectorize: bool = True
    progress: bool = True
    round_timeout_s: float = Field(3600.0, gt=0)
    checkpoint_every: int = Field(1, ge=0)  # rounds between checkpoints; 0: none
    max_coordinator_restarts: int = Field(3, ge=0)  # from the last checkpoint, in one session

    @field_validator("client_group_size")
    @classmethod
    def _group_size(cls, v: int | str) -> int | str:
        if v != "auto" and int(v) < 1:
            raise ValueError(f"client_group_size must be a positive integer or 'auto', got {v}")
        return v

    @field_validator("gpus_per_worker")
    @classmethod
    def _gpu_fraction(cls, v: float | str) -> float | str:
        if v != "auto" and not 0 < float(v) <= 1:
            raise ValueError(f"GPU fraction must be in (0, 1] or 'auto', got {v}")
        return v


class ExperimentConfig(_Section):
    name: str = "experiment"
    rounds: int = Field(20, gt=0)
    seed: int = Field(0, ge=0)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="after")
    def _client_level_delta(self) -> ExperimentConfig:
        # The sample-level bound (delta < 1/smallest client dataset) needs the data: see
        # experiment.check_against_data.
        if self.privacy.mode == "client" and self.privacy.delta >= 1 / self.data.num_clients:
            raise ValueError(
                f"privacy.delta={self.privacy.delta} must be below 1/num_clients = "
                f"{1 / self.data.num_clients:.3g} for client-level DP"
            )
        return self


def _parse_value(text: str) -> Any:
    """`--set` values are YAML scalars/lists: 0.1, true, [3, 6], null, fmnist."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        key, value = item.split("=", 1)
        node = raw
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[leaf] = _parse_value(value)
    return raw


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "literal_error":
            msg = f"{msg} (got {err.get('input')!r})"
        lines.append(f"{field}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(raw: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read YAML (or the defaults when path is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return build_config(apply_overrides(raw, overrides or []))


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
