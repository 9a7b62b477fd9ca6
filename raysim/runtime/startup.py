"""Start-up in parallel: Ray's daemons come up while the driver prepares data and model.

``ray.init`` spends most of its 3-5 s waiting for its own processes (GCS, raylet, prestarted
workers); building the federated dataset is numpy and gzip work in the driver. Overlapping them
saves the shorter of the two. ``ray.init`` stays on the main thread (it installs signal
handlers); the preparation runs in a helper thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def prepare_while_ray_starts(prepare: Callable[[], T], cfg: Any) -> tuple[T, bool]:
    """Run ``prepare()`` while Ray starts for ``cfg.runtime``; returns its result and whether
    Ray was started here (the caller shuts it down). If ``prepare`` raises, Ray is shut down
    again and the exception propagates (a ConfigError still exits 2)."""
    from raysim.runtime.session import ensure_ray

    with ThreadPoolExecutor(1, thread_name_prefix="raysim-prepare") as pool:
        future = pool.submit(prepare)
        started = False
        try:
            started = ensure_ray(cfg.runtime)
            return future.result(), started
        except BaseException:
            future.cancel()
            if started:
                import ray

                ray.shutdown()
            raise
