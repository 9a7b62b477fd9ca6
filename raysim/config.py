"""Typed experiment configuration: YAML + ``--set dotted.key=value`` overrides, validated up front.

Validation happens here, before Ray starts, so a user mistake costs nothing and gets a message
naming the field and the allowed values.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# re-exported: the layers above know these by raysim.config's name
from raysim.validation import (  # noqa: F401
    MESSAGE_LIMIT,
    ConfigError,
    ConfigModel,
    brief,
    check_import_path,
    did_you_mean,
    error_message,
    import_named,
    shorten,
)

DATASETS = ("digits", "fmnist", "mnist", "synthetic_linear", "cifar10", "npz")
SHIFTS = ("none", "rotation", "label_flip")
# the privacy modes by name: the built-in ones, then any raysim.privacy.modes.register_mode adds
PRIVACY_MODES = ["none", "sample", "client", "distributed", "dprivacy"]
DEMO_CONFIG = Path(__file__).with_name("demo.yaml")  # the default experiment
# The most rounds a config may ask for. Every round leaves records that the run keeps to its end
# (a metrics row, the noise schedule's phase, the privacy ledger's charges), so a run's memory
# grows with its rounds; the longest runs of the papers raysim reproduces are a few thousand.
MAX_ROUNDS = 100_000
MAX_ERRORS = 20  # validation errors listed in one message; the count of the rest follows


class _Section(ConfigModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    dataset: str = Field(
        "digits",
        description="The base dataset: digits (scikit-learn, always there), fmnist, mnist, "
        "cifar10 (offline copies), synthetic_linear (generated) or npz (your own "
        "arrays in data.root). `raysim list datasets`.",
    )
    num_clients: int = Field(
        100,
        gt=0,
        description="Clients in the population.",
    )
    cluster_sizes: list[int] | None = Field(
        None,
        description="Clients per true cluster (adding up to num_clients); the smallest cluster is "
        "the minority. null: one cluster, or the clusters an npz file's cluster array "
        "gives.",
    )
    cluster_ratios: list[float] | None = Field(
        None,
        description="Clients per true cluster as proportions (instead of cluster_sizes), e.g. [2, "
        "1, 1]; proportions that do not add up to 1 are normalised, with a warning.",
    )
    shift: Literal["none", "rotation", "label_flip"] = Field(
        "rotation",
        description="How the clusters differ: rotation (cluster k's images rotated by k*90 "
        "degrees), label_flip (cluster k relabels y -> (y + k) mod classes) or none.",
    )
    dirichlet_alpha: float | None = Field(
        None,
        gt=0,
        description="Label skew inside each cluster: each client's label proportions drawn from "
        "Dirichlet(alpha); null: an even split.",
    )
    samples_per_client: int | None = Field(
        None,
        gt=0,
        description="Images per client (train and test together); null: the dataset split evenly "
        "over the clients.",
    )
    train_fraction: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="The share of each client's rows it trains on; the rest is its test set.",
    )
    root: str | None = Field(
        None,
        description="Where the data is: a directory of IDX files (mnist, fmnist) or CIFAR-10 "
        "batches, or the .npz file of dataset npz. null: the known places "
        "(docs/usage.md).",
    )
    public_pretrain_samples: int = Field(
        0,
        ge=0,
        description="The last N images of the training file, kept out of the federated partition: "
        "the public, unrotated slice a frozen base (LoRA models) is pretrained on.",
    )
    dim: int = Field(
        10,
        gt=0,
        description="synthetic_linear: the features' dimension (taken from true_weights when "
        "those are given).",
    )
    noise_std: float = Field(
        0.1,
        ge=0,
        description="synthetic_linear with label_noise gaussian: the labels' noise std.",
    )
    cluster_separation: float = Field(
        1.0,
        gt=0,
        description="synthetic_linear, drawn weights: how far apart the clusters' true weights "
        "are drawn.",
    )
    true_weights: list[list[float]] | None = Field(
        None,
        description="synthetic_linear: one row of dim weights per cluster (null: drawn).",
    )
    true_bias: list[float] | None = Field(
        None,
        description="synthetic_linear: one bias per cluster (0 when true_weights are given and "
        "this is not).",
    )
    label_noise: Literal["gaussian", "uniform"] = Field(
        "gaussian",
        description="synthetic_linear: the labels' noise, N(0, noise_std^2) or U[0, 1].",
    )
    input_dist: Literal["normal", "uniform"] = Field(
        "normal",
        description="synthetic_linear: x ~ N(0, I) or U[-1, 1]^dim.",
    )
    draws: Literal["per_client", "sequential"] = Field(
        "per_client",
        description="How a client's rows are drawn: per_client, from its own generator (seed, "
        "client), so that any client's rows can be made alone; sequential: one generator "
        "drawn client after client, as runs made before per-client draws were drawn (to "
        "reproduce or continue one).",
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        if v not in DATASETS:
            raise ValueError(
                f"unknown dataset {v!r}; allowed: {', '.join(DATASETS)}{did_you_mean(v, DATASETS)}"
            )
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
    def _absolute_root(cls, v: str | None) -> str | None:
        """Relative to where the command runs: a sweep's trials and a cluster's driver run in
        other directories."""
        return None if v is None else str(Path(v).expanduser().absolute())

    @model_validator(mode="after")
    def _root_exists(self) -> DataConfig:
        root = None if self.root is None else Path(self.root)
        if self.dataset == "npz":  # the researcher's own arrays (raysim.data.arrays)
            if root is None or not root.is_file():
                why = "none is given" if root is None else _not_a("file", root)
                raise ValueError(
                    f"data.root: dataset npz reads the .npz file data.root names; {why}"
                )
        elif root is not None and not root.is_dir():
            raise ValueError(f"data.root: {_not_a('directory', root)} (the data directory)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _dim_from_true_weights(cls, data: Any) -> Any:
        """A given ``true_weights`` fixes the dimension: ``dim`` need not repeat it."""
        if isinstance(data, dict) and "dim" not in data:
            rows = data.get("true_weights")
            if isinstance(rows, list) and rows and isinstance(rows[0], list) and rows[0]:
                return {**data, "dim": len(rows[0])}
        return data

    @model_validator(mode="after")
    def _true_parameters_fit(self) -> DataConfig:
        k = self.num_clusters
        if self.true_weights is not None:
            w = self.true_weights
            if len(w) != k or any(len(row) != self.dim for row in w):
                raise ValueError(
                    f"true_weights must be {k} row(s) (one per cluster) of dim={self.dim} "
                    f"numbers, got {brief(w)}"
                )
            if not all(math.isfinite(v) for row in w for v in row):
                raise ValueError(f"true_weights must be finite, got {brief(w)}")
        if self.true_bias is not None:
            if self.true_weights is None:
                raise ValueError("true_bias needs true_weights (drawn weights draw their bias)")
            if len(self.true_bias) != k or not all(math.isfinite(v) for v in self.true_bias):
                raise ValueError(
                    f"true_bias must be {k} finite number(s), got {brief(self.true_bias)}"
                )
        return self

    @model_validator(mode="after")
    def _sizes_add_up(self) -> DataConfig:
        if self.cluster_sizes is not None and self.cluster_ratios is not None:
            raise ValueError("give cluster_sizes or cluster_ratios, not both")
        if self.cluster_sizes is not None and sum(self.cluster_sizes) != self.num_clients:
            raise ValueError(
                f"cluster_sizes {brief(self.cluster_sizes)} add up to {sum(self.cluster_sizes)}, "
                f"not num_clients={self.num_clients}"
            )
        return self

    @property
    def num_clusters(self) -> int:
        sizes = self.cluster_sizes or self.cluster_ratios
        return len(sizes) if sizes else 1


class ModelConfig(ConfigModel):
    """`name` plus the model's own keyword arguments (``hidden`` for mlp, ``rank`` for the LoRA
    models...), checked against the builder's signature (raysim.models.spec)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = Field(
        "cnn",
        description="The model: cnn, galli_cnn, mlp, linear, resnet18, vit, cnn_lora, vit_lora, or "
        "module:Name for one of your own (a class or function taking (input_shape, "
        "num_classes, **kwargs)). Its keyword arguments are further model.* keys.",
    )

    @field_validator("name")
    @classmethod
    def _importable_name(cls, v: str) -> str:
        if ":" in v:
            check_import_path(v, "model.name")
        return v

    @model_validator(mode="before")
    @classmethod
    def _legacy_hidden(cls, data: Any, info: ValidationInfo) -> Any:
        # Configs written before models took arbitrary keys dump `hidden: 64` (the old default)
        # for every model; drop it where the model has no such key so old runs still resume.
        if _lean(info):
            return data
        if isinstance(data, dict) and data.get("hidden") == 64:
            from raysim.models.spec import model_keys

            try:
                if "hidden" not in model_keys(str(data.get("name", "cnn"))):
                    data = {k: v for k, v in data.items() if k != "hidden"}
            except ValueError:
                pass  # unknown name: reported by the check below
        return data

    @model_validator(mode="after")
    def _known_keys(self, info: ValidationInfo) -> ModelConfig:
        if _lean(info):  # the builders' signatures are read with torch loaded
            return self
        from raysim.models.spec import check_model_kwargs

        check_model_kwargs(self.name, self.model_extra or {})
        return self


class AlgorithmConfig(ConfigModel):
    """`name` plus the algorithm's own parameters (validated by the algorithm's Params model)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = Field(
        "fedavg",
        description="The federated algorithm (`raysim list algorithms`), or module:Class for one "
        "of your own; its parameters are further algorithm.* keys.",
    )
    num_clusters: int | None = Field(
        None,
        gt=0,
        description="Cluster models the server keeps, for the algorithms that take it (null: the "
        "algorithm's own default or choice).",
    )
    server_lr: float = Field(
        1.0,
        gt=0,
        description="The server optimizer's learning rate on each model's aggregated update (1: "
        "plain averaging with sgd). Post-processing of what the mode released: costs "
        "no privacy.",
    )
    server_optimizer: Literal["sgd", "adam", "adagrad"] = Field(
        "sgd",
        description="The server's optimizer on the aggregated updates (FedOpt, Reddi et al. "
        "2021): sgd (averaging, with server_momentum: FedAvgM), adam or adagrad.",
    )
    server_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="sgd's momentum on the aggregated update (0.9: FedAvgM).",
    )
    server_betas: tuple[float, float] = Field(
        (0.9, 0.99),
        description="adam's betas.",
    )
    server_tau: float = Field(
        1e-3,
        gt=0,
        description="adam's and adagrad's adaptivity (torch's eps).",
    )

    @field_validator("name")
    @classmethod
    def _importable_name(cls, v: str) -> str:
        if ":" in v:
            check_import_path(v, "algorithm.name")
        return v

    @field_validator("server_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1) (got {list(v)})")
        return v

    def server_keys_set(self) -> list[str]:
        """The server optimizer's keys set away from their defaults (plain averaging)."""
        keys = ("server_lr", "server_optimizer", "server_momentum", "server_betas", "server_tau")
        fields = type(self).model_fields
        return [f"algorithm.{k}" for k in keys if getattr(self, k) != fields[k].default]

    @model_validator(mode="after")
    def _optimizer_keys(self) -> AlgorithmConfig:
        if self.server_momentum and self.server_optimizer != "sgd":
            raise ValueError(
                f"algorithm.server_momentum is sgd's only, and server_optimizer is "
                f"{self.server_optimizer} (adam's first moment is algorithm.server_betas[0]; "
                "adagrad keeps none): leave server_momentum out"
            )
        return self


class PrivacyConfig(_Section):
    mode: str = Field(
        "sample",
        description="Who is trusted (`raysim list modes`, docs/privacy.md): none, sample (DP-SGD "
        "per client), client (trusted server, central noise), distributed (untrusted "
        "server, secure aggregation), dprivacy (metric local DP), a mode registered with "
        "raysim.privacy.modes.register_mode, or module:Name for one of your own (a PrivacyMode "
        "subclass, docs/architecture.md).",
        json_schema_extra={
            "anyOf": [
                {"enum": list(PRIVACY_MODES)},
                {"pattern": r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"},
            ]
        },
    )

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if ":" in v:
            check_import_path(v, "privacy.mode")
        elif v not in PRIVACY_MODES:
            raise ValueError(
                f"privacy.mode: unknown mode {brief(v)}; allowed: {', '.join(PRIVACY_MODES)}, "
                "or module:Name for a mode of your own"
            )
        return v

    epsilon: float | None = Field(
        4.0,
        gt=0,
        description="The budget per client, spent exactly by the planned schedule (calibrated "
        "before the run; a run never spends more). null with noise_multiplier set: no "
        "calibration.",
    )
    delta: float = Field(
        1e-4,
        gt=0,
        lt=1,
        description="The delta of (eps, delta)-DP; below 1/smallest client dataset (sample), "
        "1/num_clients (client) or 1/population (distributed, default "
        "population^-1.1).",
    )
    clip: float = Field(
        3.0,
        gt=0,
        description="The clipping norm: per sample under sample (DP-SGD's C), per client update "
        "under client and distributed (the starting clip when clip_quantile is set).",
    )
    noise_multiplier: float | None = Field(
        None,
        ge=0,
        description="The noise multiplier z, given instead of calibrated from epsilon (the ledger "
        "then reports what it spends).",
    )
    clip_quantile: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="client, distributed: adaptive clipping (Andrew et al. 2021): the clip "
        "follows this quantile of the cohort's update norms, learnt from a noisy "
        "count charged with the sums.",
    )
    clip_lr: float = Field(
        0.2,
        gt=0,
        description="Adaptive clipping's rate eta_C: after each round the clip moves by "
        "exp(-clip_lr (b - quantile)).",
    )
    clip_count_noise: float | None = Field(
        None,
        gt=0,
        description="client mode, adaptive clipping: the noise std of the count of updates under "
        "the clip (default: the cohort / 20).",
    )
    accountant: Literal["rdp", "pld"] = Field(
        "rdp",
        description="The privacy accountant of dp_accounting: rdp or pld.",
    )
    noise_cohort_size: int | None = Field(
        None,
        gt=0,
        description="distributed: the cohort the noise is sized for. null: the real expected "
        "cohort (training.sampling_rate x data.num_clients) where the population is simulated "
        "in full (privacy.population unset or data.num_clients), so the run trains with the "
        "noise its epsilon pays for; else 10000. A cohort larger than the real one is the "
        "noise-cohort convention of McMahan et al. 2018, labelled as such in every output.",
    )
    population: int | None = Field(
        None,
        gt=0,
        description="distributed: the population sampled from, for accounting (default: "
        "data.num_clients).",
    )
    noise_source: Literal["server", "clients"] = Field(
        "server",
        description="distributed: server (one draw by the simulated aggregator) or clients "
        "(per-client noise shares that add up under secure aggregation).",
    )
    dropout_tolerance: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="noise_source clients: the share t of the expected cohort that may drop out "
        "before the aggregator must add noise; each share is sized for (1 - t) of the "
        "expected members.",
    )
    shortfall: Literal["top_up", "abort"] = Field(
        "top_up",
        description="A round with fewer members than the shares were sized for: top_up (the "
        "aggregator adds the noise they lack) or abort (it releases nothing, as a "
        "real secure aggregation must).",
    )
    nu: float = Field(
        1.0,
        gt=0,
        description="dprivacy: the metric-DP parameter; a release leaks n / nu (eps = n / (nu "
        "||delta||)).",
    )
    leakage_cap: float | None = Field(
        None,
        gt=0,
        description="dprivacy: a per-client total leakage; a client whose next release would "
        "cross it sits the round out.",
    )
    client_seed: int | Literal["same_as_seed"] | None = Field(
        None,
        description="sample, distributed, dprivacy: the seed of the clients' own draws (DP-SGD "
        "noise and batches, choices, noise shares), never held by the server's "
        "process. null: drawn from the OS and recorded in the run's config.yaml; "
        "same_as_seed: the run's seed (a reproduction mode in which the server could "
        "redraw the clients' noise).",
    )

    @field_validator("client_seed", mode="before")
    @classmethod
    def _client_seed(cls, v: Any) -> Any:
        whole = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        if v is None or v == "same_as_seed" or whole:
            return v
        hint = did_you_mean(v, ["same_as_seed"]) if isinstance(v, str) else ""
        raise ValueError(f"must be a whole number >= 0, 'same_as_seed' or null (got {v!r}){hint}")

    @model_validator(mode="after")
    def _budget_given(self) -> PrivacyConfig:
        needs_budget = self.mode not in ("none", "dprivacy")
        if needs_budget and self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("privacy.epsilon or privacy.noise_multiplier is required under DP")
        if self.clip_quantile is not None and self.mode not in ("client", "distributed"):
            raise ValueError(
                f"privacy.clip_quantile (adaptive clipping) clips client updates: set "
                f"privacy.mode=client or distributed, or leave it out under mode {self.mode!r}"
            )
        if self.clip_count_noise is not None and self.mode != "client":
            raise ValueError(
                "privacy.clip_count_noise is client mode's count noise: under distributed DP "
                "the count is noised inside the secure sum; leave it out"
            )
        shares = (self.mode, self.noise_source) == ("distributed", "clients")
        for key, given in (
            ("dropout_tolerance", self.dropout_tolerance != 0),
            ("shortfall", self.shortfall != "top_up"),
        ):
            if given and not shares:
                raise ValueError(
                    f"privacy.{key} is about the clients' noise shares: set "
                    "privacy.mode=distributed and privacy.noise_source=clients, or leave it out"
                )
        if needs_budget and self.noise_multiplier == 0:
            raise ValueError(
                f"privacy.noise_multiplier=0 adds no noise (eps = infinity) under mode "
                f"{self.mode!r}: give a multiplier > 0, or use privacy.mode=none"
            )
        return self


class TrainingConfig(_Section):
    lr: float = Field(
        0.05,
        gt=0,
        description="The clients' local learning rate.",
    )
    batch_size: int = Field(
        32,
        gt=0,
        description="The clients' batch size (under sample: the expected Poisson batch of DP-SGD).",
    )
    local_epochs: int = Field(
        1,
        gt=0,
        description="Passes over its data a client makes per round.",
    )
    momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="The clients' SGD momentum.",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="The clients' L2 weight decay.",
    )
    physical_batch_size: int = Field(
        256,
        gt=0,
        description="DP-SGD: the most samples per forward pass (memory), without changing the "
        "logical batch.",
    )
    sampling_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="q: the probability that a client takes part in a round (poisson) or the "
        "cohort's share (without_replacement).",
    )
    sampling: Literal["poisson", "without_replacement"] = Field(
        "poisson",
        description="How each round's cohort is drawn: poisson (each client with probability q) "
        "or without_replacement (a fixed-size cohort).",
    )
    client_dropout: float | list[float] = Field(
        0.0,
        description="The probability that a sampled client is unavailable in a round (neither "
        "trains nor reports); a list gives one per true cluster, so one cluster's "
        "devices can be less available.",
    )
    dropout_correlation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="rho: how much a client's unavailability carries over to the next round (0: "
        "independent rounds); the long-run rate stays client_dropout.",
    )
    eval_every: int = Field(
        1,
        gt=0,
        description="Rounds between evaluations on the clients' test sets (the last round is "
        "always evaluated).",
    )
    eval_clients: int | None = Field(
        None,
        gt=0,
        description="Clients evaluated at each evaluation: a cohort drawn once from the run's "
        "seed, its mean accuracy given with a 95% confidence interval (a million clients "
        "cannot all be judged every time); null: every client.",
    )
    held_out_clients: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Share of the population kept out of training and judged at every "
        "evaluation instead of the training clients (validation on held-out clients, as in "
        "Galli et al.): drawn once from the run's seed, never trained, so what the metrics and "
        "early_stop_patience read is how the models do on clients they never saw; null: every "
        "client trains and is judged.",
    )
    early_stop_patience: int | None = Field(
        None,
        gt=0,
        description="Stop when the judged clients' mean test loss has not improved for this "
        "many evaluations (null: never).",
    )
    regression_loss: Literal["mse", "rmse"] = Field(
        "mse",
        description="A regression task's loss, in local training (per batch), the clients' "
        "choice of model and their evaluation: mse, or rmse, the root of the mean squared error "
        "(Galli et al.'s Eq. 14), whose gradient has about unit norm at any distance.",
    )

    @field_validator("client_dropout")
    @classmethod
    def _client_dropout(cls, v: float | list[float]) -> float | list[float]:
        rates = v if isinstance(v, list) else [v]
        if not rates or not all(0 <= r < 1 for r in rates):
            raise ValueError(
                f"expected a probability in [0, 1), or a list of them (one per true cluster), "
                f"got {brief(v)}"
            )
        return v

    @model_validator(mode="after")
    def _correlation_needs_dropout(self) -> TrainingConfig:
        rates = self.client_dropout
        if self.dropout_correlation and not any(rates if isinstance(rates, list) else [rates]):
            raise ValueError(
                "training.dropout_correlation correlates unavailability across rounds: give "
                "training.client_dropout a rate above 0, or leave it out"
            )
        return self


class RuntimeConfig(_Section):
    num_workers: int = Field(
        2,
        gt=0,
        description="Processes that train clients (the coordinator's included where it trains).",
    )
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        description="CPUs Ray reserves for each worker actor.",
    )
    gpus_per_worker: float | Literal["auto"] = Field(
        "auto",
        description="The GPU fraction of each worker (e.g. 0.25: four share a GPU); auto: the "
        "cluster's GPUs shared evenly, 0 without GPUs.",
    )
    threads_per_worker: int = Field(
        1,
        gt=0,
        description="torch threads per worker, fixed so that the bits do not depend on the "
        "machine.",
    )
    address: str | None = Field(
        None,
        description="auto or ray://HOST:PORT: join a running Ray cluster instead of starting a "
        "local Ray.",
    )
    actor_per_client: bool = Field(
        False,
        description="One actor per client (small populations only) instead of a shared pool.",
    )
    client_group_size: int | Literal["auto"] = Field(
        "auto",
        description="Clients trained at once by the vectorized trainer; auto: 32 on a GPU, 1 on a "
        "CPU.",
    )
    vectorize: bool = Field(
        True,
        description="false: always the per-client Opacus / torch.optim path (the reference "
        "implementation).",
    )
    eval_group_size: int = Field(
        64,
        gt=0,
        description="Clients per evaluation group: the clients of a group judged on the same "
        "model share forward passes.",
    )
    coordinator_trains: bool = Field(
        True,
        description="The coordinator's process trains clients itself as one of num_workers, where "
        "allowed (a trusted server, CPU only); false: every shard on a worker actor.",
    )
    fork_workers: bool = Field(
        True,
        description="A local Ray's workers are forked from a process with torch and raysim loaded "
        "(faster start); false: Ray starts them itself.",
    )
    population: Literal["auto", "table", "lazy"] = Field(
        "auto",
        description="How the clients' rows reach the workers (the same rows either way): table, "
        "all built at the start and shared; lazy, each client's made on the worker when it is "
        "sampled or evaluated (memory and start-up independent of the number of clients); "
        "auto: lazy where clients share the dataset's images, else table.",
    )
    progress: bool = Field(
        True,
        description="A progress bar per run (a line a minute where runs go side by side).",
    )
    round_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Seconds a round may take before the run fails (a lost cluster never hangs a "
        "run).",
    )
    checkpoint_every: int = Field(
        1,
        ge=0,
        description="Rounds between checkpoints (0: none); the last round always gets one.",
    )
    max_coordinator_restarts: int = Field(
        3,
        ge=0,
        description="Times a lost coordinator is restarted from the last checkpoint within one "
        "session.",
    )

    @property
    def forks_workers(self) -> bool:
        """Whether a zygote serves this runtime's workers: a local Ray, not turned off."""
        return self.fork_workers and not self.address

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v == "auto" or v.startswith("ray://") or _host_port(v):
            return v
        raise ValueError(f"expected auto, ray://HOST:PORT or HOST:PORT (or null), got {v!r}")

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


TRACKING_BACKENDS = ("none", "tensorboard", "mlflow")  # raysim.metrics.tracking


class TrackingConfig(_Section):
    backend: Literal["none", "tensorboard", "mlflow"] = Field(
        "none",
        description="Where params, per-round metrics and result files are also logged: "
        "tensorboard or mlflow (`pip install -e '.[tracking]'`); none: the run directory only.",
    )
    dir: str | None = Field(
        None,
        description="TensorBoard's log directory (default: the run directory's tensorboard/; a "
        "sweep's logs go into each trial's directory).",
    )
    uri: str | None = Field(
        None,
        description="MLflow's tracking URI: a server (http://HOST:PORT) or a local store "
        "(default: file store ./mlruns beside the command).",
    )
    experiment: str | None = Field(
        None,
        description="The MLflow experiment the runs go into (default: the config's name).",
    )


class ExperimentConfig(_Section):
    name: str = Field(
        "experiment",
        description="The run's name: the default run directory is runs/NAME-TIME. One plain "
        "directory name (no path separator, no '..').",
    )
    rounds: int = Field(
        20,
        gt=0,
        le=MAX_ROUNDS,
        description="a run keeps a few records per round to its end (metrics, the noise "
        "schedule, the privacy ledger): its memory grows with its rounds",
    )
    seed: int = Field(
        0,
        ge=0,
        description="The run's seed: every draw of the server's (sampling, initialisation, the "
        "data partition) is keyed by (seed, round, client, purpose), so the same seed "
        "gives the same bits on any number of workers.",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        """The name is a directory's (runs/NAME-TIME): it must stay one directory, in runs/."""
        bad = [c for c in ("/", "\\", "\0") if c in v]
        if not v.strip() or ".." in v or bad or len(v) > 128 or v.startswith((".", "-")):
            raise ValueError(
                "must be a plain name of at most 128 characters (it names the run's directory "
                "under runs/): no path separator (/ or \\), no '..', not starting with '.' or "
                f"'-' (got {brief(v)})"
            )
        return v

    def evaluated_after(self, round: int) -> bool:
        """Whether the clients are evaluated after ``round``: every ``training.eval_every``
        rounds, and after the last."""
        return round % self.training.eval_every == 0 or round == self.rounds

    @model_validator(mode="after")
    def _distributed_defaults(self) -> ExperimentConfig:
        p = self.privacy
        if p.mode != "distributed":
            # read by distributed only: a run recorded with the 10000 it once defaulted to is
            # the same run as one without it
            if p.noise_cohort_size is not None:
                p.noise_cohort_size = None
            return self
        population = p.population or self.data.num_clients
        if population < self.data.num_clients:
            raise ValueError(
                f"privacy.population={population} must be at least data.num_clients="
                f"{self.data.num_clients}"
            )
        if p.noise_cohort_size is not None and p.noise_cohort_size > population:
            raise ValueError(
                f"privacy.noise_cohort_size={p.noise_cohort_size} must not exceed the population "
                f"{population} (privacy.population, default data.num_clients)"
            )
        if "delta" not in p.model_fields_set:
            p.delta = population**-1.1
        elif p.delta >= 1 / population:  # client-level DP over the population, as in "client"
            raise ValueError(
                f"privacy.delta={p.delta} must be below 1/population = {1 / population:.3g} for "
                "distributed DP (privacy.population, default data.num_clients)"
            )
        return self

    @model_validator(mode="after")
    def _held_out_leaves_both(self) -> ExperimentConfig:
        share, n = self.training.held_out_clients, self.data.num_clients
        if share is not None and not 1 <= held_out_count(share, n) < n:
            raise ValueError(
                f"training.held_out_clients={share} of data.num_clients={n} holds out "
                f"{held_out_count(share, n)} clients: at least one must be held out and one train"
            )
        return self

    @model_validator(mode="after")
    def _rmse_without_dp_sgd(self) -> ExperimentConfig:
        if self.training.regression_loss == "rmse" and self.privacy.mode == "sample":
            raise ValueError(
                "training.regression_loss=rmse cannot train under privacy.mode=sample: DP-SGD "
                "clips per-sample gradients, and a batch's RMSE is not a sum over samples; use "
                "mse, or another privacy mode"
            )
        return self

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


def held_out_count(share: float, num_clients: int) -> int:
    """How many clients ``training.held_out_clients`` keeps out of training."""
    return round(share * num_clients)


def dotted(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping (a loaded config) as dotted keys to its leaf values."""
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    return {k: v for key, val in d.items() for k, v in dotted(val, f"{prefix}{key}.").items()}


def changed_keys(a: str, b: str) -> list[str]:
    """Dotted keys whose values differ between two dumped configs, ``runtime`` and ``tracking``
    aside (how a run is executed and where it is also logged do not change its numbers): what a
    resumed run may not change."""
    fa, fb = dotted(yaml.safe_load(a)), dotted(yaml.safe_load(b))
    keys = {k for k in fa.keys() | fb.keys() if not k.startswith(("runtime.", "tracking."))}
    return sorted(k for k in keys if fa.get(k) != fb.get(k))


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
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. training.lr=0.1")
        node = raw
        *parents, leaf = parts
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[leaf] = _parse_value(value)
    return raw


def format_validation_error(
    exc: ValidationError, model: type[BaseModel] | None = None, prefix: str = ""
) -> str:
    """Every error as "field: message", the field a dotted config key (``prefix`` first); the
    first ``MAX_ERRORS`` of them, then how many more (a list of 200k wrong items has as many)."""
    lines = []
    errors = exc.errors(include_url=False, include_context=True, include_input=True)
    for err in errors[:MAX_ERRORS]:
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith((f"{field}.", f"{field}:")):  # it names the key (model.<key>)
            lines.append(msg)
            continue
        lines.append(shorten(f"{field}: {error_message(err, model or ExperimentConfig, loc)}", 400))
    if len(errors) > MAX_ERRORS:
        lines.append(f"... and {len(errors) - MAX_ERRORS} more errors")
    return shorten("invalid config:\n  " + "\n  ".join(lines))


def _lean(info: ValidationInfo) -> bool:
    """Whether this validation leaves out the checks that need torch (``build_config(lean=)``)."""
    return bool(info.context and info.context.get("lean"))


def build_config(raw: dict[str, Any], lean: bool = False) -> ExperimentConfig:
    """``raw`` validated. ``lean``: without the checks that load torch (a model's own keys,
    read from its builder's signature), for a driver that refuses a mistake before it forks the
    process that prepares the run (and must never import torch itself)."""
    try:  # lean first: a mistake elsewhere is refused without loading torch (~1.5 s, 150 MB)
        cfg = ExperimentConfig.model_validate(raw, context={"lean": True})
        return cfg if lean else ExperimentConfig.model_validate(raw, context={"lean": False})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit()


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, lean: bool = False
) -> ExperimentConfig:
    """Read YAML (or the defaults when path is None), apply overrides, validate (``lean``: see
    ``build_config``). An empty file is refused: it would run the built-in defaults (100
    clients) where the user likely meant the demo."""
    raw: dict[str, Any] = {}
    if path is not None:
        empty = (
            "; `raysim run` with no CONFIG runs the demo, and a file holding `{}` runs the "
            "built-in defaults"
        )
        raw = read_yaml_mapping(Path(path), "config file", "of sections", empty=empty)
    return build_config(apply_overrides(raw, overrides or []), lean=lean)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML
    keeps the last one silently, so `rounds: 2` above `rounds: 3` ran 3 rounds unnoticed."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _not_a(kind: str, path: Path) -> str:
    """Why ``path`` is not the file or directory (``kind``) asked for: missing, or what it is."""
    if not path.exists():
        return f"{str(path)!r} does not exist"
    if path.is_dir():
        return f"{str(path)!r} is a directory, not a {kind}"
    mode = path.stat().st_mode
    what = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
    what = "a file" if stat.S_ISREG(mode) else what
    return f"{str(path)!r} is {what}, not a {kind}"


def read_yaml_mapping(path: Path, what: str, holding: str = "", empty: str = "") -> dict[str, Any]:
    """The mapping a YAML file holds; ConfigError naming ``what`` and the path otherwise (a
    directory, a device, a missing or empty file, not UTF-8, not YAML, not a mapping).
    ``empty``: what to add to the message for an empty file. A pipe (``<(...)``) is read."""
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory: give the YAML file in it")
    if not (path.is_file() or path.is_fifo()):
        raise ConfigError(f"{what} {_not_a('file', path)}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text: {exc}") from None
    if raw is None:
        raise ConfigError(f"{what} {str(path)!r} is empty (it holds no YAML){empty}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping {holding}".rstrip())
    return raw


def with_client_seed(cfg: ExperimentConfig, seed: int | None) -> ExperimentConfig:
    """``cfg`` with ``privacy.client_seed`` set (None: taken out)."""
    privacy = cfg.privacy.model_copy(update={"client_seed": seed})
    return cfg.model_copy(update={"privacy": privacy})


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
