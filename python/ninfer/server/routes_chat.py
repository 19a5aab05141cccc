"""POST /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import time
from typing import Optional

import orjson
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ninfer.outputs import GenerationError
from ninfer.server.choices import ChoiceBuilder, TokenText, chat_logprobs
from ninfer.server.errors import bad_request, error_payload
from ninfer.server.protocol import ChatRequest, parse_chat
from ninfer.server.reasoning import ReasoningParser
from ninfer.server.sse import DONE, data_event, error_event
from ninfer.server.state import ServerState, Submission, until_disconnect

SSE_PING_S = 15


async def read_json(request: Request):
    """The request body as JSON, or 400 naming the parse error."""
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def json_response(obj, status: int = 200) -> Response:
    """A JSON response serialised with orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def make_builders(sub: Submission, req: ChatRequest) -> list:
    """One ChoiceBuilder per choice; a reasoning parser when the model has thinking tags."""
    chat = sub.stream.chat
    # Grammar-constrained output is the answer itself, never reasoning.
    thinking = chat.has_thinking_tags and "response_format" not in req.sampling
    return [ChoiceBuilder(i, reasoning=ReasoningParser(chat.starts_in_reasoning) if thinking else None, tools=req.tools)
            for i in range(len(sub.choice_of))]


def usage_of(builders: list, prompt_tokens: list) -> dict:
    """OpenAI usage summed over choices (prompt counted once per prompt)."""
    completion = sum(b.completion_tokens for b in builders)
    prompt = sum(prompt_tokens)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "completion_tokens_details": {"reasoning_tokens": sum(b.reasoning_tokens for b in builders)}}
    cached = max((b.cached_tokens for b in builders), default=0)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions."""
    state: ServerState = request.app.state.server
    req = parse_chat(await read_json(request), state.defaults)
    rid = "chatcmpl-" + request.scope["state"]["request_id"]
    sub = await state.start_chat(req, rid)
    builders = make_builders(sub, req)
    token_text = TokenText(state.engine.tokenizer)
    created = int(time.time())
    if req.stream:
        return EventSourceResponse(_stream(sub, req, builders, token_text, rid, created), ping=SSE_PING_S,
                                   sep="\n", headers={"x-request-id": request.scope["state"]["request_id"]})

    async def collect():
        with sub.stream:
            async for delta in sub.stream:
                builders[sub.choice_of[delta.request_id]].feed(delta)

    await until_disconnect(request, collect)
    choices = []
    for b in builders:
        choice = {"index": b.index, "message": b.message(), "finish_reason": b.finish_reason, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": chat_logprobs(b.logprobs, token_text)}
        if req.return_token_ids:
            choice["token_ids"] = b.token_ids
        choices.append(choice)
    return json_response({"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                          "choices": choices, "usage": usage_of(builders, sub.prompt_tokens)})


def _chunk(rid: str, created: int, model: str, choices: list, usage: Optional[dict] = None, with_usage=False) -> bytes:
    c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if with_usage:
        c["usage"] = usage
    return data_event(c)


async def _stream(sub: Submission, req: ChatRequest, builders: list, token_text, rid: str, created: int):
    model, wu = req.model, req.include_usage
    try:
        with sub.stream:
            for b in builders:
                yield _chunk(rid, created, model, [{"index": b.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}], with_usage=wu)
            async for delta in sub.stream:
                b = builders[sub.choice_of[delta.request_id]]
                fields = b.feed(delta)
                lp = {"content": chat_logprobs(delta.logprobs, token_text)} if req.logprobs and delta.logprobs else None
                if fields or lp or (req.return_token_ids and delta.token_ids):
                    choice = {"index": b.index, "delta": fields, "logprobs": lp, "finish_reason": None}
                    if req.return_token_ids:
                        choice["token_ids"] = delta.token_ids
                    yield _chunk(rid, created, model, [choice], with_usage=wu)
                if delta.finished:
                    yield _chunk(rid, created, model, [{"index": b.index, "delta": {}, "logprobs": None,
                                                        "finish_reason": b.finish_reason}], with_usage=wu)
        if wu:
            yield _chunk(rid, created, model, [], usage_of(builders, sub.prompt_tokens), with_usage=True)
        yield DONE
    except Exception as e:
        if isinstance(e, GenerationError) and e.delta is not None and e.request_id in sub.choice_of:
            # The failed request's last delta holds the text of its accepted tokens that was still
            # held back (a possible stop-string start, a parser's buffer): sent before the error,
            # so the stream carries all the output produced, as LLM.generate's result does.
            b = builders[sub.choice_of[e.request_id]]
            fields = b.feed(e.delta)
            if fields:
                yield _chunk(rid, created, model, [{"index": b.index, "delta": fields, "logprobs": None,
                                                    "finish_reason": None}], with_usage=wu)
        # As vLLM reports a failure midway: the error event, then the end of the stream.
        yield error_event(error_payload(e))
        yield DONE
