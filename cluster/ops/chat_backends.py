"""Where ``chunkserve chat`` sends its turns: a running server or an in-process engine.

Both backends answer the same three questions: a streamed reply (in the reuse mode
asked for) with its token counts and time to first token, registering a chunk, and
listing chunks. A message
``{"role": ..., "chunk_id": ID}`` stands for a registered chunk: the remote backend
sends it as a chunk content part (the server expands it); the local backend expands
it itself from what it registered.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

Message = dict  # {"role", "content"} or {"role", "chunk_id"}


@dataclass(frozen=True)
class Turn:
    text: str
    prompt_tokens: int
    cached_tokens: int  # of the prompt, served from the KV cache
    reuse_mode: str  # the reuse mode that served the prompt ("off", "exact", ...)
    ttft_s: float  # request sent -> first generated text


@dataclass(frozen=True)
class ChunkRow:
    chunk_id: str
    role: str
    tokens: int
    pinned_tokens: int
    hits: int | None  # None where the backend does not count hits


class Backend(Protocol):
    def reply(
        self, messages: Sequence[Message], on_text: Callable[[str], None], reuse: str = "exact"
    ) -> Turn:
        """``reuse``: exact or approximate (``Turn.reuse_mode`` says what served it)."""
        ...

    def register(self, content: str, role: str, after: Sequence[str]) -> str: ...

    def chunks(self) -> list[ChunkRow]: ...


class RemoteBackend:
    """A running chunkserve server (``--url``), through the openai client and /v1/chunks."""

    def __init__(self, url: str, api_key: str, max_tokens: int, model: str | None) -> None:
        import httpx
        import openai

        self._client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
        self._http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
        )
        self._model = model or self._client.models.list().data[0].id
        self._max_tokens = max_tokens

    def reply(
        self, messages: Sequence[Message], on_text: Callable[[str], None], reuse: str = "exact"
    ) -> Turn:
        started = time.monotonic()
        stream = self._client.chat.completions.create(
            model=self._model,
            messages=[_wire(m) for m in messages],
            max_tokens=self._max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"reuse": reuse},  # chunkserve's request field
        )
        text, ttft, usage, reuse = "", 0.0, None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            reuse = (chunk.model_extra or {}).get("reuse") or reuse  # chunkserve's extra field
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                ttft = ttft or time.monotonic() - started
                text += piece
                on_text(piece)
        cached = usage.prompt_tokens_details.cached_tokens if usage else 0
        mode = reuse["mode"] if reuse else "unreported"  # a server without the field
        return Turn(text, usage.prompt_tokens if usage else 0, cached, mode, ttft)

    def register(self, content: str, role: str, after: Sequence[str]) -> str:
        body = {"content": content, "role": role, "after": list(after)}
        response = self._http.post("/chunks", json=body)
        if response.status_code != 200:
            raise ValueError(response.json()["error"]["message"])
        return response.json()["id"]

    def chunks(self) -> list[ChunkRow]:
        data = self._http.get("/chunks").json()["data"]
        return [
            ChunkRow(c["id"], c["role"], c["tokens"], c["pinned_tokens"], c["hits"]) for c in data
        ]


def _wire(message: Message) -> dict:
    if "chunk_id" in message:
        return {
            "role": message["role"],
            "content": [{"type": "chunk", "chunk_id": message["chunk_id"]}],
        }
    return message


class LocalBackend:
    """An in-process engine (``--model DIR``) through ``workers.LLM``."""

    def __init__(self, model_dir: str, max_tokens: int, device: str | None) -> None:
        from workers.llm import LLM

        self._llm = LLM(model_dir, device=device)
        self._llm.engine.stream_text = True  # text deltas every step, for the terminal
        self._max_tokens = max_tokens
        self._contents: dict[str, str] = {}  # chunk id -> its registered text
        self._ids = itertools.count()

    def reply(
        self, messages: Sequence[Message], on_text: Callable[[str], None], reuse: str = "exact"
    ) -> Turn:
        from chunkstore.chunking import chunk_conversation, placeable_spans
        from workers.engine.reuse_info import ReuseRequest
        from workers.engine.sampling_params import SamplingParams

        expanded = [
            {"role": m["role"], "content": self._contents[m["chunk_id"]]} if "chunk_id" in m else m
            for m in messages
        ]
        chunks = chunk_conversation(self._llm.tokenizer, expanded)
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        engine = self._llm.engine
        request_id = f"chat-{next(self._ids)}"
        started = time.monotonic()
        engine.add_request(
            request_id,
            tokens,
            SamplingParams(max_tokens=self._max_tokens, temperature=0),
            placeable=placeable_spans(chunks),
            reuse=ReuseRequest(reuse),
        )
        text, ttft, reuse = "", 0.0, None
        while engine.has_unfinished():
            for out in engine.step():
                reuse = out.reuse
                if out.new_token_ids:
                    ttft = ttft or time.monotonic() - started
                if out.new_text:
                    text += out.new_text
                    on_text(out.new_text)
        assert reuse is not None, "a finished request had at least one output"
        return Turn(text, len(tokens), reuse.reused_tokens, reuse.mode, ttft)

    def register(self, content: str, role: str, after: Sequence[str]) -> str:
        chunk_id = self._llm.register_chunk(content, role=role, after=after)
        self._contents[chunk_id] = content
        return chunk_id

    def chunks(self) -> list[ChunkRow]:
        return [
            ChunkRow(i.chunk_id, i.role, i.num_tokens, i.pinned_tokens, None)
            for i in self._llm.list_chunks()
        ]
