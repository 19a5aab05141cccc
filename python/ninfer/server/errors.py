"""The one mapping from exceptions to OpenAI error JSON and HTTP status.

Handlers raise `ApiError` (or let core exceptions through); `error_response` turns any of them
into `{"error": {"message", "type", "param", "code"}}` with the right status, and
`error_payload` gives the same body for an SSE `data:` event when a stream fails midway (a
request whose grammar fails after tokens were sent, `ninfer.GenerationError`, among others).
`anthropic_error_payload` is the same error in the Anthropic shape, for `/v1/messages` streams.
"""

from __future__ import annotations

import re
from typing import Optional

import orjson
from starlette.responses import Response

from ninfer.engine import QueueFullError

_FIELD = re.compile(r"field `([^`]+)`")


class ApiError(Exception):
    """An error with the HTTP status and OpenAI error fields it should be reported with."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 naming the offending field."""
    return ApiError(400, message, param=param, code=code)


def _core_errors():
    try:
        from ninfer import _core
    except ImportError:
        return None
    return _core


def to_api_error(exc: BaseException) -> ApiError:
    """Classify any exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    core = _core_errors()
    msg = str(exc)
    if core is not None:
        if isinstance(exc, core.ContextOverflowError):
            # A prompt that leaves no room at all names `messages` (the exception's `param`).
            return ApiError(400, msg, param=getattr(exc, "param", None) or "max_tokens", code="context_length_exceeded")
        if isinstance(exc, core.InvalidRequestError):
            m = _FIELD.search(msg)
            return ApiError(400, msg, param=m.group(1) if m else None)
        if isinstance(exc, core.UnsupportedError):
            return ApiError(400, msg, code="unsupported")
        if isinstance(exc, core.OutOfMemoryError):
            return ApiError(503, msg, type="server_error", code="out_of_memory")
    if isinstance(exc, ValueError):
        return ApiError(400, msg)
    if isinstance(exc, OverflowError):
        # A number past what the core's integer types hold (token ids are u32, counts usize).
        return ApiError(400, f"a number in the request is out of range: {msg}")
    if isinstance(exc, RecursionError):
        # JSON nested deeper than the serialisers recurse (an extra field of a message, say).
        return ApiError(400, "the request is nested too deeply")
    return ApiError(500, f"internal error: {type(exc).__name__}: {msg}", type="server_error")


def error_body(err: ApiError) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_payload(exc: BaseException) -> str:
    """JSON text of the error, for an SSE `data:` event after the stream started."""
    return orjson.dumps(error_body(to_api_error(exc))).decode()


#: Anthropic's error type per HTTP status (its API documents these); others by class of status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_payload(exc: BaseException) -> str:
    """JSON text of the error in the Anthropic shape, `{"type": "error", "error": {"type", "message"}}`,
    for the `event: error` of a `/v1/messages` stream."""
    err = to_api_error(exc)
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": err.message}}).decode()


def error_response(exc: BaseException) -> Response:
    """An HTTP response carrying the error JSON and status."""
    err = to_api_error(exc)
    return Response(orjson.dumps(error_body(err)), status_code=err.status, media_type="application/json",
                    headers=err.headers)
