"""POST /v1/completions: prompts as text, lists of text, token ids or lists of token ids."""

from __future__ import annotations

import time

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ninfer.outputs import GenerationError
from ninfer.server.choices import ChoiceBuilder, TokenText
from ninfer.server.errors import error_payload
from ninfer.server.protocol import parse_completion
from ninfer.server.routes_chat import SSE_PING_S, json_response, read_json, usage_of
from ninfer.server.sse import DONE, data_event, error_event
from ninfer.server.state import ServerState, Submission, until_disconnect


def completion_logprobs(entries: list, token_text: TokenText) -> dict:
    """Core logprob entries in the legacy completions shape."""
    tokens = [token_text(e["token_id"]) for e in entries]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.get("top") or []} for e in entries],
        "text_offset": offsets,
    }


async def completions(request: Request) -> Response:
    """OpenAI (legacy) completions."""
    state: ServerState = request.app.state.server
    req = parse_completion(await read_json(request), state.defaults)
    engine = state.require_engine()
    prompts = req.prompts
    if any(isinstance(p, str) for p in prompts):
        # On a worker thread: a long prompt would stall the event loop.
        prompts = await anyio.to_thread.run_sync(
            lambda: [p if isinstance(p, list) else list(state.tokenizer().encode(p, add_special_tokens=True))
                     for p in req.prompts])
    rid = "cmpl-" + request.scope["state"]["request_id"]
    sub = await state.start(prompts, req, rid)
    builders = [ChoiceBuilder(i, reasoning=None, tools=None) for i in range(len(sub.choice_of))]
    token_text = TokenText(engine.tokenizer)
    created = int(time.time())
    if req.stream:
        return EventSourceResponse(_stream(sub, req, builders, token_text, rid, created), ping=SSE_PING_S, sep="\n")

    async def collect():
        with sub.stream:
            async for delta in sub.stream:
                builders[sub.choice_of[delta.request_id]].feed(delta)

    await until_disconnect(request, collect)
    choices = [{"index": b.index, "text": b.text, "finish_reason": b.finish_reason,
                "logprobs": completion_logprobs(b.logprobs, token_text) if req.logprobs else None} for b in builders]
    if req.return_token_ids:
        for c, b in zip(choices, builders):
            c["token_ids"] = b.token_ids
    return json_response({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                          "choices": choices, "usage": usage_of(builders, sub.prompt_tokens)})


def _chunk(rid, created, model, choices, usage=None, with_usage=False) -> bytes:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if with_usage:
        c["usage"] = usage
    return data_event(c)


async def _stream(sub: Submission, req, builders: list, token_text, rid: str, created: int):
    wu = req.include_usage
    try:
        with sub.stream:
            async for delta in sub.stream:
                b = builders[sub.choice_of[delta.request_id]]
                b.feed(delta)
                if delta.text or delta.finished or (req.logprobs and delta.logprobs) or (
                        req.return_token_ids and delta.token_ids):
                    lp = completion_logprobs(delta.logprobs or [], token_text) if req.logprobs else None
                    choice = {"index": b.index, "text": delta.text, "logprobs": lp, "finish_reason": b.finish_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = delta.token_ids
                    yield _chunk(rid, created, req.model, [choice], with_usage=wu)
        if wu:
            yield _chunk(rid, created, req.model, [], usage_of(builders, sub.prompt_tokens), with_usage=True)
        yield DONE
    except Exception as e:
        delta = e.delta if isinstance(e, GenerationError) else None
        if delta is not None and delta.text and e.request_id in sub.choice_of:
            # The failed request's held-back text (a possible stop-string start), sent before the
            # error as routes_chat does.
            choice = {"index": sub.choice_of[e.request_id], "text": delta.text, "logprobs": None, "finish_reason": None}
            if req.return_token_ids:
                choice["token_ids"] = []
            yield _chunk(rid, created, req.model, [choice], with_usage=wu)
        # As vLLM reports a failure midway: the error event, then the end of the stream.
        yield error_event(error_payload(e))
        yield DONE
