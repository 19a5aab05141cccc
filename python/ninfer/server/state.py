"""What every route shares: the engine (once loaded), server defaults, metrics and logs.

`ServerState.start` turns validated requests into engine submissions: it resolves max_tokens
(request, else `--default-max-tokens`, else what fits the context), derives seeds for n > 1,
and gives each engine request an id derived from the HTTP request id. `start_chat` does the same
for a conversation in one call into the core, which renders, tokenizes and queues it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

import anyio
from starlette.requests import Request

from ninfer.engine import AsyncEngine, RequestStream
from ninfer.server.errors import ApiError, bad_request, to_api_error
from ninfer.server.metrics import ServerMetrics
from ninfer.server.protocol import ChatRequest, GenerationRequest, ServerDefaults, forces_tool_call
from ninfer.server.tool_grammar import ToolSyntax, forced_tools, prompt_reasoning, tool_call_grammar
from ninfer.server.request_log import RequestLog


_UNKNOWN = object()


@dataclasses.dataclass
class Submission:
    """A started API call: one stream over all its engine requests, and which choice each one is."""

    stream: RequestStream
    choice_of: dict
    prompt_tokens: list


class ServerState:
    """Shared state of one server process."""

    def __init__(self, defaults: ServerDefaults, *, api_key: Optional[str] = None,
                 request_log: Optional[RequestLog] = None):
        self.defaults = defaults
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.request_log = request_log
        self.engine: Optional[AsyncEngine] = None
        self.load_error: Optional[str] = None
        # Numbers the submissions, so that two requests sent with the same x-request-id get
        # distinct engine request ids (the engine refuses an id already in flight).
        self._submissions = itertools.count()
        #: The model's tool-call syntax, read from its tokenizer on the first forced tool call.
        self._tool_syntax: Optional[ToolSyntax] = None
        #: `core.thinking_closing_tokens` for the server's budget message, asked once.
        self._closing_tokens: Any = _UNKNOWN

    def attach(self, engine: AsyncEngine) -> None:
        """Start serving with a loaded engine."""
        engine.finished_listeners.append(lambda rid, d, t: self.metrics.request_finished(d, t))
        if self.request_log is not None:
            engine.finished_listeners.append(self.request_log.request_finished)
        self.engine = engine

    def require_engine(self) -> AsyncEngine:
        """The engine, or 503 while it is still loading (or failed to load)."""
        if self.engine is None:
            msg = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise ApiError(503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"})
        return self.engine

    def tokenizer(self):
        """The engine's tokenizer, or 400 when the model has none."""
        tok = self.require_engine().tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", code="no_tokenizer")
        return tok

    def resolve_max_tokens(self, req: GenerationRequest, prompt_len: int) -> int:
        """Requested max_tokens, else the server default clamped to fit, else all the context left."""
        engine = self.require_engine()
        room = engine.max_context - prompt_len
        if req.max_tokens is not None:
            return req.max_tokens
        if room < 1:
            raise ApiError(400, f"prompt of {prompt_len} tokens leaves no room in the maximum context of "
                                f"{engine.max_context} tokens", param="messages", code="context_length_exceeded")
        if self.defaults.default_max_tokens is not None:
            return min(self.defaults.default_max_tokens, room)
        return room

    async def start(self, prompts: list, req: GenerationRequest, request_id: str) -> Submission:
        """Submit n engine requests per prompt; choice index = prompt index * n + i."""
        engine = self.require_engine()
        ids_list, params, rids, choice_of = [], [], [], {}
        serial = next(self._submissions)
        for p, ids in enumerate(prompts):
            max_tokens = self.resolve_max_tokens(req, len(ids))
            for i in range(req.n):
                sp: dict[str, Any] = dict(req.sampling, max_tokens=max_tokens)
                if req.n > 1 and "seed" in sp:
                    sp["seed"] = (sp["seed"] + i) & 0xFFFFFFFFFFFFFFFF
                rid = f"{request_id}-{serial}-{p * req.n + i}"
                ids_list.append(ids)
                params.append(sp)
                rids.append(rid)
                choice_of[rid] = p * req.n + i
        stream = await engine.submit_many(ids_list, params, rids)
        return Submission(stream, choice_of, [len(ids) for ids in prompts])


    async def start_chat(self, req: ChatRequest, request_id: str) -> Submission:
        """Submit a conversation's n choices in one call into the core (choice i samples with
        seed + i); the stream's `chat` tells where the output starts (reasoning or not)."""
        engine = self.require_engine()
        self.tokenizer()  # a 400 when the model has none
        if not engine.has_chat_template:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        sampling = dict(req.sampling, max_tokens=req.max_tokens, **self.thinking_fields(req))
        serial = next(self._submissions)
        rids = [f"{request_id}-{serial}-{i}" for i in range(req.n)]
        forced = forces_tool_call(req.tool_choice)
        if forced:
            sampling["response_format"] = await anyio.to_thread.run_sync(self.tool_call_format, req)
        try:
            stream = await engine.submit_chat(req.messages, sampling, request_ids=rids,
                                              tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                                              default_max_tokens=self.defaults.default_max_tokens)
        except Exception as e:
            err = to_api_error(e)
            if forced and err.param == "response_format":
                # The grammar is the server's; what the client sent wrong is a tool's schema.
                raise bad_request(f"the tools' parameter schemas cannot be enforced: {err.message}", "tools") from e
            raise
        return Submission(stream, {rid: i for i, rid in enumerate(rids)}, [stream.chat.prompt_tokens])

    def tool_call_format(self, req: ChatRequest) -> dict:
        """The grammar (as a Lark response_format the core compiles) that forces a request's
        tool call: the model's tool-call syntax, after the reasoning block its prompt leaves room
        for. It goes in the submission only: `req.sampling` stays free of it, so the reply's
        reasoning is still split off (routes_chat.make_builders)."""
        engine = self.require_engine()
        if self._tool_syntax is None:
            self._tool_syntax = ToolSyntax.of(engine.tokenizer)
        reasoning = prompt_reasoning(engine.tokenizer, self._tool_syntax, req.messages, req.tools,
                                     req.chat_template_kwargs)
        # As OpenAI documents it: "required" calls one or more tools (one with parallel_tool_calls
        # false), a named function is called exactly once.
        parallel = req.parallel_tool_calls and req.tool_choice == "required"
        grammar = tool_call_grammar(forced_tools(req.tools, req.tool_choice), self._tool_syntax,
                                    parallel=parallel, reasoning=reasoning)
        return {"type": "lark", "lark": grammar}


    def closing_tokens(self) -> Optional[int]:
        """Tokens the engine forces to close a reasoning block whose budget ran out (with the
        server's `--reasoning-budget-message`); None when the model has no thinking tags."""
        if self._closing_tokens is _UNKNOWN:
            ask = getattr(self.require_engine().core, "thinking_closing_tokens", None)
            self._closing_tokens = ask(self.defaults.reasoning_budget_message) if ask else None
        return self._closing_tokens

    def thinking_fields(self, req: ChatRequest) -> dict:
        """The thinking-budget sampling fields of a chat request: its own budget (from
        `thinking_budget` or `reasoning_effort`), else the server's `--reasoning-budget` where that
        leaves room for an answer. A `thinking_budget` without that room is a 400 naming the field,
        the budget and max_tokens; an effort's budget shrinks to half the room instead."""
        field = req.budget_field
        budget = req.sampling.get("thinking_budget") if field else self.defaults.reasoning_budget
        closing = self.closing_tokens() if budget is not None else None
        if closing is None:
            return {}
        max_tokens = req.max_tokens if req.max_tokens is not None else self.defaults.default_max_tokens
        if field == "reasoning_effort" and max_tokens is not None and budget + closing >= max_tokens:
            # An effort is a level, not a count: where the table's budget would leave no answer,
            # it takes half of what max_tokens leaves after the closing, the answer the other half.
            budget = max(0, (max_tokens - closing) // 2)
        if max_tokens is not None and budget + closing >= max_tokens:
            if field is None:
                return {"thinking_budget": None}
            what = (f"`thinking_budget` {budget}" if field == "thinking_budget"
                    else f"`reasoning_effort` {req.reasoning_effort!r} (a thinking budget of {budget} tokens)")
            raise bad_request(f"{what} plus the {closing} tokens that close the reasoning leave no room for an answer "
                              f"within max_tokens {max_tokens}: raise max_tokens above {budget + closing} or lower the "
                              "budget", field)
        fields = {"thinking_budget": budget}
        if self.defaults.reasoning_budget_message:
            fields["thinking_budget_message"] = self.defaults.reasoning_budget_message
        return fields


async def until_disconnect(request: Request, work) -> Any:
    """Run `work()`; if the client disconnects first, cancel it (its `finally` aborts the requests)."""
    outcome: dict = {}

    async def run(scope):
        try:
            outcome["value"] = await work()
        except Exception as e:
            outcome["error"] = e
        scope.cancel()

    async def watch(scope):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        tg.start_soon(run, tg.cancel_scope)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
