"""Batch files: request lines in, response lines out, resumable.

Input lines are either OpenAI Batch API lines
``{"custom_id", "method", "url", "body": {...}}`` or bare request bodies carrying
a ``custom_id`` (or ``id``); a missing ``model`` is the served one. Output lines
follow the OpenAI Batch API:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

Invariants:
- Every input line yields exactly one output record (empty lines none), written in
  input order; a line that cannot be parsed or validated yields an error record, and
  so does each later line repeating an id (``duplicate_custom_id``).
- A line with no usable id (not JSON, not an object, no ``custom_id``) is filed under
  ``line-<number>`` with one of the ``UNKEYED_CODES``: a namespace of its own, so a
  line whose real id reads ``line-4`` is never mistaken for it.
- A record is one ``write`` of a whole line followed by a flush, so a killed job
  leaves complete records plus at most one torn last line, which the rerun cuts off
  before appending; a rerun (``Answered``) skips every line whose record is there.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TextIO

from pydantic import BaseModel, Field

from cluster.api.openai_protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ErrorDetail,
    parse_request,
)
from cluster.errors import APIError, BadRequest


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


# the error codes of lines without a usable id, filed under "line-<number>"
UNKEYED_CODES = frozenset({"invalid_json", "invalid_line", "missing_custom_id"})


@dataclass(frozen=True)
class BatchItem:
    line_number: int  # 1-based
    custom_id: str
    request: ChatCompletionRequest | CompletionRequest | None
    error: APIError | None  # why the line could not become a request
    keyed: bool = True  # ``custom_id`` is the line's own (False: its "line-<number>")


class BatchResponse(BaseModel):
    status_code: int = Field(description="HTTP status the request would have had")
    request_id: str = Field(description="id of this attempt")
    body: ChatCompletion | Completion | ErrorBody = Field(description="the response body")


class BatchError(BaseModel):
    code: str | None = Field(description="machine-readable code")
    message: str = Field(description="what went wrong")


class BatchRecord(BaseModel):
    id: str = Field(description="record id")
    custom_id: str = Field(description="the input line's id")
    response: BatchResponse | None = Field(description="the response, or None")
    error: BatchError | None = Field(description="set when the request failed")


def read_items(path: Path, model_name: str) -> Iterator[BatchItem]:
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield parse_line(number, line, model_name)


def parse_line(number: int, line: str, model_name: str) -> BatchItem:
    fallback_id = f"line-{number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        problem = BadRequest(f"line {number} is not valid JSON: {error.msg}", code="invalid_json")
        return BatchItem(number, fallback_id, None, problem, keyed=False)
    if not isinstance(data, dict):
        problem = BadRequest(f"line {number} is not an object", code="invalid_line")
        return BatchItem(number, fallback_id, None, problem, keyed=False)
    raw_id = data.get("custom_id", data.get("id"))
    if not isinstance(raw_id, str | int) or raw_id == "" or isinstance(raw_id, bool):
        missing = BadRequest(
            f"line {number} has no custom_id: give every line a unique custom_id "
            f"(its error record is filed under {fallback_id!r})",
            param="custom_id",
            code="missing_custom_id",
        )
        return BatchItem(number, fallback_id, None, missing, keyed=False)
    custom_id = str(raw_id)
    try:
        return BatchItem(number, custom_id, _request(data, model_name), None)
    except APIError as error:
        return BatchItem(number, custom_id, None, error)


def _request(data: dict, model_name: str) -> ChatCompletionRequest | CompletionRequest:
    body = data.get("body") if "body" in data else _bare_body(data)
    if not isinstance(body, dict):
        raise BadRequest("body must be an object", param="body")
    endpoint = _endpoint(data.get("url"), body)
    body = {"model": model_name, **body, "stream": False}
    body_type = ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest
    return parse_request(body_type, json.dumps(body))


def _bare_body(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("custom_id", "id", "method", "url")}


def _endpoint(url: object, body: dict) -> Endpoint:
    if url is not None:
        try:
            return Endpoint(url)
        except ValueError:
            raise BadRequest(
                f"url must be {Endpoint.CHAT} or {Endpoint.COMPLETIONS}, got {url!r}", param="url"
            ) from None
    if "messages" in body:
        return Endpoint.CHAT
    if "prompt" in body:
        return Endpoint.COMPLETIONS
    raise BadRequest("a request needs 'messages' (chat) or 'prompt' (completions)")


def ok_record(custom_id: str, body: ChatCompletion | Completion) -> BatchRecord:
    response = BatchResponse(status_code=200, request_id=body.id, body=body)
    return BatchRecord(id=_record_id(), custom_id=custom_id, response=response, error=None)


def error_record(custom_id: str, error: APIError) -> BatchRecord:
    detail = ErrorDetail(message=error.message, type=error.type, param=error.param, code=error.code)
    response = BatchResponse(
        status_code=error.status, request_id=_record_id(), body=ErrorBody(error=detail)
    )
    return BatchRecord(
        id=_record_id(),
        custom_id=custom_id,
        response=response,
        error=BatchError(code=error.code, message=error.message),
    )


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


@dataclass
class Answered:
    """The records already in an output file, counted per id: of lines with an id of
    their own (``keyed``), and of lines without one (``unkeyed``, by line-<number>)."""

    keyed: Counter[str] = field(default_factory=Counter)
    unkeyed: Counter[str] = field(default_factory=Counter)

    def holds(self, item: BatchItem, occurrence: int) -> bool:
        """Whether the ``occurrence``-th line (0: the first) with ``item``'s id has its
        record: records are written in input order, so an id's first n lines do."""
        counts = self.keyed if item.keyed else self.unkeyed
        return occurrence < counts[item.custom_id]

    def __len__(self) -> int:
        return self.keyed.total() + self.unkeyed.total()


def answered_records(path: Path, retry_errors: bool = False) -> Answered:
    """The records already in ``path``; cuts off a torn last line first.
    ``retry_errors``: error records are removed from ``path`` (rewritten atomically), so
    their lines run again and each line still has one record."""
    answered = Answered()
    if not path.exists():
        return answered
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    kept = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
            continue
        error = record.get("error")
        if retry_errors and error is not None:
            continue
        unkeyed = isinstance(error, dict) and error.get("code") in UNKEYED_CODES
        (answered.unkeyed if unkeyed else answered.keyed)[record["custom_id"]] += 1
        kept.append(line)
    if retry_errors and len(kept) < len(data[:end].splitlines()):
        temporary = path.with_name(path.name + ".retry")
        temporary.write_bytes(b"".join(line + b"\n" for line in kept))
        temporary.replace(path)
    return answered


class RecordWriter:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, record: BatchRecord) -> None:
        self._out.write(record.model_dump_json() + "\n")
        self._out.flush()
