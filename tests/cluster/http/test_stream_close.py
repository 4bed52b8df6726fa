"""A client that gives up stops its answer's generation at the worker, through either
ingress (the replicas' own listeners, or Serve's proxy): a stream closed after a few
deltas, or a whole answer whose client timed out, makes the worker generate far fewer
tokens than the limit, and the request counts as 499 (closed by its client). An answer
checked to run to its limit is used: the limit is long enough (about 5 s of the tiny
model's generation on a CPU) that the client leaves first; on the 1,024-token context
of the other apps, the whole answer could finish before it. And a stream whose worker
dies ends with an in-band ``worker_lost`` error and counts as that error's 503."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import ray

from tests.cluster.conftest import cluster_config, stop_app, unique_name, wait_healthy

pytestmark = pytest.mark.ray

LIMIT = 3000  # tokens of the answer (the context is 4,096)
ASK = dict(
    model="tiny",
    messages=[{"role": "user", "content": "a long story"}],
    max_tokens=LIMIT,
    temperature=0,  # greedy: this answer has no end-of-text before LIMIT (checked below)
)


@pytest.fixture(scope="module", params=["replicas", "serve_proxy"])
def app(request, start_app, tiny_qwen3):
    config = cluster_config(
        tiny_qwen3,
        unique_name(f"close-{request.param.replace('_', '-')}"),
        engine={"max_model_len": 4096},
        server={"ingress": request.param},
    )
    app = start_app(config)
    yield app
    stop_app(app)


def _status(app):
    return ray.get(app.worker().status.remote())


def _idle(app, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(app).load.requests == 0:
            return True
        time.sleep(0.05)
    return False


def _chats(app, status: int) -> float:
    """The chat requests counted with ``status`` (0 if none yet)."""
    series = f'chunkserve_requests_total{{endpoint="chat",status="{status}"}}'
    for line in httpx.get(app.url("/metrics"), timeout=30).text.splitlines():
        if line.split(" ")[0] == series:
            return float(line.split(" ")[1])
    return 0.0


def _counted_soon(app, status: int, at_least: float, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _chats(app, status) >= at_least:
            return True
        time.sleep(0.1)
    return False


def test_closing_a_stream_stops_generation(app):
    client = openai.OpenAI(base_url=app.base_url, api_key="none", max_retries=0, timeout=120)
    assert client.chat.completions.create(**ASK).choices[0].finish_reason == "length"
    assert _idle(app)
    before, closed = _status(app).load.generated_tokens_total, _chats(app, 499)
    stream = client.chat.completions.create(**ASK, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert _idle(app)
    generated = _status(app).load.generated_tokens_total - before
    assert 0 < generated < LIMIT // 2, generated  # stopped, not run to its end
    assert _counted_soon(app, 499, closed + 1)


def test_a_client_that_gives_up_on_a_whole_answer_stops_its_generation(app):
    """Not streamed: the client times out while the answer is being generated, and
    the worker stops (nobody would read the answer), as a closed stream does."""
    assert _idle(app)
    before, closed = _status(app).load.generated_tokens_total, _chats(app, 499)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(app.url("/v1/chat/completions"), json=ASK, timeout=1.0)
    assert _idle(app)
    generated = _status(app).load.generated_tokens_total - before
    assert 0 < generated < LIMIT // 2, generated  # stopped, not run to its end
    assert _counted_soon(app, 499, closed + 1)
    assert _chats(app, 500) == 0


def test_a_stream_whose_worker_dies_ends_with_an_in_band_error_counted_as_503(app):
    assert _idle(app)
    failed = _chats(app, 503)
    events = []
    with httpx.stream(
        "POST", app.url("/v1/chat/completions"), json={**ASK, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3:
                ray.kill(app.worker(), no_restart=False)  # Ray restarts it in place
    assert events[-1]["error"]["code"] == "worker_lost", events[-1]
    assert _counted_soon(app, 503, failed + 1)
    wait_healthy(app, 1)
