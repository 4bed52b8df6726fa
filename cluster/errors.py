"""API errors: each carries its HTTP status and renders as an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After: when trying again makes sense

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class HTTPStatusError(APIError):
    """A protocol-level refusal (e.g. 405) with the status the HTTP layer chose."""

    type = "invalid_request_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(APIError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"
    retry_after_s = 1  # a worker's queue drains in about that long


class NoHealthyWorker(APIError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"
    retry_after_s = 5  # workers restart or finish draining in seconds


class WorkerLost(APIError):
    """The serving worker died after output had been sent; the request cannot be
    retried transparently."""

    status = 503
    type = "service_unavailable"
    code = "worker_lost"
