"""One retry layer: however its workers fail (before output, or a buffered answer's
worker mid-answer), a request starts at most ``router.max_attempts`` generations
in all. Worker stand-ins refuse or die on cue; a shared log counts the starts."""

from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.api.completions import CompletionService, ServiceSettings
from cluster.api.openai_protocol import CompletionRequest
from cluster.errors import NoHealthyWorker, WorkerLost
from cluster.metrics import Metrics
from cluster.routing.policy import RoutingWeights
from cluster.routing.router import Router, RouterSettings
from cluster.routing.worker_pool import WorkerPool
from tests.cluster.worker_doubles import (
    AGREEMENT,
    DIE_AFTER_FIRST_DELTA,
    REFUSE_AS_DRAINING,
    RESTART_SILENTLY,
    RESTART_SILENTLY_AFTER_FIRST_DELTA,
    FakeWorker,
    NoDirectory,
    StartLog,
    worker_info,
)
from workers.engine.checkpoint import load_tokenizer

# a hang fails these tests in minutes, not at the suite's 10-minute limit
pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MAX_ATTEMPTS = 3
WEIGHTS = RoutingWeights(max_requests_per_worker=8)


def starts_of_one_failing_request(tokenizer, behaviours: list[str], workers: int) -> int:
    """Starts one buffered completion on ``workers`` stand-ins that fail as
    ``behaviours`` say, in turn; returns how many generations it started."""
    log = StartLog.remote(behaviours)
    handles = {f"w{i}": FakeWorker.remote(worker_info(f"w{i}"), log) for i in range(workers)}
    ray.get([handle.status.remote() for handle in handles.values()])  # all started

    async def run() -> None:
        pool = WorkerPool(handles, AGREEMENT, poll_interval_s=0.05, poll_timeout_s=10)
        router = Router(pool, NoDirectory(), RouterSettings(WEIGHTS, MAX_ATTEMPTS), Metrics())
        settings = ServiceSettings(
            model_name="tiny",
            namespace_model=AGREEMENT.namespace_model,
            page_size=AGREEMENT.page_size,
            default_max_tokens=4,
        )
        service = CompletionService(router, tokenizer, settings, Metrics())
        body = CompletionRequest(model="tiny", prompt=[1, 2, 3], max_tokens=4)
        try:
            with pytest.raises((WorkerLost, NoHealthyWorker)):
                # bounded: a start that never answers fails the test, not the suite
                await asyncio.wait_for(service.completion(body, ""), 120)
        finally:
            await pool.close()

    asyncio.run(run())
    starts = ray.get(log.count.remote())
    for handle in [*handles.values(), log]:
        ray.kill(handle)
    return starts


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return load_tokenizer(tiny_qwen3)


def test_workers_failing_before_and_after_output_use_one_budget(ray_cluster, tokenizer):
    """Each buffered start-over used to get its own ``max_attempts`` (up to its
    square): here 2 starts per start-over (a refusal, then a death mid-answer), 6 in
    all."""
    behaviours = [REFUSE_AS_DRAINING, DIE_AFTER_FIRST_DELTA]
    starts = starts_of_one_failing_request(tokenizer, behaviours, workers=2 * MAX_ATTEMPTS)
    assert starts == MAX_ATTEMPTS


def test_workers_dying_mid_answer_are_tried_max_attempts_times(ray_cluster, tokenizer):
    starts = starts_of_one_failing_request(
        tokenizer, [DIE_AFTER_FIRST_DELTA], workers=MAX_ATTEMPTS + 1
    )
    assert starts == MAX_ATTEMPTS


@pytest.mark.parametrize("behaviour", [RESTART_SILENTLY, RESTART_SILENTLY_AFTER_FIRST_DELTA])
def test_a_worker_found_restarted_fails_its_unanswered_calls(ray_cluster, tokenizer, behaviour):
    """Ray may never resolve a call to a worker that died (a death racing the
    stream's report): the pool's polls, meeting a new epoch, end the wait, before
    the first delta or after it, and the request moves on as after a reported
    death. Here no worker ever answers, so it fails after ``max_attempts`` starts
    (``wait_for`` in ``starts_of_one_failing_request`` bounds a hang)."""
    starts = starts_of_one_failing_request(tokenizer, [behaviour], workers=MAX_ATTEMPTS + 1)
    assert starts == MAX_ATTEMPTS
