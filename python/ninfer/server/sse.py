"""Server-sent event framing, done once here as bytes so sse-starlette sends them as they are.

Streaming routes yield these bytes into `EventSourceResponse`; pre-framed bytes skip a
per-token `ServerSentEvent` object, which matters at tens of streams times hundreds of tokens.
"""

from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"


def data_event(obj) -> bytes:
    """`data: <json>` event."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def named_event(kind: str, obj) -> bytes:
    """`event: <kind>` + `data: <json>` event (Anthropic streams)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def error_event(payload: str, kind: str = "") -> bytes:
    """An error body (already JSON text) as an event."""
    head = b"event: " + kind.encode() + b"\n" if kind else b""
    return head + b"data: " + payload.encode() + b"\n\n"
