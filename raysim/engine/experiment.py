"""Preparing and running one experiment: everything that can fail on user input fails here,
before Ray starts; then the session runs the rounds and the results are written.

The caller passes the algorithm class (the CLI and Tune look it up in `algorithms`): the engine
never imports an algorithm.
"""

from __future__ import annotations

import inspect
import math
import mmap
import multiprocessing
import os
import pickle
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim import privacy as privacy_lib
from raysim.config import ConfigError, ExperimentConfig, with_client_seed
from raysim.data import Population, build_population
from raysim.engine import zygote
from raysim.engine.sealed import Sealed
from raysim.limits import check_schedule
from raysim.metrics.tracking import check_available as check_tracking
from raysim.privacy import BudgetError, PrivacyConfigError

if TYPE_CHECKING:
    import torch


@dataclass
class Prepared:
    cfg: ExperimentConfig
    dataset: Population
    algorithm: Any  # Sealed when prepared apart
    env: Any  # None when prepared apart
    privacy_summary: dict[str, Any]  # the mode's and the algorithm's, once noise is calibrated
    spec: Any  # the model's ModelSpec (Sealed when prepared apart)
    # the seed of the clients' own draws where the server is untrusted (None: the run's seed
    # serves them): the experimenter's, for the clients; ``cfg`` (the server's) has none
    client_seed: int | None = None
    # the privacy mode (``raysim.privacy.modes``), calibrated: the engine's, never the algorithm's
    # (Sealed when prepared apart)
    mode: Any = None

    def recorded_config(self) -> ExperimentConfig:
        """The config as the run directory records it: with the clients' seed, so that the
        directory's config.yaml reproduces the run."""
        return (
            self.cfg if self.client_seed is None else with_client_seed(self.cfg, self.client_seed)
        )

    @property
    def truth(self) -> np.ndarray:
        """The true clusters: for the engine's metrics, never for the algorithm."""
        return np.asarray(self.dataset.true_cluster)


def initial_weights(cfg: ExperimentConfig, ds: Population) -> torch.Tensor:
    """Model initialisation drawn from the (seed, 0, server, "model_init") generator."""
    from raysim.models import build_from_spec, flat_params, init_seed, model_spec

    try:
        spec = model_spec(cfg)
        model = build_from_spec(spec, ds.feature_shape, ds.num_classes, init_seed(cfg.seed))
    except ValueError as exc:  # a bad model.* value (the builders name the key)
        raise ConfigError(str(exc)) from None
    return flat_params(model)


def check_against_data(cfg: ExperimentConfig, ds: Population) -> None:
    """The checks that need the population, e.g. delta < 1/n for sample-level DP."""
    if ds.task == "regression" and cfg.model.name not in ("linear", "mlp"):
        raise ConfigError(f"model.name: {cfg.data.dataset} is a regression task; use linear or mlp")
    if ds.task != "regression" and cfg.training.regression_loss != "mse":
        raise ConfigError(
            f"training.regression_loss={cfg.training.regression_loss}: {cfg.data.dataset} is a "
            f"{ds.task} task (cross-entropy); leave it at mse or use a regression dataset"
        )
    if cfg.privacy.mode == "sample":
        try:
            privacy_lib.check_sample_level_delta(cfg.privacy.delta, int(np.min(ds.train_sizes)))
        except (PrivacyConfigError, BudgetError) as exc:
            raise ConfigError(str(exc)) from None
    rates = cfg.training.client_dropout
    clusters = int(np.max(ds.true_cluster)) + 1
    if isinstance(rates, list) and len(rates) != clusters:
        raise ConfigError(
            f"training.client_dropout: {len(rates)} rate(s) for the data's {clusters} true "
            f"cluster(s): give one per cluster, or one number for every client"
        )


_SAID: set[str] = set()  # notes said once per process (a compare prepares a config twice)


def note_renormalised_ratios(cfg: ExperimentConfig) -> None:
    """Say so where ``data.cluster_ratios`` read as shares (each at most 1) do not add up to 1:
    they are taken as proportions (``[2, 1, 1]`` is half, a quarter, a quarter, by design), and
    ``[0.5, 0.6]`` silently became 5:6 where 0.5 + 0.5 may have been meant."""
    from raysim.config import brief
    from raysim.data.partition import sizes_from_ratios

    ratios = cfg.data.cluster_ratios
    if not ratios or max(ratios) > 1 or math.isclose(sum(ratios), 1.0, rel_tol=1e-9):
        return
    total = sum(ratios)
    shares = ", ".join(f"{r / total:.3g}" for r in ratios[:8]) + (
        ", ..." if len(ratios) > 8 else ""
    )
    sizes = sizes_from_ratios(cfg.data.num_clients, ratios)
    note = (
        f"raysim: data.cluster_ratios {brief(ratios)} add up to {total:.6g}, not 1: taken as "
        f"proportions, shares {shares} (cluster sizes {brief(sizes)})"
    )
    if note not in _SAID:
        _SAID.add(note)
        print(note, file=sys.stderr)


def build_dataset(cfg: ExperimentConfig) -> Population:
    note_renormalised_ratios(cfg)
    try:
        return build_population(cfg.data, cfg.seed, cfg.runtime.population)
    except ValueError as exc:  # DataNotFoundError and impossible partitions: user input
        raise ConfigError(str(exc)) from None


def prepare(
    cfg: ExperimentConfig,
    algorithm_cls: Callable[[Any], Any],
    env_cls: Any,
    dataset: Population | None = None,
) -> Prepared:
    """Build data, model initialisation and the algorithm (which calibrates its noise). The
    clients' seed is taken out of the config first: the algorithm, whose server step is the
    server's code, never sees it. ``dataset``: the population to use in place of the config's
    (the black-box audit's, with its canaries in the clients' train sets)."""
    check_schedule(cfg)  # before anything is built
    check_supports(cfg, algorithm_cls)
    check_tracking(cfg.tracking)  # a missing package is said before the data is built
    if cfg.runtime.forks_workers:  # before any torch operation
        zygote.fork_planned()
    given, cfg = cfg.privacy.client_seed, with_client_seed(cfg, None)
    ds = build_dataset(cfg) if dataset is None else dataset
    check_against_data(cfg, ds)
    oracle = getattr(algorithm_cls, "uses_ground_truth", False)
    from raysim.models import model_spec

    spec = model_spec(cfg)  # here, where the data config is held (the public slice's name)
    env = env_cls(
        cfg=server_view(cfg),
        train_sizes=np.asarray(ds.train_sizes),
        init_weights=initial_weights(cfg, ds),
        feature_shape=tuple(ds.feature_shape),
        num_classes=int(ds.num_classes),
        ground_truth=np.asarray(ds.true_cluster) if oracle else None,
        model=spec,
    )
    from raysim.privacy.modes import make_mode

    try:
        algorithm = algorithm_cls(env)
        mode = make_mode(cfg, env.train_sizes, algorithm.privacy_needs())
    except (BudgetError, PrivacyConfigError) as exc:  # the request cannot be met: refuse
        raise ConfigError(str(exc)) from None
    summary = {**mode.summary(), **algorithm.privacy_summary(mode.view())}
    seed = client_seed(cfg, mode.trusted_server, given)
    return Prepared(cfg, ds, algorithm, env, summary, spec, seed, mode)


def check_supports(cfg: ExperimentConfig, algorithm_cls: Any) -> None:
    """The algorithm declares the modes it runs under (``privacy_modes``; a mode of one's own
    runs where the built-in mode it serves as is declared); the engine, which owns the mode,
    refuses any other before anything is built."""
    from raysim.privacy.modes import mode_class

    plan_evaluation = getattr(algorithm_cls, "plan_evaluation", None)
    t = cfg.training
    cohort_key = "eval_clients" if t.eval_clients is not None else "held_out_clients"
    if getattr(t, cohort_key) is not None and plan_evaluation is not None:
        if "clients" not in inspect.signature(plan_evaluation).parameters:
            raise ConfigError(
                f"training.{cohort_key}: algorithm {algorithm_cls.name!r} plans every client's "
                "evaluation (its plan_evaluation takes no clients); leave it null"
            )
    allowed = getattr(algorithm_cls, "privacy_modes", ())
    if mode_class(cfg.privacy.mode).contract() not in allowed:
        raise ConfigError(
            f"privacy.mode: algorithm {algorithm_cls.name!r} does not support "
            f"{cfg.privacy.mode!r}; allowed: {', '.join(allowed)}"
        )


def server_view(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config as the algorithm (the server's code) holds it: under a mode whose server is
    untrusted, without the data config (``protocol.HiddenData``), from which the run's seed would
    rebuild every client's rows and the true clusters."""
    from raysim.privacy.modes import mode_class
    from raysim.protocol import HiddenData

    if mode_class(cfg.privacy.mode).trusted_server:
        return cfg
    return cfg.model_copy(update={"data": HiddenData()})


def client_seed(cfg: ExperimentConfig, trusted_server: bool, given: int | str | None) -> int | None:
    """The clients' seed of a run whose server is untrusted: ``privacy.client_seed``, or 128
    bits from the OS. A seed derived from the run's would let the server, which holds the
    run's, regenerate every client's noise and take it off what they released. ``same_as_seed``
    is the run's seed: the reproduction mode, labelled as such in the config."""
    if trusted_server:  # e.g. a config's pinned seed, run under `--set privacy.mode=none`
        if given not in (None, "same_as_seed"):
            print(
                f"raysim: privacy.client_seed is for an untrusted server's clients; under mode "
                f"{cfg.privacy.mode!r} the run's seed serves them: left out",
                file=sys.stderr,
            )
        return None
    if given == "same_as_seed":
        return cfg.seed
    return int(given) if given is not None else secrets.randbits(128)


def prepare_apart(
    build: Callable[[], list[Prepared]], meanwhile: Callable[[], Any] | None = None
) -> list[Prepared]:
    """``build()`` (configs and ``prepare``) in a forked child process. What comes back holds the
    algorithm and the model spec sealed (raysim.engine.sealed), so this process never imports
    torch: ~150 MiB kept out of `raysim run`'s driver for the whole run. A ConfigError is raised
    here as itself. In-process where it would gain nothing (torch already loaded here), where Ray
    runs in this process (forking its threads is unsafe), and off Linux (no safe fork).
    ``meanwhile`` runs here while the child works (e.g. imports the driver needs next: on two
    cores they take the other core)."""
    ray_here = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if sys.platform != "linux" or "torch" in sys.modules or ray_here:
        return build()
    ctx = multiprocessing.get_context("fork")
    plan = zygote.plan()
    receive, send = ctx.Pipe(duplex=False)
    # the large buffers (the dataset's pixels) come back through an anonymous shared file, not
    # the pipe: no name that an interruption could leave behind in /dev/shm
    shared = _shared_file()
    child = ctx.Process(target=_prepare_child, args=(build, send, shared), daemon=True)
    child.start()
    send.close()
    if plan is not None:
        os.close(plan.lifeline[0])  # the zygote's end
    try:
        if meanwhile is not None:
            meanwhile()
        kind, payload, forked = receive.recv()
        if kind == "ok":
            payload = _unpickle_shared(payload, shared)
        if forked and plan is not None and kind == "ok":
            plan.forked = True
        else:
            zygote.release()
    except EOFError:
        zygote.release()
        child.join()
        code = child.exitcode
        raise RuntimeError(f"preparing the experiment failed (exit code {code})") from None
    except BaseException:  # interrupted: the child goes too
        child.terminate()
        zygote.release()
        raise
    finally:
        receive.close()
        if shared is not None:
            os.close(shared)
    child.join()
    if kind == "ok":
        return payload
    if kind == "config":
        raise ConfigError(payload)
    raise pickle.loads(payload)


def _shared_file() -> int | None:
    """An anonymous file for _pickle_shared; None where the kernel has no memfd (the pipe)."""
    try:
        return os.memfd_create("raysim-prepared", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None


def _prepare_child(build: Callable[[], list[Prepared]], send: Any, shared: int | None) -> None:
    try:
        try:
            seal = [
                replace(
                    p,
                    algorithm=Sealed.of(p.algorithm),
                    env=None,
                    spec=Sealed.of(p.spec),
                    mode=Sealed.of(p.mode),
                )
                for p in build()
            ]
            send.send(("ok", _pickle_shared(seal, shared), zygote.forked()))
        except ConfigError as exc:
            send.send(("config", str(exc), zygote.forked()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
            try:
                blob = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
            send.send(("raise", blob, zygote.forked()))
    finally:
        send.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not the parent's atexit handlers, which the fork copied


def _pickle_shared(obj: Any, fd: int | None) -> tuple[bytes, list[tuple[int, int]]]:
    """Pickle ``obj`` with its buffers out of band (protocol 5), written one after another into
    the file ``fd``: (pickle, [(offset, length)]). Through the pipe, W's 53 MB of pixels took
    ~0.3 s (pickled, piped, read and unpickled: four copies); written once, ~0.03 s."""
    if fd is None:  # no shared file: everything in band, through the pipe
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), []
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    spans, offset = [], 0
    for buf in buffers:
        raw = buf.raw()
        written = 0
        while written < raw.nbytes:  # Linux writes at most ~2 GiB a call
            written += os.pwrite(fd, raw[written:], offset + written)
        spans.append((offset, raw.nbytes))
        offset += -(-raw.nbytes // 64) * 64  # each buffer 64-byte aligned, as numpy's are
    return body, spans


def _unpickle_shared(payload: tuple[bytes, list[tuple[int, int]]], fd: int | None) -> Any:
    """The inverse of _pickle_shared: the buffers are views of a private mapping of the file (no
    copy until written), which lives as long as they do."""
    body, spans = payload
    if not spans:
        return pickle.loads(body)
    size = os.fstat(fd).st_size
    view = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
    return pickle.loads(body, buffers=[view[o : o + n] for o, n in spans])
