"""Every field of the OpenAI chat and completions request schemas (as the official
client types them) is either implemented or refused with a 400 naming it: none is
silently ignored. Batch lines go through the same parser."""

from __future__ import annotations

import json

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from cluster.batch_io import parse_line
from cluster.errors import BadRequest
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request

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


def test_tools_response_format_and_logit_bias_are_400s_not_plain_text():
    for field, value in [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
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
    line = json.dumps({"custom_id": "a", **CHAT, "response_format": {"type": "json_object"}})
    item = parse_line(1, line, "m")
    assert item.request is None and item.error.param == "response_format"


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
