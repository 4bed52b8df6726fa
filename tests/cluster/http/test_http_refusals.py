"""A refused request is logged as one line an operator can act on: the method, path,
status, error code and parameter, and the reason."""

from __future__ import annotations

import json
import logging

from starlette.requests import Request

from cluster.errors import BadRequest
from cluster.http.app import refused


def test_a_refusal_is_logged_with_its_code_parameter_and_reason(caplog):
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [], "query_string": b""})  # fmt: skip
    error = BadRequest("stop takes at most 4 non-empty strings", param="stop")
    with caplog.at_level(logging.INFO, logger="cluster.http.app"):
        response = refused(request, error)
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["param"] == "stop"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("POST /v1/chat/completions 400 invalid_request_error (param stop)")
    assert "at most 4 non-empty strings" in line
