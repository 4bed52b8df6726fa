"""The router asks the chunk directory only when it has a choice to make: with one
worker open a request is routed without the lookup's round trip (reason ``sole``);
with two, it looks up once. A request sent away from the worker holding its prompt
(a spill) tells the worker so (``held_elsewhere``)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from chunkstore import directory as d
from cluster.metrics import Metrics
from cluster.routing.policy import Reason, RoutingWeights
from cluster.routing.prompts import PreparedPrompt
from cluster.routing.router import Router, RouterSettings
from cluster.routing.worker_pool import WorkerPool
from tests.cluster.worker_doubles import (
    AGREEMENT,
    HANG_AFTER_FIRST_DELTA,
    FakeWorker,
    NoDirectory,
    StartLog,
    worker_info,
)
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import EngineLoad, WorkerRequest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


class CountingDirectory(NoDirectory):
    def __init__(self) -> None:
        self.lookups = 0

    async def lookup(self, keys, token_ends, entry_keys=()) -> d.LookupResult:
        self.lookups += 1
        return d.NO_INFORMATION


class HolderDirectory(CountingDirectory):
    """Says worker w0 holds the first 32 tokens of every prompt."""

    async def lookup(self, keys, token_ends, entry_keys=()) -> d.LookupResult:
        self.lookups += 1
        return d.LookupResult(True, (d.WorkerHolding("w0", 1, 32),))


def route_one(
    workers: int,
    directory: CountingDirectory | None = None,
    loads: dict[str, EngineLoad] | None = None,
) -> tuple[Reason, int, list[tuple[str, WorkerRequest]]]:
    """Routes one request over ``workers`` stand-ins (each answers one delta; ``loads``:
    what some report when polled); returns the decision's reason, the directory
    lookups made, and the (worker, request) each start was sent."""
    log = StartLog.remote([HANG_AFTER_FIRST_DELTA])  # no exit racing the delta to the router
    loads = loads or {}
    handles = {
        f"w{i}": FakeWorker.remote(worker_info(f"w{i}"), log, loads.get(f"w{i}"))
        for i in range(workers)
    }
    ray.get([handle.status.remote() for handle in handles.values()])
    directory = directory or CountingDirectory()

    async def run() -> Reason:
        pool = WorkerPool(handles, AGREEMENT, poll_interval_s=0.05, poll_timeout_s=10)
        settings = RouterSettings(RoutingWeights(max_requests_per_worker=8), max_attempts=1)
        router = Router(pool, directory, settings, Metrics())
        tokens = tuple(range(40))
        prompt = PreparedPrompt(token_ids=tokens, lookup_keys=(b"k" * 32,), token_ends=(32,))
        request = WorkerRequest(
            request_id="r",
            prompt=PromptRequest(tokens, "", reuse=ReuseRequest()),
            params=(SamplingParams(max_tokens=1),),
        )
        try:
            stream = await asyncio.wait_for(router.open(prompt, request), 60)
            stream.close()
            return stream.decision.reason
        finally:
            await pool.close()

    reason = asyncio.run(run())
    sent = ray.get(log.requests.remote())
    for handle in [*handles.values(), log]:
        ray.kill(handle)
    return reason, directory.lookups, sent


def test_one_worker_is_routed_without_a_lookup_two_with_one(ray_cluster):
    assert route_one(1)[:2] == (Reason.SOLE, 0)
    reason, lookups, _ = route_one(2)
    assert lookups == 1 and reason is Reason.NO_DIRECTORY  # the stand-in knows nothing


def test_a_spilled_request_tells_its_worker_the_prompt_is_held_elsewhere(ray_cluster):
    reason, _, sent = route_one(2, HolderDirectory())
    assert reason is Reason.AFFINITY
    assert [(w, r.prompt.held_elsewhere) for w, r in sent] == [("w0", False)]
    # the holder's queued prefill (a second at the assumed rate) outweighs its 32 tokens
    busy = EngineLoad(2, 20_000, 0, 0, 0, 0, prefill_backlog_tokens=20_000)
    reason, _, sent = route_one(2, HolderDirectory(), {"w0": busy})
    assert reason is Reason.SPILL
    assert [(w, r.prompt.held_elsewhere) for w, r in sent] == [("w1", True)]
