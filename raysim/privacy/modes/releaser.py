"""The client's side of its privacy mode, as the algorithm's client code reaches it.

The engine builds one ``Releaser`` per worker from the run's mode and hands each client step
its own (``ClientContext.release``). The algorithm says what it releases (its update, its
cluster choice, a sketch) and the mode decides how: DP-SGD output, clipped secure contribution,
d-private point or the plain value. The algorithm never holds, builds or names the mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Releaser:
    __slots__ = ("_ctx", "_mode")

    def __init__(self, mode: Any, ctx: Any = None) -> None:
        self._mode, self._ctx = mode, ctx

    def for_client(self, ctx: Any) -> Releaser:
        return Releaser(self._mode, ctx)

    def __reduce__(self) -> Any:
        raise TypeError("a client's releaser stays in the worker that runs it")

    def update(self, report: Any, task: Any, result: Any, slot: int | None = None) -> None:
        """``result.update`` on ``report`` as the mode sends it (``slot``: the model it
        trained, where a secure aggregation adds it; default the task's cluster)."""
        self._mode.release_update(report, task, result, self._ctx, slot)

    def keep(self, report: Any, task: Any, result: Any) -> Any:
        """The update stays on the client (a personal model); what its release costs is still
        charged where the mode charges local training. Returns the value kept."""
        return self._mode.keep_update(report, task, result, self._ctx)

    def choose(
        self, utility: np.ndarray, sensitivity: float, eps: float, rng: np.random.Generator
    ) -> Any:
        """The client's cluster choice by ``utility``: exact, or by the exponential mechanism
        at ``eps`` where the mode protects it."""
        return self._mode.release_choice(utility, sensitivity, eps, rng)

    def choice(self, report: Any, choice: Any) -> None:
        """Put the chosen cluster on the report (hidden in the secure slot where summed)."""
        self._mode.report_choice(report, choice)

    def sketch(
        self,
        report: Any,
        update: np.ndarray,
        k: int,
        projection_seed: int,
        rng: np.random.Generator,
    ) -> None:
        """A ``k``-dim projection of ``update`` on the report, as the mode releases it."""
        self._mode.release_sketch(report, update, k, projection_seed, rng)
