"""Fixtures: a real Redis (the one on 127.0.0.1:6379, else one we start), throwaway
key prefixes, private servers for tests that kill Redis, and a directory factory
parametrized over both implementations."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from chunkstore.directory import ChunkDirectory
from chunkstore.embedded_directory import EmbeddedChunkDirectory
from chunkstore.redis_directory import RedisChunkDirectory
from tests.chunkstore.testkit import RedisProcess, answers

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"

MakeDirectory = Callable[..., ChunkDirectory]


def _require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("no Redis answers on 127.0.0.1:6379 and redis-server is not installed")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The shared Redis if it answers, else a redis-server started for this session."""
    if answers(SHARED_REDIS_URL):
        yield SHARED_REDIS_URL
        return
    _require_redis_server()
    server = RedisProcess()
    server.start()
    yield server.url
    server.kill()


@pytest.fixture
def private_redis() -> Iterator[RedisProcess]:
    """A redis-server of this test alone (never the shared one): safe to kill."""
    _require_redis_server()
    server = RedisProcess()
    server.start()
    yield server
    server.kill()


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # a test that killed its private server leaves nothing to clean
    finally:
        client.close()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A throwaway key prefix, deleted after the test."""
    prefix = f"cstest-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
def make_directory(request: pytest.FixtureRequest) -> Iterator[MakeDirectory]:
    """``make_directory(lease_ttl_s=...)`` -> a fresh directory of the parametrized kind.

    Redis directories made in one test share one throwaway prefix (they see the same
    data, like a router and a worker); every directory is closed after the test.
    """
    made: list[ChunkDirectory] = []

    def make(lease_ttl_s: float = 5.0) -> ChunkDirectory:
        if request.param == "embedded":
            directory: ChunkDirectory = EmbeddedChunkDirectory(lease_ttl_s=lease_ttl_s)
        else:
            directory = RedisChunkDirectory(
                request.getfixturevalue("redis_url"),
                prefix=request.getfixturevalue("redis_prefix"),
                lease_ttl_s=lease_ttl_s,
                timeout_s=0.5,  # a loaded CI box must not turn a slow call into a flake
            )
        made.append(directory)
        return directory

    yield make
    for directory in made:
        directory.close()
