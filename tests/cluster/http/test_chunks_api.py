"""``/v1/chunks`` against the real Serve app (embedded directory, two CPU workers, a
small pool): generation from chunk ids equals the inline text and hits the pinned
pages, DELETE unpins (and the directory follows), tenant scoping, replicas spread
requests, and bad input pins nothing.

The pin-survives-a-flood property is tested offline (tests/workers/test_chunk_registry.py):
through HTTP on CPU the flood would take too long for this suite."""

from __future__ import annotations

import sys
import time

import httpx
import openai
import pexpect
import pytest
import ray

from chunkstore.hashing import Namespace
from cluster.assembly import namespace_model
from cluster.config import load_config
from cluster.http.tenancy import tenant_salt
from cluster.ops.model_store import ensure_model
from cluster.routing.prompts import prepare_chat
from tests.cluster.conftest import cluster_config, stop_app, unique_name
from workers.engine.checkpoint import load_tokenizer

pytestmark = pytest.mark.ray

KEY_A, KEY_B = "sk-chunks-a", "sk-chunks-b"
SYSTEM = "You are the archivist of the Harbor Analytics handbook; answer from it. " * 2
DOC = "Handbook: Starter costs 29 dollars a month; backups run every six hours. " * 3
QUESTION = "How often do backups run?"
PAGE = 16
# 40 pages of 16, 256-token requests: at most 24 pages (384 tokens) may be pinned.
MAX_PINNED_TOKENS = (40 - 256 // PAGE) * PAGE


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(
        tiny_qwen3,
        unique_name("chunks"),
        engine={"page_size": PAGE, "num_pages": 40, "max_model_len": 256},
        workers={"count": 2},
        # one router, whose rotation shares requests among equal holders; replicas
        # each rotate on their own, so requests that alternate between replicas can
        # land on one worker every time
        server={"api_keys": [KEY_A, KEY_B], "num_replicas": 1},
    )
    app = start_app(config)
    yield app
    stop_app(app)


@pytest.fixture(scope="module")
def http_a(app):
    with httpx.Client(headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def http_b(app):
    with httpx.Client(headers={"Authorization": f"Bearer {KEY_B}"}, timeout=120) as client:
        yield client


@pytest.fixture(autouse=True)
def delete_chunks_afterwards(app, http_a):
    """Each test starts with tenant A holding no chunks, even after a failure."""
    yield
    for chunk in http_a.get(f"{app.base_url}/chunks").json()["data"]:
        http_a.delete(f"{app.base_url}/chunks/{chunk['id']}")


def openai_client(app, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=key, max_retries=0, timeout=120)


def register(http: httpx.Client, app, **body) -> dict:
    response = http.post(f"{app.base_url}/chunks", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chunk_part(chunk_id: str) -> list[dict]:
    return [{"type": "chunk", "chunk_id": chunk_id}]


def ask(client: openai.OpenAI, messages: list[dict]):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    return raw.headers["x-chunkserve-worker"], raw.parse()


def _prepared(app, key: str, messages: list[dict], approximate: bool = False):
    """The prompt as the router prepares it, and the app's directory actor."""
    cfg = load_config(app.config_path)
    model_dir = ensure_model(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    namespace = Namespace(namespace_model(cfg, model_dir), tenant_salt(key))
    prompt = prepare_chat(tokenizer, messages, namespace, PAGE, approximate=approximate)
    return prompt, ray.get_actor(f"{cfg.name}-directory", namespace=cfg.ray.namespace)


def holders_in_directory(app, key: str, messages: list[dict], chunk: int = 0) -> set[str]:
    """Workers the directory reports holding every full page up to the end of chunk
    ``chunk`` of ``messages`` (a message, or a part of one)."""
    prompt, host = _prepared(app, key, messages)
    keys, ends = prompt.lookup_keys[: chunk + 1], prompt.token_ends[: chunk + 1]
    result = ray.get(host.lookup.remote(list(keys), list(ends)))
    return {h.worker_id for h in result.holdings if h.tokens >= ends[-1]}


def entry_holders_in_directory(app, key: str, messages: list[dict]) -> set[str]:
    """Workers the directory reports holding a position-free entry of a placeable
    chunk of ``messages``."""
    prompt, host = _prepared(app, key, messages, approximate=True)
    result = ray.get(host.lookup.remote([], [], list(prompt.entry_keys)))
    return {e.worker_id for e in result.entries}


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_generation_from_chunk_ids_equals_inline_and_hits_the_pins(app, http_a):
    system = register(http_a, app, content=SYSTEM, role="system")
    doc = register(http_a, app, content=DOC, after=[system["id"]])
    assert doc["object"] == "chunk" and doc["role"] == "context" and doc["expires_at"] is None
    assert doc["holders"] == system["holders"] and len(doc["holders"]) == 1
    assert doc["pinned_tokens"] > system["pinned_tokens"] > 0 and doc["tokens"] > 0
    pinned = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC}]
    assert wait_for(
        lambda: holders_in_directory(app, KEY_A, pinned, chunk=1) == {doc["holders"][0]}
    )

    client = openai_client(app, KEY_A)
    question = {"role": "user", "content": QUESTION}
    by_id = [
        {"role": "system", "content": chunk_part(system["id"])},
        {"role": "user", "content": chunk_part(doc["id"])},
        question,
    ]
    worker, from_ids = ask(client, by_id)
    assert worker == doc["holders"][0]  # routed to the holder
    assert from_ids.usage.prompt_tokens_details.cached_tokens >= doc["pinned_tokens"]
    inline = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC}, question]
    _, from_text = ask(client, inline)
    assert from_text.choices[0].message.content == from_ids.choices[0].message.content
    assert from_text.usage.prompt_tokens == from_ids.usage.prompt_tokens

    listed = http_a.get(f"{app.base_url}/chunks").json()
    assert {c["id"] for c in listed["data"]} == {system["id"], doc["id"]}
    info = http_a.get(f"{app.base_url}/chunks/{doc['id']}").json()
    assert info["hits"] >= 1 and info["tokens_saved"] > 0 and info["holders"] == doc["holders"]
    for chunk in (doc, system):
        assert http_a.delete(f"{app.base_url}/chunks/{chunk['id']}").status_code == 200


def test_delete_unpins_and_the_directory_follows(app, http_a):
    content = "A note that only this test registers, about lighthouses and tides. " * 3
    chunk = register(http_a, app, content=content, role="system", ttl_s=600)
    assert chunk["expires_at"] > time.time()
    messages = [{"role": "system", "content": content}]
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set(chunk["holders"]))

    deleted = http_a.delete(f"{app.base_url}/chunks/{chunk['id']}")
    assert deleted.json() == {"id": chunk["id"], "object": "chunk", "deleted": True}
    assert http_a.get(f"{app.base_url}/chunks/{chunk['id']}").status_code == 404
    assert http_a.delete(f"{app.base_url}/chunks/{chunk['id']}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        ask(openai_client(app, KEY_A), [{"role": "system", "content": chunk_part(chunk["id"])}])
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set())


def test_ttl_unpins_without_further_calls(app, http_a):
    content = "A short-lived note about the ferry timetable and its winter schedule. " * 3
    chunk = register(http_a, app, content=content, role="system", ttl_s=3)
    messages = [{"role": "system", "content": content}]
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set(chunk["holders"]))
    # only the directory is asked meanwhile: the worker's expiry timer unpins and evicts
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set(), timeout_s=9)
    assert http_a.get(f"{app.base_url}/chunks/{chunk['id']}").status_code == 404


def test_tenants_cannot_see_use_or_hit_each_others_chunks(app, http_a, http_b):
    content = "Tenant A's private price list: gold plan 99 dollars, silver 49 dollars. " * 3
    chunk = register(http_a, app, content=content, role="system")
    url = f"{app.base_url}/chunks/{chunk['id']}"
    assert http_b.get(url).status_code == 404
    assert http_b.delete(url).status_code == 404
    assert http_b.get(f"{app.base_url}/chunks").json()["data"] == []
    client_b = openai_client(app, KEY_B)
    with pytest.raises(openai.NotFoundError):
        ask(client_b, [{"role": "system", "content": chunk_part(chunk["id"])}])
    messages = [{"role": "system", "content": content}]
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set(chunk["holders"]))
    _, reply = ask(client_b, [{"role": "system", "content": content}])
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert http_a.get(url).status_code == 200  # B's attempts changed nothing
    assert http_a.delete(url).status_code == 200


def test_replicas_pin_on_two_workers_and_requests_spread(app, http_a):
    chunk = register(http_a, app, content=DOC, role="system", replicas=2)
    assert len(chunk["holders"]) == 2
    messages = [{"role": "system", "content": DOC}]
    assert wait_for(lambda: holders_in_directory(app, KEY_A, messages) == set(chunk["holders"]))
    client = openai_client(app, KEY_A)
    workers = set()
    seen = []
    for i in range(4):
        messages = [
            {"role": "system", "content": chunk_part(chunk["id"])},
            # distinct from its first token, so no page after the pinned ones is shared
            {"role": "user", "content": f"{i}: which plan?"},
        ]
        worker, reply = ask(client, messages)
        assert reply.usage.prompt_tokens_details.cached_tokens >= chunk["pinned_tokens"]
        workers.add(worker)
        seen.append((worker, reply.usage.prompt_tokens_details.cached_tokens))
    assert workers == set(chunk["holders"]), seen
    assert http_a.delete(f"{app.base_url}/chunks/{chunk['id']}").status_code == 200


BIG = "Every page of this appendix repeats the same long clause about tides. " * 40


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"content": "x", "role": "assistant"}, 400, "role"),
        ({"content": "x", "ttl_s": -1}, 400, "ttl_s"),
        ({"content": "x", "ttl_s": 0}, 400, "ttl_s"),
        ({"content": "x", "ttl_s": "10"}, 400, "ttl_s"),
        ({"content": "   "}, 400, "empty"),
        ({"content": "x", "replicas": 0}, 400, "replicas"),
        ({"content": "x", "replicas": 3}, 400, "only 2 worker"),
        ({"content": "x", "tll_s": 5}, 400, "tll_s"),
        ({"content": "x", "after": ["no-such-chunk"]}, 404, "no-such-chunk"),
        ({"content": BIG}, 400, f"at most {MAX_PINNED_TOKENS} tokens"),
        # refused by the router by counting, before a worker renders any of it
        ({"content": [{"role": "user", "content": ""}] * 257}, 400, "257 messages"),
    ],
)
def test_bad_registrations_pin_nothing(app, http_a, body, status, says):
    response = http_a.post(f"{app.base_url}/chunks", json=body)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]
    assert http_a.get(f"{app.base_url}/chunks").json()["data"] == []


def test_unknown_ids_and_missing_key(app, http_a):
    assert http_a.get(f"{app.base_url}/chunks/nope").status_code == 404
    with pytest.raises(openai.NotFoundError):
        ask(openai_client(app, KEY_A), [{"role": "user", "content": chunk_part("nope")}])
    assert httpx.get(f"{app.base_url}/chunks").status_code == 401


def test_chat_command_against_the_server(app, http_a, tmp_path):
    """``chunkserve chat --url``: chunks registered through /v1/chunks, reuse shown."""
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "cluster.ops.cli", "chat", "--url", app.base_url, "--api-key", KEY_A]
        + ["--max-tokens", "6"],
        timeout=120,
    )
    try:
        child.expect_exact("you> ")
        child.sendline(f"/system {SYSTEM}")
        child.sendline(f"/register-file {doc}")
        child.expect(r"registered .*doc.txt as [0-9a-f]{64}")
        # the command strips its argument: the system prompt without its trailing space
        system = {"role": "system", "content": SYSTEM.strip()}
        pinned = [system, {"role": "user", "content": DOC}]
        assert wait_for(lambda: len(holders_in_directory(app, KEY_A, pinned, chunk=1)) == 1)
        child.sendline("Which plan is cheapest?")
        child.expect(rb"reused (\d+) / computed \d+ prompt tokens, TTFT \d+ ms")
        assert int(child.match.group(1)) > 0
        child.sendline("/chunks")
        child.expect(r"context +\d+ tokens, \d+ pinned, 1 hits")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    for chunk in http_a.get(f"{app.base_url}/chunks").json()["data"]:
        assert http_a.delete(f"{app.base_url}/chunks/{chunk['id']}").status_code == 200


def test_an_approximate_chunk_is_one_pinned_copy_for_every_system_prompt(app, http_a):
    doc = register(http_a, app, content=DOC, mode="approximate")
    assert doc["mode"] == "approximate" and doc["role"] == "context"
    assert doc["pinned_tokens"] >= doc["tokens"] > 0 and len(doc["holders"]) == 1
    assert register(http_a, app, content=DOC, mode="approximate")["id"] == doc["id"]
    inline = [{"type": "text", "text": DOC}, {"type": "text", "text": QUESTION}]
    held = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": inline}]
    assert wait_for(lambda: entry_holders_in_directory(app, KEY_A, held) == {doc["holders"][0]})
    client = openai_client(app, KEY_A)
    for system in ("You are terse.", "You are the archivist; quote the handbook."):
        messages = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [*chunk_part(doc["id"]), {"type": "text", "text": QUESTION}],
            },
        ]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_body={"reuse": "approximate"},
        )
        reply = raw.parse()
        assert raw.headers["x-chunkserve-worker"] == doc["holders"][0]  # routed to the copy
        assert reply.reuse["mode"] == "approximate"
        assert reply.reuse["reused_tokens"] >= doc["tokens"]
        assert reply.usage.prompt_tokens_details.cached_tokens == reply.reuse["reused_tokens"]
    [listed] = http_a.get(f"{app.base_url}/chunks").json()["data"]
    assert listed["pinned_tokens"] == doc["pinned_tokens"]  # still one copy


@pytest.mark.parametrize(
    "body",
    [
        {"content": DOC, "mode": "approximate", "after": ["x"]},
        {"content": DOC, "mode": "approximate", "role": "system"},
        {"content": DOC, "mode": "fuzzy"},
    ],
)
def test_bad_approximate_registrations_are_400(app, http_a, body):
    response = http_a.post(f"{app.base_url}/chunks", json=body)
    assert response.status_code == 400, response.text
    assert http_a.get(f"{app.base_url}/chunks").json()["data"] == []
