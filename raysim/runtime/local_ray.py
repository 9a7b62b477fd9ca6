"""Starting the single-node Ray of a local run without the head daemons that run never uses.

A local Ray head starts three Python daemons that a raysim run never talks to:

- the autoscaler monitor: there is nothing to scale on one machine;
- the dashboard's API server, started even with ``include_dashboard=False`` (for usage stats,
  the state API and job submission); ``ray.init`` waits for it before it starts the raylet;
- the log monitor, which streams worker logs to drivers; raysim runs with ``log_to_driver=False``.

Measured on the 2-core machine (docs/speed.md): ``ray.init`` takes 2.0 s instead of 4.1 s, the
Ray tree holds 118 MiB less (PSS), and ``ray.shutdown`` takes 0.1-0.3 s instead of 1.1-1.4 s (the
monitor's SIGTERM handler reports to the GCS, which is already gone, so it sits out its whole 1 s
grace period). Ray has no public switch for them (``ray start --no-monitor`` exists, ``ray.init``
has no such argument), so the head node's three start methods are skipped while ``ray.init``
builds it, and put back at once. A Ray whose node class does not have all three starts as usual.
What is lost: ``ray status`` and the state API (``ray list ...``) against this Ray, which only
lives as long as the run. Connecting to a cluster (``runtime.address``) is never affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

SKIPPED = ("start_monitor", "start_api_server", "start_log_monitor")


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def lean_head() -> Iterator[bool]:
    """While active, a Ray head started in this process leaves out the daemons in ``SKIPPED``;
    yields whether it does (False: an unknown Ray layout, started as usual)."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield False
        return
    saved = {name: Node.__dict__.get(name) for name in SKIPPED}
    if any(fn is None for fn in saved.values()):
        yield False
        return
    for name in SKIPPED:
        setattr(Node, name, _skip)
    try:
        yield True
    finally:
        for name, fn in saved.items():
            setattr(Node, name, fn)


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init(address="local", ...)`` without the head daemons a run does not use."""
    with lean_head():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
