"""Chat and text completions: request -> prompt -> router -> response or SSE stream.

Shared by the HTTP app and the batch job. Invariants:
- The prompt is tokenized and keyed once, off the event loop (``PromptLanes``: a
  large prompt never delays a small one), and only after its size was checked
  against the limit, so an over-long prompt costs no tokenizing.
- A buffered (non-streaming) answer is started over on another worker when its
  worker dies, even mid-generation: nothing reached the client yet. Its starts,
  first and over, share one ``router.Attempts`` (the router's retry layer).
- A stream is bound to its worker once it started; a death then ends it with an
  error event.
- Every token a worker sent to the router is counted in the metrics, whether its
  answer finished, failed or was abandoned by the client (a buffered answer's
  attempts on a worker that died excepted: the client gets the retry's tokens).
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
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
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.prompts import (
    EncodeCache,
    PreparedPrompt,
    PromptLanes,
    longest_token_chars,
    message_chars,
    prepare_chat,
    prepare_chunks,
    prepare_text,
)
from cluster.router import Router, WorkerStream
from cluster.routing_policy import Decision
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import WorkerDelta, WorkerRequest

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
    stream_interval_s: float = 0.0  # streamed answers: least time between worker deltas
    default_reuse: ReuseRequest = ReuseRequest()  # for requests whose `reuse` is absent


@dataclass(frozen=True)
class Reply:
    worker_id: str
    body: BaseModel | None = None  # buffered answer
    events: AsyncGenerator[str, None] | None = None  # server-sent events
    decision: Decision | None = None  # how the router chose the worker that answered


class CompletionService:
    """``max_prompt_chars``: the longest prompt text accepted (the HTTP app sets it from
    ``server.max_prompt_chars``); None: the most that could fit the context, the
    context length times the longest token's characters."""

    def __init__(
        self,
        router: Router,
        tokenizer: ChatTokenizer,
        settings: ServiceSettings,
        metrics: Metrics,
    ) -> None:
        self.router = router
        self._tokenizer = tokenizer
        self._lanes = PromptLanes(tokenizer, _ENCODE_CACHE_CHARS)
        self._token_chars = longest_token_chars(tokenizer)
        self._settings = settings
        self.metrics = metrics
        self.max_prompt_chars: int | None = None
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode)

    async def chat(
        self,
        body: ChatCompletionRequest,
        tenant_salt: str,
        messages: Sequence[Message] | None = None,
        arrived: float | None = None,
    ) -> Reply:
        """``messages``: the body's messages with chunk parts expanded (required when
        the body uses chunks). ``arrived``: when the request arrived (``time.monotonic``;
        None: now), for the latency metrics."""
        arrived = time.monotonic() if arrived is None else arrived
        self._check_model(body.model)
        if messages is None:
            if body.chunk_ids:
                raise BadRequest("chunk parts are only served by the HTTP server")
            messages = [m.as_chunking_message() for m in body.messages]
        namespace = Namespace(self._settings.namespace_model, tenant_salt)
        page_size = self._settings.page_size
        asked = body.reuse_request(self._settings.default_reuse)
        approximate = asked.mode == "approximate"
        chars = message_chars(messages)
        await self._check_prompt_chars(chars, "messages")
        prompt = await self._prepare(
            chars,
            lambda encoder: prepare_chat(
                encoder,
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
        return await self._run(body, prompt, tenant_salt, fmt, "messages", asked, arrived)

    async def completion(
        self, body: CompletionRequest, tenant_salt: str, arrived: float | None = None
    ) -> Reply:
        """``arrived``: as for ``chat``."""
        arrived = time.monotonic() if arrived is None else arrived
        self._check_model(body.model)
        namespace = Namespace(self._settings.namespace_model, tenant_salt)
        page_size = self._settings.page_size
        if isinstance(body.prompt, str):
            text = body.prompt
            await self._check_prompt_chars(len(text), "prompt")

            def prepare(encoder: EncodeCache) -> PreparedPrompt:
                return prepare_text(encoder, text, namespace, page_size)
        else:
            chunk = Chunk("query", tuple(body.prompt))
            await self.router.pool.start()
            self._check_context(len(chunk.token_ids), "prompt")

            def prepare(encoder: EncodeCache) -> PreparedPrompt:
                return prepare_chunks([chunk], namespace, page_size)

        # a text prompt is one chunk: approximate reuse has nothing to place, but the
        # request is still served (and reported) in the mode it asked for
        asked = body.reuse_request(self._settings.default_reuse)
        prompt = await self._prepare(len(body.prompt), prepare, "prompt")
        fmt = CompletionFormat(body.model, self._token_text, body.logprobs or 0)
        return await self._run(body, prompt, tenant_salt, fmt, "prompt", asked, arrived)

    # -- internals -----------------------------------------------------------------
    async def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt text over ``max_prompt_chars``."""
        limit, code = self.max_prompt_chars, "prompt_too_long"
        source = "server.max_prompt_chars"
        if limit is None:
            await self.router.pool.start()
            context = self.router.pool.max_model_len()
            if context is None:
                return  # no worker answered yet: routing refuses the request
            limit, code = context * self._token_chars, "context_length_exceeded"
            source = (
                f"the context length {context} times {self._token_chars}, the most characters "
                "one token stands for: a longer text cannot fit; server.max_prompt_chars "
                "overrides it"
            )
        if chars > limit:
            raise BadRequest(
                f"the prompt has {chars} characters, more than the {limit} this server "
                f"accepts ({source}); shorten the prompt",
                param=param,
                code=code,
            )

    async def _prepare(
        self, size: int, prepare: Callable[[EncodeCache], PreparedPrompt], param: str
    ) -> PreparedPrompt:
        """``size``: the prompt's characters (or token ids), which picks its lane."""
        lane = self._lanes.lane(size)
        preparing = self.metrics.preparing
        preparing[lane] = preparing.get(lane, 0) + 1
        try:
            return await self._lanes.run(lane, prepare)
        except ValueError as error:
            raise BadRequest(str(error), param=param) from None
        finally:
            preparing[lane] -= 1

    async def _run(
        self,
        body: Body,
        prompt: PreparedPrompt,
        tenant_salt: str,
        fmt: ResponseFormat,
        param: str,
        asked: ReuseRequest,
        arrived: float,
    ) -> Reply:
        """``asked``: what the request asks of reuse (its ``reuse`` field or the default)."""
        await self.router.pool.start()
        request = WorkerRequest(
            request_id=uuid.uuid4().hex,
            prompt=PromptRequest(
                prompt.token_ids, tenant_salt, placeable=prompt.placeable, reuse=asked
            ),
            params=self._sampling(body, len(prompt.token_ids), param),
            chunk_ids=body.chunk_ids if isinstance(body, ChatCompletionRequest) else (),
            # buffered: nothing to show before the end, so no deltas in between
            stream_interval_s=self._settings.stream_interval_s if body.stream else math.inf,
        )
        self.metrics.queue_time.observe(time.monotonic() - arrived)
        if body.stream:
            stream = await self.router.open(prompt, request)
            self.metrics.ttft.observe(time.monotonic() - arrived)
            events = self._events(stream, fmt, body, len(prompt.token_ids))
            return Reply(stream.worker_id, events=events, decision=stream.decision)
        stream, choices = await self._buffered(prompt, request, arrived)
        answer = usage(len(prompt.token_ids), choices)
        body = fmt.response(choices, answer, reuse(choices))
        return Reply(stream.worker_id, body=body, decision=stream.decision)

    async def _buffered(
        self, prompt: PreparedPrompt, request: WorkerRequest, arrived: float
    ) -> tuple[WorkerStream, list[ChoiceOutput]]:
        """The answer, and the stream (worker, routing decision) that gave it."""
        attempts = self.router.attempts()
        first = True
        while True:
            stream = await self.router.open(prompt, request, attempts)
            if first:
                self.metrics.ttft.observe(time.monotonic() - arrived)
                first = False
            choices = [ChoiceOutput() for _ in request.params]
            gaps = _TokenGaps(self.metrics)
            try:
                async for delta in stream.deltas():
                    gaps.saw(delta)
                    choices[delta.index].add(delta)
            except WorkerLost:
                if attempts.exhausted:
                    raise
                self.metrics.retries.inc()
                continue
            except BaseException:  # failed, or cancelled (the client left): count what came
                self._count(len(request.prompt.token_ids), choices)
                raise
            finally:
                stream.close()
            self._count(len(request.prompt.token_ids), choices)
            return stream, choices

    async def _events(
        self, stream: WorkerStream, fmt: ResponseFormat, body: Body, prompt_tokens: int
    ) -> AsyncGenerator[str, None]:
        choices = [ChoiceOutput() for _ in range(body.n)]
        gaps = _TokenGaps(self.metrics)
        try:
            for chunk in fmt.opening_chunks(body.n):
                yield sse(chunk)
            async for delta in stream.deltas():
                gaps.saw(delta)
                choices[delta.index].add(delta)
                # reuse goes on the last chunk before [DONE] (see openai_protocol.Reuse)
                last = not body.include_usage and all(c.finish_reason for c in choices)
                yield sse(fmt.chunk(delta, reuse(choices) if last else None))
            if body.include_usage:
                yield sse(fmt.usage_chunk(usage(prompt_tokens, choices), reuse(choices)))
            yield SSE_DONE
        except APIError as error:
            yield sse(error.body())
        finally:  # finished, failed, or closed by the client: its tokens count alike
            stream.close()
            self._count(prompt_tokens, choices)

    def _check_context(self, prompt_tokens: int, param: str) -> None:
        limit = self.router.pool.max_model_len()
        if limit is not None and prompt_tokens >= limit:
            raise BadRequest(
                f"the prompt has {prompt_tokens} tokens but this model serves at most "
                f"{limit - 1} prompt tokens (context length {limit}); shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    def _sampling(self, body: Body, prompt_tokens: int, param: str) -> tuple[SamplingParams, ...]:
        self._check_context(prompt_tokens, param)
        limit = self.router.pool.max_model_len()
        budget = self._settings.default_max_tokens
        if limit is not None:
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

    def _count(self, prompt_tokens: int, choices: Sequence[ChoiceOutput]) -> None:
        """Count one answer's tokens, complete or not (cached: as its first choice
        saw it, like ``usage``; none before any output)."""
        info = choices[0].reuse
        self.metrics.prompt_tokens.inc(by=prompt_tokens)
        self.metrics.cached_tokens.inc(by=0 if info is None else info.reused_tokens)
        self.metrics.generated_tokens.inc(by=sum(c.num_tokens for c in choices))

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])


class _TokenGaps:
    """Observes one request's inter-token latency from its deltas' arrival times: a
    delta of k tokens that came g seconds after its choice's previous one counts as k
    gaps of g/k; a choice's first delta starts its clock."""

    def __init__(self, metrics: Metrics) -> None:
        self._histogram = metrics.inter_token
        self._last: dict[int, float] = {}  # choice -> when its previous delta came

    def saw(self, delta: WorkerDelta) -> None:
        now = time.monotonic()
        previous = self._last.get(delta.index)
        self._last[delta.index] = now
        tokens = len(delta.token_ids)
        if previous is not None and tokens:
            self._histogram.observe((now - previous) / tokens, count=tokens)
