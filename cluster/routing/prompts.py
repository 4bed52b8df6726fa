"""Turning a request's prompt into tokens and directory lookup keys, once per request.

The tokenization is the canonical one of ``chunkstore.chunking`` (each chunk on its
own), which is also what the engine keys its pages by; the keys use the same
namespace (model id + checkpoint fingerprint + tenant salt) the engine uses, so a
key the router looks up is exactly a key a worker published. For a request that asks
for approximate reuse the prompt also carries its placeable chunk spans and their
position-free entry keys (what ``ChunkReuse`` in the engine looks up).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from chunkstore.chunking import (
    ChatTokenizer,
    Chunk,
    Message,
    chunk_conversation,
    chunk_prompt,
    placeable_spans,
)
from chunkstore.directory import MAX_LOOKUP_KEYS
from chunkstore.hashing import Namespace, PageKey, page_keys, position_free_key

# Prompts longer than this (characters, or token ids) are prepared in their own lane:
# tokenizing one takes some 30 ms on one CPU core (2 MB took 1 s).
LARGE_PROMPT_CHARS = 65536


class EncodeCache:
    """A tokenizer whose ``encode`` remembers long texts (system prompts, documents).

    Chunks are tokenized on their own, so a document's tokens are the same in every
    request that carries it; repeated chunks are what this system serves, and
    tokenizing them again was most of a router's work per request. Invariants:
    ``encode`` returns exactly what the wrapped tokenizer returns; texts shorter than
    ``min_chars`` (questions, template pieces) are not kept; the kept texts total at
    most ``max_chars`` characters, least recently used dropped first. The kept texts
    may be shared by caches over other tokenizers (``sharing``), one per thread: a
    lock guards the kept texts, never a tokenizer call, and each cache's tokenizer is
    used by one thread only (Hugging Face fast tokenizers are not safe to share).
    """

    def __init__(self, tokenizer: ChatTokenizer, max_chars: int, min_chars: int = 512) -> None:
        self._tokenizer = tokenizer
        self._encode = direct_encoder(tokenizer)
        self._store = _KeptTokens(max_chars, min_chars)

    @property
    def hits(self) -> int:
        return self._store.hits

    def sharing(self, tokenizer: ChatTokenizer) -> EncodeCache:
        """A cache over ``tokenizer`` (an equal copy, for another thread) that keeps
        and finds texts in the same store as this one."""
        other = copy.copy(self)
        other._tokenizer = tokenizer
        other._encode = direct_encoder(tokenizer)
        return other

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self._store.keeps(text):
            return self._encode(text, add_special_tokens)
        key = (text, add_special_tokens)
        kept = self._store.get(key)
        if kept is not None:
            return kept
        tokens = self._encode(text, add_special_tokens)
        self._store.put(key, tokens)
        return tokens


# Texts a direct encoder must tokenize as the tokenizer's own ``encode`` does before
# it is used: spaces, newlines, digits, punctuation, accents, CJK, emoji, and the
# special tokens of the chat templates (recognized inside text).
_ENCODER_PROBES = (
    "Hello, world! It's 3.14 -- isn't it?",
    "  two leading spaces\n\nand blank lines\t tab",
    "Crème brûlée à Paris; naïve façade. 東京都の天気は晴れです。 🚀🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|begin_of_text|><|eot_id|>",
    "Document 7: x=1; y = [2, 3]; print(f'{x}')",
)


def direct_encoder(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """``tokenizer.encode(text, add_special_tokens=...)`` as a function; for a Hugging
    Face fast tokenizer, its Rust tokenizer called directly (a third of the time for a
    short text: no Python wrapper), used only if it gives the same ids on every probe
    text, with and without special tokens."""

    def wrapped(text: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return wrapped

    def direct(text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while it works, so a huge
        # prompt tokenizing in its lane never stalls the event loop (encode would hold
        # it for seconds: tests/cluster/http/test_openai_api.py's huge prompt); as fast for
        # one short text
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    same = all(
        direct(text, special) == wrapped(text, special)
        for text in _ENCODER_PROBES
        for special in (True, False)
    )
    return direct if same else wrapped


class _KeptTokens:
    """The texts an ``EncodeCache`` keeps, and their token ids; thread-safe."""

    def __init__(self, max_chars: int, min_chars: int) -> None:
        self._max_chars = max_chars
        self._min_chars = min_chars
        self._kept: OrderedDict[tuple[str, bool], array] = OrderedDict()  # token ids
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0

    def keeps(self, text: str) -> bool:
        return self._min_chars <= len(text) <= self._max_chars

    def get(self, key: tuple[str, bool]) -> list[int] | None:
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                return None
            self._kept.move_to_end(key)
            self.hits += 1
            return kept.tolist()

    def put(self, key: tuple[str, bool], tokens: list[int]) -> None:
        with self._lock:
            if key in self._kept:  # another thread encoded the same text meanwhile
                return
            self._kept[key] = array("i", tokens)
            self._chars += len(key[0])
            while self._chars > self._max_chars:
                (old, _), _ = self._kept.popitem(last=False)
                self._chars -= len(old)


class PromptLanes:
    """Prompt preparation (tokenizing, keying) off the event loop, in two lanes of one
    thread each: prompts of at most ``large_chars`` characters in one, longer ones in
    the other. Invariant: a large prompt never delays a small one (it waits only
    behind other large ones). Each lane has its own copy of the tokenizer, and both
    share one ``EncodeCache`` store of ``cache_chars`` characters."""

    SMALL, LARGE = "small", "large"

    def __init__(
        self, tokenizer: ChatTokenizer, cache_chars: int, large_chars: int = LARGE_PROMPT_CHARS
    ) -> None:
        small = EncodeCache(tokenizer, cache_chars)
        self._large_chars = large_chars
        self._lanes = {
            self.SMALL: (_one_thread(self.SMALL), small),
            self.LARGE: (_one_thread(self.LARGE), small.sharing(copy.deepcopy(tokenizer))),
        }

    def lane(self, size: int) -> str:
        """The lane of a prompt of ``size`` characters (or tokens, given as ids)."""
        return self.LARGE if size > self._large_chars else self.SMALL

    async def run(
        self, lane: str, prepare: Callable[[EncodeCache], PreparedPrompt]
    ) -> PreparedPrompt:
        """``prepare(tokenizer)`` on ``lane``'s thread, with that lane's tokenizer."""
        executor, tokenizer = self._lanes[lane]
        return await asyncio.get_running_loop().run_in_executor(executor, prepare, tokenizer)


def _one_thread(lane: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prompts-{lane}")


Span = tuple[int, int]


@dataclass(frozen=True)
class PreparedPrompt:
    """Invariants: ``len(lookup_keys) + len(entry_keys) <= MAX_LOOKUP_KEYS`` (one
    directory lookup); ``entry_keys[i]`` is the position-free key of the tokens of
    ``placeable[i]``; both are empty unless approximate reuse was asked for."""

    token_ids: tuple[int, ...]
    lookup_keys: tuple[PageKey, ...]  # chunk keys: distinct, in prompt order
    token_ends: tuple[int, ...]  # prompt tokens covered up to each key (page-aligned)
    placeable: tuple[Span, ...] = ()  # chunks approximate reuse may place (for the worker)
    entry_keys: tuple[PageKey, ...] = ()  # of the leading placeable spans (for the router)


def prepare_chat(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    namespace: Namespace,
    page_size: int,
    approximate: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> PreparedPrompt:
    """Raises ``ValueError`` for messages the chat template cannot render.
    ``approximate``: also find the placeable chunks and their entry keys.
    ``continue_final_message``: the prompt ends inside the last (assistant) message."""
    try:
        chunks = chunk_conversation(
            tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except ValueError:
        raise
    except Exception as error:  # a template rejecting a role, say: the client's fault
        raise ValueError(f"the chat template cannot render these messages: {error}") from None
    return prepare_chunks(chunks, namespace, page_size, approximate)


def prepare_text(
    tokenizer: ChatTokenizer, prompt: str, namespace: Namespace, page_size: int
) -> PreparedPrompt:
    return prepare_chunks(chunk_prompt(tokenizer, prompt), namespace, page_size)


def prepare_chunks(
    chunks: Sequence[Chunk], namespace: Namespace, page_size: int, approximate: bool = False
) -> PreparedPrompt:
    token_ids = tuple(itertools.chain.from_iterable(chunk.token_ids for chunk in chunks))
    if not token_ids:
        raise ValueError("the prompt is empty")
    keys = page_keys(token_ids, page_size, namespace)
    lookup: list[PageKey] = []
    ends: list[int] = []
    end = 0
    for chunk in chunks:
        end += len(chunk.token_ids)
        full_pages = min(end // page_size, len(keys))
        if full_pages == 0 or (lookup and lookup[-1] == keys[full_pages - 1]):
            continue  # no full page yet, or the chunk ends inside the previous key's page
        lookup.append(keys[full_pages - 1])
        ends.append(full_pages * page_size)
    lookup, ends = lookup[:MAX_LOOKUP_KEYS], ends[:MAX_LOOKUP_KEYS]
    placeable = placeable_spans(chunks) if approximate else ()
    entry_keys = tuple(
        position_free_key(namespace, token_ids[start:end])
        for start, end in placeable[: MAX_LOOKUP_KEYS - len(lookup)]
    )
    return PreparedPrompt(
        token_ids=token_ids,
        lookup_keys=tuple(lookup),
        token_ends=tuple(ends),
        placeable=placeable,
        entry_keys=entry_keys,
    )
