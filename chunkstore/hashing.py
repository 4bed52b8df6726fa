"""Page-chain keys and chunk keys: the one key derivation used by router and workers.

Invariants:
- A page key names the exact token ids of a full page *and* everything before it:
  ``key_i = SHA-256(key_{i-1} || namespace || token ids of page i)``. Two pages
  share a key only if the whole token prefix up to their end is identical under the
  same namespace, so reusing the page's KV is exact.
- Keys are deterministic across processes and machines (SHA-256 over fixed-width
  little-endian token ids; never Python ``hash()``).
- Only full pages get keys; a trailing partial page is always recomputed.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

PageKey = bytes  # 32-byte SHA-256 digest

assert array("I").itemsize == 4, "token packing needs a 4-byte unsigned int"

_KEY_VERSION = b"chunkserve-pagekey-v1"


@dataclass(frozen=True)
class Namespace:
    """Model id + tenant salt. The salt comes from the server (the caller's API key),
    never from the client, so two tenants never share keys for identical text."""

    model_id: str
    tenant_salt: str = ""

    @cached_property
    def digest(self) -> bytes:
        h = hashlib.sha256(_KEY_VERSION)
        for part in (self.model_id, self.tenant_salt):
            encoded = part.encode()
            h.update(struct.pack("<I", len(encoded)))
            h.update(encoded)
        return h.digest()

    @cached_property
    def root_key(self) -> PageKey:
        """The parent key of a sequence's first page."""
        return hashlib.sha256(b"root" + self.digest).digest()


def root_key(namespace: Namespace) -> PageKey:
    """The parent key of a sequence's first page."""
    return namespace.root_key


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, as keys hash them (and as the KV pool
    compares pages). ValueError for anything but integers in [0, 2**32)."""
    try:
        packed = array("I", token_ids)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from e
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    namespace: Namespace,
    parent: PageKey | None = None,
) -> list[PageKey]:
    """Keys of every full page of ``token_ids`` (the trailing partial page has none)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    key = root_key(namespace) if parent is None else parent
    full = len(token_ids) // page_size
    return chain_page_keys(
        key, namespace.digest, pack_tokens(token_ids[: full * page_size]), page_size
    )


def chain_page_keys(
    parent: PageKey, namespace_digest: bytes, packed: bytes, page_size: int
) -> list[PageKey]:
    """Key of each full page of ``packed`` (token ids as ``pack_tokens`` packs them) in
    turn: ``SHA-256(parent key || namespace digest || the page's packed token ids)``,
    the first page's parent being ``parent``."""
    width = 4 * page_size
    keys: list[PageKey] = []
    for start in range(0, len(packed) - width + 1, width):
        h = hashlib.sha256(parent)
        h.update(namespace_digest)
        h.update(packed[start : start + width])
        parent = h.digest()
        keys.append(parent)
    return keys


def position_free_key(namespace: Namespace, token_ids: Sequence[int]) -> PageKey:
    """Key of a position-free chunk entry: ``SHA-256("pic" || namespace || token ids)``,
    no parent. The entry holds the chunk's KV computed in some context (a request's that
    first saw it, or the engine's entry context, ``chunking.entry_context``) and moved to
    start at position 0: whichever context computed it, a request that places it repairs
    it in its own; the "pic" tag keeps these keys apart from page keys."""
    return packed_position_free_key(namespace, pack_tokens(token_ids))


def packed_position_free_key(namespace: Namespace, packed: bytes) -> PageKey:
    """``position_free_key`` of token ids packed already (``pack_tokens``): an
    admission reads its chunks from the prompt's packed ids instead of packing each
    again."""
    h = hashlib.sha256(b"pic")
    h.update(namespace.digest)
    h.update(packed)
    return h.digest()


def chunk_keys(
    chunk_lengths: Sequence[int], keys: Sequence[PageKey], page_size: int
) -> list[PageKey | None]:
    """Chunk key of each chunk: the page key at the chunk's last full page.

    ``chunk_lengths`` are token counts of consecutive chunks; ``keys`` the page keys
    of their concatenation. A worker "holds" a chunk when it holds that page (and so,
    by the chain, every page before it). A chunk that ends before the first full page
    has no key (``None``).
    """
    out: list[PageKey | None] = []
    end = 0
    for length in chunk_lengths:
        if length < 0:
            raise ValueError("chunk lengths must be >= 0")
        end += length
        full_pages = min(end // page_size, len(keys))
        out.append(keys[full_pages - 1] if full_pages > 0 else None)
    return out
