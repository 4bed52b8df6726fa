"""A worker keying its cache unlike the router (page size, model, checkpoint,
directory) is refused with a reason naming both values and the config keys, never
routed to (its cache could never be hit)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray

from cluster.errors import NoHealthyWorker
from cluster.metrics import Metrics
from cluster.routing.policy import RoutingWeights
from cluster.routing.prompts import PreparedPrompt
from cluster.routing.router import Router, RouterSettings
from cluster.routing.worker_pool import Health, WorkerPool, disagreement
from tests.cluster.worker_doubles import AGREEMENT, FakeWorker, NoDirectory, worker_info
from workers.engine.request import PromptRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import WorkerRequest

WEIGHTS = RoutingWeights(max_requests_per_worker=8)


def other(**changes) -> object:
    return dataclasses.replace(AGREEMENT, **changes)


def test_an_agreeing_worker_is_accepted():
    assert disagreement(AGREEMENT, worker_info("w0")) is None


def test_a_page_size_mismatch_names_both_sizes_and_the_key():
    reason = disagreement(AGREEMENT, worker_info("w0", other(page_size=32)))
    assert "w0" in reason and "32" in reason and "16" in reason
    assert "engine.page_size" in reason


def test_a_model_or_checkpoint_mismatch_names_both_and_the_key():
    model = disagreement(AGREEMENT, worker_info("w0", other(namespace_model="small@0123abcd")))
    assert "'small'" in model and "'tiny'" in model and "model.name" in model
    checkpoint = disagreement(AGREEMENT, worker_info("w0", other(namespace_model="tiny@ffff")))
    assert "'ffff'" in checkpoint and "'0123abcd'" in checkpoint and "model.path" in checkpoint


def test_a_directory_mismatch_names_both_and_the_keys():
    reason = disagreement(
        AGREEMENT, worker_info("w0", other(directory_namespace="redis prefix 'old'"))
    )
    assert "'old'" in reason and "'chunkserve'" in reason
    assert "directory.redis.prefix" in reason


def test_an_entry_context_mismatch_names_both_prompts_and_the_key():
    reason = disagreement(AGREEMENT, worker_info("w0", other(entry_system_prompt=None)))
    assert "None" in reason and repr(AGREEMENT.entry_system_prompt) in reason
    assert "engine.entry_system_prompt" in reason


def test_every_disagreement_is_named_at_once():
    reason = disagreement(AGREEMENT, worker_info("w0", other(page_size=8, namespace_model="x@1")))
    assert "engine.page_size" in reason and "model.name" in reason


@pytest.mark.ray
def test_the_pool_refuses_a_disagreeing_worker_and_says_why(ray_cluster):
    handles = {
        "good": FakeWorker.remote(worker_info("good")),
        "bad": FakeWorker.remote(worker_info("bad", other(page_size=32))),
    }
    ray.get([h.status.remote() for h in handles.values()])  # started (each imports torch)

    async def run() -> None:
        pool = WorkerPool(handles, AGREEMENT, poll_interval_s=0.05, poll_timeout_s=10)
        await pool.start()
        try:
            assert pool.health() == {"good": Health.HEALTHY, "bad": Health.REFUSED}
            assert [v.worker_id for v in pool.views()] == ["good"]
            described = pool.describe()
            assert "bad: refused (worker bad refused: its KV pages hold 32 tokens" in described
            assert "engine.page_size" in described
            await asyncio.sleep(0.2)  # later polls keep it refused
            assert pool.health()["bad"] is Health.REFUSED
        finally:
            await pool.close()

    asyncio.run(run())


@pytest.mark.ray
def test_a_request_with_only_disagreeing_workers_gets_the_reason(ray_cluster):
    handles = {"bad": FakeWorker.remote(worker_info("bad", other(namespace_model="tiny@ffff")))}
    ray.get([h.status.remote() for h in handles.values()])  # started (it imports torch)

    async def run() -> None:
        pool = WorkerPool(handles, AGREEMENT, poll_interval_s=0.05, poll_timeout_s=10)
        router = Router(pool, NoDirectory(), RouterSettings(WEIGHTS, max_attempts=3), Metrics())
        prompt = PreparedPrompt(token_ids=(1, 2, 3), lookup_keys=(), token_ends=())
        request = WorkerRequest("r", PromptRequest((1, 2, 3), ""), (SamplingParams(max_tokens=4),))
        try:
            with pytest.raises(NoHealthyWorker, match="fingerprint 'ffff'.*model.path"):
                await router.open(prompt, request)
        finally:
            await pool.close()

    asyncio.run(run())
