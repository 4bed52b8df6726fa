"""Turning a request's prompt into tokens and directory lookup keys, once per request.

The tokenization is the canonical one of ``chunkstore.chunking`` (each chunk on its
own), which is also what the engine keys its pages by; the keys use the same
namespace (model id + checkpoint fingerprint + tenant salt) the engine uses, so a
key the router looks up is exactly a key a worker published.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkstore.chunking import ChatTokenizer, Chunk, Message, chunk_conversation, chunk_prompt
from chunkstore.directory import MAX_LOOKUP_KEYS
from chunkstore.hashing import Namespace, PageKey, page_keys


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    lookup_keys: tuple[PageKey, ...]  # chunk keys: distinct, in prompt order
    token_ends: tuple[int, ...]  # prompt tokens covered up to each key (page-aligned)


def prepare_chat(
    tokenizer: ChatTokenizer, messages: Sequence[Message], namespace: Namespace, page_size: int
) -> PreparedPrompt:
    """Raises ``ValueError`` for messages the chat template cannot render."""
    try:
        chunks = chunk_conversation(tokenizer, messages)
    except ValueError:
        raise
    except Exception as error:  # a template rejecting a role, say: the client's fault
        raise ValueError(f"the chat template cannot render these messages: {error}") from None
    return prepare_chunks(chunks, namespace, page_size)


def prepare_text(
    tokenizer: ChatTokenizer, prompt: str, namespace: Namespace, page_size: int
) -> PreparedPrompt:
    return prepare_chunks(chunk_prompt(tokenizer, prompt), namespace, page_size)


def prepare_chunks(chunks: Sequence[Chunk], namespace: Namespace, page_size: int) -> PreparedPrompt:
    token_ids = tuple(t for chunk in chunks for t in chunk.token_ids)
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
    return PreparedPrompt(
        token_ids=token_ids,
        lookup_keys=tuple(lookup[:MAX_LOOKUP_KEYS]),
        token_ends=tuple(ends[:MAX_LOOKUP_KEYS]),
    )
