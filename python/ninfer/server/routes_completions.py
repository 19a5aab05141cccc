"""POST /v1/completions: prompts as text, lists of text, token ids or lists of token ids.

With `echo` each choice starts with its prompt; with `logprobs` too, the logprobs cover the
prompt's tokens first (from one scoring forward, `AsyncEngine.score`, the path of `LLM.score`;
the first token's logprob is null). `max_tokens` 0 (with echo only) returns just the scored
prompt: how loglikelihood evaluation tools use the API. A stream sends the prompt in the first
chunk of each choice.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ninfer.outputs import GenerationError
from ninfer.server.choices import ChoiceBuilder, TokenText
from ninfer.server.errors import ApiError, bad_request, error_payload
from ninfer.server.prompt_logprobs import prompt_logprob_entries
from ninfer.server.protocol import CompletionRequest, parse_completion
from ninfer.server.routes_chat import SSE_PING_S, json_response, read_json, usage_of
from ninfer.server.sse import DONE, data_event, error_event
from ninfer.server.state import ServerState, Submission, until_disconnect


@dataclasses.dataclass
class Echo:
    """A prompt as echoed: its text and, when logprobs were asked for, its tokens' entries."""

    text: str
    logprobs: Optional[list]


def completion_logprobs(entries: list, token_text: TokenText, at: int = 0) -> dict:
    """Logprob entries in the legacy completions shape; `text_offset` counts from `at`.

    An entry without a logprob (a prompt's first token) has null top_logprobs too.
    """
    tokens = [token_text(e["token_id"]) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["logprob"] is None else {token_text(t): lp for t, lp in e.get("top") or []}
                         for e in entries],
        "text_offset": offsets,
    }


def _text_length(lp: dict) -> int:
    """Characters the tokens of a logprobs object span (where the next one's offsets start)."""
    return sum(len(t) for t in lp["tokens"])


async def echoes(state: ServerState, req: CompletionRequest, prompts: list) -> list:
    """One `Echo` per prompt: the text as sent (token ids decoded), scored when logprobs were asked for."""
    engine = state.require_engine()
    tokenizer = engine.tokenizer
    out, scored = [], {}
    for given, ids in zip(req.prompts, prompts):
        text = given if isinstance(given, str) else (
            tokenizer.decode(list(ids), skip_special_tokens=False) if tokenizer is not None else "")
        entries = None
        if req.logprobs:
            key = tuple(ids)
            if key not in scored:
                logits = await engine.score(ids)
                # Off the loop: a long prompt's log-softmax over the vocabulary takes a while.
                scored[key] = await anyio.to_thread.run_sync(
                    lambda: prompt_logprob_entries(logits, list(ids), req.top_logprobs))
            entries = scored[key]
        out.append(Echo(text, entries))
    return out


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
    token_text = TokenText(engine.tokenizer)
    created = int(time.time())
    if req.max_tokens == 0:
        _check_scorable(prompts, engine.max_context)
        return _prompts_only(req, await echoes(state, req, prompts), prompts, token_text, rid, created)
    # Submitted first: a request the engine refuses costs no scoring forward.
    sub = await state.start(prompts, req, rid)
    echo = None
    if req.echo:
        try:
            echo = await echoes(state, req, prompts)
        except BaseException:
            sub.stream.close()
            raise
    builders = [ChoiceBuilder(i, reasoning=None, tools=None) for i in range(len(sub.choice_of))]
    if req.stream:
        return EventSourceResponse(_stream(sub, req, builders, token_text, rid, created, echo),
                                   ping=SSE_PING_S, sep="\n")

    async def collect():
        with sub.stream:
            async for delta in sub.stream:
                builders[sub.choice_of[delta.request_id]].feed(delta)

    await until_disconnect(request, collect)
    choices = []
    for b in builders:
        e = echo[b.index // req.n] if echo else Echo("", [])
        choices.append({"index": b.index, "text": e.text + b.text, "finish_reason": b.finish_reason,
                        "logprobs": completion_logprobs((e.logprobs or []) + b.logprobs, token_text)
                        if req.logprobs else None})
    if req.return_token_ids:
        for c, b in zip(choices, builders):
            c["token_ids"] = b.token_ids
    return json_response({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                          "choices": choices, "usage": usage_of(builders, sub.prompt_tokens)})


def _check_scorable(prompts: list, max_context: int) -> None:
    """A prompt returned without generation still has to be one the engine could run."""
    for ids in prompts:
        if not ids:
            raise bad_request("prompt is empty: at least one token is required", "prompt")
        if len(ids) > max_context:
            raise ApiError(400, f"prompt of {len(ids)} tokens exceeds the maximum context of {max_context} tokens",
                           param="prompt", code="context_length_exceeded")


def _prompts_only(req: CompletionRequest, echo: list, prompts: list, token_text, rid: str, created: int) -> Response:
    """max_tokens 0: every choice is its echoed prompt, finished for length, nothing generated."""
    choices = []
    for p, e in enumerate(echo):
        for i in range(req.n):
            c = {"index": p * req.n + i, "text": e.text, "finish_reason": "length",
                 "logprobs": completion_logprobs(e.logprobs, token_text) if req.logprobs else None}
            if req.return_token_ids:
                c["token_ids"] = []
            choices.append(c)
    prompt_tokens = sum(len(ids) for ids in prompts)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    if not req.stream:
        return json_response({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                              "choices": choices, "usage": usage})

    async def events():
        for c in choices:
            yield _chunk(rid, created, req.model, [c], with_usage=req.include_usage)
        if req.include_usage:
            yield _chunk(rid, created, req.model, [], usage, with_usage=True)
        yield DONE

    return EventSourceResponse(events(), ping=SSE_PING_S, sep="\n")


def _chunk(rid, created, model, choices, usage=None, with_usage=False) -> bytes:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if with_usage:
        c["usage"] = usage
    return data_event(c)


async def _stream(sub: Submission, req, builders: list, token_text, rid: str, created: int, echo: Optional[list]):
    wu = req.include_usage
    # Per choice: where the next logprobs' text_offset starts (after what was already sent).
    at = [0] * len(builders)
    try:
        with sub.stream:
            for b in builders if echo else ():
                e = echo[b.index // req.n]
                lp = completion_logprobs(e.logprobs, token_text) if req.logprobs else None
                if lp is not None:
                    at[b.index] = _text_length(lp)
                choice = {"index": b.index, "text": e.text, "logprobs": lp, "finish_reason": None}
                if req.return_token_ids:
                    choice["token_ids"] = []
                yield _chunk(rid, created, req.model, [choice], with_usage=wu)
            async for delta in sub.stream:
                b = builders[sub.choice_of[delta.request_id]]
                b.feed(delta)
                if delta.text or delta.finished or (req.logprobs and delta.logprobs) or (
                        req.return_token_ids and delta.token_ids):
                    lp = None
                    if req.logprobs:
                        lp = completion_logprobs(delta.logprobs or [], token_text, at[b.index])
                        at[b.index] += _text_length(lp)
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
