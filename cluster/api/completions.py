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
import json
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from chunkstore.chunking import (
    ChatTokenizer,
    Chunk,
    Message,
    longest_token_chars,
    message_chars,
)
from chunkstore.hashing import Namespace
from cluster.api.openai_format import (
    SSE_DONE,
    ChatFormat,
    ChoiceOutput,
    CompletionFormat,
    ResponseFormat,
    reuse,
    sse,
    usage,
    usage_so_far,
)
from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.errors import APIError, BadRequest, ModelNotFound, WorkerLost
from cluster.metrics import Metrics
from cluster.routing.policy import Decision
from cluster.routing.prompts import (
    EncodeCache,
    PreparedPrompt,
    PromptLanes,
    prepare_chat,
    prepare_chunks,
    prepare_text,
)
from cluster.routing.router import Router, WorkerStream
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import WorkerDelta, WorkerRequest

Body = ChatCompletionRequest | CompletionRequest

# Characters of repeated chunk texts whose tokens a router keeps (~1.4 bytes a char
# with their token ids).
_ENCODE_CACHE_CHARS = 32 * 2**20
_ROLE_KEY = re.compile(rb'"role"\s*:')  # a JSON object's "role" key, as bytes
# What a message weighs, in characters, in choosing its prompt's preparation lane:
# about a chat template's text around one message (so thousands of empty messages,
# whose rendering is work though they have no text, go to the large lane)
MESSAGE_CHARS = 32


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
    """``max_prompt_chars``, ``max_messages``: the longest prompt text and the most
    messages accepted (the HTTP app sets them from ``server.max_prompt_chars`` and
    ``server.max_messages``); None: the most that could fit the context
    (``check_prompt_size``)."""

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
        self.max_messages: int | None = None
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
        await self.check_prompt_size(chars, len(messages), "messages")
        self._check_repair(asked)
        prompt = await self._prepare(
            chars + MESSAGE_CHARS * len(messages),
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
            await self.check_prompt_size(len(text), 1, "prompt")

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
        self._check_repair(asked)
        prompt = await self._prepare(len(body.prompt), prepare, "prompt")
        fmt = CompletionFormat(body.model, self._token_text, body.logprobs or 0)
        return await self._run(body, prompt, tenant_salt, fmt, "prompt", asked, arrived)

    async def check_prompt_size(self, chars: int, messages: int, param: str) -> None:
        """Refuse, before anything is rendered or tokenized, a prompt (or a chunk) of
        more messages than ``max_messages`` or more text than ``max_prompt_chars``. By
        default both are what could fit the context: each message renders to at least
        one token, and one token stands for at most ``longest_token_chars``."""
        if self.max_prompt_chars is None or self.max_messages is None:
            await self.router.pool.start()
        context = self.router.pool.max_model_len()  # None: routing refuses the request
        limit = self._messages_limit(context)
        if limit is not None and messages > limit[0]:
            raise _over(f"the request has {messages} messages", limit, param, "send fewer")
        limit = self._chars_limit(context)
        if limit is not None and chars > limit[0]:
            raise _over(f"the prompt has {chars} characters", limit, param, "shorten the prompt")

    def _check_repair(self, asked: ReuseRequest) -> None:
        """``first_tokens`` beyond the context is refused: no chunk is that long, so it
        can only be a mistake (a chunk of fewer tokens is recomputed whole anyway)."""
        context = self.router.pool.max_model_len()
        if context is not None and asked.first_tokens > context:
            raise BadRequest(
                f"reuse.first_tokens is {asked.first_tokens}, more than the context length "
                f"{context}; any value at least a chunk's length recomputes that chunk whole",
                param="reuse.first_tokens",
            )

    async def check_raw_messages(self, raw: bytes, field: str) -> None:
        """Refuse, before the body is parsed, one whose ``field`` lists more messages
        than accepted: parsing 100,000 messages into request objects holds the event
        loop's interpreter for half a second (decoding the JSON alone, 45 ms); scanning
        the bytes for "role" keys takes about 10 ms. Every message has one such key, so
        their count bounds the messages from above. Past twice the limit the request is
        refused by that count (no request has that many "role" keys elsewhere); just
        past the limit, the body is decoded to count its messages exactly."""
        if self.max_messages is None:
            await self.router.pool.start()
        limit = self._messages_limit(self.router.pool.max_model_len())
        if limit is None:
            return
        keys = len(_ROLE_KEY.findall(raw))
        if keys <= limit[0]:
            return
        if keys > 2 * limit[0] + 64:
            count = f"{keys} messages (by its role keys)"
        else:
            try:
                data = json.loads(raw)
            except ValueError:
                return  # not JSON: the parser says so
            messages = data.get(field) if isinstance(data, dict) else None
            if not isinstance(messages, list) or len(messages) <= limit[0]:
                return
            count = f"{len(messages)} messages"
        raise _over(f"the request has {count}", limit, field, "send fewer")

    def _messages_limit(self, context: int | None) -> tuple[int, str, str] | None:
        """(limit, its source, error code); None: no limit known yet."""
        if self.max_messages is not None:
            return self.max_messages, "server.max_messages", "too_many_messages"
        if context is None:
            return None
        source = (
            f"each message takes at least one token of the context length {context}; "
            "server.max_messages lowers it"
        )
        return context, source, "context_length_exceeded"

    def _chars_limit(self, context: int | None) -> tuple[int, str, str] | None:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars, "server.max_prompt_chars", "prompt_too_long"
        if context is None:
            return None
        source = (
            f"the context length {context} times {self._token_chars}, the most characters "
            "one token stands for: a longer text cannot fit; server.max_prompt_chars "
            "overrides it"
        )
        return context * self._token_chars, source, "context_length_exceeded"

    # -- internals -----------------------------------------------------------------

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
        # events that go out together are written together (one write, one packet):
        # the opening chunks with the first delta's, the usage chunk with [DONE]
        before = usage_so_far(prompt_tokens, choices) if body.continuous_usage else None
        opening = "".join(sse(chunk) for chunk in fmt.opening_chunks(body.n, before))
        try:
            async for delta in stream.deltas():
                gaps.saw(delta)
                choices[delta.index].add(delta)
                # reuse goes on the last chunk before [DONE] (see openai_protocol.Reuse)
                last = not body.include_usage and all(c.finish_reason for c in choices)
                running = usage_so_far(prompt_tokens, choices) if body.continuous_usage else None
                yield opening + sse(fmt.chunk(delta, reuse(choices) if last else None, running))
                opening = ""
            closing = SSE_DONE
            if body.include_usage:
                closing = sse(fmt.usage_chunk(usage(prompt_tokens, choices), reuse(choices)))
                closing += SSE_DONE
            yield opening + closing
        except APIError as error:  # in-band: the stream's 200 went out with its first event
            yield sse(error.body())
            raise  # so the caller counts the request as failed (the event was sent)
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
                    ignore_eos=body.ignore_eos,
                    min_tokens=body.min_tokens,
                    response_format=body.output_format,
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


def _over(what: str, limit: tuple[int, str, str], param: str, advice: str) -> BadRequest:
    """``what`` ("the prompt has N characters") is past ``limit`` (value, source,
    error code)."""
    return BadRequest(
        f"{what}, more than the {limit[0]} this server accepts ({limit[1]}); {advice}",
        param=param,
        code=limit[2],
    )
