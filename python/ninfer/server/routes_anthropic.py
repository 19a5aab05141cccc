"""POST /v1/messages: the Anthropic Messages API over the same engine, streaming and not.

The body is translated to a chat request (system prompt, text / tool_use / tool_result blocks,
tools with `input_schema`), run through the same reasoning and tool-call parsing, and answered
with content blocks (`thinking`, `text`, `tool_use`) and Anthropic stop reasons.
"""

from __future__ import annotations

import json
import uuid

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ninfer.server.errors import anthropic_error_payload, bad_request
from ninfer.server.protocol import ChatRequest, number, parse_chat
from ninfer.server.routes_chat import SSE_PING_S, json_response, make_builders, read_json
from ninfer.server.sse import error_event, named_event
from ninfer.server.state import ServerState, until_disconnect

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _block_text(blocks: list, where: str) -> str:
    """The text of a list of text blocks (`system`, a tool_result's content): each `text` a string."""
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            continue
        t = b.get("text", "")
        if not isinstance(t, str):
            raise bad_request(f"`{where}[{i}].text` must be a string, got {t!r}", f"{where}[{i}].text")
        out.append(t)
    return "".join(out)


def _blocks_to_messages(role: str, content, where: str) -> list:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"`{where}.content` must be a string or a list of blocks, got {content!r}", where)
    text, calls, out = [], [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            t = block.get("text")
            if not isinstance(t, str):
                raise bad_request(f"`{where}.content[{i}].text` must be a string, got {t!r}", f"{where}.content[{i}].text")
            text.append(t)
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "tool_result":
            c = block.get("content")
            if isinstance(c, list):
                c = _block_text(c, f"{where}.content[{i}].content")
            elif c is not None and not isinstance(c, str):
                raise bad_request(f"`{where}.content[{i}].content` must be a string or a list of blocks, got {c!r}",
                                  f"{where}.content[{i}].content")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": c or ""})
        elif kind == "thinking":
            continue
        else:
            raise bad_request(f"content block type {kind!r} is not supported yet", where, "unsupported")
    msg = {"role": role, "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return ([msg] if text or calls or not out else []) + out


def to_chat_body(body: dict) -> dict:
    """The equivalent OpenAI chat body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise bad_request("`max_tokens` is required", "max_tokens")
    number(body, "max_tokens", lo=1, integer=True)
    messages = []
    system = body.get("system")
    if isinstance(system, list):
        system = _block_text(system, "system")
    elif system is not None and not isinstance(system, str):
        raise bad_request(f"`system` must be a string or a list of text blocks, got {system!r}", "system")
    if system:
        messages.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request(f"`messages` must be a non-empty list, got {raw!r}", "messages")
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"`messages[{i}]` must have role user or assistant, got {m!r}", f"messages[{i}]")
        messages += _blocks_to_messages(m["role"], m.get("content"), f"messages[{i}]")
    chat = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    chat["messages"] = messages
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"`tools` must be a list of tools, got {tools!r}", "tools")
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}}
                         for t in tools if isinstance(t, dict)]
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking.get("type") == "enabled"}
    return chat


def _content_blocks(b) -> list:
    blocks = []
    if b.reasoning is not None and b.reasoning.saw_reasoning:
        blocks.append({"type": "thinking", "thinking": b.reasoning_text, "signature": ""})
    if b.content:
        blocks.append({"type": "text", "text": b.content})
    for c in b.tool_calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])})
    return blocks


async def messages(request: Request) -> Response:
    """Anthropic Messages."""
    state: ServerState = request.app.state.server
    req: ChatRequest = parse_chat(to_chat_body(await read_json(request)), state.defaults)
    mid = "msg_" + uuid.uuid4().hex[:24]
    sub = await state.start_chat(req, mid)
    b = make_builders(sub, req)[0]
    if req.stream:
        return EventSourceResponse(_stream(sub, req, b, mid), ping=SSE_PING_S, sep="\n")

    async def collect():
        with sub.stream:
            async for delta in sub.stream:
                b.feed(delta)

    await until_disconnect(request, collect)
    return json_response({"id": mid, "type": "message", "role": "assistant", "model": req.model,
                          "content": _content_blocks(b), "stop_reason": STOP_REASON.get(b.finish_reason, "end_turn"),
                          "stop_sequence": None,
                          "usage": {"input_tokens": b.prompt_tokens, "output_tokens": b.completion_tokens}})


def _event(kind: str, data: dict) -> bytes:
    return named_event(kind, dict(data, type=kind))


async def _stream(sub, req: ChatRequest, b, mid: str):
    try:
        yield _event("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "model": req.model,
                                                   "content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": sub.prompt_tokens[0], "output_tokens": 0}}})
        index, open_kind = -1, None

        def switch(kind, start):
            nonlocal index, open_kind
            events = []
            if open_kind is not None:
                events.append(_event("content_block_stop", {"index": index}))
            index += 1
            open_kind = kind
            events.append(_event("content_block_start", {"index": index, "content_block": start}))
            return events

        with sub.stream:
            async for delta in sub.stream:
                fields = b.feed(delta)
                if fields.get("reasoning_content"):
                    if open_kind != "thinking":
                        for e in switch("thinking", {"type": "thinking", "thinking": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "thinking_delta", "thinking": fields["reasoning_content"]}})
                if fields.get("content"):
                    if open_kind != "text":
                        for e in switch("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "text_delta", "text": fields["content"]}})
                for c in fields.get("tool_calls", []):
                    for e in switch("tool_use", {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                                                 "input": {}}):
                        yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": c["function"]["arguments"]}})
        if open_kind is not None:
            yield _event("content_block_stop", {"index": index})
        yield _event("message_delta", {"delta": {"stop_reason": STOP_REASON.get(b.finish_reason, "end_turn"),
                                                 "stop_sequence": None},
                                       "usage": {"output_tokens": b.completion_tokens}})
        yield _event("message_stop", {})
    except Exception as e:
        yield error_event(anthropic_error_payload(e), "error")
