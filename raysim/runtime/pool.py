"""A pool of ClientWorker actors: runs a round's groups of clients on it and survives lost
workers.

The groups go out in pieces that shrink as the round goes on (``cut_pieces``), largest first,
to whichever worker is free. Which worker runs a client changes nothing in the result: every
client draws from generators keyed by (seed, round, client, purpose), and the groups are fixed
before the pool sees them. The pool may also hold one ClientWorker in the coordinator's own
process (``local``): see ``raysim.runtime.coordinator.trains_in_coordinator``.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, WorkerCrashedError

from raysim.protocol import ClientTask

log = logging.getLogger(__name__)

# A round's groups go out in pieces to whichever worker is free, largest first. The pieces shrink
# as the round goes on (guided self-scheduling): each holds 1/(GUIDE x workers) of the training
# samples not yet handed out, so the round ends on small pieces and its workers finish within one
# small piece of each other. Equal pieces of 1/8 of a worker's share left one worker idle for up
# to ~15% of a W round. Every piece costs a call and a reply (on 10,000 clients of 6 images, 16
# pieces a round were slower than 4), hence a floor of MIN_PIECE_WEIGHT samples. An actor holds
# IN_FLIGHT pieces while enough are left for everyone, so it does not wait for the coordinator
# between two.
GUIDE = 2
MIN_PIECE_WEIGHT = 128
IN_FLIGHT = 2


def cut_pieces(groups: list[list[ClientTask]], workers: int) -> list[list[list[ClientTask]]]:
    """Whole groups in pieces of decreasing weight, largest groups first: each piece holds at
    least 1/(GUIDE x workers) of the weight left and MIN_PIECE_WEIGHT, or 1/workers of the round
    where that is less, so a light round (unit weights, a few tiny clients) still splits between
    the workers."""
    weight = [sum(t.weight for t in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda j: (-weight[j], groups[j][0].client_id))
    left = sum(weight)
    floor = min(MIN_PIECE_WEIGHT, left / workers)
    pieces: list[list[list[ClientTask]]] = []
    piece: list[list[ClientTask]] = []
    load = 0
    for j in order:
        if not piece:
            target = max(floor, left / (GUIDE * workers))
        piece.append(groups[j])
        load += weight[j]
        if load >= target:
            pieces.append(piece)
            left -= load
            piece, load = [], 0
    if piece:
        pieces.append(piece)
    return pieces


class WorkerPool:
    def __init__(
        self,
        make_worker: Callable[[int], Any],
        size: int,
        timeout_s: float,
        workers: list[Any] | None = None,
        local: Any = None,
    ) -> None:
        """``size`` workers in all: with ``local`` (a ClientWorker in this process), that one and
        ``size - 1`` actors."""
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
        return [{**self.local.info(), "in_coordinator": True}, *remote]

    def _replace(self, index: int) -> None:
        log.warning("worker %d lost: starting a replacement", index)
        # Workers are not restartable (max_restarts=0); a worker that timed out may still be
        # alive: kill it, or it and its replacement both hold the worker's CPUs.
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._make(index)
        self.replaced += 1

    def _reply(self, ref: Any, worker: int, handle: Any, lost: int, limit: int) -> list[Any] | None:
        """A finished call's reply, or None when its worker died: the worker is replaced (unless
        another of its calls already had it replaced). ``lost`` calls so far; at ``limit``, the
        worker's error is raised instead."""
        try:
            return ray.get(ref)
        except (RayActorError, WorkerCrashedError):
            if lost >= limit:
                raise
            if self.workers[worker] is handle:
                self._replace(worker)
            return None

    def run(self, kind: str, round: int, models: Any, groups: list[list[ClientTask]]) -> list[Any]:
        """Run every group. The groups go out in pieces of decreasing size (``cut_pieces``) to
        whichever worker is free (an actor holds two while enough are left; the coordinator's own
        worker takes the next piece whenever it finishes one), so a worker slowed down by the
        machine takes fewer pieces and the round's workers finish within about one small piece
        of each other. A piece whose worker died is re-run on a replacement.
        ``models``: the round's stacked broadcast (numpy), put in the object store once."""
        pieces = cut_pieces(groups, self.size)
        results: list[list[Any] | None] = [None] * len(pieces)
        queue = deque(range(len(pieces)))
        pending: dict[Any, tuple[int, int, Any]] = {}
        models_ref = ray.put(models) if self.workers else None  # once per round, not per client
        attempts = 0

        def top_up() -> None:
            for w, handle in enumerate(self.workers):
                busy = sum(1 for _, worker, _ in pending.values() if worker == w)
                while queue and busy < (IN_FLIGHT if len(queue) > self.size else 1):
                    i = queue.popleft()
                    pending[handle.run.remote(kind, round, models_ref, pieces[i])] = (i, w, handle)
                    busy += 1

        def harvest(block: bool) -> None:
            """Collect the pieces the actors have finished; ``block``: wait for one first."""
            nonlocal attempts
            if block and not ray.wait(list(pending), num_returns=1, timeout=self.timeout_s)[0]:
                raise TimeoutError(f"round {round}: no clients finished in {self.timeout_s} s")
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                i, worker, handle = pending.pop(ref)
                results[i] = self._reply(ref, worker, handle, attempts, 3 * len(pieces))
                if results[i] is None:  # its worker died: the piece goes again, first
                    attempts += 1
                    queue.appendleft(i)

        top_up()
        while queue or pending:
            if self.local is not None and queue:  # a copy, as an actor's reply would be
                i = queue.popleft()
                out = self.local.run(kind, round, models, pieces[i])
                results[i] = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
                if pending:
                    harvest(block=False)
            else:
                harvest(block=True)
            top_up()
        return [r for piece in results for r in piece]  # type: ignore[union-attr]

    def run_pinned(
        self, kind: str, round: int, models: Any, shards: list[tuple[int, list[ClientTask]]]
    ) -> list[Any]:
        """Run each (worker index, groups) on that worker actor (one actor per client); a shard
        whose worker died is re-run on a replacement."""
        results: list[list[Any] | None] = [None] * len(shards)
        pending: dict[Any, tuple[int, int, Any]] = {}
        models_ref = ray.put(models)

        def submit(shard: int, worker: int) -> None:
            handle = self.workers[worker]
            pending[handle.run.remote(kind, round, models_ref, shards[shard][1])] = (
                shard,
                worker,
                handle,
            )

        for i, (worker, _) in enumerate(shards):
            submit(i, worker)
        attempts = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"round {round}: no shard finished in {self.timeout_s} s")
            ref = ready[0]
            shard, worker, handle = pending.pop(ref)
            results[shard] = self._reply(ref, worker, handle, attempts, 3 * len(shards))
            if results[shard] is None:
                attempts += 1
                submit(shard, worker)
        return [r for shard in results for r in shard]  # type: ignore[union-attr]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
