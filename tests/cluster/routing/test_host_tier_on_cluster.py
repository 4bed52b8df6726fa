"""The host-memory KV tier on a real cluster: two workers with small device pools and a
host tier, the Redis directory. A prefix pushed out of its worker's device pool stays
listed there as host-only (the directory's lookup says so), the router still sends its
requests there, the worker loads it back instead of computing it, and ``/metrics``
and ``chunkserve status`` show the tier's pages, hits, bytes and load time."""

from __future__ import annotations

import time
import uuid

import pytest

from cluster.routing.prompts import prepare_chat
from tests.chunkstore.testkit import wait_until
from tests.cluster.conftest import cluster_config, stop_app, unique_name
from tests.cluster.http.test_router_replicas import scrape
from tests.cluster.routing.test_redis_cluster import LEASE_TTL_S, Probe, post, status_output

pytestmark = [pytest.mark.ray, pytest.mark.redis]

POLL_S = 0.2  # router.poll_interval_s: how old the router's view of worker loads may be
SENTENCE = "You are the archivist of the Harbor Analytics handbook and quote it. "
SYSTEM = SENTENCE * 6


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3, redis_server, ray_cluster):
    config = cluster_config(
        tiny_qwen3,
        unique_name("hosttier"),
        engine={"num_pages": 48, "max_model_len": 512, "host_kv_gib": 0.05},
        workers={"count": 2},
        directory={
            "kind": "redis",
            "lease_ttl_s": LEASE_TTL_S,
            "redis": {
                "url": redis_server.url,
                "prefix": f"cstest-{uuid.uuid4().hex[:8]}",
                "timeout_s": 0.5,
            },
        },
        # no route memory: only the directory's answer sends a request back home
        router={"poll_interval_s": POLL_S, "recent_route_lease_s": 0.0},
        server={"num_replicas": 1, "default_max_tokens": 4},
    )
    app = start_app(config)
    yield app
    stop_app(app)


@pytest.fixture(scope="module")
def probe(app):
    probe = Probe(app.config_path)
    yield probe
    probe.directory.close()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def host_tokens(probe: Probe, messages: list[dict]) -> dict[str, int]:
    prompt = prepare_chat(probe.tokenizer, messages, probe.namespace, probe.page_size)
    result = probe.directory.lookup(prompt.lookup_keys, prompt.token_ends)
    return {h.worker_id: h.host_tokens for h in result.holdings} if result.available else {}


def test_a_prefix_pushed_to_host_memory_is_routed_home_and_loaded_back(app, probe):
    home = post(app, chat("Q: who keeps the archive?"), max_tokens=4).worker
    assert probe.wait_held(chat("Q: next?"), home)
    # Floods open with most of the system prompt, so the router sends them where those
    # pages are (home), then go on with ~20 pages of their own on home's 48: the system
    # prompt's last pages leave the device. Each waits for the router's load view to
    # show home idle again (three polls), lest home look busy and a flood go by load
    # (floods with nothing in common went 15 of 16 to the other worker).
    routed = []
    for n in range(16):
        time.sleep(3 * POLL_S)
        flood = SENTENCE * 5 + f"Flood {n}: an unrelated request about invoices, region {n}. " * 12
        routed.append(
            post(
                app, [{"role": "system", "content": flood}, {"role": "user", "content": "Q"}], 2
            ).worker
        )
    # two are enough to need room; a flood that still goes to the other worker by load
    # copies the opening there, and the two then share the rest by rotation
    assert routed.count(home) >= 2, routed
    assert wait_until(lambda: host_tokens(probe, chat("Q: x?")).get(home, 0) > 0, 10)
    held = probe.holders(chat("Q: x?"))
    # the other worker holds at most the floods' opening, never the whole system prompt
    assert all(tokens < held[home] for worker, tokens in held.items() if worker != home)

    reply = post(app, chat("Q: and who reads it?"), max_tokens=4)
    assert reply.worker == home
    assert reply.cached >= held[home] - probe.page_size  # loaded back, not computed
    assert wait_until(lambda: host_tokens(probe, chat("Q: x?")).get(home) == 0, 10)

    values = scrape(app)
    worker = f'worker="{home}"'
    assert values[f"chunkserve_worker_host_kv_hits_total{{{worker}}}"] >= 1
    moved = 'chunkserve_worker_host_kv_bytes_total{{{},direction="{}"}}'
    assert values[moved.format(worker, "to_device")] > 0
    assert values[moved.format(worker, "to_host")] >= values[moved.format(worker, "to_device")]
    assert values[f"chunkserve_worker_host_kv_load_seconds_total{{{worker}}}"] > 0
    assert values[f"chunkserve_worker_host_kv_pages{{{worker}}}"] > 48


def test_status_shows_each_workers_host_tier(app, ray_cluster):
    out = status_output(app, ray_cluster)
    lines = [line for line in out.splitlines() if "host KV tier:" in line]
    assert len(lines) == 2, out
    assert any(" 0 hits" not in line for line in lines), lines
