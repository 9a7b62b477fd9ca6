"""ClientWorker: a long-lived actor that runs many virtual clients per call.

It holds the federated dataset (zero-copy from the object store) and one resident model; per
client it only loads weights in place. One call carries a whole shard of clients, the pattern
measured fastest here (one call per actor with its list of clients; docs/speed.md).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.engine.sealed import opened
from raysim.protocol import ClientContext, ClientTask
from raysim.runtime.reuse import Renewable

if TYPE_CHECKING:  # torch, the models and the trainer load in the actor, not in the driver
    import torch

    from raysim.models import ModelSpec


def pick_device(num_gpus: float) -> torch.device:
    import torch

    # Ray sets CUDA_VISIBLE_DEVICES for GPU actors; a fake (declared) GPU has no CUDA: ask torch.
    if num_gpus > 0 and torch.cuda.is_available():
        from raysim.training import float32_kernels

        float32_kernels()
        return torch.device("cuda")
    return torch.device("cpu")


def fixed_threads(threads: int) -> Any:
    """torch's threads and the BLAS's (numpy's OpenBLAS: a clipped update's norm) at
    ``threads``, in this process. OpenBLAS takes every core when it loads, as it did in the
    zygote before Ray set the thread count: on two cores a worker's 29k-float norm then waited
    ~1.4 ms for a BLAS thread the other worker held (36% of a distributed client's time), and
    a sum's order, so its bits, followed the machine's cores. The BLAS limits are returned, to
    restore where the process is the user's (the inline loop)."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    return threadpool_limits(limits=threads, user_api="blas")


# glibc's malloc: blocks above M_MMAP_THRESHOLD are mmap'ed fresh and unmapped when freed, and a
# free top of the heap above M_TRIM_THRESHOLD goes back to the kernel; either way the next step
# faults its pages in again. Both at the largest value glibc takes (docs/speed.md, "DP-SGD").
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 64 * 2**20


def keep_freed_memory() -> bool:
    """Let this process keep the memory a training step frees for the next step, instead of
    giving it back to the kernel: a DP-SGD step's per-sample gradients and oneDNN's buffers of
    the grouped convolutions (a few MB each) were faulted in page by page at every step, tens
    of thousands of faults a round in a W-DP worker. True where glibc took both settings."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, TRIM_THRESHOLD)
    )


class ClientWorker(Renewable):
    def __init__(
        self,
        algorithm: Any,
        dataset: Any,
        model_spec: ModelSpec,
        seed: int,
        threads: int,
        num_gpus: float,
        vectorize: bool = True,
        client_seed: int | None = None,
        mode: Any = None,
        client_side: tuple[Any, bytes] | None = None,
    ) -> None:
        """``algorithm`` and ``model_spec`` may be sealed (raysim.engine.sealed).
        ``client_seed``: where the server is untrusted, the seed of the clients' draws (the
        run's ``seed`` still builds the model, as the server's is built). ``client_side``: (the
        clients' side, the run's client key) where the server is untrusted: the clients' states
        and secure inputs go there, never into a reply (a ``ClientSide``, or its actor as
        ``client_side.OnRay``)."""

        from raysim.models import build_from_spec, init_seed
        from raysim.training import LocalTrainer

        keep_freed_memory()
        fixed_threads(threads)
        algorithm, model_spec, mode = opened(algorithm), opened(model_spec), opened(mode)
        self.algorithm = algorithm
        # the clients' side of the run's privacy mode: what a client step releases goes through
        # it (ClientContext.release); None only for a worker that evaluates alone
        self.mode = mode
        from raysim.privacy.modes.releaser import Releaser

        self.releaser = None if mode is None else Releaser(mode)
        if isinstance(dataset, list):  # [ObjectRef]: fetched here, zero-copy
            import ray

            dataset = ray.get(dataset[0])
        self.dataset = dataset  # zero-copy views of the object store
        ds = dataset
        self.device = pick_device(num_gpus)
        # seeded like the run's initial weights; the frozen part is the same in every process
        model = build_from_spec(model_spec, ds.feature_shape, ds.num_classes, init_seed(seed))
        # a worker given no algorithm (it only evaluates, or a test's) trains with the default
        loss = "mse" if algorithm is None else algorithm.cfg.training.regression_loss
        self.trainer = LocalTrainer(model, ds.task, self.device, regression_loss=loss)
        self.trainer.vectorize = vectorize
        self.seed = seed if client_seed is None else client_seed  # of the clients' draws
        self.client_side = client_side

    def run(
        self, kind: str, round: int, models: np.ndarray, groups: list[list[ClientTask]]
    ) -> list[Any]:
        """Run `kind` ("train" or "evaluate") for each group of tasks; models is the round's
        broadcast. A group goes to the algorithm whole (client_steps: vectorized where it can
        be; client_evaluations: shared forward passes); the groups are fixed by the coordinator,
        so the bits do not depend on how many workers share them. With the clients' side (an
        untrusted server), the clients admit the request first and check what they release
        (``modes.device``), and an evaluation's scores go to that side, not into the reply."""
        if self.client_side is None:
            return self._run(kind, round, self._broadcast(models), groups)
        from raysim.privacy.modes.device import (
            ReleaseRefused,
            check_broadcast,
            check_round,
            vet_releases,
        )

        check_round(kind, round, self.algorithm.cfg)
        dim = self.trainer.dim
        width = dim if kind == "evaluate" else self.algorithm.broadcast_width(round, dim)
        models = check_broadcast(models, width)
        new = self._admit(kind, round, models, groups)
        try:
            out = self._run(kind, round, self._broadcast(models), groups)
            if kind == "train":
                may_select = self.algorithm.may_select(round)
                vet_releases(self.mode, round, out, may_select)
                self._hand_back(round, out)
            else:  # the scores are the experimenter's: to the clients' side, none to the server
                side, key = self.client_side
                side.keep_evaluations(key, round, out)
                out = []
        except ReleaseRefused as refused:
            # what the server sent was refused: nothing of the clients' left, the round is
            # still theirs (a failure on their data spends it: a retry would be a new release)
            if new and not refused.spent:
                side, key = self.client_side
                side.withdraw(key, kind, round, new)
            raise
        return out

    @staticmethod
    def _broadcast(models: np.ndarray) -> list[torch.Tensor]:
        import torch

        return [torch.from_numpy(np.array(m, copy=True)) for m in models]

    def _run(
        self, kind: str, round: int, broadcast: list[torch.Tensor], groups: list[list[ClientTask]]
    ) -> list[Any]:
        out: list[Any] = []
        for group in groups:
            ctxs = [
                ClientContext(
                    t.client_id,
                    round,
                    self.seed,
                    self.trainer,
                    self.dataset,
                    broadcast,
                    self.releaser,
                )
                for t in group
            ]
            steps = getattr(self.algorithm, "client_steps", None)
            if kind == "train" and steps is not None:
                out.extend(steps(group, ctxs))
                continue
            evaluations = getattr(self.algorithm, "client_evaluations", None)
            if kind == "evaluate" and evaluations is not None:
                out.extend(evaluations(group, ctxs))
                continue
            step = self.algorithm.client_step if kind == "train" else self.algorithm.client_evaluate
            out.extend(step(t, c) for t, c in zip(group, ctxs, strict=True))
        return out

    def _admit(
        self, kind: str, round: int, models: np.ndarray, groups: list[list[ClientTask]]
    ) -> list[int]:
        """The clients' states, from the clients' side (a state the server sent is not
        theirs), once the devices admit the request (``modes.device``); the clients admitted
        to it for the first time."""
        from raysim.privacy.modes.device import (
            ReleaseRefused,
            broadcast_digest,
            check_task,
            request_digest,
        )

        side, key = self.client_side  # type: ignore[misc]
        tasks, sent = [t for g in groups for t in g], broadcast_digest(models)
        for t in tasks:
            check_task(t)
        members = [[t.client_id for t in g] for g in groups]
        requests = {
            t.client_id: request_digest(sent, t, ids)
            for g, ids in zip(groups, members, strict=True)
            for t in g
        }
        if len(requests) < len(tasks):  # two tasks of one client: two releases of its round
            raise ReleaseRefused(f"round {round}: a client was given two tasks in one piece")
        limit = None
        if kind == "train":  # the cap of the client's own model's releases
            limit = self.mode.releases_per_client(self.trainer.dim)
        states, new = side.admit(key, kind, round, requests, limit)
        for t in tasks:
            t.state = states.get(t.client_id)
        return new

    def _hand_back(self, round: int, reports: list[Any]) -> None:
        """The new states and the secure inputs go to the clients' side; the reply keeps only
        that a report's contribution went there (``deposited``). The training loss and the
        values of withheld releases, which stay with the client (``ClientReport``), are
        dropped."""
        side, key = self.client_side  # type: ignore[misc]
        states, contributions = {}, {}
        for rep in reports:
            rep.loss = float("nan")
            # a withheld release stays with the client: the server charges it, without its value
            rep.withheld = [replace(w, value=None) for w in rep.withheld]
            if rep.state is not None:
                states[rep.client_id], rep.state = rep.state, None
            if rep.contribution is not None:
                contributions[rep.client_id], rep.contribution = rep.contribution, None
                rep.deposited = True
        if states or contributions:
            side.keep(key, round, states, contributions)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node_id": _node_id(),
        }


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit tests)
        return None
