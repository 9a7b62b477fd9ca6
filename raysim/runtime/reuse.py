"""Actors kept from one run to the next within one command (``raysim compare`` on Ray).

Starting an actor costs a process, Ray's worker start-up and the imports of torch and the
algorithms: seconds of a run's start-up (docs/speed.md). The runs of a
comparison ask for the same actors (same class, same resources), so inside ``kept_actors()`` a
run that ends cleanly leaves its coordinator and workers here with their state dropped
(``Renewable.clear``), and the next run gives them new state (``Renewable.renew``: the object's
attributes go and ``__init__`` runs again with the new run's arguments). Nothing but the process
and the modules it imported carries over: every random draw comes from generators keyed by
(seed, round, client, purpose), and the constructors set the process-wide state they rely on
(torch's thread count). tests/test_reuse.py checks the same bits as fresh actors.

An actor is only renewed as the same class with the same options and the same ``tag`` (the
coordinator's: whether the server was trusted with raw updates), so a process that served a
trusted server never serves an untrusted one. Idle actors hold their CPUs: a run takes the ones
it can use, and the others are ended before it starts new ones (``start``) or once it has all
it needs (``drop_idle``).

Ray is imported where it is used: the worker module, which the mixin serves, is also imported
where Ray is not (``compare --inline``).
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

# None: actors are not kept (a single run, a Tune trial); else idle actors by key
_idle: dict[Hashable, list[Any]] | None = None
# the refs of renew calls not yet known to have succeeded (``settle``)
_renewing: list[Any] = []


class Renewable:
    """Mixin for an actor class whose process may serve another run."""

    def clear(self) -> None:
        """Drop every attribute (the run's data, models, handles) while the actor waits."""
        self.__dict__.clear()
        gc.collect()

    def renew(self, *args: Any, **kwargs: Any) -> None:
        """Become a new object for the next run, as the constructor would build it."""
        self.clear()
        self.__init__(*args, **kwargs)  # type: ignore[misc]


@contextmanager
def kept_actors() -> Iterator[None]:
    """Keep the actors of runs that end cleanly for the next run; end them all on leaving."""
    global _idle
    _idle = {}
    try:
        yield
    finally:
        drop_idle()
        _idle = None
        _renewing.clear()  # a run that failed before it settled them


def keeping() -> bool:
    return _idle is not None


def start(cls: type, options: dict[str, Any], args: tuple[Any, ...], tag: Hashable = None) -> Any:
    """An actor of ``cls`` built from ``args``: a kept one renewed where one with the same
    options and tag waits, else a new one (idle actors that do not fit are ended first, so that
    their CPUs are free for it)."""
    import ray

    key = _key(cls, options, tag)
    if _idle is not None:
        kept = _idle.get(key)
        if kept:
            actor = kept.pop()
            _renewing.append(actor.renew.remote(*args))
            return actor
        drop_idle(keep=key)
    return ray.remote(cls).options(**options).remote(*args)


def settle(timeout_s: float) -> None:
    """Wait for the renew calls; raise the error of one that failed (the run then ends its
    actors). Called before the coordinator calls on the workers: Ray orders an actor's calls
    per caller only, so a worker renewed by the driver must be renewed before the coordinator's
    first call reaches it."""
    import ray

    refs = list(_renewing)
    _renewing.clear()
    ray.get(refs, timeout=timeout_s)


def park(actor: Any, cls: type, options: dict[str, Any], tag: Hashable = None) -> bool:
    """Keep ``actor`` (idle, its calls finished) for a later run; False where nothing is kept."""
    if _idle is None:
        return False
    actor.clear.remote()
    _idle.setdefault(_key(cls, options, tag), []).append(actor)
    return True


def drop_idle(keep: Hashable = None) -> None:
    """End the idle actors (except those under ``keep``)."""
    import ray

    if not _idle:
        return
    for key in [k for k in _idle if k != keep]:
        for actor in _idle.pop(key):
            ray.kill(actor)


def _key(cls: type, options: dict[str, Any], tag: Hashable) -> Hashable:
    def plain(value: Any) -> Hashable:
        if isinstance(value, (str, int, float, bool, type(None))):
            return value
        # a scheduling strategy: its class and fields (a node id, soft)
        fields = getattr(value, "__dict__", None)
        if fields is None:
            return (type(value).__name__, repr(value))
        return (type(value).__name__, tuple(sorted((k, repr(v)) for k, v in fields.items())))

    settings = tuple(sorted((k, plain(v)) for k, v in options.items()))
    return (cls.__module__, cls.__qualname__, tag, settings)
