"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the same engine.

The body is translated to a chat request (`anthropic_body.to_chat_body`), run through the same
reasoning and tool-call parsing, and answered with content blocks (`thinking`, `text`,
`tool_use`) and Anthropic stop reasons; a stream sends each block as it grows (a tool call's
arguments as `input_json_delta` fragments).
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ninfer.server.anthropic_body import to_chat_body
from ninfer.server.errors import ApiError, anthropic_error_payload
from ninfer.server.protocol import ChatRequest, parse_chat
from ninfer.server.routes_chat import SSE_PING_S, json_response, make_builders, read_json
from ninfer.server.sse import error_event, named_event
from ninfer.server.state import ServerState, until_disconnect

__all__ = ["count_tokens", "messages", "to_chat_body"]

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def stop_fields(b, matched, stops: Optional[list]) -> tuple:
    """(stop_reason, stop_sequence): `stop_sequence` with the string when one of the request's
    `stop_sequences` ended the answer (`matched`: the core's `stop_reason` of the last delta),
    else the finish reason's Anthropic name and None. A tool call wins: the client must run it."""
    if b.finish_reason == "stop" and isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return STOP_REASON.get(b.finish_reason, "end_turn"), None


def tool_input(arguments: str) -> dict:
    """A tool call's `input`: its arguments, or {} when they are not a whole JSON object (a call
    cut by max_tokens; a stream carried the fragments written)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _content_blocks(b) -> list:
    blocks = []
    if b.reasoning is not None and b.reasoning.saw_reasoning:
        blocks.append({"type": "thinking", "thinking": b.reasoning_text, "signature": ""})
    if b.content:
        blocks.append({"type": "text", "text": b.content})
    for c in b.tool_calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": tool_input(c["function"]["arguments"])})
    return blocks


async def messages(request: Request) -> Response:
    """Anthropic Messages."""
    state: ServerState = request.app.state.server
    body = await read_json(request)
    req: ChatRequest = parse_chat(to_chat_body(body), state.defaults)
    stops = body.get("stop_sequences")
    mid = "msg_" + uuid.uuid4().hex[:24]
    try:
        sub = await state.start_chat(req, mid)
    except ApiError as e:
        # A budget without room for an answer: named as the Anthropic field it came from.
        if e.param == "thinking_budget":
            e.param = "thinking.budget_tokens"
            e.message = e.message.replace("`thinking_budget`", "`thinking.budget_tokens`")
        raise
    b = make_builders(sub, req)[0]
    if req.stream:
        return EventSourceResponse(_stream(sub, req, b, mid, stops), ping=SSE_PING_S, sep="\n")
    last: dict = {}

    async def collect():
        with sub.stream:
            async for delta in sub.stream:
                b.feed(delta)
                if delta.finished:
                    last["stop"] = delta.stop_reason

    await until_disconnect(request, collect)
    reason, sequence = stop_fields(b, last.get("stop"), stops)
    return json_response({"id": mid, "type": "message", "role": "assistant", "model": req.model,
                          "content": _content_blocks(b), "stop_reason": reason, "stop_sequence": sequence,
                          "usage": {"input_tokens": b.prompt_tokens, "output_tokens": b.completion_tokens}})


async def count_tokens(request: Request) -> Response:
    """Anthropic token counting: the prompt tokens the same body would take on /v1/messages
    (same rendering: system, blocks, tools, thinking on or off)."""
    state: ServerState = request.app.state.server
    req: ChatRequest = parse_chat(to_chat_body(await read_json(request), for_count=True), state.defaults)
    engine = state.require_engine()
    state.tokenizer()  # a 400 when the model has none
    # On a worker thread: a long conversation would stall the event loop.
    ids = await anyio.to_thread.run_sync(lambda: engine.encode_chat(
        req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs))
    return json_response({"input_tokens": len(ids)})


def _event(kind: str, data: dict) -> bytes:
    return named_event(kind, dict(data, type=kind))


class BlockStream:
    """The content-block events of one streamed answer, from the chat delta fields: a block
    opens when output of another kind starts (or a new tool call), and the open block closes
    before it, so blocks open and close in order."""

    def __init__(self):
        self.index = -1
        self.open: Optional[tuple] = None  # ("thinking",), ("text",) or ("tool_use", call index)
        self.call_block: dict = {}  # tool call index -> its block index

    def _switch(self, key: tuple, start: dict) -> list:
        events = self.close()
        self.index += 1
        self.open = key
        events.append(_event("content_block_start", {"index": self.index, "content_block": start}))
        return events

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list:
        """Close the open block, if any (a thinking block gets its, empty, signature first)."""
        if self.open is None:
            return []
        events = []
        if self.open[0] == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        return events

    def feed(self, fields: dict) -> list:
        """The events of one chat `delta` (reasoning_content, content, tool_calls items)."""
        events = []
        if fields.get("reasoning_content"):
            if self.open != ("thinking",):
                events += self._switch(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": fields["reasoning_content"]}))
        if fields.get("content"):
            if self.open != ("text",):
                events += self._switch(("text",), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": fields["content"]}))
        for item in fields.get("tool_calls", ()):
            call = item.get("index")
            fn = item.get("function") or {}
            if "id" in item:
                # The first item of a call (id and name); a whole call comes as one such item.
                events += self._switch(("tool_use", call), {"type": "tool_use", "id": item["id"],
                                                            "name": fn.get("name"), "input": {}})
                self.call_block[call] = self.index
            if fn.get("arguments"):
                events.append(_event("content_block_delta", {"index": self.call_block.get(call, self.index), "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return events


async def _stream(sub, req: ChatRequest, b, mid: str, stops: Optional[list]):
    try:
        yield _event("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "model": req.model,
                                                   "content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": sub.prompt_tokens[0], "output_tokens": 0}}})
        blocks = BlockStream()
        matched = None
        with sub.stream:
            async for delta in sub.stream:
                for e in blocks.feed(b.feed(delta)):
                    yield e
                if delta.finished:
                    matched = delta.stop_reason
        for e in blocks.close():
            yield e
        reason, sequence = stop_fields(b, matched, stops)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": {"output_tokens": b.completion_tokens}})
        yield _event("message_stop", {})
    except Exception as e:
        yield error_event(anthropic_error_payload(e), "error")
