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


def message_chars(messages: Sequence[Message]) -> int:
    """Characters of the messages' text (contents and text parts), what a prompt size
    limit counts before anything is tokenized."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return total


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for, from the vocabulary's spellings
    (a byte-level BPE spells each byte as one character, a SentencePiece-style one each
    character as one, so a spelling is never shorter than its text). A text of more
    than ``context * this`` characters has more than ``context`` tokens: the bound by
    which an over-long prompt is refused before it is tokenized."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


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
    probe = _render(tokenizer, [*flat[:-1], {**flat[-1], "content": _mark(0)}], False)
    footer = probe.rsplit(_mark(0), 1)[-1]
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


_MARK_OPENING = "\u2063CHUNKSERVE-"
MAX_ROLES = 8  # distinct roles a conversation is chunked with (one rendering each)


def _mark(k: int) -> str:
    """Message ``k``'s content in a probe rendering: text no template changes, none a
    part of another."""
    return f"{_MARK_OPENING}{k}\u2063"


def _render_per_chunk(
    tokenizer: ChatTokenizer, messages: Sequence[Message], add_generation_prompt: bool
) -> list[tuple[str, str]]:
    """(role, text) per chunk, such that the texts concatenate to the full rendering.

    Linear in the conversation's size (a quadratic one let a request of thousands of
    empty messages hold a router for minutes): the conversation is rendered once with
    its contents and once with each message's content replaced by a mark (the probe),
    plus once per distinct role up to that role's first message (at most
    ``MAX_ROLES``). The probe gives the template's text between consecutive contents;
    the per-role renderings say how much of it ends the message before (its footer:
    what the template writes after a message's content when it is the last one), the
    rest opens the next (its header). So a message's chunk is its header, content and
    footer, as a rendering of the conversation up to it ends, and a chunk's tokens do
    not depend on the messages after it
    (``test_chunk_tokens_do_not_depend_on_what_follows``), except where the template
    itself writes a message differently when more follow (Qwen3 marks the last
    assistant turn's thinking).

    Exact or nothing: the chunks must concatenate to the full rendering, checked;
    where a template breaks that (it renders a prefix other than as a prefix of the
    whole, or changes contents beyond trimming them), the whole conversation is one
    chunk, still exact, just less shareable.
    """
    flat = [_flatten(m) for m in messages]
    full = _render(tokenizer, flat, add_generation_prompt)
    whole = [("conversation", full)]
    marks = [_mark(k) for k in range(len(flat))]
    probe = _render(
        tokenizer, [{**m, "content": marks[k]} for k, m in enumerate(flat)], add_generation_prompt
    )
    between = _between_marks(probe, marks)  # len(flat) + 1 template texts
    if between is None:
        return whole
    footers: dict[str, str] = {}  # role -> its footer
    for k, message in enumerate(flat):
        if message["role"] in footers:
            continue
        if len(footers) == MAX_ROLES:
            return whole
        ending = _render(tokenizer, [{**m, "content": marks[i]} for i, m in enumerate(flat[: k + 1])], False)  # fmt: skip
        if not probe.startswith(ending) or marks[k] not in ending:
            return whole
        footers[message["role"]] = ending[ending.index(marks[k]) + len(marks[k]) :]
    out: list[tuple[str, str]] = []
    header, position = between[0], 0  # ``position``: where ``header`` starts in ``full``
    for k, message in enumerate(messages):
        footer = footers[message["role"]]
        if not between[k + 1].startswith(footer) or not full.startswith(header, position):
            return whole
        position += len(header)
        rendered = _rendered_content(full, position, flat[k]["content"], footer)
        if rendered is None:
            return whole
        out += [(message["role"], t) for t in _message_texts(message, header, rendered, footer)]
        position += len(rendered) + len(footer)
        header = between[k + 1][len(footer) :]
    if full[position:] != header:  # what is left: the generation prompt, if any
        return whole
    out.append(("generation", header))
    return out


def _between_marks(probe: str, marks: list[str]) -> list[str] | None:
    """The probe's texts before, between and after the marks (each exactly once, in
    order), or None."""
    if probe.count(_MARK_OPENING) != len(marks):
        return None
    texts, position = [], 0
    for mark in marks:
        found = probe.find(mark, position)
        if found < 0:
            return None
        texts.append(probe[position:found])
        position = found + len(mark)
    texts.append(probe[position:])
    return texts


def _rendered_content(full: str, position: int, content: str, footer: str) -> str | None:
    """The message's content as the template wrote it at ``position`` of ``full``
    (itself, or trimmed: Llama 3's template trims contents), or None."""
    for rendered in (content, content.strip()):
        if full.startswith(rendered + footer, position):
            return rendered
    return None


def _flatten(message: Message) -> dict[str, Any]:
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {**message, "content": content}


def _message_texts(message: Message, header: str, rendered: str, footer: str) -> list[str]:
    """Texts of a message's chunks: itself, or its header (the role's template
    text) and then one per content part, the footer joined to the last part. The
    header is a chunk of its own so a part's tokens are the same wherever the part
    appears in the message (a document first or third is one position-free entry).
    A message whose parts the template changed (trimmed) is one chunk."""
    content = message["content"]
    texts = [part["text"] for part in content] if isinstance(content, list) else [content]
    if len(texts) == 1 or "".join(texts) != rendered:
        return [header + rendered + footer]
    texts[-1] += footer
    return [header, *texts]
