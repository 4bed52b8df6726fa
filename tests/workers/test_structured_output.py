"""Structured output on the tiny random-weight model: whatever the weights, every
token keeps the output a prefix of compact JSON of the asked format, and the output
ends with the JSON's last token. It composes with reuse (a repeated prompt, served
from the cache, gives the same answer) and with overlapped steps' accounting."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from workers import LLM, SamplingParams
from workers.engine.structured import ResponseFormat

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "pages": {"type": "integer", "minimum": 1, "maximum": 999},
    },
    "required": ["answer", "pages"],
    "additionalProperties": False,
}
PROMPT = "The handbook has how many pages? Answer in JSON."


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3)


def _accepted_by_a_fresh_matcher(llm: LLM, fmt: ResponseFormat, tokens) -> bool:
    """Every token, in order, allowed by the grammar, and the JSON complete at the
    last: checked apart from the engine."""
    matcher = llm.engine._grammars.matcher(fmt)
    return all(matcher.accept_token(t) for t in tokens) and matcher.is_terminated()


def _a_valid_prefix(llm: LLM, fmt: ResponseFormat, tokens) -> bool:
    matcher = llm.engine._grammars.matcher(fmt)
    return all(matcher.accept_token(t) for t in tokens)


def test_a_json_schema_answer_parses_follows_the_schema_and_ends_there(llm):
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    for params in (
        SamplingParams(max_tokens=96, temperature=0, response_format=fmt),
        SamplingParams(max_tokens=96, temperature=1.0, seed=7, response_format=fmt),
    ):
        out = llm.generate([PROMPT], params)[0]
        assert out.finish_reason == "stop", out.text
        answer = json.loads(out.text)
        assert set(answer) == {"answer", "pages"} and answer["answer"] in ("yes", "no")
        assert isinstance(answer["pages"], int)
        assert _accepted_by_a_fresh_matcher(llm, fmt, out.token_ids)
    free = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))[0]
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes no JSON
        json.loads(free.text)


def test_json_object_outputs_are_json_objects_batched_beside_free_text(llm):
    fmt = ResponseFormat("json_object")
    outputs = llm.generate(
        [PROMPT, "Tell me a story.", PROMPT],
        [
            SamplingParams(max_tokens=64, temperature=1.0, seed=1, response_format=fmt),
            SamplingParams(max_tokens=16, temperature=0),
            SamplingParams(max_tokens=64, temperature=1.0, seed=2, response_format=fmt),
        ],
    )
    for out in (outputs[0], outputs[2]):
        assert _a_valid_prefix(llm, fmt, out.token_ids)  # cut by max_tokens or complete
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
            assert _accepted_by_a_fresh_matcher(llm, fmt, out.token_ids)
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 16


def test_the_cached_prompt_gives_the_same_constrained_answer(llm):
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=96, temperature=0, response_format=fmt)
    prompt = "A long shared preamble about the harbor handbook, its chapters and pages. " * 8
    first = llm.generate([prompt + PROMPT], params)[0]
    again = llm.generate([prompt + PROMPT], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_a_bad_schema_is_refused_with_the_reason():
    from workers.engine.structured import check_response_format

    with pytest.raises(ValueError, match='Unsupported type "objekt"'):
        check_response_format(ResponseFormat("json_schema", '{"type": "objekt"}'))
    with pytest.raises(ValueError, match="needs its schema"):
        ResponseFormat("json_schema")
    assert xgr.Grammar.from_json_schema(json.dumps(SCHEMA))  # the library itself agrees
