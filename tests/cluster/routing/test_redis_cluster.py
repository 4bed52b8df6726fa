"""Two workers, two router replicas, the Redis directory (a private redis-server we
may kill): affinity (exact prefixes and approximate reuse's position-free entries),
Redis outage, a worker killed mid-load, and ``chunkserve status``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import ray

from chunkstore.hashing import Namespace
from chunkstore.redis_directory import RedisChunkDirectory
from cluster.assembly import namespace_model
from cluster.config import load_config
from cluster.routing.prompts import prepare_chat
from tests.chunkstore.testkit import wait_until
from tests.cluster.conftest import REPO, cluster_config, stop_app, unique_name, wait_healthy
from workers.engine.checkpoint import load_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.redis]

LEASE_TTL_S = 2.0
DOCS = [
    "Document: Pricing. Starter costs 29 dollars a month for five seats. " * 4,
    "Document: Security. Backups run every six hours and are kept thirty days. " * 4,
]


@dataclass(frozen=True)
class Reply:
    worker: str
    cached: int
    text: str
    reuse: dict | None = None  # the response's reuse object


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3, redis_server, ray_cluster):
    prefix = f"cstest-{uuid.uuid4().hex[:8]}"
    config = cluster_config(
        tiny_qwen3,
        unique_name("redis"),
        workers={"count": 2},
        directory={
            "kind": "redis",
            "lease_ttl_s": LEASE_TTL_S,
            "redis": {"url": redis_server.url, "prefix": prefix, "timeout_s": 0.5},
        },
        router={"poll_interval_s": 0.2, "max_attempts": 3},
        server={"num_replicas": 2, "default_max_tokens": 8},
    )
    app = start_app(config)
    yield app
    stop_app(app)


class Probe:
    """Reads the directory the way the routers do (same keys, same namespace)."""

    def __init__(self, config_path: Path) -> None:
        cfg = load_config(config_path)
        model_dir = Path(cfg.model.path)
        self.namespace = Namespace(namespace_model(cfg, model_dir), "")
        self.tokenizer = load_tokenizer(model_dir)
        self.page_size = cfg.engine.page_size
        section = cfg.directory.redis
        self.directory = RedisChunkDirectory(
            section.url, prefix=section.prefix, lease_ttl_s=LEASE_TTL_S, timeout_s=0.5
        )

    def holders(self, messages: list[dict]) -> dict[str, int]:
        prompt = prepare_chat(self.tokenizer, messages, self.namespace, self.page_size)
        result = self.directory.lookup(prompt.lookup_keys, prompt.token_ends)
        return {h.worker_id: h.tokens for h in result.holdings} if result.available else {}

    def wait_held(self, messages: list[dict], worker: str, timeout_s: float = 5) -> bool:
        return wait_until(lambda: worker in self.holders(messages), timeout_s)

    def entry_holders(self, messages: list[dict]) -> dict[str, tuple[int, ...]]:
        """Worker -> indices of the placeable chunks whose entries it holds."""
        prompt = prepare_chat(self.tokenizer, messages, self.namespace, self.page_size, True)
        result = self.directory.lookup(prompt.lookup_keys, prompt.token_ends, prompt.entry_keys)
        return {e.worker_id: e.entries for e in result.entries} if result.available else {}


@pytest.fixture(scope="module")
def probe(app):
    probe = Probe(app.config_path)
    yield probe
    probe.directory.close()


def rag(system: str, question: str) -> list[dict]:
    parts = [{"type": "text", "text": d} for d in DOCS] + [{"type": "text", "text": question}]
    return [{"role": "system", "content": system}, {"role": "user", "content": parts}]


def post(
    app,
    messages: list[dict],
    max_tokens: int = 8,
    reuse: str | None = None,
    ignore_eos: bool = False,
) -> Reply:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    if reuse is not None:
        body["reuse"] = reuse
    response = httpx.post(app.url("/v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    return Reply(
        worker=response.headers["x-chunkserve-worker"],
        cached=body["usage"]["prompt_tokens_details"]["cached_tokens"],
        text=body["choices"][0]["message"]["content"],
        reuse=body["reuse"],
    )


def worker_handle(app, worker_id: str):
    return ray.get_actor(worker_id, namespace="chunkserve-tests")


def test_requests_sharing_chunks_land_on_the_worker_holding_them(app, probe):
    seen = set()
    for k in range(3):
        system = f"You are support assistant number {k} of Harbor Analytics. " * 3
        home = post(app, rag(system, "Q: first?")).worker
        assert probe.wait_held(rag(system, "Q: next?"), home)
        for question in ("Q: second?", "Q: third?", "Q: fourth?"):
            reply = post(app, rag(system, question))
            assert reply.worker == home and reply.cached > 0
        seen.add(home)

    # Unrelated prompts in flight together spread by load. Each runs 200 tokens past
    # its end-of-text token, so the eight overlap even on a busy host. (Sent one after
    # another, the workers are idle and alike, and which one a prompt goes to depends on
    # which finished request a worker's last load report still counted.)
    def unrelated(i: int) -> str:
        messages = [{"role": "user", "content": f"unrelated {i} " * 20}]
        return post(app, messages, 200, ignore_eos=True).worker

    with ThreadPoolExecutor(8) as pool:
        unique = set(pool.map(unrelated, range(8)))
    assert unique == {f"{app.name}-worker-0", f"{app.name}-worker-1"}


PLACED_DOCS = (
    "Runbook A: restart the ingest service before touching the queue workers. " * 3,
    "Runbook B: rotate the signing keys on the first Monday of each quarter. " * 3,
    "Runbook C: the status page is updated by whoever holds the incident pager. " * 3,
)


def placed(system: str, order: tuple[int, ...], question: str) -> list[dict]:
    documents = [{"role": "user", "content": PLACED_DOCS[i]} for i in order]
    return [
        {"role": "system", "content": system},
        *documents,
        {"role": "user", "content": question},
    ]


def test_approximate_requests_go_where_the_documents_entries_are(app, probe):
    """After one worker filled the documents' position-free entries, approximate
    requests with the documents in other orders, after system prompts nobody holds,
    are routed to it (one Redis lookup of chunk and entry keys) and place them."""
    first = post(
        app, placed("You write runbook summaries. " * 4, (0, 1, 2), "Q: a?"), 2, "approximate"
    )
    assert first.reuse["mode"] == "approximate"
    home = first.worker
    later = placed("Someone else's system prompt. " * 4, (2, 0, 1), "Q: b?")
    assert wait_until(lambda: probe.entry_holders(later).get(home) == (0, 1, 2), timeout_s=20)
    for k, order in enumerate([(2, 0, 1), (1, 2, 0), (0, 2, 1)]):
        system = f"System prompt number {k} that no worker has seen. " * 3
        reply = post(app, placed(system, order, f"Q: {k}?"), 2, "approximate")
        assert reply.worker == home
        assert reply.reuse["mode"] == "approximate"
        assert reply.reuse["reused_tokens"] == reply.cached > 0
        # the default repair recomputes the most deviating tenth of the placed tokens
        assert 0 < reply.reuse["recomputed_tokens"] <= 0.15 * reply.reuse["reused_tokens"]


def test_redis_stopped_mid_load_then_affinity_returns(app, probe, redis_server):
    system = "You are the outage-time assistant. " * 6

    def ask(i: int) -> Reply:
        return post(app, rag(system, f"Q: during outage {i}?"), max_tokens=24)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        time.sleep(0.05)
        redis_server.kill()
        replies = [f.result() for f in futures]  # every request succeeds
        replies += list(pool.map(ask, range(8, 14)))  # and keeps succeeding while down
    assert len(replies) == 14
    down = httpx.get(app.url("/health"), timeout=30)  # serving, but hitting no cache
    assert down.status_code == 200 and down.json()["status"] == "degraded", down.text
    assert "chunk directory does not answer" in down.json()["detail"]
    redis_server.start()  # same port, empty: workers re-publish snapshots
    assert wait_until(lambda: probe.directory.stats().live_workers == 2, timeout_s=10)
    assert wait_until(
        lambda: httpx.get(app.url("/health"), timeout=30).json()["status"] == "ok", timeout_s=30
    )
    system = "You are the after-outage assistant. " * 6
    home = post(app, rag(system, "Q: first?")).worker
    assert probe.wait_held(rag(system, "Q: again?"), home)
    for question in ("Q: again?", "Q: once more?"):
        reply = post(app, rag(system, question))
        assert reply.worker == home and reply.cached > 0


def test_worker_killed_mid_load(app, probe):
    system = "You are the assistant that is about to lose a worker. " * 4
    victim = post(app, rag(system, "Q: warm?")).worker
    assert probe.wait_held(rag(system, "Q: held?"), victim)
    handle = worker_handle(app, victim)
    old_epoch = ray.get(handle.status.remote()).info.epoch
    client = openai.OpenAI(base_url=app.base_url, api_key="unused", max_retries=0, timeout=120)

    def buffered(i: int) -> str:
        messages = rag(system, f"Q: buffered {i}?")
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=300)
        return reply.choices[0].message.content

    def streamed(i: int) -> tuple[bool, Exception | None]:
        got_output = False
        try:
            messages = rag(system, f"Q: streamed {i}?")
            stream = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=300, stream=True
            )
            # the stream starts (its first chunks sent) once the worker's first delta
            # arrived, whose text may be empty (a partial character): from then on it
            # is bound to that worker (cluster/api/completions.py)
            for chunk in stream:
                got_output = got_output or bool(chunk.choices)
        except Exception as error:  # noqa: BLE001 - recorded and checked below
            return got_output, error
        return got_output, None

    with ThreadPoolExecutor(12) as pool:
        buffered_futures = [pool.submit(buffered, i) for i in range(6)]
        streamed_futures = [pool.submit(streamed, i) for i in range(6)]
        # at least one request in flight there (more on a quiet machine; routing may
        # spread a loaded one's burst over both workers)
        assert wait_until(lambda: ray.get(handle.status.remote()).load.requests >= 1, 20, 0.01)
        ray.kill(handle, no_restart=False)
        # the dead worker's directory entries are gone within one lease (+ slack for
        # a loaded 2-core box)
        gone = wait_until(
            lambda: victim not in probe.holders(rag(system, "Q: x?")), LEASE_TTL_S + 3
        )
        assert gone
        for future in buffered_futures:
            future.result()  # buffered answers never fail: retried elsewhere
        for future in streamed_futures:
            got_output, error = future.result()
            assert error is None or got_output, f"failed before the stream started: {error!r}"
    wait_healthy(app, 2, timeout_s=60)
    assert ray.get(handle.status.remote()).info.epoch > old_epoch
    served_by_victim = False
    for i in range(8):
        if post(app, [{"role": "user", "content": f"after restart {i} " * 10}]).worker == victim:
            served_by_victim = True
            break
    assert served_by_victim


def status_output(app, ray_cluster) -> str:
    """What ``chunkserve status`` prints for ``app``'s cluster (it must succeed)."""
    result = subprocess.run(
        [
            sys.executable, "-m", "cluster.ops.cli", "status", "--config", str(app.config_path),
            "--set", f"ray.address={ray_cluster.gcs_address}",
        ],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_status_command(app, ray_cluster):
    out = status_output(app, ray_cluster)
    assert f"{app.name}-worker-0" in out and f"{app.name}-worker-1" in out
    assert out.count("healthy") >= 2
    assert "directory (redis): 2 live workers" in out
    assert "cache hit rate" in out
    assert " up " in out.splitlines()[1]  # each worker's uptime, not its raw epoch
    assert re.search(rf"{app.name}-worker-0 +healthy +\d+m\d\ds ", out), out


def test_health_endpoint_reports_both_workers(app):
    assert httpx.get(app.url("/health")).json()["healthy_workers"] == 2
