"""GET /v1/models, /health, /metrics, /; POST /tokenize and /detokenize."""

from __future__ import annotations

import pathlib
import time

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response

from ninfer.server.errors import bad_request
from ninfer.server.protocol import chat_messages, parse_tools, template_kwargs
from ninfer.server.routes_chat import json_response, read_json
from ninfer.server.state import ServerState

STATIC_DIR = pathlib.Path(__file__).resolve().parent.parent / "static"
STARTED = int(time.time())


async def models(request: Request) -> Response:
    """The one model this server serves."""
    state: ServerState = request.app.state.server
    entry = {"id": state.defaults.model_id, "object": "model", "created": STARTED, "owned_by": "ninfer"}
    if state.engine is not None:
        entry["max_model_len"] = state.engine.max_context
    return json_response({"object": "list", "data": [entry]})


async def health(request: Request) -> Response:
    """200 once the model is loaded, 503 while loading or after a failed load."""
    state: ServerState = request.app.state.server
    if state.engine is None:
        status = "failed: " + state.load_error if state.load_error else "loading"
        return json_response({"status": status}, 503)
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    """Prometheus text."""
    state: ServerState = request.app.state.server
    stats = await state.engine.astats() if state.engine is not None else {}
    return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4")


async def tokenize(request: Request) -> Response:
    """Token ids of `prompt` (text) or of `messages` (and `tools`) rendered by the chat template."""
    state: ServerState = request.app.state.server
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    engine = state.require_engine()
    tok = state.tokenizer()
    if "messages" in body:
        kwargs = {"enable_thinking": state.defaults.enable_thinking, **template_kwargs(body)}
        tools, _ = parse_tools(body)
        messages = chat_messages(body["messages"])
        add_prompt = body.get("add_generation_prompt", True) is not False
        # On a worker thread: a long conversation would stall the event loop.
        ids = await anyio.to_thread.run_sync(lambda: engine.encode_chat(
            messages, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=add_prompt))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(f"`prompt` must be a string, got {prompt!r}", "prompt")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise bad_request(f"`add_special_tokens` must be a boolean, got {add!r}", "add_special_tokens")
        ids = await anyio.to_thread.run_sync(lambda: tok.encode(prompt, add_special_tokens=add))
    return json_response({"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_context})


async def detokenize(request: Request) -> Response:
    """Text of `tokens`."""
    state: ServerState = request.app.state.server
    body = await read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise bad_request(f"`tokens` must be a list of non-negative integers, got {tokens!r}"[:300], "tokens")
    tok = state.tokenizer()
    vocab = tok.vocab_size
    bad = [t for t in tokens if t >= vocab]
    if bad:
        raise bad_request(f"`tokens` holds id {bad[0]} outside the vocabulary of {vocab}", "tokens")
    return json_response({"prompt": tok.decode(tokens, skip_special_tokens=False)})


async def index(request: Request) -> Response:
    """The demo page when it exists."""
    page = STATIC_DIR / "index.html"
    if page.is_file():
        return FileResponse(page)
    return PlainTextResponse("NInfer server: see /v1/models, /v1/chat/completions, /health, /metrics\n")
