"""Building OpenAI response bodies and stream chunks from worker deltas."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from cluster.api.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    Reuse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from workers.engine.reuse_info import ReuseInfo
from workers.runtime.worker_types import TokenLogprobs, WorkerDelta

TokenText = Callable[[int], str]


@dataclass
class ChoiceOutput:
    """A choice's output accumulated from its deltas."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    reuse: ReuseInfo | None = None  # from the first delta on
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, delta: WorkerDelta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.finish_reason = delta.finish_reason
        self.reuse = delta.reuse
        self.logprobs.extend(delta.logprobs)


def usage(prompt_tokens: int, choices: Sequence[ChoiceOutput]) -> Usage:
    return _usage(prompt_tokens, choices, reuse(choices).reused_tokens)


def usage_so_far(prompt_tokens: int, choices: Sequence[ChoiceOutput]) -> Usage:
    """``usage`` mid-stream: no cached tokens until the first choice says how it was
    served (``usage`` would raise)."""
    served = choices[0].reuse is not None
    return _usage(prompt_tokens, choices, reuse(choices).reused_tokens if served else 0)


def _usage(prompt_tokens: int, choices: Sequence[ChoiceOutput], cached: int) -> Usage:
    completion = sum(c.num_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def reuse(choices: Sequence[ChoiceOutput]) -> Reuse:
    """How the prompt was served, as the first choice saw it (like ``cached_tokens``)."""
    info = choices[0].reuse
    if info is None:
        raise ValueError("no output yet: a choice's first delta says how it was served")
    return Reuse(**info.as_dict())


def sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ResponseFormat(Protocol):
    def response(
        self, choices: Sequence[ChoiceOutput], usage: Usage, reuse: Reuse
    ) -> BaseModel: ...

    def opening_chunks(self, n: int, usage: Usage | None = None) -> list[BaseModel]: ...

    def chunk(
        self, delta: WorkerDelta, reuse: Reuse | None = None, usage: Usage | None = None
    ) -> BaseModel:
        """``reuse``: only on the stream's last chunk (see ``Reuse``); ``usage``: on
        every chunk with ``stream_options.continuous_usage_stats``."""
        ...

    def usage_chunk(self, usage: Usage, reuse: Reuse) -> BaseModel: ...


@dataclass(frozen=True)
class _Header:
    id: str
    created: int
    model: str


def _header(prefix: str, model: str) -> _Header:
    return _Header(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


class ChatFormat:
    def __init__(self, model: str, token_text: TokenText, top_logprobs: int) -> None:
        self._h = _header("chatcmpl", model)
        self._token_text = token_text
        self._top = top_logprobs

    def response(
        self, choices: Sequence[ChoiceOutput], usage: Usage, reuse: Reuse
    ) -> ChatCompletion:
        return ChatCompletion(
            id=self._h.id,
            created=self._h.created,
            model=self._h.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=c.text),
                    finish_reason=c.finish_reason,
                    logprobs=self._logprobs(c.logprobs),
                )
                for i, c in enumerate(choices)
            ],
            usage=usage,
            reuse=reuse,
        )

    def opening_chunks(self, n: int, usage: Usage | None = None) -> list[ChatCompletionChunk]:
        return [
            self._chunk(
                [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))], usage
            )
            for i in range(n)
        ]

    def chunk(
        self, delta: WorkerDelta, reuse: Reuse | None = None, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text),
            finish_reason=delta.finish_reason,
            logprobs=self._logprobs(delta.logprobs),
        )
        return self._chunk([choice], usage, reuse)

    def usage_chunk(self, usage: Usage, reuse: Reuse) -> ChatCompletionChunk:
        return self._chunk([], usage, reuse)

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None, reuse: Reuse | None = None
    ) -> ChatCompletionChunk:
        h = self._h
        return ChatCompletionChunk(
            id=h.id, created=h.created, model=h.model, choices=choices, usage=usage, reuse=reuse
        )

    def _logprobs(self, tokens: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        if not tokens:
            return None
        return ChatLogprobs(content=[self._token(entry) for entry in tokens])

    def _token(self, entry: TokenLogprobs) -> TokenLogprob:
        (chosen, logprob), alternatives = entry[0], entry[1 : 1 + self._top]
        return TokenLogprob(
            **self._top_logprob(chosen, logprob).model_dump(),
            top_logprobs=[self._top_logprob(t, lp) for t, lp in alternatives],
        )

    def _top_logprob(self, token: int, logprob: float) -> TopLogprob:
        text = self._token_text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


class CompletionFormat:
    def __init__(self, model: str, token_text: TokenText, top_logprobs: int) -> None:
        self._h = _header("cmpl", model)
        self._token_text = token_text
        self._top = top_logprobs

    def response(self, choices: Sequence[ChoiceOutput], usage: Usage, reuse: Reuse) -> Completion:
        return self._completion(
            [
                CompletionChoice(
                    index=i,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=self._logprobs(c.logprobs),
                )
                for i, c in enumerate(choices)
            ],
            usage,
            reuse,
        )

    def opening_chunks(self, n: int, usage: Usage | None = None) -> list[Completion]:
        return []

    def chunk(
        self, delta: WorkerDelta, reuse: Reuse | None = None, usage: Usage | None = None
    ) -> Completion:
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            finish_reason=delta.finish_reason,
            logprobs=self._logprobs(delta.logprobs),
        )
        return self._completion([choice], usage, reuse)

    def usage_chunk(self, usage: Usage, reuse: Reuse) -> Completion:
        return self._completion([], usage, reuse)

    def _completion(
        self,
        choices: list[CompletionChoice],
        usage: Usage | None = None,
        reuse: Reuse | None = None,
    ) -> Completion:
        h = self._h
        return Completion(
            id=h.id, created=h.created, model=h.model, choices=choices, usage=usage, reuse=reuse
        )

    def _logprobs(self, tokens: Sequence[TokenLogprobs]) -> CompletionLogprobs | None:
        if not tokens:
            return None
        texts = [self._token_text(entry[0][0]) for entry in tokens]
        offsets, offset = [], 0
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=texts,
            token_logprobs=[entry[0][1] for entry in tokens],
            top_logprobs=[
                {self._token_text(t): lp for t, lp in entry[1 : 1 + self._top]} for entry in tokens
            ],
            text_offset=offsets,
        )
