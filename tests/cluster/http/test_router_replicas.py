"""Two router replicas over two workers: /metrics answers for the whole app from
either replica (repeated scrapes agree and sum every replica's requests), the
latency and worker families, tokens of a stream the client closed, the prompt size
limit derived from the context, and /health degraded while a worker is unavailable."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray

from chunkstore.chunking import longest_token_chars
from tests.cluster.conftest import cluster_config, stop_app, unique_name
from workers.engine.checkpoint import load_tokenizer
from workers.runtime.engine_loop import RATE_SAMPLE_MIN_TOKENS

pytestmark = pytest.mark.ray

CONTEXT = 1024  # cluster_config's max_model_len
# over a page of tokens, so the workers' caches hold pages of it
PROMPT = "The harbor office keeps its tide tables and ship manifests in the east wing. " * 3


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(
        tiny_qwen3,
        unique_name("reps"),
        workers={"count": 2},
        server={"num_replicas": 2},
    )
    app = start_app(config)
    yield app
    stop_app(app)


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    # a connection a request: the kernel deals connections over the replicas'
    # listeners, so requests spread over both replicas as they would over many clients
    fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60)
    return openai.OpenAI(
        base_url=app.base_url, api_key="none", max_retries=0, timeout=60, http_client=fresh
    )


def scrape(app) -> dict[str, float]:
    """Series -> value, from one /metrics answer (whichever replica gives it)."""
    response = httpx.get(app.url("/metrics"), timeout=30)
    assert response.status_code == 200
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            values[series] = float(value)
    return values


def counts(values: dict[str, float]) -> dict[str, float]:
    """The counters and histograms (what must agree across scrapes of an idle app)."""
    return {
        k: v
        for k, v in values.items()
        # not the workers' own, nor what the replicas sample over time whatever they serve
        if not k.startswith(
            (
                "chunkserve_worker_",
                "chunkserve_healthy_workers",
                "chunkserve_event_loop_lag_seconds",
                "chunkserve_router_cpu_seconds",
            )
        )
    }


def settled(app, done, timeout_s: float = 20) -> dict[str, float]:
    """A scrape for which ``done(values)`` holds (other replicas push their counts
    every half second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(app)
        if done(values):
            return values
        totals = {k: v for k, v in values.items() if "_total" in k or k.endswith("_count")}
        assert time.monotonic() < deadline, f"metrics did not settle: {totals}"
        time.sleep(0.2)


CHAT_404 = 'chunkserve_requests_total{endpoint="chat",status="404"}'
COMPLETIONS_200 = 'chunkserve_requests_total{endpoint="completions",status="200"}'
COMPLETIONS_499 = 'chunkserve_requests_total{endpoint="completions",status="499"}'
GENERATED = "chunkserve_generated_tokens_total"
PROMPT_TOKENS = "chunkserve_prompt_tokens_total"
# completions answered (status 200) by this module's tests so far, whichever ran
answered = {"completions": 0}


def all_answered(values: dict[str, float]) -> bool:
    return values.get(COMPLETIONS_200, 0) == answered["completions"]


def test_repeated_scrapes_agree_and_count_every_replicas_requests(app, client):
    unknown = 12
    for _ in range(unknown):  # cheap requests, spread over both replicas
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
    replies = [
        client.completions.create(model="tiny", prompt=PROMPT + str(i), max_tokens=3)
        for i in range(4)
    ]
    answered["completions"] += len(replies)
    generated = sum(r.usage.completion_tokens for r in replies)
    prompt_tokens = sum(r.usage.prompt_tokens for r in replies)

    def all_in(values: dict[str, float]) -> bool:
        return values.get(CHAT_404) == unknown and all_answered(values)

    first = counts(settled(app, all_in))
    assert first[GENERATED] == generated and first[PROMPT_TOKENS] == prompt_tokens
    for _ in range(6):  # each answered by either replica
        assert counts(scrape(app)) == first


def _histogram(values: dict[str, float], name: str) -> tuple[list[float], float, float]:
    """(cumulative bucket counts, +Inf last), sum, count of one histogram."""
    buckets = [v for k, v in values.items() if k.startswith(f"{name}_bucket{{")]
    return buckets, values[f"{name}_sum"], values[f"{name}_count"]


def test_latency_and_worker_families_after_requests(app, client):
    # a prompt long enough to be a prefill-rate sample (smaller ones are decode steps)
    long = client.completions.create(model="tiny", prompt=PROMPT * 4, max_tokens=1)
    assert long.usage.prompt_tokens >= RATE_SAMPLE_MIN_TOKENS
    answered["completions"] += 1
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    streamed = len([c for c in stream if c.choices and c.choices[0].text])
    assert streamed > 0
    answered["completions"] += 1
    values = settled(app, all_answered)
    e2e = "chunkserve_e2e_request_latency_seconds"
    ttft = "chunkserve_time_to_first_token_seconds"
    queue = "chunkserve_request_queue_time_seconds"
    itl = "chunkserve_inter_token_latency_seconds"
    for name in (e2e, ttft, queue, itl):
        buckets, total, count = _histogram(values, name)
        assert buckets == sorted(buckets) and buckets[-1] == count > 0, (name, buckets)
        assert total > 0, name
    # every answered request: one end-to-end latency, one queue time, one first token
    assert _histogram(values, e2e)[2] == answered["completions"]
    assert _histogram(values, queue)[2] == _histogram(values, ttft)[2] == answered["completions"]
    # waiting for a worker comes before the first token, which comes before the end
    assert _histogram(values, queue)[1] <= _histogram(values, ttft)[1] <= _histogram(values, e2e)[1]
    # a gap per token after each choice's first delta
    assert 0 < _histogram(values, itl)[2] <= values[GENERATED]
    workers = [f"{app.name}-worker-{i}" for i in range(2)]
    for worker in workers:
        assert values[f'chunkserve_worker_up{{worker="{worker}"}}'] == 1
        assert values[f'chunkserve_worker_requests{{worker="{worker}"}}'] == 0
        assert values[f'chunkserve_worker_load_tokens{{worker="{worker}"}}'] == 0
        # idle: nothing running or pinned holds a page, and the pool has pages
        assert values[f'chunkserve_worker_kv_pages{{worker="{worker}"}}'] > 0
        assert values[f'chunkserve_worker_kv_pages_in_use{{worker="{worker}"}}'] == 0
        # idle: nothing queued for prefill; it measured its rate while serving
        assert values[f'chunkserve_worker_prefill_backlog_tokens{{worker="{worker}"}}'] == 0
    rates = [
        values[f'chunkserve_worker_prefill_tokens_per_second{{worker="{w}"}}'] for w in workers
    ]
    assert max(rates) > 0, rates
    cached = [values[f'chunkserve_worker_cached_pages{{worker="{w}"}}'] for w in workers]
    assert sum(cached) > 0, cached
    # where each worker's engine time went: CPU workers step eagerly in torch
    steps = [values.get(f'chunkserve_worker_steps_total{{worker="{w}",kind="torch eager"}}', 0)
             for w in workers]  # fmt: skip
    seconds = [
        values.get(f'chunkserve_worker_step_seconds_total{{worker="{w}",kind="torch eager"}}', 0)
        for w in workers
    ]
    busy = [values[f'chunkserve_worker_engine_busy_seconds_total{{worker="{w}"}}'] for w in workers]
    assert sum(steps) > 0 and 0 < sum(seconds) <= sum(busy), (steps, seconds, busy)
    assert not [k for k in values if "_steps_total" in k and "torch eager" not in k]


def test_a_stream_closed_by_the_client_counts_its_tokens(app, client):
    # greedy, so the stream below gives this answer, which runs to the token limit: a
    # stream that ends early was closed by the client (sampled, the tiny model's answer
    # can reach its end-of-text token first and be answered in full)
    limit = 900
    ask = dict(
        model="tiny", prompt="A long story about the harbor", max_tokens=limit, temperature=0
    )
    assert client.completions.create(**ask).choices[0].finish_reason == "length"
    answered["completions"] += 1
    before = counts(settled(app, all_answered))
    stream = client.completions.create(**ask, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)  # each delta: >= 1 token
        if received == 5:
            break
    stream.close()

    def counted(values: dict[str, float]) -> bool:
        closed = values.get(COMPLETIONS_499, 0) > before.get(COMPLETIONS_499, 0)
        sent_in_full = values[COMPLETIONS_200] > before[COMPLETIONS_200]
        return values[GENERATED] > before[GENERATED] and (closed or sent_in_full)

    after = counts(settled(app, counted))
    # as 499, closed by its client (or 200, where the server sent the whole answer
    # before the close reached it, through Serve's proxy)
    answered["completions"] += after[COMPLETIONS_200] > before[COMPLETIONS_200]
    generated = after[GENERATED] - before[GENERATED]
    assert generated >= received
    assert after[PROMPT_TOKENS] > before[PROMPT_TOKENS]
    # it was not answered in full: no end-to-end latency for it (unless the server
    # sent the whole answer before the close reached it, through Serve's proxy)
    e2e_count = "chunkserve_e2e_request_latency_seconds_count"
    assert after[e2e_count] == before[e2e_count] + (generated == limit)


def test_the_prompt_size_limit_follows_the_context(app, tiny_qwen3):
    limit = CONTEXT * longest_token_chars(load_tokenizer(tiny_qwen3))
    response = httpx.post(
        app.url("/v1/completions"),
        json={"model": "tiny", "prompt": "z" * (limit + 1), "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"more than the {limit}" in error["message"] and f"length {CONTEXT}" in error["message"]
    fits = httpx.post(  # at the limit: tokenized, then refused (or served) by its tokens
        app.url("/v1/completions"),
        json={"model": "tiny", "prompt": "z" * limit, "max_tokens": 1},
        timeout=60,
    )
    assert "characters" not in fits.json().get("error", {}).get("message", "")
    answered["completions"] += fits.status_code == 200


def test_health_is_degraded_while_a_worker_cannot_take_requests(app):
    worker = app.worker(1)
    ray.get(worker.drain.remote(5.0))
    try:
        deadline = time.monotonic() + 20
        while (health := httpx.get(app.url("/health"), timeout=30)).json()["status"] != "degraded":
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        body = health.json()
        assert health.status_code == 200
        assert (body["healthy_workers"], body["workers"]) == (1, 2)
        assert "1 of 2 workers" in body["detail"]
        assert f"{app.name}-worker-1: draining" in body["detail"]
    finally:
        ray.get(worker.resume.remote())
    # every replica polls the workers on its own: one may still report the drain for
    # a poll interval after another has seen the resume
    ok = {"status": "ok", "healthy_workers": 2, "workers": 2}
    deadline = time.monotonic() + 20
    while (body := httpx.get(app.url("/health"), timeout=30).json()) != ok:
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
