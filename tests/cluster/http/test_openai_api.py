"""The official ``openai`` client against the real Serve app (embedded directory, one
CPU worker): chat and completions, streaming and not, chunk reuse that changes
nothing, content parts as chunks, tenants, logprobs, n/seed/stop, health, metrics,
drain (closing a stream: test_stream_close.py), body and prompt size limits, and a huge prompt that holds up
nobody."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import ray

from chunkstore.chunking import chunk_conversation
from cluster.api.openai_format import ChatFormat, ChoiceOutput, CompletionFormat, reuse, usage
from cluster.ops.chat_backends import RemoteBackend
from cluster.ops.chat_cli import reuse_line
from tests.chunkstore.testkit import wait_until
from tests.cluster.conftest import cluster_config, stop_app, unique_name, wait_healthy
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams
from workers.runtime.actor import coalesce

pytestmark = pytest.mark.ray

KEY_A, KEY_B = "sk-test-a", "sk-test-b"
SCRAPE = {"Authorization": "Bearer scrape-token"}  # server.metrics_token's
MAX_REQUEST_BYTES = 8 * 2**20
MAX_PROMPT_CHARS = 6_000_000
SYSTEM = "You are a careful assistant for the Harbor Analytics documentation. " * 4
DOC_A = "Document A: Starter costs 29 dollars a month for five seats and one workspace. " * 3
DOC_B = "Document B: Backups run every six hours and are kept for thirty days in two regions. " * 3
DOC_C = "Document C: Reports export to CSV, Excel and PDF; the API allows 600 requests. " * 3


def rag_messages(docs: list[str], question: str) -> list[dict]:
    parts = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(
        tiny_qwen3,
        unique_name("api"),
        server={
            "api_keys": [KEY_A, KEY_B],
            "metrics_token": SCRAPE["Authorization"].split()[1],
            "max_request_bytes": MAX_REQUEST_BYTES,
            "max_prompt_chars": MAX_PROMPT_CHARS,  # above what the context fits: it is tokenized
            "stream_interval_s": 0,  # each token as it is made
        },
        router={"max_requests_per_worker": 2},  # so that one n=2 stream fills the worker
    )
    app = start_app(config)
    yield app
    stop_app(app)


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=KEY_A, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cold_engine(tiny_qwen3) -> Engine:
    """The oracle: the same engine path with reuse off, in this process."""
    config = EngineConfig(model_dir=str(tiny_qwen3), model_id="tiny", enable_reuse=False)
    return Engine(config, stream_text=True)


def cold_text(engine: Engine, messages: list[dict], max_tokens: int) -> str:
    tokens = [t for c in chunk_conversation(engine.tokenizer, messages) for t in c.token_ids]
    engine.add_request("oracle", tokens, SamplingParams(max_tokens=max_tokens, temperature=0))
    text = ""
    while engine.has_unfinished():
        text += "".join(out.new_text for out in engine.step())
    return text


def reuse_of(reply) -> dict | None:
    """chunkserve's ``reuse`` object beside ``usage`` (an extra field to the openai client)."""
    return (reply.model_extra or {}).get("reuse")


def exact(cached_tokens: int) -> dict:
    return {"mode": "exact", "reused_tokens": cached_tokens, "recomputed_tokens": 0}


def test_models_and_health(app, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-17")
    assert missing.value.body["code"] == "model_not_found" and "'tiny'" in missing.value.message
    health = httpx.get(app.url("/health")).json()
    assert health == {"status": "ok", "healthy_workers": 1, "workers": 1}
    for path in ("/health", "/metrics"):  # what probes and scrapers send
        assert httpx.head(app.url(path), headers=SCRAPE, timeout=30).status_code == 200


def test_metrics_of_a_server_with_api_keys_need_the_scrape_token(app):
    """/metrics counts every tenant's requests: a tenant's key does not open it."""
    for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
        refused = httpx.get(app.url("/metrics"), headers=headers, timeout=30)
        assert refused.status_code == 401 and "metrics_token" in refused.json()["error"]["message"]
    assert httpx.get(app.url("/metrics"), headers=SCRAPE, timeout=30).status_code == 200


def test_chat_streaming_and_not_agree(client):
    messages = [{"role": "user", "content": "Say something about ships."}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    assert raw.headers["x-chunkserve-worker"].endswith("-worker-0")
    reply = raw.parse()
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12
    assert reuse_of(reply) == exact(reply.usage.prompt_tokens_details.cached_tokens)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    # reuse only on the last chunk: with include_usage, the usage chunk
    assert [reuse_of(c) for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert reuse_of(chunks[-1]) == exact(chunks[-1].usage.prompt_tokens_details.cached_tokens)


def test_completions_streaming_and_not_agree(client):
    reply = client.completions.create(
        model="tiny", prompt="The harbor at dawn", max_tokens=10, temperature=0
    )
    assert reply.object == "text_completion" and reply.usage.prompt_tokens > 0
    assert reuse_of(reply) == exact(reply.usage.prompt_tokens_details.cached_tokens)
    stream = client.completions.create(
        model="tiny", prompt="The harbor at dawn", max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    # without include_usage, reuse comes on the chunk that ends the (last) choice
    assert [reuse_of(c) for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason is not None
    assert reuse_of(chunks[-1])["mode"] == "exact"
    assert reuse_of(chunks[-1])["reused_tokens"] >= 0


def test_shared_chunks_hit_the_cache_and_change_nothing(client, cold_engine):
    first = client.chat.completions.create(
        model="tiny",
        messages=rag_messages([DOC_A, DOC_B], "Q: price?"),
        max_tokens=16,
        temperature=0,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(0.3)  # let the worker publish (affinity does not matter: one worker)
    messages = rag_messages([DOC_A, DOC_B], "Q: backups?")
    second = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert second.choices[0].message.content == cold_text(cold_engine, messages, 16)
    assert (reuse_of(first), reuse_of(second)) == (exact(0), exact(cached))
    again = client.chat.completions.create(  # the identical request, streamed
        model="tiny",
        messages=messages,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(again)[-1]
    assert reuse_of(last) == exact(last.usage.prompt_tokens_details.cached_tokens)
    assert reuse_of(last)["reused_tokens"] >= cached > 0


def test_chat_backend_turn_line_names_the_reuse_mode(app):
    """``chunkserve chat --url``: the per-turn line, through the real server."""
    backend = RemoteBackend(app.base_url, KEY_A, max_tokens=3, model=None)
    messages = rag_messages([DOC_B, DOC_C], "Q: chat line?")
    first, second = (backend.reply(messages, lambda _: None) for _ in range(2))
    assert (first.reuse_mode, second.reuse_mode) == ("exact", "exact")
    assert second.cached_tokens > 0
    computed = second.prompt_tokens - second.cached_tokens
    assert reuse_line(second).startswith(
        f"reuse exact: reused {second.cached_tokens} / computed {computed} prompt tokens, "
    )


def test_reuse_off_is_reported_as_off(cold_engine):
    """An engine with reuse off, through the worker's coalescing and both response
    formats, read back by the official client's models: mode off, nothing reused."""
    messages = rag_messages([DOC_A], "Q: off?")
    tokens = [t for c in chunk_conversation(cold_engine.tokenizer, messages) for t in c.token_ids]
    for attempt in range(2):  # the second, identical prompt reuses nothing either
        request_id = f"off-{attempt}"
        cold_engine.add_request(request_id, tokens, SamplingParams(max_tokens=3, temperature=0))
        outputs = []
        while cold_engine.has_unfinished():
            outputs += cold_engine.step()
        choice = ChoiceOutput()
        for delta in coalesce(outputs, {request_id: 0}):
            choice.add(delta)
        counts, how = usage(len(tokens), [choice]), reuse([choice])
        chat = ChatFormat("tiny", str, 0).response([choice], counts, how)
        text = CompletionFormat("tiny", str, 0).response([choice], counts, how)
        parsed = [
            openai.types.chat.ChatCompletion.model_validate_json(chat.model_dump_json()),
            openai.types.Completion.model_validate_json(text.model_dump_json()),
        ]
        off = {"mode": "off", "reused_tokens": 0, "recomputed_tokens": 0}
        assert [reuse_of(p) for p in parsed] == [off, off]
        assert all(p.usage.prompt_tokens_details.cached_tokens == 0 for p in parsed)


def test_each_content_part_is_a_chunk(client, cold_engine):
    client.chat.completions.create(
        model="tiny", messages=rag_messages([DOC_A, DOC_C], "Q: one?"), max_tokens=4, temperature=0
    )
    messages = rag_messages([DOC_A, DOC_B], "Q: two?")
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0
    )
    chunks = chunk_conversation(cold_engine.tokenizer, messages)
    system_and_doc_a = len(chunks[0].token_ids) + len(chunks[1].token_ids)
    # DOC_A is reused after the system prompt although a different document followed it
    assert reply.usage.prompt_tokens_details.cached_tokens >= system_and_doc_a // 16 * 16


def test_tenants_never_share_chunks(app, client):
    messages = rag_messages([DOC_C], "Q: tenant?")
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    time.sleep(0.3)
    other = openai.OpenAI(base_url=app.base_url, api_key=KEY_B, max_retries=0)
    first_b = other.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first_b.usage.prompt_tokens_details.cached_tokens == 0
    again_b = other.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert again_b.usage.prompt_tokens_details.cached_tokens > 0


PLACE_SYSTEMS = (
    "You are the approximate-reuse assistant of the Harbor handbook. " * 3,
    "Every answer quotes the handbook document it comes from, nothing else. " * 3,
)
PLACE_DOCS = (  # documents as messages of their own: the same tokens in any position
    "Handbook A: the Oslo office opens at eight and the Bergen office at nine. " * 3,
    "Handbook B: invoices go out on the first working day of every month. " * 3,
    "Handbook C: on-call engineers rotate weekly and hand over on Mondays. " * 3,
)


def placed_messages(system: str, docs: tuple[str, ...], question: str) -> list[dict]:
    documents = [{"role": "user", "content": d} for d in docs]
    return [
        {"role": "system", "content": system},
        *documents,
        {"role": "user", "content": question},
    ]


def test_reuse_field_asks_for_approximate_reuse_streamed_or_not(client):
    """``extra_body={"reuse": ...}`` through the official client: the documents'
    entries are filled on the first request and placed by later ones after another
    system prompt, in another order; the reuse object and cached_tokens say so."""
    first = client.chat.completions.create(
        model="tiny",
        messages=placed_messages(PLACE_SYSTEMS[0], PLACE_DOCS, "Q: Oslo?"),
        max_tokens=2,
        temperature=0,
        extra_body={"reuse": "approximate"},
    )
    assert reuse_of(first) == {"mode": "approximate", "reused_tokens": 0, "recomputed_tokens": 0}
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reordered = placed_messages(PLACE_SYSTEMS[1], PLACE_DOCS[::-1], "Q: invoices?")

    def placed(repair) -> dict:
        reply = client.chat.completions.create(
            model="tiny", messages=reordered, max_tokens=2, extra_body={"reuse": repair}
        )
        return reuse_of(reply) | {"cached": reply.usage.prompt_tokens_details.cached_tokens}

    # the entries are filled by the worker after the first request: wait for them
    first_four = {"mode": "approximate", "first_tokens": 4, "deviation_ratio": 0}
    deadline = time.monotonic() + 20
    while (got := placed(first_four))["recomputed_tokens"] < 4 * len(PLACE_DOCS):
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got["mode"] == "approximate" and got["reused_tokens"] == got["cached"] > 0
    assert got["recomputed_tokens"] == 4 * len(PLACE_DOCS)  # first_tokens 4 per document
    repaired = placed({"mode": "approximate", "first_tokens": 8, "deviation_ratio": 0})
    assert repaired["recomputed_tokens"] == 8 * len(PLACE_DOCS)
    # the default repair: the most deviating tenth of the placed tokens
    default = placed("approximate")
    assert default["mode"] == "approximate"
    assert 0 < default["recomputed_tokens"] <= 0.15 * default["reused_tokens"]

    stream = client.chat.completions.create(
        model="tiny",
        messages=placed_messages(PLACE_SYSTEMS[1], PLACE_DOCS[1:], "Q: on-call?"),
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"reuse": {"mode": "approximate"}},
    )
    last = list(stream)[-1]
    assert reuse_of(last)["mode"] == "approximate"
    assert reuse_of(last)["reused_tokens"] == last.usage.prompt_tokens_details.cached_tokens > 0
    text = client.completions.create(
        model="tiny", prompt="The harbor", max_tokens=2, extra_body={"reuse": "approximate"}
    )
    assert reuse_of(text)["mode"] == "approximate"  # one chunk: nothing to place
    # an exact request (the default) of the same prompt: exact, never placed KV
    exact_reply = client.chat.completions.create(model="tiny", messages=reordered, max_tokens=2)
    assert reuse_of(exact_reply)["mode"] == "exact"
    assert reuse_of(exact_reply)["recomputed_tokens"] == 0


BAD_REUSE = [
    ("unknown mode", "sloppy", 'got "sloppy"'),
    ("unknown mode in object", {"mode": "fuzzy"}, "mode"),
    ("negative first_tokens", {"mode": "approximate", "first_tokens": -1}, "first_tokens"),
    ("ratio 2", {"mode": "approximate", "deviation_ratio": 2}, "deviation_ratio"),
    ("wrong type", 7, "got 7"),
    ("list", ["approximate"], ""),
    ("unknown setting", {"mode": "approximate", "first_token": 2}, "first_token"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_reuse_values_get_400_listing_the_allowed_values(app, path):
    body = {"model": "tiny", "max_tokens": 1}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    headers = {"Authorization": f"Bearer {KEY_A}"}
    failures = []
    for name, reuse_value, detail in BAD_REUSE:
        for stream in (False, True):
            response = httpx.post(
                app.url(path), json={**body, "reuse": reuse_value, "stream": stream},
                headers=headers, timeout=30,
            )  # fmt: skip
            error = response.json().get("error", {})
            message = error.get("message", "")
            allowed = '"exact", "approximate" or an object {"mode": "exact" | "approximate"'
            if (
                response.status_code != 400
                or error.get("param") != "reuse"
                or allowed not in message
                or detail not in message
            ):
                failures.append((name, stream, response.status_code, message))
    assert not failures
    # first_tokens beyond the context (1,024 tokens) cannot be meant: refused by the router
    beyond = {"mode": "approximate", "first_tokens": 10**9}
    response = httpx.post(app.url(path), json={**body, "reuse": beyond}, headers=headers)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "reuse.first_tokens"
    assert "1000000000" in error["message"] and "1024" in error["message"]


def test_the_fields_benchmark_tools_send(client):
    """guidellm and aiperf force output lengths with vLLM's ignore_eos and min_tokens,
    and read continuous_usage_stats: every chunk carries the usage so far."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "min_tokens": 24},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 24
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24  # the include_usage chunk
    # each token as it is made (this app's server.stream_interval_s is 0), so their
    # inter-token latency is real: most chunks carry one token (a few merge where the
    # router lags)
    tokens_per_chunk = [b - a for a, b in zip(counts, counts[1:], strict=False) if b > a]
    assert tokens_per_chunk.count(1) >= len(tokens_per_chunk) // 2, tokens_per_chunk
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"min_tokens": 3},
        )
    assert caught.value.body["param"] == "min_tokens"


def test_structured_output_through_http_streamed_or_not(client):
    schema = {
        "type": "object",
        "properties": {"plan": {"enum": ["starter", "team"]}, "seats": {"type": "integer",
                       "minimum": 1, "maximum": 99}},
        "required": ["plan", "seats"],
        "additionalProperties": False,
    }  # fmt: skip
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Which plan, and how many seats? JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "plan", "schema": schema}},
    )
    reply = client.chat.completions.create(**ask)
    answer = json.loads(reply.choices[0].message.content)
    assert answer["plan"] in ("starter", "team") and 1 <= answer["seats"] <= 99
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
        if c.choices
    )  # fmt: skip
    assert json.loads(streamed) == answer
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**ask, "response_format": bad})
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "objekt" in caught.value.message


def test_an_assistant_prefill_is_continued_not_closed(client):
    """continue_final_message: the prompt ends inside the assistant's last message; by
    default it is closed and a new turn opened (vLLM's semantics)."""
    messages = [
        {"role": "user", "content": "Name a port."},
        {"role": "assistant", "content": "The port of"},
    ]

    def prompt_tokens(**extra) -> int:
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra
        )
        return reply.usage.prompt_tokens

    continued = prompt_tokens(continue_final_message=True, add_generation_prompt=False)
    closed = prompt_tokens(add_generation_prompt=False)
    new_turn = prompt_tokens()
    assert continued < closed < new_turn
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        prompt_tokens(continue_final_message=True)


def test_n_seed_and_stop(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Two answers please"}],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
    )
    assert [c.index for c in reply.choices] == [0, 1]
    again = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Two answers please"}],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    full = client.completions.create(model="tiny", prompt="Stop here", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("greedy output has no usable stop string")
    cut = client.completions.create(
        model="tiny", prompt="Stop here", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "logprobs"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    completion = client.completions.create(
        model="tiny", prompt="logprobs", max_tokens=3, temperature=0, logprobs=1
    )
    assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens


LONG = "word " * 3000


def _chat(**fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {**body, **fields}


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', KEY_A, 400),
    ("max_tokens wrong type", "/v1/chat/completions", _chat(max_tokens="ten"), KEY_A, 400),
    ("temperature wrong type", "/v1/chat/completions", _chat(temperature="hot"), KEY_A, 400),
    ("content wrong type", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), KEY_A, 400),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), KEY_A, 400),
    ("huge max_tokens", "/v1/chat/completions", _chat(max_tokens=10**9), KEY_A, 400),
    ("over-long prompt", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": LONG}]), KEY_A, 400),
    ("over-long completion prompt", "/v1/completions", {"model": "tiny", "prompt": LONG}, KEY_A, 400),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, KEY_A, 400),
    ("n = 0", "/v1/chat/completions", _chat(n=0), KEY_A, 400),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), KEY_A, 404),
    ("bad key", "/v1/chat/completions", _chat(), "sk-wrong", 401),
    ("no key", "/v1/chat/completions", _chat(), None, 401),
    ("unknown route", "/v1/embeddings", _chat(), KEY_A, 404),
]  # fmt: skip


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(app, client):
    failures = []
    for name, path, body, key, status in BAD_REQUESTS:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, bytes):
            response = httpx.post(app.url(path), content=body, headers=headers, timeout=30)
        else:
            response = httpx.post(app.url(path), json=body, headers=headers, timeout=30)
        error = response.json().get("error", {})
        if response.status_code != status or set(error) != {"message", "type", "param", "code"}:
            failures.append((name, response.status_code, response.text[:200]))
    assert not failures
    over_long = httpx.post(
        app.url("/v1/chat/completions"),
        json=_chat(messages=[{"role": "user", "content": LONG}]),
        headers={"Authorization": f"Bearer {KEY_A}"},
    ).json()["error"]
    assert "1023" in over_long["message"] and "1024" in over_long["message"]
    # more messages than the context has tokens: refused by counting, before rendering
    too_many = httpx.post(
        app.url("/v1/chat/completions"),
        json=_chat(messages=[{"role": "user", "content": ""}] * 1025),
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert too_many.status_code == 400
    error = too_many.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert "1025 messages" in error["message"] and "server.max_messages" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        bad = openai.OpenAI(base_url=app.base_url, api_key="sk-wrong", max_retries=0)
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    for unsupported in (
        {"tools": [{"type": "function", "function": {"name": "lookup"}}]},
        {"logit_bias": {"42": 5}},
    ):  # through the official client: a 400 naming the field, never plain text
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], **unsupported
            )
        [field] = unsupported
        assert caught.value.body["param"] == field and "not supported" in caught.value.message
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok"}]
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def _wait_idle(worker, timeout_s: float = 10) -> bool:
    return wait_until(lambda: ray.get(worker.status.remote()).load.requests == 0, timeout_s)


def _router_in_flight(app) -> float:
    text = httpx.get(app.url("/metrics"), headers=SCRAPE).text
    return float(re.search(r"^chunkserve_requests_in_flight (\S+)$", text, re.M).group(1))


def _wait_router_idle(app, timeout_s: float = 10) -> bool:
    """The replica finished its requests too (it uncounts a closed stream's work when
    its handler ends, which may come after the worker dropped it)."""
    return wait_until(lambda: _router_in_flight(app) == 0, timeout_s, step_s=0.05)


def test_full_worker_answers_429(app, client):
    # greedy, and checked to run to the limit: sampled, both answers could reach their
    # end-of-text token before the next request arrives, and no 429 would come
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "two long stories"}],
        max_tokens=900,
        temperature=0,
    )
    assert client.chat.completions.create(**ask).choices[0].finish_reason == "length"
    stream = client.chat.completions.create(**ask, n=2, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert refused.value.response.headers["retry-after"] == "1"
    assert "limit of 2 requests" in refused.value.message
    stream.close()
    assert _wait_idle(app.worker())
    assert _wait_router_idle(app)


def test_draining_worker_refuses_then_resumes(app, client):
    worker = app.worker()
    before = ray.get(worker.status.remote()).load
    try:
        drained = ray.get(worker.drain.remote(5.0))
        after = ray.get(worker.status.remote()).load
        # (flaky in some full runs: work outstanding though the test before waited for
        # none; the loads say whether requests arrived since and how large they are)
        assert drained is True, f"outstanding after 5 s: {after}; before the drain: {before}"
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}]
            )
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "5"
        assert httpx.get(app.url("/health")).status_code == 503
    finally:  # even on a failure: the module's one worker must not stay draining
        ray.get(worker.resume.remote())
    wait_healthy(app, 1, timeout_s=10)  # the router sees it at its next poll
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}]
    )
    assert reply.usage.completion_tokens > 0


def test_metrics(app, client):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "m"}])
    text = httpx.get(app.url("/metrics"), headers=SCRAPE).text
    for name in (
        'chunkserve_requests_total{endpoint="chat",status="200"}',
        'chunkserve_requests_total{endpoint="chat",status="400"}',
        "chunkserve_time_to_first_token_seconds_bucket",
        "chunkserve_prompt_tokens_total",
        "chunkserve_cached_prompt_tokens_total",
        "chunkserve_generated_tokens_total",
        "chunkserve_directory_lookups_total",
        "chunkserve_directory_lookup_failures_total",
        "chunkserve_cache_hit_rate",
    ):
        assert name in text
    hit_rate = next(
        line for line in text.splitlines() if line.startswith("chunkserve_cache_hit_rate")
    )
    assert float(hit_rate.split()[1]) > 0


def _series(app, series: str) -> float | None:
    """One series' value in a /metrics scrape (None: absent)."""
    for line in httpx.get(app.url("/metrics"), headers=SCRAPE, timeout=30).text.splitlines():
        if line.split(" ")[0] == series:
            return float(line.split(" ")[1])
    return None


def test_a_huge_prompt_being_tokenized_holds_up_neither_small_requests_nor_health(app, client):
    """A 5 MB prompt, under both limits, takes seconds to tokenize (and is then refused
    for its token count); meanwhile a small request and /health are answered."""
    huge = "word " * 1_000_000
    finished: dict[str, tuple[float, httpx.Response]] = {}

    def send_huge() -> None:
        response = httpx.post(
            app.url("/v1/completions"),
            json={"model": "tiny", "prompt": huge, "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=300,
        )
        finished["huge"] = (time.monotonic(), response)

    sender = threading.Thread(target=send_huge)
    sent = time.monotonic()
    sender.start()
    large_lane = 'chunkserve_prompts_preparing{lane="large"}'
    while _series(app, large_lane) != 1:  # until the huge prompt is being prepared
        assert sender.is_alive(), (
            f"the huge request ended before its prompt was prepared: {finished}"
        )
        time.sleep(0.02)
    asked = time.monotonic()
    health = httpx.get(app.url("/health"), timeout=60)
    health_at = time.monotonic()
    small = client.completions.create(model="tiny", prompt="A small one", max_tokens=2)
    small_at = time.monotonic()
    sender.join(timeout=300)
    huge_at, huge_response = finished["huge"]
    figures = (
        f"/health took {health_at - asked:.3f} s and the small request {small_at - health_at:.3f}"
        f" s while the huge prompt was in flight; the huge request took {huge_at - sent:.3f} s"
    )
    assert health.status_code == 200 and health.json()["status"] == "ok", figures
    assert small.usage.completion_tokens > 0, figures
    assert health_at < huge_at and small_at < huge_at, figures
    # it was tokenized in full: refused for its tokens, not its characters
    assert huge_response.status_code == 400, figures
    error = huge_response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "2000002 tokens" in error["message"]


# Posts one body over and over until its stop file appears, from a process of its own
# (so the test's clients share no interpreter with it); prints each answer's status
# line, the first answer's body last.
FLOOD = """
import sys, pathlib, httpx
url, body, key, stop = sys.argv[1], pathlib.Path(sys.argv[2]).read_bytes(), sys.argv[3], sys.argv[4]
headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
first = None
while not pathlib.Path(stop).exists():
    answer = httpx.post(url, content=body, headers=headers, timeout=120)
    print(answer.status_code, flush=True)
    first = first or answer.text
print(first)
"""


def test_huge_message_lists_get_a_clear_400_and_hold_up_no_one(app, client, tmp_path):
    """A chat of 100,000 empty messages (3.3 MB) and a chunk of 3,000 messages, each
    sent over and over by another process: each is refused (more messages than the
    1,024-token context could hold) by counting, not by rendering or tokenizing, and a
    small request sent meanwhile takes at most 5x its time alone (medians, measured in
    this test). Parsing each flood body would hold the replica's interpreter about
    0.57 s, over 20x a small request's time; counted, the flood costs the small
    request 1.4-2.3x (two cores shared with the flood's own client)."""

    def small() -> float:
        started = time.monotonic()
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "A small one"}], max_tokens=8
        )
        return time.monotonic() - started

    chat = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": ""}] * 100_000,
    }
    chunk = {"content": [{"role": "user", "content": "x"}] * 3_000}  # fmt: skip
    for path, body, count in (
        ("/v1/chat/completions", chat, 100_000),
        ("/v1/chunks", chunk, 3_000),
    ):
        baseline = statistics.median(small() for _ in range(9))
        encoded, stop = tmp_path / "body.json", tmp_path / "stop"
        encoded.write_text(json.dumps(body))
        stop.unlink(missing_ok=True)
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, app.url(path), str(encoded), KEY_A, str(stop)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(1.0)  # the flood is under way
            meanwhile = statistics.median(small() for _ in range(9))
        finally:
            stop.touch()
            out, _ = flood.communicate(timeout=120)
        *statuses, first = out.strip().splitlines()
        assert statuses and set(statuses) == {"400"}, out[-500:]
        error = json.loads(first)["error"]
        assert (
            f"{count} messages" in error["message"] and error["code"] == "context_length_exceeded"
        )
        assert meanwhile <= 5 * baseline, (path, meanwhile, baseline, len(statuses))


def test_a_body_over_the_limit_gets_413_naming_the_limit(app):
    body = b'{"model": "tiny", "max_tokens": 1, "prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}'

    def chunked():  # no Content-Length: the limit holds as the body arrives
        for start in range(0, len(body), 2**20):
            yield body[start : start + 2**20]

    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    for content in (body, chunked()):
        response = httpx.post(
            app.url("/v1/completions"), content=content, headers=headers, timeout=60
        )
        assert response.status_code == 413, response.text[:300]
        error = response.json()["error"]
        assert str(MAX_REQUEST_BYTES) in error["message"]
        assert "server.max_request_bytes" in error["message"]
        assert error["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_prompt_over_the_limit_gets_400_before_tokenizing(app, path):
    text = "y" * (MAX_PROMPT_CHARS + 1)
    body = {"model": "tiny", "max_tokens": 1}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    response = httpx.post(
        app.url(path), json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60
    )
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"  # the size check, not the token count
    assert f"{MAX_PROMPT_CHARS + 1} characters" in error["message"]
    assert str(MAX_PROMPT_CHARS) in error["message"]
    assert "server.max_prompt_chars" in error["message"]
