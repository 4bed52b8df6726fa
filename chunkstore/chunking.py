"""Turn requests into chunks with the canonical tokenization.

A chat message is one chunk; a message whose content is a list of text parts gives
one chunk per part (the message's template header goes with its first part, the
footer with its last); the generation prompt is a chunk of its own. Each chunk is
tokenized on its own and the results are concatenated, so a chunk's tokens never
depend on what follows it — the same document yields the same tokens wherever it
appears. This tokenization is used with reuse on and off alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_PART_SENTINEL = "\u2063CHUNKSERVE-PART\u2063"


class ChatTokenizer(Protocol):
    """What chunking needs of a tokenizer (a Hugging Face tokenizer fits)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Chunk:
    role: str  # system | user | assistant | tool | context | query | generation
    token_ids: tuple[int, ...]


Message = Mapping[str, Any]


def validate_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m["role"], str) or not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise ValueError(f"messages[{i}].content must be a string or a non-empty list of parts")
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(
                    f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': ...}}"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}].text must be a string")


def placeable_spans(chunks: Sequence[Chunk]) -> tuple[tuple[int, int], ...]:
    """(start, end) token spans of the chunks that approximate reuse may place from
    position-free entries: every chunk except the one that opens the prompt (its
    cached KV is exact anyway), the last content chunk (the question: its logits are
    the answer's) and the generation prompt."""
    content = [i for i, c in enumerate(chunks) if c.role != "generation"]
    placeable = set(content[1:-1])
    spans, offset = [], 0
    for index, chunk in enumerate(chunks):
        end = offset + len(chunk.token_ids)
        if index in placeable and end > offset:
            spans.append((offset, end))
        offset = end
    return tuple(spans)


_SENTINEL = "chunkserve-entry-context-sentinel"


def entry_context(tokenizer: ChatTokenizer, system_prompt: str | None) -> tuple[int, ...]:
    """The tokens a position-free entry is computed after: the template's system turn
    with ``system_prompt`` and the opening of a user turn, up to where a user
    message's first text part starts (what precedes a retrieved document in an
    ordinary prompt). ``None``: no context, the chunk alone from position 0."""
    if system_prompt is None:
        return ()
    messages = [
        {"role": "system", "content": system_prompt},
        {
            "role": "user",
            "content": [{"type": "text", "text": _SENTINEL}, {"type": "text", "text": "?"}],
        },
    ]
    chunks = chunk_conversation(tokenizer, messages, add_generation_prompt=False)
    own = tuple(tokenizer.encode(_SENTINEL, add_special_tokens=False))
    context: list[int] = []
    for chunk in chunks:
        if chunk.token_ids == own:
            return tuple(context)
        context += chunk.token_ids
    raise ValueError("this chat template does not render a user message's parts as chunks")


def chunk_prompt(tokenizer: ChatTokenizer, prompt: str) -> list[Chunk]:
    """A plain string prompt is one chunk."""
    if not prompt:
        raise ValueError("prompt is empty")
    return [Chunk("query", tuple(tokenizer.encode(prompt)))]


def chunk_conversation(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Chunk]:
    """The conversation's chunks. ``add_generation_prompt``: open a new assistant turn
    after the messages. ``continue_final_message``: leave the last message, from the
    assistant, open, so generation continues it (a "prefill"); exclusive with
    ``add_generation_prompt`` (the semantics vLLM documents)."""
    validate_messages(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
    texts = _render_per_chunk(tokenizer, messages, add_generation_prompt)
    if continue_final_message:
        texts = _leave_final_open(tokenizer, messages, texts)
    return [
        Chunk(role, tuple(tokenizer.encode(text, add_special_tokens=False)))
        for role, text in texts
        if text
    ]


def _leave_final_open(
    tokenizer: ChatTokenizer, messages: Sequence[Message], texts: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """``texts`` without the template's end of the last message (what follows its
    content), so the prompt ends inside that message."""
    flat = [_flatten(m) for m in messages]
    probe = _render(tokenizer, [*flat[:-1], {**flat[-1], "content": _PART_SENTINEL}], False)
    footer = probe.rsplit(_PART_SENTINEL, 1)[-1]
    texts = [(role, text) for role, text in texts if text]
    role, last = texts[-1]
    if not footer or not last.endswith(footer):
        raise ValueError("this chat template cannot continue the final message")
    return [*texts[:-1], (role, last[: len(last) - len(footer)])]


def _render(tokenizer: ChatTokenizer, messages: Sequence[Message], generation: bool) -> str:
    if not messages and not generation:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation
    )


def _render_per_chunk(
    tokenizer: ChatTokenizer, messages: Sequence[Message], add_generation_prompt: bool
) -> list[tuple[str, str]]:
    """(role, text) per chunk, such that the texts concatenate to the full rendering.

    Relies on the template rendering a conversation's prefix as a prefix of its text
    (true of ChatML and Llama 3 templates); when a template breaks that, the whole
    conversation becomes one chunk, which is still exact, just less shareable.
    """
    flat = [_flatten(m) for m in messages]
    full = _render(tokenizer, flat, add_generation_prompt)
    out: list[tuple[str, str]] = []
    previous = ""
    for k, message in enumerate(messages):
        rendered = _render(tokenizer, flat[: k + 1], False)
        if not rendered.startswith(previous):
            return [("conversation", full)]
        piece = rendered[len(previous) :]
        parts = _split_parts(tokenizer, flat[:k], message, previous, piece)
        if parts is None:
            return [("conversation", full)]
        out += [(message["role"], text) for text in parts]
        previous = rendered
    if not full.startswith(previous):
        return [("conversation", full)]
    out.append(("generation", full[len(previous) :]))
    return out


def _flatten(message: Message) -> dict[str, Any]:
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {**message, "content": content}


def _split_parts(
    tokenizer: ChatTokenizer,
    history: list[dict[str, Any]],
    message: Message,
    previous: str,
    piece: str,
) -> list[str] | None:
    """Texts of a message's chunks: itself, or its header (the role's template
    text) and then one per content part, the footer joined to the last part. The
    header is a chunk of its own so a part's tokens are the same wherever the part
    appears in the message (a document first or third is one position-free entry)."""
    content = message["content"]
    if isinstance(content, str) or len(content) == 1:
        return [piece]
    probe = _render(tokenizer, [*history, {**message, "content": _PART_SENTINEL}], False)
    if not probe.startswith(previous) or probe.count(_PART_SENTINEL) != 1:
        return None
    header, footer = probe[len(previous) :].split(_PART_SENTINEL)
    texts = [part["text"] for part in content]
    texts[-1] = texts[-1] + footer
    if header + "".join(texts) != piece:
        return None
    return [header, *texts]
