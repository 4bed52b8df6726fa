"""Clients that give up never hurt a worker: a storm of requests whose clients time
out after 2-60 ms (chunk registrations, chats that reference a chunk, plain and
streamed chats) leaves the worker in its first incarnation, a chunk registered
before the storm still held, the worker's pages in use and requests in flight back
at their baseline, and no traceback in any Ray log written meanwhile. Nor does the
GCS keep a record of each request (task events: about 3 KB a call, without bound
until Ray's cap of 100,000 calls)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray.util.state import list_tasks

from tests.cluster.conftest import cluster_config, stop_app, unique_name

pytestmark = [pytest.mark.ray, pytest.mark.integration]

PER_KIND = 200
CONCURRENCY = 8
TIMEOUTS_S = (0.002, 0.060)  # each client gives up after a time drawn from this range
SETTLE_S = 60  # how long the worker may take to finish or drop the abandoned work
DOC = "Staff note {i}: Petra Lind lives in Tallinn and is {age} years old. "
KEPT = "Handbook: the Starter plan costs 29 dollars a month; backups run every six hours."


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(tiny_qwen3, unique_name("timeouts"), workers={"max_restarts": 3})
    app = start_app(config)
    yield app
    stop_app(app)


def _status(app):
    return ray.get(app.worker().status.remote(), timeout=30)


def _log_sizes(log_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in log_dir.iterdir() if p.is_file()}


def _new_log_text(log_dir: Path, before: dict[Path, int]) -> dict[Path, str]:
    text = {}
    for path in log_dir.iterdir():
        if not path.is_file():
            continue
        with path.open("rb") as f:
            f.seek(before.get(path, 0))
            text[path] = f.read().decode(errors="replace")
    return text


async def _one(client: httpx.AsyncClient, app, kind: str, i: int, kept_id: str) -> str:
    """Send one request of ``kind`` with a short client timeout; what became of it."""
    timeout = random.uniform(*TIMEOUTS_S)
    chat = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    if kind == "register":
        url, body = "/chunks", {"content": DOC.format(i=i, age=20 + i % 50), "ttl_s": 30}
    elif kind == "chunk_chat":
        content = [{"type": "chunk", "chunk_id": kept_id}, {"type": "text", "text": f"Q{i}?"}]
        url, body = (
            "/chat/completions",
            {**chat, "messages": [{"role": "user", "content": content}]},
        )
    else:
        messages = [{"role": "user", "content": f"question {i}: where does Petra live?"}]
        url, body = "/chat/completions", {**chat, "messages": messages}
        if kind == "stream":
            body["stream"] = True
    try:
        if kind == "stream":
            async with client.stream("POST", app.base_url + url, json=body, timeout=timeout) as r:
                async for _ in r.aiter_bytes():
                    pass
        else:
            await client.post(app.base_url + url, json=body, timeout=timeout)
    except httpx.TimeoutException:
        return "timed out"
    return "answered"


async def _storm(app, kept_id: str) -> dict[str, int]:
    kinds = [k for k in ("register", "chunk_chat", "chat", "stream") for _ in range(PER_KIND)]
    random.Random(0).shuffle(kinds)
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(i: int, kind: str) -> None:
        async with gate:
            outcome = await _one(client, app, kind, i, kept_id)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(run(i, kind) for i, kind in enumerate(kinds)))
    return outcomes


def test_clients_that_time_out_crash_nothing(app, ray_cluster):
    log_dir = Path(ray_cluster.temp_dir) / "session_latest" / "logs"
    http = httpx.Client(timeout=120)
    kept = http.post(f"{app.base_url}/chunks", json={"content": KEPT, "role": "context"})
    assert kept.status_code == 200, kept.text
    kept_id = kept.json()["id"]
    baseline = _status(app)
    logs_before = _log_sizes(log_dir)

    outcomes = asyncio.run(_storm(app, kept_id))
    assert outcomes.get("timed out", 0) > PER_KIND, outcomes  # the storm did give up

    deadline = time.monotonic() + SETTLE_S
    while True:  # the abandoned work is finished or dropped; temporary chunks expire
        status = _status(app)
        settled = (
            status.load.requests == baseline.load.requests
            and status.kv_pages_in_use == baseline.kv_pages_in_use
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status.info.epoch == baseline.info.epoch, "the worker restarted"
    assert status.load.requests == baseline.load.requests
    assert status.kv_pages_in_use == baseline.kv_pages_in_use
    held = http.get(f"{app.base_url}/chunks/{kept_id}")
    assert held.status_code == 200, held.text
    answer = http.post(
        f"{app.base_url}/chat/completions",
        json={
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "chunk", "chunk_id": kept_id}]}],
        },
    )
    assert answer.status_code == 200, answer.text
    written = _new_log_text(log_dir, logs_before)
    tracebacks = {p.name: t for p, t in written.items() if "Traceback" in t}
    assert not tracebacks, {
        name: t[t.index("Traceback") :][:3000] for name, t in tracebacks.items()
    }
    never_retrieved = [p.name for p, t in written.items() if "never retrieved" in t]
    assert not never_retrieved, never_retrieved
    # a task with events on is recorded (so the query below can find what it looks for)
    ray.get(_recorded_probe.remote())
    deadline = time.monotonic() + SETTLE_S
    while not _recorded(ray_cluster, "_recorded_probe") and time.monotonic() < deadline:
        time.sleep(1)
    assert _recorded(ray_cluster, "_recorded_probe")
    assert _recorded(ray_cluster, "Worker.generate") == []


@ray.remote(num_cpus=0)
def _recorded_probe() -> int:
    return 1


def _recorded(ray_cluster, name: str) -> list:
    """The GCS's task records of tasks called ``name`` (at most 10)."""
    return list_tasks(
        address=ray_cluster.dashboard_url,
        filters=[("name", "=", name)],
        limit=10,
        raise_on_missing_output=False,
    )
