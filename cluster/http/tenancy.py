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
