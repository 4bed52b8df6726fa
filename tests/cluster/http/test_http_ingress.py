"""The router replicas' own HTTP listeners (``cluster.http.ingress``): several share one
port, a port held by another process is refused with the reason, a stop lets requests
in flight finish and takes no new ones; and through the real Serve app, both ingress
kinds serve the same answers."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from cluster.http.ingress import ReplicaListener
from tests.chunkstore.testkit import free_port
from tests.cluster.conftest import cluster_config, stop_app, unique_name


def named_app(name: str, slow_s: float = 0.0) -> FastAPI:
    api = FastAPI()

    @api.get("/who")
    async def who() -> PlainTextResponse:
        await asyncio.sleep(slow_s)
        return PlainTextResponse(name)

    return api


async def ask(url: str, timeout_s: float = 10) -> str:
    # a fresh connection each time: the kernel deals connections, not requests
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        reply = await client.get(url)
        reply.raise_for_status()
        return reply.text


def test_listeners_share_one_port_and_the_kernel_deals_connections_among_them():
    async def main() -> set[str]:
        port = free_port()
        listeners = [ReplicaListener(named_app(n), "127.0.0.1", port) for n in ("a", "b")]
        try:
            await asyncio.sleep(0.2)
            return {await ask(f"http://127.0.0.1:{port}/who") for _ in range(60)}
        finally:
            await asyncio.gather(*(listener.stop() for listener in listeners))

    assert asyncio.run(main()) == {"a", "b"}


def test_a_port_held_without_reuse_is_refused_with_the_reason():
    async def main() -> None:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            with pytest.raises(RuntimeError) as error:
                ReplicaListener(named_app("a"), "127.0.0.1", port)
        message = str(error.value)
        assert f"127.0.0.1:{port}" in message and "server.ingress" in message

    asyncio.run(main())


def test_a_route_prefix_mounts_the_app_under_it():
    async def main() -> tuple[str, int]:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port, "/pre")
        try:
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=10) as client:
                missing = (await client.get(f"http://127.0.0.1:{port}/who")).status_code
            return await ask(f"http://127.0.0.1:{port}/pre/who"), missing
        finally:
            await listener.stop()

    assert asyncio.run(main()) == ("a", 404)


def test_a_stop_finishes_requests_in_flight_and_takes_no_new_ones():
    async def main() -> tuple[str, BaseException | None]:
        port = free_port()
        listener = ReplicaListener(named_app("slow", slow_s=1.0), "127.0.0.1", port)
        await asyncio.sleep(0.2)
        url = f"http://127.0.0.1:{port}/who"
        in_flight = asyncio.create_task(ask(url))
        await asyncio.sleep(0.3)  # the request is being served
        stopping = asyncio.create_task(listener.stop())
        await asyncio.sleep(0.3)
        refused = None
        try:
            await ask(url, timeout_s=2)
        except httpx.HTTPError as error:
            refused = error
        answer = await in_flight
        await stopping
        assert listener.failure() is None  # stopped as asked: not a failure
        return answer, refused

    answer, refused = asyncio.run(main())
    assert answer == "slow"
    assert isinstance(refused, httpx.ConnectError)


@pytest.mark.ray
def test_serve_proxy_and_replica_ingress_give_the_same_answers(start_app, tiny_qwen3):
    """The same model behind each ingress kind: equal greedy answers, streamed and not,
    and the replicas' event-loop lag and CPU time in /metrics."""
    apps = {
        ingress: start_app(
            cluster_config(
                tiny_qwen3,
                unique_name(f"ingress-{ingress.replace('_', '-')}"),
                server={"ingress": ingress, "num_replicas": 2},
            )
        )
        for ingress in ("serve_proxy", "replicas")
    }
    try:
        texts = {}
        for ingress, app in apps.items():
            client = openai.OpenAI(base_url=app.base_url, api_key="x", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "Tell me about the harbor."}]
            whole = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0
            )
            stream = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            texts[ingress] = (whole.choices[0].message.content, streamed)
        assert texts["serve_proxy"] == texts["replicas"]
        assert texts["replicas"][0] == texts["replicas"][1]
        metrics = httpx.get(apps["replicas"].url("/metrics"), timeout=30).text
        lag = [line for line in metrics.splitlines() if line.startswith("chunkserve_event_loop")]
        count = next(
            line for line in lag if line.startswith("chunkserve_event_loop_lag_seconds_count")
        )
        assert float(count.split()[-1]) > 0
        cpu = next(
            line for line in metrics.splitlines()
            if line.startswith("chunkserve_router_cpu_seconds_total")
        )  # fmt: skip
        assert float(cpu.split()[-1]) > 0
    finally:
        for app in apps.values():
            stop_app(app)
