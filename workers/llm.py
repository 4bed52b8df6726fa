"""Offline API: ``LLM(model_dir).generate(prompts, params)`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkstore.chunking import Message, chunk_conversation, chunk_prompt
from workers.config import EngineConfig
from workers.engine import Engine
from workers.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated tokens
    text: str
    finish_reason: str
    num_cached_tokens: int  # prompt tokens served from the KV cache
    # per generated token: (token, logprob) then the top alternatives (if requested)
    logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass
class _Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_cached_tokens: int = 0
    logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


class LLM:
    """Runs the engine in-process. ``enable_reuse=False`` turns chunk reuse off (for
    comparisons); every other keyword is an ``EngineConfig`` field."""

    def __init__(self, model_dir: str, device: str | None = None, dtype: str | None = None, **kw):
        self.engine = Engine(
            EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype, **kw)
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._tokens(p) for p in prompts]
        return self.generate_tokens(token_lists, params)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [self.chat_tokens(c) for c in conversations]
        return self.generate_tokens(token_lists, params)

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The canonical (chunk-by-chunk) tokenization of a conversation."""
        chunks = chunk_conversation(self.tokenizer, messages)
        return [t for chunk in chunks for t in chunk.token_ids]

    def generate_tokens(
        self,
        token_lists: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params_list = _per_prompt(params, len(token_lists))
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        added: list[str] = []
        try:
            for request_id, tokens, p in zip(ids, token_lists, params_list, strict=True):
                self.engine.add_request(request_id, list(tokens), p)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        return self._run(ids, token_lists)

    def _run(self, ids: list[str], token_lists: Sequence[Sequence[int]]) -> list[RequestOutput]:
        collected = {rid: _Collected() for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                entry = collected.get(out.request_id)
                if entry is None:
                    continue
                entry.token_ids += out.new_token_ids
                entry.text += out.new_text
                entry.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None:
                    entry.logprobs.append(out.logprobs)
                if out.finished:
                    entry.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return [
            RequestOutput(
                request_id=rid,
                prompt_token_ids=tuple(tokens),
                token_ids=tuple(collected[rid].token_ids),
                text=collected[rid].text,
                finish_reason=collected[rid].finish_reason,
                num_cached_tokens=collected[rid].num_cached_tokens,
                logprobs=tuple(collected[rid].logprobs),
            )
            for rid, tokens in zip(ids, token_lists, strict=True)
        ]

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            chunks = chunk_prompt(self.tokenizer, prompt)
            return [t for chunk in chunks for t in chunk.token_ids]
        return list(prompt)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
