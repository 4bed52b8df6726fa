"""Batch files without Ray: line formats, bad lines as errors, torn-line resume."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.batch_io import completed_ids, error_record, parse_line, read_items
from cluster.errors import BadRequest
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]


def test_openai_batch_lines_and_bare_bodies():
    batch = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": MESSAGES}}  # fmt: skip
    item = parse_line(1, json.dumps(batch), "m")
    assert item.custom_id == "a" and isinstance(item.request, ChatCompletionRequest)
    bare = parse_line(2, json.dumps({"id": 7, "prompt": "once upon"}), "m")
    assert bare.custom_id == "7" and isinstance(bare.request, CompletionRequest)
    assert bare.request.model == "m"  # the served model when none is given
    streaming = parse_line(
        3, json.dumps({"custom_id": "s", "messages": MESSAGES, "stream": True}), "m"
    )
    assert streaming.request.stream is False


def test_bad_lines_become_errors_not_exceptions():
    cases = {
        "{not json": "invalid_json",
        "[1, 2]": None,
        json.dumps({"custom_id": "x"}): None,  # neither messages nor prompt
        json.dumps({"custom_id": "y", "messages": [], "n": 0}): None,
        json.dumps({"custom_id": "z", "url": "/v1/embeddings", "body": {"input": "a"}}): None,
    }
    for number, (line, code) in enumerate(cases.items(), start=1):
        item = parse_line(number, line, "m")
        assert item.request is None and isinstance(item.error, BadRequest)
        if code:
            assert item.error.code == code and item.custom_id == f"line-{number}"


def test_a_line_without_custom_id_is_an_error_record_that_says_so():
    for number, line in enumerate(
        [
            json.dumps({"messages": MESSAGES}),
            json.dumps({"custom_id": "", "messages": MESSAGES}),
            json.dumps({"custom_id": True, "messages": MESSAGES}),
            json.dumps({"method": "POST", "body": {"model": "m", "messages": MESSAGES}}),
        ],
        start=1,
    ):
        item = parse_line(number, line, "m")
        assert item.request is None and item.custom_id == f"line-{number}"
        assert item.error.code == "missing_custom_id" and "no custom_id" in item.error.message


def test_retry_errors_drops_error_records_so_their_ids_run_again(tmp_path):
    out = tmp_path / "out.jsonl"
    ok = {"custom_id": "a", "error": None, "response": {}}
    failed = {"custom_id": "b", "error": {"code": "x", "message": "no"}, "response": {}}
    out.write_text(json.dumps(ok) + "\n" + json.dumps(failed) + "\n")
    assert completed_ids(out) == {"a", "b"}  # plain resume: errors count as done
    assert completed_ids(out, retry_errors=True) == {"a"}
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["a"]


def test_batch_lines_can_continue_an_assistant_prefill():
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    line = {"custom_id": "p", "messages": messages, "continue_final_message": True}
    refused = parse_line(1, json.dumps(line), "m")
    assert refused.request is None and "add_generation_prompt" in refused.error.message
    item = parse_line(2, json.dumps({**line, "add_generation_prompt": False}), "m")
    assert item.request.continue_final_message and not item.request.add_generation_prompt


def test_error_records_are_openai_batch_shaped():
    record = json.loads(error_record("q", BadRequest("nope", param="n")).model_dump_json())
    assert record["custom_id"] == "q" and record["error"]["message"] == "nope"
    assert record["response"]["status_code"] == 400
    assert record["response"]["body"]["error"]["param"] == "n"


def test_resume_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    assert completed_ids(out) == {"a", "b"}
    assert out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert completed_ids(tmp_path / "absent.jsonl") == set()


def test_example_requests_share_a_system_prompt_and_documents():
    items = list(read_items(REPO / "configs" / "examples" / "rag_requests.jsonl", "tiny-qwen3"))
    assert len(items) >= 8 and all(item.request is not None for item in items)
    assert len({item.custom_id for item in items}) == len(items)
    systems = {item.request.messages[0].content for item in items}
    assert len(systems) == 1
    first_parts = [item.request.messages[1].content[0].text for item in items]
    assert len(set(first_parts)) < len(items)  # documents repeat across requests
