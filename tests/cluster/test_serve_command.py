"""``chunkserve serve`` as a user runs it: prints the URL, serves the OpenAI API,
stops and cleans up on Ctrl-C (here: joining the session's Ray and Serve)."""

from __future__ import annotations

import re
import signal
import sys

import httpx
import pexpect
import pytest
import ray

from tests.cluster.conftest import REPO, cluster_config, unique_name, write_config

pytestmark = pytest.mark.ray


def test_serve_prints_the_url_serves_and_stops_on_ctrl_c(
    ray_cluster, serve_port, tiny_qwen3, tmp_path
):
    config = cluster_config(tiny_qwen3, unique_name("cli"))
    config["server"].update({"port": serve_port, "route_prefix": "/cli"})
    path = write_config(tmp_path, config)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "cluster.cli", "serve", "--config", str(path),
         "--set", f"ray.address={ray_cluster.gcs_address}"],
        cwd=str(REPO), timeout=180, encoding="utf-8",
    )  # fmt: skip
    try:
        child.expect(r"serving 'tiny' at (http://\S+/v1)")
        url = child.match.group(1)
        assert url == f"http://127.0.0.1:{serve_port}/cli/v1"
        models = httpx.get(f"{url}/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        reply = httpx.post(
            f"{url}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert reply.status_code == 200 and re.match(
            r".*-worker-0$", reply.headers["x-chunkserve-worker"]
        )
        child.kill(signal.SIGINT)
        child.expect("stopping")
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    with pytest.raises(ValueError):
        ray.get_actor(f"{config['name']}-worker-0", namespace="chunkserve-tests")
