"""Who is calling: API key check and the tenant salt derived from the key.

Invariants: the salt is computed by the server from the key (never taken from the
client) and is the same on every router replica, so one key's chunks are shared
across replicas and workers, and never with another key's. Without configured
keys every caller is the one default tenant (salt "").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from cluster.errors import Unauthorized

_SALT_KEY = b"chunkserve-tenant-v1"


def tenant_salt(api_key: str) -> str:
    return hmac.new(_SALT_KEY, api_key.encode(), hashlib.sha256).hexdigest()[:32]


class Authenticator:
    def __init__(self, api_keys: Sequence[str]) -> None:
        self._keys = tuple(api_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant salt from an ``Authorization`` header; raises 401."""
        if not self._keys:
            return ""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        key = key.strip()
        # Compare with every key (constant time each) so timing tells nothing.
        matched = [hmac.compare_digest(key.encode(), k.encode()) for k in self._keys]
        if not any(matched):
            raise Unauthorized("incorrect API key")
        return tenant_salt(key)


class ScrapeGuard:
    """Who may read ``/metrics``, which counts every tenant's requests: anyone on a
    server without API keys and without ``server.metrics_token``; else only a caller
    sending that token (a server with keys and no token serves /metrics to nobody, and
    says which setting opens it)."""

    def __init__(self, metrics_token: str | None, api_keys: Sequence[str]) -> None:
        self._token = metrics_token
        self._closed = metrics_token is None and bool(api_keys)

    def check(self, authorization: str | None) -> None:
        """Raises ``Unauthorized`` unless the caller may scrape."""
        if self._closed:
            raise Unauthorized(
                "this server has API keys, and /metrics counts every tenant's requests: "
                "set server.metrics_token and scrape with 'Authorization: Bearer <token>'"
            )
        if self._token is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self._token.encode()
        ):
            raise Unauthorized("/metrics needs 'Authorization: Bearer <server.metrics_token>'")
