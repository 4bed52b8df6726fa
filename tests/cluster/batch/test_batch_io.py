"""Batch files without Ray: line formats, bad lines as errors, torn-line resume."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.batch.job import _pending
from cluster.batch.lines import (
    BatchItem,
    BatchRecord,
    answered_records,
    error_record,
    parse_line,
    read_items,
)
from cluster.errors import BadRequest

REPO = Path(__file__).resolve().parents[3]
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
    assert set(answered_records(out).keyed) == {"a", "b"}  # plain resume: errors count
    assert set(answered_records(out, retry_errors=True).keyed) == {"a"}
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
    assert set(answered_records(out).keyed) == {"a", "b"}
    assert out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert len(answered_records(tmp_path / "absent.jsonl")) == 0


def test_example_requests_share_a_system_prompt_and_documents():
    items = list(read_items(REPO / "configs" / "examples" / "rag_requests.jsonl", "tiny-qwen3"))
    assert len(items) >= 8 and all(item.request is not None for item in items)
    assert len({item.custom_id for item in items}) == len(items)
    systems = {item.request.messages[0].content for item in items}
    assert len(systems) == 1
    first_parts = [item.request.messages[1].content[0].text for item in items]
    assert len(set(first_parts)) < len(items)  # documents repeat across requests


def _write_run(source, out, retry_errors: bool = False) -> list[dict]:
    """One run of the job's line handling, every parsed request answered as ok (a
    record without a response): the records it appends."""
    answered = answered_records(out, retry_errors)
    written = []
    with out.open("a") as file:
        for item in _pending(read_items(source, "m"), answered):
            record = error_record(item.custom_id, item.error) if item.error else _ok(item)
            file.write(record.model_dump_json() + "\n")
            written.append(json.loads(record.model_dump_json()))
    return written


def _ok(item: BatchItem) -> BatchRecord:
    return BatchRecord(id="r", custom_id=item.custom_id, response=None, error=None)


def test_a_real_id_that_reads_like_a_line_number_is_its_own_request(tmp_path):
    """Line 2 has no id and is filed under line-2; line 3's real id is "line-2": it
    runs, on the first run and after a resume."""
    lines = [
        json.dumps({"custom_id": "a", "messages": MESSAGES}),
        json.dumps({"messages": MESSAGES}),
        json.dumps({"custom_id": "line-2", "messages": MESSAGES}),
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    first = _write_run(source, out)
    assert [(r["custom_id"], (r["error"] or {}).get("code")) for r in first] == [
        ("a", None),
        ("line-2", "missing_custom_id"),
        ("line-2", None),
    ]
    assert _write_run(source, out) == []  # resumed: every line has its record


def test_every_line_has_one_record_after_a_retry_of_errors_duplicates_included(tmp_path):
    lines = [
        json.dumps({"custom_id": "a", "messages": MESSAGES}),
        json.dumps({"custom_id": "a", "messages": MESSAGES}),  # a duplicate: an error
        json.dumps({"custom_id": "b", "messages": MESSAGES}),
        "not json",
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    assert len(_write_run(source, out)) == 4
    retried = _write_run(source, out, retry_errors=True)
    assert [(r["custom_id"], r["error"]["code"]) for r in retried] == [
        ("a", "duplicate_custom_id"),
        ("line-4", "invalid_json"),
    ]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["a", "a", "b", "line-4"]


def test_a_rerun_with_every_line_answered_starts_no_cluster(tmp_path):
    """Nothing left to do: the summary says every line was done before, and no Ray
    cluster is asked for (none runs in this test)."""
    from cluster.batch.job import run_batch
    from cluster.config import ClusterConfig

    lines = [json.dumps({"custom_id": "a", "messages": MESSAGES}), "[1]"]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    _write_run(source, out)
    config = ClusterConfig.model_validate({"model": {"name": "m", "path": str(tmp_path)}})
    summary = run_batch(config, source, out)
    assert (summary.requests, summary.errors, summary.skipped) == (0, 0, 2)
