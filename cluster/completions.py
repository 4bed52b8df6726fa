"""Chat and text completions: request -> prompt -> router -> response or SSE stream.

Shared by the HTTP app and the batch job. Invariants:
- The prompt is tokenized and keyed once, off the event loop, on one thread.
- A buffered (non-streaming) answer is retried from scratch on another worker when
  its worker dies, even mid-generation: nothing reached the client yet.
- A stream is bound to its worker once it started; a death then ends it with an
  error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import BaseModel

from chunkstore.chunking import ChatTokenizer, Chunk, Message
from chunkstore.hashing import Namespace
from cluster.errors import APIError, BadRequest, ModelNotFound, WorkerLost
from cluster.metrics import Metrics
from cluster.openai_format import (
    SSE_DONE,
    ChatFormat,
    ChoiceOutput,
    CompletionFormat,
    ResponseFormat,
    reuse,
    sse,
    usage,
)
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, Usage
from cluster.prompts import (
    EncodeCache,
    PreparedPrompt,
    prepare_chat,
    prepare_chunks,
    prepare_text,
)
from cluster.router import Router, WorkerStream
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import WorkerRequest

Body = ChatCompletionRequest | CompletionRequest

# Characters of repeated chunk texts whose tokens a router keeps (~1.4 bytes a char
# with their token ids).
_ENCODE_CACHE_CHARS = 32 * 2**20


@dataclass(frozen=True)
class ServiceSettings:
    model_name: str  # what clients send as `model`
    namespace_model: str  # model id + checkpoint fingerprint, as the engine keys pages
    page_size: int
    default_max_tokens: int
    max_attempts: int  # buffered answers: workers tried when one dies mid-answer
    stream_interval_s: float = 0.0  # streamed answers: least time between worker deltas
    default_reuse: ReuseRequest = ReuseRequest()  # for requests whose `reuse` is absent


@dataclass(frozen=True)
class Reply:
    worker_id: str
    body: BaseModel | None = None  # buffered answer
    events: AsyncIterator[str] | None = None  # server-sent events


class CompletionService:
    def __init__(
        self,
        router: Router,
        tokenizer: ChatTokenizer,
        settings: ServiceSettings,
        metrics: Metrics,
    ) -> None:
        self.router = router
        self._tokenizer = tokenizer
        self._encoder = EncodeCache(tokenizer, _ENCODE_CACHE_CHARS)  # prompt thread only
        self._settings = settings
        self.metrics = metrics
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode)
        # One thread prepares prompts: off the event loop, and never two tokenizer
        # calls at once (Hugging Face fast tokenizers are not safe to share across threads).
        self._prepare_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")

    async def chat(
        self,
        body: ChatCompletionRequest,
        tenant_salt: str,
        messages: Sequence[Message] | None = None,
    ) -> Reply:
        """``messages``: the body's messages with chunk parts expanded (required when
        the body uses chunks)."""
        self._check_model(body.model)
        if messages is None:
            if body.chunk_ids:
                raise BadRequest("chunk parts are only served by the HTTP server")
            messages = [m.as_chunking_message() for m in body.messages]
        namespace = Namespace(self._settings.namespace_model, tenant_salt)
        page_size = self._settings.page_size
        asked = body.reuse_request(self._settings.default_reuse)
        approximate = asked.mode == "approximate"
        prompt = await self._prepare(
            lambda: prepare_chat(
                self._encoder,
                messages,
                namespace,
                page_size,
                approximate,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            ),
            "messages",
        )
        fmt = ChatFormat(body.model, self._token_text, body.top_logprobs or 0)
        return await self._run(body, prompt, tenant_salt, fmt, "messages", asked)

    async def completion(self, body: CompletionRequest, tenant_salt: str) -> Reply:
        self._check_model(body.model)
        namespace = Namespace(self._settings.namespace_model, tenant_salt)
        page_size = self._settings.page_size
        if isinstance(body.prompt, str):
            text = body.prompt

            def prepare() -> PreparedPrompt:
                return prepare_text(self._encoder, text, namespace, page_size)
        else:
            chunk = Chunk("query", tuple(body.prompt))

            def prepare() -> PreparedPrompt:
                return prepare_chunks([chunk], namespace, page_size)

        # a text prompt is one chunk: approximate reuse has nothing to place, but the
        # request is still served (and reported) in the mode it asked for
        asked = body.reuse_request(self._settings.default_reuse)
        prompt = await self._prepare(prepare, "prompt")
        fmt = CompletionFormat(body.model, self._token_text, body.logprobs or 0)
        return await self._run(body, prompt, tenant_salt, fmt, "prompt", asked)

    # -- internals -----------------------------------------------------------------
    async def _prepare(self, prepare: Callable[[], PreparedPrompt], param: str) -> PreparedPrompt:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._prepare_thread, prepare)
        except ValueError as error:
            raise BadRequest(str(error), param=param) from None

    async def _run(
        self,
        body: Body,
        prompt: PreparedPrompt,
        tenant_salt: str,
        fmt: ResponseFormat,
        param: str,
        asked: ReuseRequest,
    ) -> Reply:
        """``asked``: what the request asks of reuse (its ``reuse`` field or the default)."""
        started = time.monotonic()
        await self.router.pool.start()
        request = WorkerRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt.token_ids,
            params=self._sampling(body, len(prompt.token_ids), param),
            tenant_salt=tenant_salt,
            chunk_ids=body.chunk_ids if isinstance(body, ChatCompletionRequest) else (),
            # buffered: nothing to show before the end, so no deltas in between
            stream_interval_s=self._settings.stream_interval_s if body.stream else math.inf,
            reuse=asked,
            placeable=prompt.placeable,
        )
        if body.stream:
            stream = await self.router.open(prompt, request)
            self.metrics.ttft.observe(time.monotonic() - started)
            events = self._events(stream, fmt, body, len(prompt.token_ids))
            return Reply(stream.worker_id, events=events)
        worker_id, choices = await self._buffered(prompt, request, started)
        answer = usage(len(prompt.token_ids), choices)
        self._count(answer)
        return Reply(worker_id, body=fmt.response(choices, answer, reuse(choices)))

    async def _buffered(
        self, prompt: PreparedPrompt, request: WorkerRequest, started: float
    ) -> tuple[str, list[ChoiceOutput]]:
        for attempt in range(self._settings.max_attempts):
            request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
            stream = await self.router.open(prompt, request)
            if attempt == 0:
                self.metrics.ttft.observe(time.monotonic() - started)
            choices = [ChoiceOutput() for _ in request.params]
            try:
                async for delta in stream.deltas():
                    choices[delta.index].add(delta)
                return stream.worker_id, choices
            except WorkerLost:
                if attempt + 1 == self._settings.max_attempts:
                    raise
                self.metrics.retries.inc()
            finally:
                stream.close()
        raise AssertionError("unreachable: max_attempts >= 1")

    async def _events(
        self, stream: WorkerStream, fmt: ResponseFormat, body: Body, prompt_tokens: int
    ) -> AsyncIterator[str]:
        choices = [ChoiceOutput() for _ in range(body.n)]
        try:
            for chunk in fmt.opening_chunks(body.n):
                yield sse(chunk)
            async for delta in stream.deltas():
                choices[delta.index].add(delta)
                # reuse goes on the last chunk before [DONE] (see openai_protocol.Reuse)
                last = not body.include_usage and all(c.finish_reason for c in choices)
                yield sse(fmt.chunk(delta, reuse(choices) if last else None))
            answer = usage(prompt_tokens, choices)
            self._count(answer)
            if body.include_usage:
                yield sse(fmt.usage_chunk(answer, reuse(choices)))
            yield SSE_DONE
        except APIError as error:
            yield sse(error.body())
        finally:
            stream.close()

    def _sampling(self, body: Body, prompt_tokens: int, param: str) -> tuple[SamplingParams, ...]:
        limit = self.router.pool.max_model_len()
        budget = self._settings.default_max_tokens
        if limit is not None:
            if prompt_tokens >= limit:
                raise BadRequest(
                    f"the prompt has {prompt_tokens} tokens but this model serves at most "
                    f"{limit - 1} prompt tokens (context length {limit}); shorten the prompt",
                    param=param,
                    code="context_length_exceeded",
                )
            budget = min(budget, limit - prompt_tokens)
            if body.token_limit is not None and body.token_limit > limit - prompt_tokens:
                raise BadRequest(
                    f"max_tokens is {body.token_limit}, but after the {prompt_tokens}-token "
                    f"prompt only {limit - prompt_tokens} tokens fit in the context length "
                    f"{limit}; lower max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        try:
            return tuple(
                SamplingParams(
                    max_tokens=body.token_limit or budget,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    seed=None if body.seed is None else body.seed + i,
                    stop=body.stop_list,
                    logprobs=body.num_logprobs,
                )
                for i in range(body.n)
            )
        except ValueError as error:
            raise BadRequest(str(error)) from None

    def _check_model(self, model: str) -> None:
        if model != self._settings.model_name:
            raise ModelNotFound(
                f"model {model!r} does not exist; this server serves {self._settings.model_name!r}",
                param="model",
            )

    def _count(self, answer: Usage) -> None:
        self.metrics.prompt_tokens.inc(by=answer.prompt_tokens)
        self.metrics.cached_tokens.inc(by=answer.prompt_tokens_details.cached_tokens)
        self.metrics.generated_tokens.inc(by=answer.completion_tokens)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])
