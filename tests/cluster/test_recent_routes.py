"""The router remembers its own decisions: an identical prompt sent again at once,
before the worker's next publish reaches the directory, lands on the same worker and
hits its cache (two workers; publishing slowed so the directory cannot know yet)."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import cluster_config, stop_app, unique_name

pytestmark = pytest.mark.ray

PUBLISH_INTERVAL_S = 5.0  # longer than the test: the directory lists nothing new meanwhile


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3):
    config = cluster_config(
        tiny_qwen3,
        unique_name("recent"),
        workers={"count": 2, "publish_interval_s": PUBLISH_INTERVAL_S},
        directory={"kind": "embedded", "lease_ttl_s": 4 * PUBLISH_INTERVAL_S},
        router={"recent_route_lease_s": 60.0},
        server={"default_max_tokens": 4},
    )
    app = start_app(config)
    yield app
    stop_app(app)


def ask(app, text: str) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0}
    response = httpx.post(app.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return response.headers["x-chunkserve-worker"], cached


def test_immediate_identical_repeats_land_on_the_same_worker_and_hit(app):
    for k in range(2):  # two new prompts: each sticks to wherever it went first
        text = f"Prompt {k}: the quarterly report lists revenue by region and month. " * 6
        home, cached = ask(app, text)
        assert cached == 0  # new to every worker
        for _ in range(5):  # no sleep: well within the publish interval
            worker, cached = ask(app, text)
            assert worker == home and cached > 0
