"""Registered chunks: content named by id whose KV stays pinned in the pool.

Exact mode: a chunk registered ``after`` other chunks has its KV computed in their
context, so it is reused exactly when a request's tokens start with theirs and its
own (its *prefix*). Invariants:
- A chunk's id is SHA-256 of (namespace, role, content, after ids): identical
  registrations share one chunk, which pins its pages once.
- A registered chunk pins every full page of its prefix until it is unregistered
  or its TTL ends; pinned pages are never evicted.
- At most ``num_pages - ceil(max_model_len / page_size)`` pages are pinned, so a
  max-length request always fits beside them.
- Expired chunks are dropped lazily, at the start of every registry call.
- A registry keys ids and pages by one tenant's namespace (``tenant_salt``), so
  another tenant's registry never finds its ids and its requests never hit its pages.

Approximate mode (``mode="approximate"``): the chunk is a text that may stand
anywhere (a document); the registry pins its one position-free entry (its tokens
computed after the entry context, starting at 0), which approximate requests place wherever the text
appears as a content part, after any system prompt. ``after`` does not apply. Its
pinned pages count toward the same limit, once, whoever uses it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from chunkstore.chunking import (
    Message,
    chunk_conversation,
    longest_token_chars,
    message_chars,
    validate_messages,
)
from chunkstore.hashing import pack_tokens, position_free_key
from workers.engine.engine import Engine
from workers.engine.kv_pool import ChunkEntry

ROLES = {"system": "system", "context": "user", "query": "user"}  # chunk role -> chat role
MODES = ("exact", "approximate")


class UnknownChunkError(ValueError):
    """A chunk id that is not registered (never was, expired, or unregistered)."""


@dataclass(frozen=True)
class ChunkInfo:
    chunk_id: str
    role: str  # system | context | query
    num_tokens: int  # the chunk's own tokens (after its ``after`` chunks)
    pinned_tokens: int  # tokens in the pages it pins: full pages of its whole prefix
    hits: int  # requests from chunk ids whose cached tokens covered its pinned pages
    tokens_saved: int  # of its own tokens, how many those hits served from the cache
    expires_at: float | None  # on the registry's clock; None: until unregistered
    mode: str = "exact"  # exact: pinned prefix pages; approximate: a position-free entry


@dataclass(frozen=True)
class _Chunk:
    info: ChunkInfo
    messages: tuple[Message, ...]  # its own messages
    prefix_tokens: tuple[int, ...]  # canonical tokens of the after-chunks' messages + its own
    start: int  # where its own tokens begin in ``prefix_tokens``
    page_ids: tuple[int, ...]  # pinned: the full pages of ``prefix_tokens`` (exact mode)
    entry: ChunkEntry | None = None  # pinned: the position-free entry (approximate mode)


class ChunkRegistry:
    """``compute(tokens)`` runs the engine over ``tokens`` so that their full pages
    are cached when it returns; ``step_until(done)`` steps the engine until
    ``done()`` (the caller serializes engine access)."""

    def __init__(
        self,
        engine: Engine,
        compute: Callable[[list[int]], None],
        clock: Callable[[], float] = time.monotonic,
        tenant_salt: str | None = None,
        step_until: Callable[[Callable[[], bool]], None] | None = None,
    ) -> None:
        self._engine = engine
        self._tenant_salt = tenant_salt  # None: the engine's configured salt
        self._compute = compute
        self._step_until = step_until
        self._clock = clock
        self._chunks: dict[str, _Chunk] = {}  # registration order

    @property
    def max_pinned_pages(self) -> int:
        pool = self._engine.pool
        return max(0, pool.num_pages - math.ceil(self._engine.max_model_len / pool.page_size))

    def _check_size(self, messages: Sequence[Message]) -> None:
        """Refuse, before rendering or tokenizing, content that could not fit the
        context: more messages than its tokens (each message takes at least one), or
        more characters than its tokens could spell."""
        context = self._engine.max_model_len
        if len(messages) > context:
            raise ValueError(
                f"the chunk has {len(messages)} messages; a context of {context} tokens "
                "holds fewer (each message takes at least one token)"
            )
        chars, limit = message_chars(messages), context * _token_chars(self._engine.tokenizer)
        if chars > limit:
            raise ValueError(
                f"the chunk has {chars} characters, more than the {limit} a context of "
                f"{context} tokens could hold"
            )

    # -- API -----------------------------------------------------------------
    def register(
        self,
        content: str | Sequence[Message],
        role: str = "context",
        ttl_s: float | None = None,
        after: Sequence[str] = (),
        mode: str = "exact",
    ) -> str:
        self.expire()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        messages = _messages(content, role)
        self._check_size(messages)
        _check_ttl(ttl_s)
        if mode == "approximate" and (after or role != "context" or len(messages) != 1):
            raise ValueError(
                "an approximate chunk is one text of role context, position-free: "
                "`after` does not apply and content must be a string"
            )
        before = self._resolve(after)
        chunk_id = self._chunk_id(role, content, after, mode)
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        if chunk_id in self._chunks:  # deduplicated: refresh the TTL, pin nothing more
            self._update(chunk_id, expires_at=expires_at)
        elif mode == "approximate":
            self._chunks[chunk_id] = self._create_entry(chunk_id, messages, expires_at)
        else:
            self._chunks[chunk_id] = self._create(chunk_id, role, messages, before, expires_at)
        return chunk_id

    def unregister(self, chunk_id: str) -> None:
        self.expire()
        self._get(chunk_id)
        self._drop(chunk_id)

    def compose(self, chunk_ids: Sequence[str]) -> list[Message]:
        """The messages of ``chunk_ids``, in order."""
        self.expire()
        if isinstance(chunk_ids, str) or not chunk_ids:
            raise ValueError("chunk_ids must be a non-empty list of chunk ids")
        return [m for chunk_id in chunk_ids for m in self._get(chunk_id).messages]

    def record_use(self, chunk_ids: Sequence[str], prompt: Sequence[int], num_cached: int) -> None:
        """Count a hit for each chunk of a request whose prompt starts with the chunk's
        prefix and whose cached tokens cover the chunk's pinned pages."""
        for chunk_id in dict.fromkeys(chunk_ids):
            chunk = self._chunks.get(chunk_id)
            if chunk is None or tuple(prompt[: len(chunk.prefix_tokens)]) != chunk.prefix_tokens:
                continue
            saved = max(0, min(num_cached, len(chunk.prefix_tokens)) - chunk.start)
            if num_cached >= chunk.info.pinned_tokens and saved > 0:
                info = chunk.info
                self._update(chunk_id, hits=info.hits + 1, tokens_saved=info.tokens_saved + saved)

    def infos(self) -> list[ChunkInfo]:
        self.expire()
        return [chunk.info for chunk in self._chunks.values()]

    def expire(self) -> None:
        now = self._clock()
        for chunk_id, chunk in list(self._chunks.items()):
            if chunk.info.expires_at is not None and chunk.info.expires_at <= now:
                self._drop(chunk_id)

    # -- internals -----------------------------------------------------------
    @property
    def _page_size(self) -> int:
        return self._engine.pool.page_size

    def _get(self, chunk_id: str) -> _Chunk:
        chunk = self._chunks.get(chunk_id)
        if chunk is None:
            raise UnknownChunkError(
                f"unknown chunk id {chunk_id!r}: it was never registered here, "
                "was unregistered, or its TTL ended"
            )
        return chunk

    def _resolve(self, after: Sequence[str]) -> list[_Chunk]:
        if isinstance(after, str) or not all(isinstance(a, str) for a in after):
            raise ValueError("after must be a list of chunk ids")
        return [self._get(chunk_id) for chunk_id in after]

    def _create(
        self,
        chunk_id: str,
        role: str,
        messages: list[Message],
        before: list[_Chunk],
        expires_at: float | None,
    ) -> _Chunk:
        """Compute the KV of the chunk's prefix and pin its full pages."""
        if self._engine.reuse.mode != "exact":
            raise ValueError(
                "registering chunks needs exact reuse (enable_reuse=True); "
                f"this engine's reuse mode is {self._engine.reuse.mode!r}"
            )
        history = [m for chunk in before for m in chunk.messages]
        start = len(self._tokens(history)) if history else 0
        prefix = self._tokens([*history, *messages])
        self._check_room(prefix)
        self._compute(list(prefix))
        page_ids = self._pin(prefix)
        pinned_tokens = len(page_ids) * self._page_size
        info = ChunkInfo(chunk_id, role, len(prefix) - start, pinned_tokens, 0, 0, expires_at)
        return _Chunk(info, tuple(messages), prefix, start, page_ids)

    def _create_entry(
        self, chunk_id: str, messages: list[Message], expires_at: float | None
    ) -> _Chunk:
        """Compute the chunk's position-free entry (after the entry context) and pin it."""
        if self._engine.reuse.mode != "exact" or self._step_until is None:
            raise ValueError(
                "registering approximate chunks needs an engine with reuse on "
                f"(this engine's reuse mode is {self._engine.reuse.mode!r})"
            )
        tokens = list(self._part_tokens(messages[0]["content"]))
        pool = self._engine.pool
        pages = -(-len(tokens) // self._page_size)
        key = position_free_key(self._engine.namespace(self._tenant_salt), tokens)
        held = pool.find_entry(key)  # here, or loaded back from the host tier
        if held is None or held.pins == 0:
            self._check_pins(pages)
        self._engine.fill_entry(tokens, self._tenant_salt)
        self._step_until(lambda: pool.entry(key) is not None)
        entry = pool.entry(key)
        pool.hold_entry(entry, pin=True)
        size = len(entry.pages) * self._page_size
        info = ChunkInfo(chunk_id, "context", len(tokens), size, 0, 0, expires_at, "approximate")
        return _Chunk(info, tuple(messages), tuple(tokens), 0, (), entry)

    def _part_tokens(self, text: str) -> tuple[int, ...]:
        """A text's tokens as a content part among others: encoded on its own."""
        return tuple(self._engine.tokenizer.encode(text, add_special_tokens=False))

    def _update(self, chunk_id: str, **changes: object) -> None:
        chunk = self._chunks[chunk_id]
        self._chunks[chunk_id] = replace(chunk, info=replace(chunk.info, **changes))

    def _drop(self, chunk_id: str) -> None:
        """Unpin the chunk's pages and evict those no request or other chunk holds."""
        chunk = self._chunks.pop(chunk_id)
        pool = self._engine.pool
        if chunk.entry is not None:
            pool.drop_entry(chunk.entry, pin=True)
            pool.evict_entry(chunk.entry.key)
            return
        pool.unpin(chunk.page_ids)
        pool.evict(chunk.page_ids)

    def _chunk_id(
        self, role: str, content: str | Sequence[Message], after: Sequence[str], mode: str
    ) -> str:
        h = hashlib.sha256(b"chunkserve-chunk-v1" if mode == "exact" else b"chunkserve-pic-v1")
        canonical = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        for part in (
            self._engine.namespace(self._tenant_salt).digest,
            role.encode(),
            canonical.encode(),
            *(a.encode() for a in after),
        ):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        return h.hexdigest()

    def _tokens(self, messages: Sequence[Message]) -> tuple[int, ...]:
        chunks = chunk_conversation(self._engine.tokenizer, messages, add_generation_prompt=False)
        return tuple(t for chunk in chunks for t in chunk.token_ids)

    def _full_pages(self, tokens: Sequence[int]) -> list[int]:
        """Pool pages holding the full pages of ``tokens`` (a prefix of them)."""
        root = self._engine.namespace(self._tenant_salt).root_key
        return self._engine.pool.match_chain(
            root, pack_tokens(tokens), len(tokens) // self._page_size
        )

    def _check_room(self, prefix: Sequence[int]) -> None:
        """Refuse (nothing pinned) a chunk whose new pins would exceed the limits."""
        pool = self._engine.pool
        already = sum(1 for p in self._full_pages(prefix) if pool.pin_count(p) > 0)
        self._check_pins(len(prefix) // self._page_size - already)

    def _check_pins(self, new_pages: int) -> None:
        """The tenant's quota (``EngineConfig.pin_quota_tokens``), then the worker's
        room; the messages speak only of this tenant's own pins."""
        size = self._page_size
        own = self.pinned_tokens()
        need = new_pages * size
        quota = self._engine.config.pin_quota_tokens
        if quota is not None and own + need > quota:
            raise ValueError(
                f"cannot pin this chunk: it needs {need} more pinned tokens and your chunks "
                f"pin {own} of your quota of {quota} tokens on this worker; unregister "
                "chunks or ask for a larger quota (engine.pin_quota_tokens)"
            )
        limit = self.max_pinned_pages
        if self._engine.pool.num_pinned + new_pages > limit:
            raise ValueError(
                f"cannot pin this chunk: it needs {need} more pinned tokens and this worker "
                f"has no room for them (at most {limit * size} tokens may be pinned so that a "
                f"max-length request of {self._engine.max_model_len} tokens still fits); "
                f"your chunks pin {own} tokens: unregister some, or give the engine more pages"
            )

    def pinned_tokens(self) -> int:
        """Tokens in the pages this tenant's chunks pin (a page counted once)."""
        pages: set[int] = set()
        for chunk in self._chunks.values():
            pages.update(chunk.entry.pages if chunk.entry is not None else chunk.page_ids)
        return len(pages) * self._page_size

    def _pin(self, prefix: Sequence[int]) -> tuple[int, ...]:
        pages = self._full_pages(prefix)
        self._engine.pool.pin(pages)
        return tuple(pages)


def _messages(content: str | Sequence[Message], role: str) -> list[Message]:
    """The chunk's own chat messages (a copy: later edits by the caller change nothing)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if isinstance(content, str):
        if not content.strip():
            raise ValueError("chunk content is empty")
        return [{"role": ROLES[role], "content": content}]
    if not isinstance(content, Sequence) or not content:
        raise ValueError("chunk content must be a non-empty string or list of messages")
    messages = copy.deepcopy(list(content))
    validate_messages(messages)
    return messages


def _check_ttl(ttl_s: float | None) -> None:
    number = isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
    if ttl_s is not None and not (number and 0 < ttl_s < math.inf):
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")


_TOKEN_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _token_chars(tokenizer: Any) -> int:
    """``longest_token_chars``, once per tokenizer (it reads the whole vocabulary)."""
    chars = _TOKEN_CHARS.get(tokenizer)
    if chars is None:
        chars = _TOKEN_CHARS[tokenizer] = longest_token_chars(tokenizer)
    return chars
