"""A worker is never gone for good while its app lives: once Ray will not restart it
(killed for good here, as after its last in-place restart), the keeper creates it
again, ``/health`` says so meanwhile, and the app serves again with no resubmission."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from tests.cluster.conftest import cluster_config, stop_app, unique_name

pytestmark = [pytest.mark.ray, pytest.mark.integration]

BACK_WITHIN_S = 120


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(tiny_qwen3, unique_name("recovery"), workers={"max_restarts": 1})
    app = start_app(config)
    yield app
    stop_app(app)


def _epoch(worker) -> int:
    return ray.get(worker.status.remote(), timeout=30).info.epoch


def test_the_keeper_creates_a_worker_again_after_ray_gave_up(app):
    name = f"{app.name}-worker-0"
    worker = ray.get_actor(name, namespace="chunkserve-tests")
    first_epoch = _epoch(worker)
    ray.kill(worker, no_restart=True)  # Ray will not restart it: as if its restarts were spent

    said: list[str] = []  # /health's answers from the kill until it is ok again
    deadline = time.monotonic() + BACK_WITHIN_S
    while time.monotonic() < deadline:
        response = httpx.get(app.url("/health"), timeout=10)
        ok = response.status_code == 200 and response.json()["status"] == "ok"
        if ok and said:  # the routers saw it go, and now come back
            break
        if not ok:
            said.append(response.text)
        time.sleep(0.1)
    else:
        raise AssertionError(f"not down and back within {BACK_WITHIN_S} s: {said[-3:]}")
    # while it was down, /health said why (Ray's death, then the keeper's attempt)
    assert said and all("no healthy worker" in text for text in said), said[:3]
    assert any("keeper creates it again (attempt 1" in text for text in said), said

    again = ray.get_actor(name, namespace="chunkserve-tests")
    assert _epoch(again) > first_epoch  # a new incarnation under the same name
    answer = httpx.post(
        f"{app.base_url}/chat/completions",
        json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
