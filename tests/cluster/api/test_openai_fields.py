"""Every field of the OpenAI chat and completions request schemas (as the official
client types them) is either implemented or refused with a 400 naming it: none is
silently ignored. Batch lines go through the same parser."""

from __future__ import annotations

import json

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from cluster.batch.lines import parse_line
from cluster.errors import BadRequest
from workers.engine.structured import ResponseFormat

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
# implemented: these fields change what the server does (or are checked, e.g. penalties
# must be 0 and echo false); everything else the client can send is refused
CHAT_IMPLEMENTED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "logprobs",
    "top_logprobs",
    "response_format",
}  # fmt: skip (vLLM's add_generation_prompt / continue_final_message are ours too)
COMPLETION_IMPLEMENTED = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "user", "logprobs", "echo",
}  # fmt: skip


def _schema_fields(params_module) -> list[str]:
    return sorted(params_module.CompletionCreateParamsBase.__annotations__)


def _refused(body_type, base: dict, field: str, value: object) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse_request(body_type, json.dumps({**base, field: value}))
    return caught.value


@pytest.mark.parametrize(
    "body_type,base,fields,implemented",
    [
        (ChatCompletionRequest, CHAT, _schema_fields(chat_params), CHAT_IMPLEMENTED),
        (CompletionRequest, COMPLETION, _schema_fields(completion_params), COMPLETION_IMPLEMENTED),
    ],
    ids=["chat", "completions"],
)
def test_every_openai_field_is_implemented_or_refused_by_name(body_type, base, fields, implemented):
    assert set(fields) >= implemented - {"stream"}  # the schema still has what we implement
    for field in fields:
        if field in implemented:
            assert field in body_type.model_fields, field
            continue
        for value in ({"type": "x"}, [1], "auto", 1, True):  # any value but null
            error = _refused(body_type, base, field, value)
            assert error.param == field and "not supported" in str(error), (field, str(error))
        # null asks for nothing: accepted
        parse_request(body_type, json.dumps({**base, field: None}))


def test_tools_and_logit_bias_are_400s_not_plain_text():
    for field, value in [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("logit_bias", {"42": 5}),
        ("parallel_tool_calls", False),
    ]:
        assert _refused(ChatCompletionRequest, CHAT, field, value).param == field
    for field, value in [("suffix", "end"), ("best_of", 2)]:
        assert _refused(CompletionRequest, COMPLETION, field, value).param == field


def test_message_fields_we_do_not_implement_are_refused_too():
    message = {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}
    body = {**CHAT, "messages": [message, {"role": "user", "content": "hi"}]}
    with pytest.raises(BadRequest) as caught:
        parse_request(ChatCompletionRequest, json.dumps(body))
    assert caught.value.param == "messages.0.tool_calls"
    message["tool_calls"] = None  # a replayed null field is fine
    parse_request(ChatCompletionRequest, json.dumps(body))


def test_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(BadRequest, match="top_logprobs needs logprobs"):
        parse_request(ChatCompletionRequest, json.dumps({**CHAT, "top_logprobs": 3}))
    parse_request(ChatCompletionRequest, json.dumps({**CHAT, "top_logprobs": 3, "logprobs": True}))


def test_batch_lines_refuse_unsupported_fields_as_error_records():
    line = json.dumps({"custom_id": "a", **CHAT, "tool_choice": "auto"})
    item = parse_line(1, line, "m")
    assert item.request is None and item.error.param == "tool_choice"


def test_continue_final_message_follows_vllm_semantics():
    prefill = [*CHAT["messages"], {"role": "assistant", "content": "Sure:"}]
    body = {**CHAT, "messages": prefill, "continue_final_message": True}
    with pytest.raises(BadRequest, match="needs add_generation_prompt: false"):
        parse_request(ChatCompletionRequest, json.dumps(body))
    request = parse_request(
        ChatCompletionRequest, json.dumps({**body, "add_generation_prompt": False})
    )
    assert request.continue_final_message and not request.add_generation_prompt
    with pytest.raises(BadRequest, match="the assistant's"):
        parse_request(
            ChatCompletionRequest,
            json.dumps({**CHAT, "continue_final_message": True, "add_generation_prompt": False}),
        )


def test_validation_messages_name_fields_not_pydantic_internals():
    bad_part = {**CHAT, "messages": [{"role": "user", "content": [{"type": "image"}]}]}
    with pytest.raises(BadRequest) as caught:
        parse_request(ChatCompletionRequest, json.dumps(bad_part))
    message = str(caught.value)
    assert caught.value.param == "messages.0.content.0"
    assert "'text', 'chunk'" in message and "tagged-union" not in message
    assert "Input should be a valid string" not in message  # the other branch's noise
    bad_content = {**CHAT, "messages": [{"role": "user", "content": 5}]}
    with pytest.raises(BadRequest) as caught:
        parse_request(ChatCompletionRequest, json.dumps(bad_content))
    assert caught.value.param == "messages.0.content" and "list[" not in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"stop": ["", "x"]}, "stop", "non-empty strings"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "needs stream: true"),
        ({"temperature": float("nan")}, "temperature", "finite number"),
        ({"top_p": float("inf")}, "top_p", "finite number"),
        ({"reuse": {"mode": "exact", "deviation_ratio": 0.5}}, "reuse", "exact reuse repairs"),
        ({"reuse": {"mode": "exact", "first_tokens": 4}}, "reuse", "first_tokens set the"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content.0.text", "valid string"),
        ({"messages": [{"role": "user", "content": [{"type": "chunk"}]}]},
         "messages.0.content.0.chunk_id", "required"),
    ],
)  # fmt: skip
def test_every_refusal_names_its_field(extra, param, says):
    """Model-level checks name their field too, and a content part's type tag is no
    step of the path (``content.0.text``, not ``content.0.text.text``)."""
    with pytest.raises(BadRequest) as caught:
        parse_request(ChatCompletionRequest, json.dumps({**CHAT, **extra}))
    assert caught.value.param == param and says in caught.value.message
    assert caught.value.message.startswith(f"{param}: ")


def test_completion_refusals_name_their_field():
    for extra, param in (({"echo": True}, "echo"), ({"prompt": []}, "prompt")):
        with pytest.raises(BadRequest) as caught:
            parse_request(CompletionRequest, json.dumps({**COMPLETION, **extra}))
        assert caught.value.param == param
    streamed = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    assert parse_request(CompletionRequest, json.dumps(streamed)).include_usage


def test_response_format_json_object_and_json_schema_in_requests_and_batch_lines():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    request = parse_request(ChatCompletionRequest, json.dumps({**CHAT, "response_format": spec}))
    assert request.output_format == ResponseFormat("json_schema", json.dumps(schema))
    line = json.dumps({"custom_id": "a", **COMPLETION, "response_format": {"type": "json_object"}})
    assert parse_line(1, line, "m").request.output_format == ResponseFormat("json_object")
    text = {**CHAT, "response_format": {"type": "text"}}
    assert parse_request(ChatCompletionRequest, json.dumps(text)).output_format is None


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
         "response_format.json_schema.schema", 'Unsupported type "objekt"'),
        ({"type": "json_schema"}, "response_format.json_schema", "required"),
        ({"type": "yaml"}, "response_format", "'json_schema'"),
    ],
)  # fmt: skip
def test_a_format_the_grammar_library_cannot_build_is_a_400_naming_why(
    response_format, param, says
):
    with pytest.raises(BadRequest) as caught:
        parse_request(
            ChatCompletionRequest, json.dumps({**CHAT, "response_format": response_format})
        )
    assert caught.value.param == param and says in caught.value.message
