"""A pool of ClientWorker actors: shards a round's tasks over it and survives lost workers.

Shards are balanced largest-first (LPT). Which worker runs a client changes nothing in the
result: every client draws from generators keyed by (seed, round, client, purpose). The pool may
also hold one ClientWorker in the coordinator's own process (``local``, shard 0): see
``raysim.runtime.coordinator.trains_in_coordinator``.
"""

from __future__ import annotations

import heapq
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, WorkerCrashedError

from raysim.protocol import ClientTask

log = logging.getLogger(__name__)


def balance_groups(groups: list[list[ClientTask]], num_shards: int) -> list[list[list[ClientTask]]]:
    """Shards made of whole groups, balanced largest-first (LPT) on the groups' total weight."""
    shards: list[list[list[ClientTask]]] = [[] for _ in range(num_shards)]
    heap = [(0, i) for i in range(num_shards)]
    weight = [sum(t.weight for t in g) for g in groups]
    for j in sorted(range(len(groups)), key=lambda j: (-weight[j], groups[j][0].client_id)):
        load, i = heapq.heappop(heap)
        shards[i].append(groups[j])
        heapq.heappush(heap, (load + weight[j], i))
    return [s for s in shards if s]


class WorkerPool:
    def __init__(
        self,
        make_worker: Callable[[int], Any],
        size: int,
        timeout_s: float,
        workers: list[Any] | None = None,
        local: Any = None,
    ) -> None:
        """``size`` shards in all; with ``local`` (a ClientWorker in this process) it runs shard
        0 and ``size - 1`` actors the others."""
        self._make = make_worker
        self.local = local
        remote = size - (local is not None)
        self.workers = list(workers) if workers else [make_worker(i) for i in range(remote)]
        self.timeout_s = timeout_s
        self.replaced = 0

    @property
    def size(self) -> int:
        return len(self.workers) + (self.local is not None)

    def ready(self) -> list[dict[str, Any]]:
        remote = ray.get([w.info.remote() for w in self.workers], timeout=self.timeout_s)
        if self.local is None:
            return remote
        return [{**self.local.info(), "in_coordinator": True, "pid": os.getpid()}, *remote]

    def _replace(self, index: int) -> None:
        log.warning("worker %d lost: starting a replacement", index)
        # Workers are not restartable (max_restarts=0); a worker that timed out may still be
        # alive: kill it, or it and its replacement both hold the worker's CPUs.
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._make(index)
        self.replaced += 1

    def run(
        self, kind: str, round: int, models: Any, shards: list[tuple[int, list[ClientTask]]]
    ) -> list[Any]:
        """Run every (shard index, shard); a shard whose worker died is re-run on a replacement.
        ``models``: the round's stacked broadcast (numpy), put in the object store once."""
        results: list[list[Any] | None] = [None] * len(shards)
        pending: dict[Any, tuple[int, int, Any]] = {}
        first = 1 if self.local is not None else 0  # shard index of self.workers[0]
        remote = [i for i, (index, _) in enumerate(shards) if index >= first]
        models_ref = ray.put(models) if remote else None  # once per round, never per client

        def submit(shard: int, worker: int) -> None:
            handle = self.workers[worker]
            pending[handle.run.remote(kind, round, models_ref, shards[shard][1])] = (
                shard,
                worker,
                handle,
            )

        for i in remote:
            submit(i, shards[i][0] - first)
        for i, (index, groups) in enumerate(shards):
            if index < first:  # while the actors work; a copy, as an actor's reply would be
                out = self.local.run(kind, round, models, groups)
                results[i] = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        attempts = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"round {round}: no shard finished in {self.timeout_s} s")
            ref = ready[0]
            shard, worker, handle = pending.pop(ref)
            try:
                results[shard] = ray.get(ref)
            except (RayActorError, WorkerCrashedError):
                attempts += 1
                if attempts > 3 * len(shards):
                    raise
                if self.workers[worker] is handle:  # not yet replaced for another of its shards
                    self._replace(worker)
                submit(shard, worker)
        return [r for shard in results for r in shard]  # type: ignore[union-attr]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
