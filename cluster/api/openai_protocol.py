"""OpenAI-compatible request and response bodies (the HTTP boundary).

Requests are validated strictly (a string is never taken for a number); fields
OpenAI defines that chunkserve does not implement are ignored when absent or at
their defaults and rejected otherwise, so a client never silently gets something
other than it asked for.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.errors import BadRequest
from workers.engine.reuse_info import (
    DEFAULT_DEVIATION_RATIO,
    DEFAULT_FIRST_TOKENS,
    ReuseRequest,
)
from workers.engine.structured import ResponseFormat, check_response_format

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20


def parse_request(body_type: type[BaseModel], raw: bytes | str):
    """The validated body, or ``BadRequest`` naming the first offending fields."""
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as error:
        problems = error.errors()
        if problems[0]["type"] == "json_invalid":
            raise BadRequest(f"the request body is not valid JSON: {problems[0]['msg']}") from None
        problems = _deepest_branches(problems)
        first = _param(problems[0]) or None
        text = "; ".join(f"{_param(e) or 'body'}: {_message(e)}" for e in problems[:3])
        raise BadRequest(text, param=first) from None


def _param(error: dict) -> str:
    """The offending field's dotted path (a model-level ``refusal`` names its own)."""
    return _dotted(error["loc"]) or (error.get("ctx") or {}).get("param", "")


def _deepest_branches(problems: list[dict]) -> list[dict]:
    """Of the errors a union gives for one field (one per alternative), those that got
    furthest into the input: the alternative the client most likely meant."""

    def field(loc: tuple) -> tuple:  # the steps before the first union branch
        for i, part in enumerate(loc):
            if _TYPE_STEP.match(str(part)):
                return loc[:i]
        return loc

    depth: dict[tuple, int] = {}
    for e in problems:
        key = field(e["loc"])
        depth[key] = max(depth.get(key, 0), len(_public_loc(e["loc"])))
    return [e for e in problems if len(_public_loc(e["loc"])) == depth[field(e["loc"])]]


def _message(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "not supported by this server (remove it, or send null)"
    return error["msg"].removeprefix("Value error, ")


def _dotted(loc: tuple) -> str:
    return ".".join(str(part) for part in _public_loc(loc))


_TYPE_STEP = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|tagged-union\[.*\])$")


def _public_loc(loc: tuple) -> tuple:
    """``loc`` without pydantic's union-branch steps (``str``, ``list[...]``, ...) and
    without a discriminated union's tag (``content.0.text.text`` is ``content.0.text``)."""
    public, tag_after = [], None  # steps until the tag: 0 next, 1 after a list index
    for index, part in enumerate(loc):
        step = str(part)
        if tag_after == 0:
            tag_after = None
            continue
        if index and loc[index - 1] in _TAGGED_FIELDS and isinstance(part, str):
            continue  # an optional tagged union's tag, which pydantic gives no type step
        if tag_after == 1 and isinstance(part, int):
            tag_after = 0
        if "tagged-union[" in step:
            tag_after = 1 if step.startswith("list[") else 0
        if not _TYPE_STEP.match(step):
            public.append(part)
    return tuple(public)


# fields holding an optional discriminated union (their tag follows them in ``loc``)
_TAGGED_FIELDS = frozenset({"response_format"})


def refusal(param: str, message: str) -> PydanticCustomError:
    """A model validator's refusal that names the field it is about (pydantic gives a
    model-level error no location: ``parse_request`` reads ``param`` from here)."""
    return PydanticCustomError("refused", "{message}", {"message": message, "param": param})


class _Request(BaseModel):
    """Request bodies refuse what they do not implement: an unknown field with a value
    is a 400 naming it (a field sent as null asks for nothing and is dropped)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_null_extras(cls, data: object) -> object:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send a last chunk carrying usage")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: every chunk carries the usage so far"
    )


ReuseMode = Literal["exact", "approximate"]
REUSE_SHAPE = (
    '"exact", "approximate" or an object {"mode": "exact" | "approximate", '
    '"first_tokens": integer >= 0, "deviation_ratio": number in [0, 1]}'
)


class ReuseOptions(BaseModel):
    """The ``reuse`` request field as an object: a mode with its repair settings."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    mode: ReuseMode = Field(
        description="exact: KV reused only after identical preceding tokens (output equals "
        "plain generation); approximate: also each chunk's position-free KV, placed "
        "wherever the chunk appears and repaired (output differs from plain generation)"
    )
    first_tokens: int = Field(
        DEFAULT_FIRST_TOKENS,
        ge=0,
        description="approximate: tokens at the start of every placed chunk recomputed in context",
    )
    deviation_ratio: float = Field(
        DEFAULT_DEVIATION_RATIO,
        ge=0,
        le=1,
        description="approximate: share of each placed chunk's tokens, those whose KV "
        "deviates most in this context, recomputed as well",
    )

    @model_validator(mode="after")
    def _check_settings(self) -> ReuseOptions:
        repair = {"first_tokens", "deviation_ratio"} & self.model_fields_set
        if self.mode == "exact" and repair:
            raise ValueError(
                f"{' and '.join(sorted(repair))} set the repair of approximate reuse: exact "
                "reuse repairs nothing (remove them, or ask for mode approximate)"
            )
        return self

    def request(self) -> ReuseRequest:
        return ReuseRequest(self.mode, self.first_tokens, self.deviation_ratio)


def _reuse_error(value: object, error: ValidationError) -> PydanticCustomError:
    """One message naming every allowed value, plus what is wrong inside an object."""
    detail = ""
    if isinstance(value, dict):
        inner = [e for e in error.errors() if "ReuseOptions" in str(e["loc"][:1])]
        detail = "; ".join(f"{_dotted(e['loc'][1:]) or 'object'}: {e['msg']}" for e in inner[:2])
    got = json.dumps(value) if isinstance(value, str | int | float | bool | None) else None
    suffix = f" ({detail})" if detail else (f", got {got:.60}" if got else "")
    return PydanticCustomError("reuse", "must be {shape}{suffix}", {
        "shape": REUSE_SHAPE, "suffix": suffix,
    })  # fmt: skip


class JSONSchemaSpec(_Request):
    name: str = Field(description="the schema's name (OpenAI requires one; unused)")
    schema_: dict = Field(alias="schema", description="the JSON schema the output follows")
    description: str | None = Field(None, description="what the schema is for (unused)")
    strict: bool | None = Field(
        None, description="accepted; the output always follows the schema exactly"
    )

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, schema: dict) -> dict:
        check_response_format(ResponseFormat("json_schema", json.dumps(schema)))
        return schema


class TextFormat(_Request):
    type: Literal["text"] = Field(description="plain text: no constraint")


class JSONObjectFormat(_Request):
    type: Literal["json_object"] = Field(description="a JSON object")


class JSONSchemaFormat(_Request):
    type: Literal["json_schema"] = Field(description="JSON following json_schema.schema")
    json_schema: JSONSchemaSpec = Field(description="the schema")


OutputFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class _SamplingRequest(_Request):
    model: str = Field(description="the served model id (GET /v1/models)")
    max_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate; default: server's, within context"
    )
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate for the prompt")
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="makes sampling reproducible (choice i uses seed+i)"
    )
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP} strings; the output ends before the first"
    )
    stream: bool = Field(False, description="stream server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    presence_penalty: float = Field(0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, description="not supported: must be 0")
    user: str | None = Field(None, description="end-user id (accepted, unused)")
    response_format: OutputFormat | None = Field(
        None,
        description="json_object or json_schema: decoding is constrained so the output "
        "is compact JSON of that format and ends with it (workers.engine.structured)",
    )
    ignore_eos: bool = Field(
        False, description="vLLM's: generate past end-of-text tokens (to max_tokens)"
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="vLLM's: no end-of-text or stop token among the first min_tokens, and "
        "no stop string ends the output before it has that many",
    )
    reuse: ReuseMode | ReuseOptions | None = Field(
        None,
        description="chunkserve: how cached KV may serve the prompt, "
        f"{REUSE_SHAPE.replace('an object', 'an object (repair settings)')}; "
        "null: the server's default (server.default_reuse). With the openai client: "
        'extra_body={"reuse": ...}',
    )

    @field_validator("reuse", mode="wrap")
    @classmethod
    def _check_reuse(
        cls, value: object, handler: ValidatorFunctionWrapHandler
    ) -> ReuseMode | ReuseOptions | None:
        try:
            return handler(value)
        except ValidationError as error:
            raise _reuse_error(value, error) from None

    def reuse_request(self, default: ReuseRequest) -> ReuseRequest:
        """What this request asks of reuse (``default`` when it names nothing)."""
        if self.reuse is None:
            return default
        if isinstance(self.reuse, str):
            return ReuseRequest(self.reuse)
        return self.reuse.request()

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        for penalty in ("presence_penalty", "frequency_penalty"):
            if getattr(self, penalty):
                raise refusal(penalty, f"{penalty} is not supported (send 0 or leave it out)")
        stops = self.stop_list
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise refusal("stop", f"stop takes at most {MAX_STOP} non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise refusal("stream_options", "stream_options needs stream: true")
        limit = self.token_limit
        if limit is not None and self.min_tokens > limit:
            raise refusal(
                "min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})"
            )
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def output_format(self) -> ResponseFormat | None:
        """The engine's form of ``response_format`` (None: text)."""
        fmt = self.response_format
        if isinstance(fmt, JSONObjectFormat):
            return ResponseFormat("json_object")
        if isinstance(fmt, JSONSchemaFormat):
            return ResponseFormat("json_schema", json.dumps(fmt.json_schema.schema_))
        return None

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class TextPart(_Request):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str = Field(description="the text; each part of a message is its own chunk")


class ChunkPart(_Request):
    type: Literal["chunk"] = Field(description="a registered chunk (POST /v1/chunks)")
    chunk_id: str = Field(description="the chunk's id; stands for its registered content")


ContentPart = Annotated[TextPart | ChunkPart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="who wrote the message"
    )
    content: str | list[ContentPart] = Field(
        description="text, or a list of text or chunk parts (one reusable chunk per part)"
    )
    name: str | None = Field(None, description="participant name (accepted, unused)")

    @model_validator(mode="after")
    def _check_parts(self) -> ChatMessage:
        if isinstance(self.content, list) and not self.content:
            raise ValueError("content must be a string or a non-empty list of text parts")
        return self

    @property
    def chunk_ids(self) -> list[str]:
        if isinstance(self.content, str):
            return []
        return [part.chunk_id for part in self.content if isinstance(part, ChunkPart)]

    def as_chunking_message(self) -> dict[str, str | list[dict[str, str]]]:
        """Only for messages without chunk parts (``cluster.http.chunk_service`` expands those)."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        if self.chunk_ids:
            raise ValueError("chunk parts must be expanded before tokenizing")
        parts = [{"type": "text", "text": part.text} for part in self.content]
        return {"role": self.role, "content": parts}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="alias of max_tokens (newer OpenAI name); wins if both given"
    )
    logprobs: bool = Field(False, description="return log-probabilities of output tokens")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="alternatives per token (needs logprobs)"
    )
    add_generation_prompt: bool = Field(
        True, description="open a new assistant turn after the messages (vLLM's parameter)"
    )
    continue_final_message: bool = Field(
        False,
        description="continue the last message, which must be the assistant's: the prompt "
        "ends inside it (a prefill); needs add_generation_prompt false (vLLM's semantics)",
    )

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise refusal("top_logprobs", "top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise refusal(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false (a prompt either "
                "continues the last message or opens a new turn)",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise refusal(
                "continue_final_message",
                "continue_final_message needs the last message to be the assistant's",
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def chunk_ids(self) -> tuple[str, ...]:
        """Registered chunks the messages use, distinct, in order."""
        return tuple(dict.fromkeys(i for m in self.messages for i in m.chunk_ids))

    @property
    def num_logprobs(self) -> int:
        """Alternatives the engine must return per token (0: no logprobs)."""
        return max(1, self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(description="text, or token ids, to continue")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="return this many top alternatives per token"
    )
    echo: bool = Field(False, description="not supported: must be false")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise refusal("echo", "echo is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise refusal("prompt", "prompt must not be empty")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int:
        return 0 if self.logprobs is None else max(1, self.logprobs)


# -- responses -----------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = Field(description="prompt tokens served from the KV cache")


class Usage(_Response):
    prompt_tokens: int = Field(description="tokens in the prompt")
    completion_tokens: int = Field(description="tokens generated, all choices")
    total_tokens: int = Field(description="prompt + completion tokens")
    prompt_tokens_details: PromptTokensDetails = Field(description="prompt token breakdown")


class Reuse(_Response):
    """How the prompt was served (chunkserve's addition beside ``usage``)."""

    mode: str = Field(
        description="reuse mode that served the prompt: off (no KV reused), exact (KV "
        "reused only after identical preceding tokens; output equals plain generation) or "
        "approximate (chunks' position-free KV placed and repaired; output differs)"
    )
    reused_tokens: int = Field(
        description="prompt tokens whose KV came from the cache "
        "(= usage.prompt_tokens_details.cached_tokens)"
    )
    recomputed_tokens: int = Field(
        description="of the reused tokens, those computed again in context (0 in exact mode)"
    )


_STREAM_REUSE = (
    "how the prompt was served; in a stream only on the last chunk before [DONE]: the "
    "usage chunk with include_usage, otherwise the chunk that ends the last choice"
)


class TopLogprob(_Response):
    token: str = Field(description="the token's text")
    logprob: float = Field(description="its log-probability")
    bytes: list[int] = Field(description="UTF-8 bytes of the token's text")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="most likely alternatives")


class ChatLogprobs(_Response):
    content: list[TokenLogprob] = Field(description="one entry per output token")


class AssistantMessage(_Response):
    role: Literal["assistant"] = Field("assistant", description="always assistant")
    content: str = Field(description="the generated text")


class ChatChoice(_Response):
    index: int = Field(description="choice number")
    message: AssistantMessage = Field(description="the generated message")
    finish_reason: str | None = Field(description="stop (end or stop string) or length")
    logprobs: ChatLogprobs | None = Field(None, description="when requested")


class ChatCompletion(_Response):
    id: str = Field(description="response id")
    object: Literal["chat.completion"] = Field("chat.completion", description="object type")
    created: int = Field(description="Unix time")
    model: str = Field(description="model id")
    choices: list[ChatChoice] = Field(description="one per n")
    usage: Usage = Field(description="token counts")
    reuse: Reuse = Field(description="how the prompt was served (KV reuse)")


class ChatDelta(_Response):
    role: Literal["assistant"] | None = Field(None, description="first chunk of a choice only")
    content: str | None = Field(None, description="new text")


class ChatChunkChoice(_Response):
    index: int = Field(description="choice number")
    delta: ChatDelta = Field(description="what is new")
    finish_reason: str | None = Field(None, description="set on the choice's last chunk")
    logprobs: ChatLogprobs | None = Field(None, description="of this chunk's tokens")


class ChatCompletionChunk(_Response):
    id: str = Field(description="response id (same for every chunk)")
    object: Literal["chat.completion.chunk"] = Field(
        "chat.completion.chunk", description="object type"
    )
    created: int = Field(description="Unix time")
    model: str = Field(description="model id")
    choices: list[ChatChunkChoice] = Field(description="choices with news")
    usage: Usage | None = Field(None, description="last chunk only, with include_usage")
    reuse: Reuse | None = Field(None, description=_STREAM_REUSE)


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(description="token texts")
    token_logprobs: list[float] = Field(description="log-probability of each token")
    top_logprobs: list[dict[str, float]] = Field(description="alternatives per token")
    text_offset: list[int] = Field(description="character offset of each token")


class CompletionChoice(_Response):
    index: int = Field(description="choice number")
    text: str = Field(description="generated text (or this chunk's part of it)")
    finish_reason: str | None = Field(None, description="stop or length; null mid-stream")
    logprobs: CompletionLogprobs | None = Field(None, description="when requested")


class Completion(_Response):
    id: str = Field(description="response id")
    object: Literal["text_completion"] = Field("text_completion", description="object type")
    created: int = Field(description="Unix time")
    model: str = Field(description="model id")
    choices: list[CompletionChoice] = Field(description="one per n (or chunk's choices)")
    usage: Usage | None = Field(None, description="token counts (last chunk when streaming)")
    reuse: Reuse | None = Field(
        None, description=f"{_STREAM_REUSE}; always set on a non-streamed completion"
    )


class ModelCard(_Response):
    id: str = Field(description="model id")
    object: Literal["model"] = Field("model", description="object type")
    created: int = Field(description="Unix time the server started")
    owned_by: str = Field("chunkserve", description="owner")


class ModelList(_Response):
    object: Literal["list"] = Field("list", description="object type")
    data: list[ModelCard] = Field(description="served models")


class ErrorDetail(_Response):
    message: str = Field(description="what went wrong and how to fix it")
    type: str = Field(description="error class, e.g. invalid_request_error")
    param: str | None = Field(None, description="the offending request field")
    code: str | None = Field(None, description="machine-readable code")


class ErrorBody(_Response):
    error: ErrorDetail = Field(description="the error")
