"""Where a request's time to first token goes, as the router replica that sends it sees
it (``bench/cluster_rag.py``): preparing the prompt, routing it (of which the directory
lookup), and from the call to the chosen worker to its first delta.

A module of its own, so that Ray pickles these functions by reference into the router
replicas' actors (a ContextVar cannot be pickled by value).
"""

from __future__ import annotations

import time
from contextvars import ContextVar

# the current request's times: every client, and every open-loop request, runs as a task
# of its own, so concurrent requests never share one
_PHASES: ContextVar[dict[str, float] | None] = ContextVar("router_phases", default=None)


def begin() -> dict[str, float]:
    """A fresh record for the request this task sends next; the wrapped router fills it."""
    phases: dict[str, float] = {}
    _PHASES.set(phases)
    return phases


def time_router_phases(router) -> None:
    """Record, per request, when routing began (``open``: the prompt is prepared), how
    long the directory lookup took (``_lookup``), and when the chosen worker was called
    (``_start``, which returns with its first delta); a retry keeps the first times."""
    open_, lookup, start = router.open, router._lookup, router._start

    def mark(name: str) -> None:
        phases = _PHASES.get()
        if phases is not None:
            phases.setdefault(name, time.perf_counter())

    async def timed_open(*args, **kwargs):
        mark("routing")
        return await open_(*args, **kwargs)

    async def timed_lookup(*args, **kwargs):
        began = time.perf_counter()
        try:
            return await lookup(*args, **kwargs)
        finally:
            phases = _PHASES.get()
            if phases is not None:
                phases["lookup_s"] = phases.get("lookup_s", 0.0) + time.perf_counter() - began

    async def timed_start(*args, **kwargs):
        mark("worker")
        return await start(*args, **kwargs)

    router.open, router._lookup, router._start = timed_open, timed_lookup, timed_start


def phases_of(
    phases: dict[str, float], started: float, first: float
) -> tuple[float, float, float, float] | None:
    """(prepare, route, lookup, worker) seconds of one request sent at ``started`` whose
    first delta came at ``first``; None where routing never reached a worker."""
    if "routing" not in phases or "worker" not in phases:
        return None
    return (
        phases["routing"] - started,
        phases["worker"] - phases["routing"],
        phases.get("lookup_s", 0.0),
        first - phases["worker"],
    )
