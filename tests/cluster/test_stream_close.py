"""Closing a stream stops its generation at the worker: an answer checked to run to
its token limit, streamed and closed after a few deltas, makes the worker generate
far fewer tokens than the limit. The limit is long enough (about 5 s of the tiny
model's generation on a CPU) that the close always arrives first; on the 1,024-token
context of the other apps, the whole answer could finish before it."""

from __future__ import annotations

import time

import openai
import pytest
import ray

from tests.cluster.conftest import cluster_config, stop_app, unique_name

pytestmark = pytest.mark.ray

LIMIT = 3000  # tokens of the answer (the context is 4,096)


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(tiny_qwen3, unique_name("close"), engine={"max_model_len": 4096})
    app = start_app(config)
    yield app
    stop_app(app)


def _status(app):
    worker = ray.get_actor(f"{app.name}-worker-0", namespace="chunkserve-tests")
    return ray.get(worker.status.remote())


def _idle(app, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(app).load.requests == 0:
            return True
        time.sleep(0.05)
    return False


def test_closing_a_stream_stops_generation(app):
    client = openai.OpenAI(base_url=app.base_url, api_key="none", max_retries=0, timeout=120)
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "a long story"}],
        max_tokens=LIMIT,
        temperature=0,  # the stream below gives this answer: no end-of-text before LIMIT
    )
    assert client.chat.completions.create(**ask).choices[0].finish_reason == "length"
    assert _idle(app)
    before = _status(app).load.generated_tokens_total
    stream = client.chat.completions.create(**ask, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert _idle(app)
    generated = _status(app).load.generated_tokens_total - before
    assert 0 < generated < LIMIT // 2, generated  # stopped, not run to its end
