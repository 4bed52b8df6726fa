"""Offline API: ``LLM(model_dir).generate(prompts, params)``, ``.chat(...)`` and
registered chunks (``register_chunk``, then ``generate_from_chunks`` by id)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from chunkstore.chunking import Message, chunk_conversation, chunk_prompt, placeable_spans
from workers.engine.chunk_registry import ChunkInfo, ChunkRegistry
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.reuse_info import REQUEST_MODES, ReuseInfo, ReuseRequest
from workers.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Span = tuple[int, int]
# What ``reuse=`` takes: a mode name, {"mode", "first_tokens", "deviation_ratio"} or
# a ReuseRequest; None is exact.
ReuseArg = str | Mapping[str, object] | ReuseRequest | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated tokens
    text: str
    finish_reason: str
    num_cached_tokens: int  # prompt tokens served from the KV cache (= reuse.reused_tokens)
    reuse: ReuseInfo  # how the prompt was served: reuse mode, tokens reused and recomputed
    # per generated token: (token, logprob) then the top alternatives (if requested)
    logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass
class _Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_cached_tokens: int = 0
    reuse: ReuseInfo | None = None  # set by the request's first output
    logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


class LLM:
    """Runs the engine in-process. ``enable_reuse=False`` turns chunk reuse off (for
    comparisons); ``clock`` times chunk TTLs; every other keyword is an
    ``EngineConfig`` field."""

    def __init__(
        self,
        model_dir: str,
        device: str | None = None,
        dtype: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        **kw,
    ):
        self.engine = Engine(
            EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype, **kw)
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._chunks = ChunkRegistry(self.engine, self._prefill, clock, step_until=self._step_until)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (``tensor_parallel_size`` > 1;
        nothing otherwise); generate nothing after."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        reuse: ReuseArg = None,
    ) -> list[RequestOutput]:
        """``reuse``: see ``chat``; a plain prompt is one chunk, so approximate reuse
        has nothing to place in it (its output says it was served approximately)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._tokens(p) for p in prompts]
        return self.generate_tokens(token_lists, params, reuse=reuse)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        reuse: ReuseArg = None,
    ) -> list[RequestOutput]:
        """``reuse``: "exact" (default), "approximate", a dict ``{"mode", "first_tokens",
        "deviation_ratio"}`` or a ``ReuseRequest``. Approximate reuse places the KV of
        each message (part) held as a position-free entry wherever it appears; a missed
        one of at least ``min_entry_tokens`` tokens is computed (after the entry context) after the request,
        before this call returns, so the next call can place it."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        chunk_lists = [chunk_conversation(self.tokenizer, c) for c in conversations]
        token_lists = [[t for chunk in chunks for t in chunk.token_ids] for chunks in chunk_lists]
        spans = [placeable_spans(chunks) for chunks in chunk_lists]
        return self.generate_tokens(token_lists, params, reuse=reuse, placeable=spans)

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The canonical (chunk-by-chunk) tokenization of a conversation."""
        chunks = chunk_conversation(self.tokenizer, messages)
        return [t for chunk in chunks for t in chunk.token_ids]

    # -- registered chunks (see workers.engine.chunk_registry) ---------------------------
    def register_chunk(
        self,
        content: str | Sequence[Message],
        role: str = "context",
        ttl_s: float | None = None,
        after: Sequence[str] = (),
        mode: str = "exact",
    ) -> str:
        """Compute and pin the KV of ``content`` (a string, or messages taken as is)
        preceded by the chunks ``after``; returns its id. ``role``: system (a system
        message), context or query (a user message). Identical registrations return
        the same id and refresh its TTL. ``mode="approximate"``: pin one
        position-free copy of a text (a document) that approximate requests place
        wherever it appears as a content part."""
        return self._chunks.register(content, role, ttl_s, after, mode)

    def generate_from_chunks(
        self, chunk_ids: Sequence[str], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Generate from the registered chunks' messages in order, as ``chat`` would."""
        messages = self._chunks.compose(chunk_ids)
        out = self.generate_tokens([self.chat_tokens(messages)], params)[0]
        self._chunks.record_use(chunk_ids, out.prompt_token_ids, out.num_cached_tokens)
        return out

    def list_chunks(self) -> list[ChunkInfo]:
        return self._chunks.infos()

    def unregister_chunk(self, chunk_id: str) -> None:
        """Unpin the chunk and evict its pages that nothing else uses."""
        self._chunks.unregister(chunk_id)

    def _prefill(self, tokens: list[int]) -> None:
        self.generate_tokens([tokens], SamplingParams(max_tokens=1, temperature=0))

    def _step_until(self, done: Callable[[], bool]) -> None:
        """Step the engine until ``done()``; offline, no request is in flight here."""
        while not done():
            if not self.engine.has_unfinished():
                raise RuntimeError("the engine ran out of work before the awaited state")
            self.engine.step()

    def generate_tokens(
        self,
        token_lists: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        reuse: ReuseArg = None,
        placeable: Sequence[Sequence[Span]] | None = None,
    ) -> list[RequestOutput]:
        """``placeable``: per prompt, the chunk spans approximate reuse may place."""
        params_list = _per_prompt(params, len(token_lists))
        request = reuse_request(reuse)
        for i, tokens in enumerate(token_lists):
            # the engine packs a bool as 0 or 1 (it is an int), so a list of flags would
            # pass for token ids; checked here, not on the serving path, whose
            # requests are validated strictly before they are tokens (openai_protocol)
            if bool in set(map(type, tokens)):
                position = next(j for j, t in enumerate(tokens) if type(t) is bool)
                raise ValueError(
                    f"prompt {i}: token ids must be integers, got a bool at position {position}"
                )
        spans = [()] * len(token_lists) if placeable is None else list(placeable)
        if len(spans) != len(token_lists):
            raise ValueError(
                f"got {len(spans)} placeable span lists for {len(token_lists)} prompts"
            )
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        added: list[str] = []
        try:
            for request_id, tokens, p, s in zip(ids, token_lists, params_list, spans, strict=True):
                self.engine.add_request(
                    request_id, list(tokens), p, placeable=tuple(s), reuse=request
                )
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        return self._run(ids, token_lists)

    def _run(self, ids: list[str], token_lists: Sequence[Sequence[int]]) -> list[RequestOutput]:
        """Step until the requests finished and the engine is idle: entry fills that
        approximate requests queued complete before the call returns."""
        collected = {rid: _Collected() for rid in ids}
        pending = set(ids)
        while pending or self.engine.has_unfinished():
            for out in self.engine.step():
                entry = collected.get(out.request_id)
                if entry is None:
                    continue
                entry.token_ids += out.new_token_ids
                entry.text += out.new_text
                entry.num_cached_tokens = out.num_cached_tokens
                entry.reuse = out.reuse
                if out.logprobs is not None:
                    entry.logprobs.append(out.logprobs)
                if out.finished:
                    entry.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return [
            _output(rid, tokens, collected[rid])
            for rid, tokens in zip(ids, token_lists, strict=True)
        ]

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            chunks = chunk_prompt(self.tokenizer, prompt)
            return [t for chunk in chunks for t in chunk.token_ids]
        return list(prompt)


def _output(request_id: str, tokens: Sequence[int], collected: _Collected) -> RequestOutput:
    assert collected.reuse is not None, "a finished request had at least one output"
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=tuple(tokens),
        token_ids=tuple(collected.token_ids),
        text=collected.text,
        finish_reason=collected.finish_reason,
        num_cached_tokens=collected.num_cached_tokens,
        reuse=collected.reuse,
        logprobs=tuple(collected.logprobs),
    )


def reuse_request(reuse: ReuseArg) -> ReuseRequest:
    """The ``ReuseRequest`` a ``reuse=`` argument names; ``ValueError`` lists what is
    allowed."""
    if reuse is None:
        return ReuseRequest()
    if isinstance(reuse, ReuseRequest):
        return reuse
    if isinstance(reuse, str):
        return ReuseRequest(reuse)
    if isinstance(reuse, Mapping):
        unknown = set(reuse) - {"mode", "first_tokens", "deviation_ratio"}
        if "mode" not in reuse or unknown:
            raise ValueError(
                "a reuse dict takes 'mode' (one of "
                f"{REQUEST_MODES}) and optionally 'first_tokens', 'deviation_ratio'; "
                f"got keys {sorted(reuse)}"
            )
        ratio = reuse.get("deviation_ratio", ReuseRequest.deviation_ratio)
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise ValueError(f"deviation_ratio must be a number in [0, 1], got {ratio!r}")
        first = reuse.get("first_tokens", ReuseRequest.first_tokens)
        if isinstance(first, bool):
            raise ValueError(f"first_tokens must be an integer >= 0, got {first!r}")
        return ReuseRequest(reuse["mode"], first, float(ratio))
    raise ValueError(
        f"reuse must be one of {REQUEST_MODES}, a dict with 'mode' or a ReuseRequest, got {reuse!r}"
    )


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
