"""AsyncEngine: the asyncio face of the Rust engine, shared by the server and async users.

The Rust engine runs on its own OS thread (`core.start_background()`). The output pump, a thread
of its own, sleeps in `core.poll()` with the GIL released until the engine has deltas, gets
every delta of the finished step(s) at once, and hands them to the event loop, which fans them
out to one anyio memory stream per request. So Python crosses into the core once per engine
step, never once per token per request, and the pump takes no thread from the pool that
tokenization and submission use. A chat request crosses once on its way in too
(`core.submit_chat` renders, tokenizes and queues it). Leaving a request's iterator early
(break, cancellation, a client that disconnects) aborts the request, which frees its KV blocks
in the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence, Union

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from ninfer import _core
from ninfer._core import InvalidRequestError
from ninfer.outputs import Delta, GenerationError
from ninfer.sampling_params import SamplingParams

Messages = Sequence[dict]
Prompt = Union[str, Sequence[int], Messages]


@dataclasses.dataclass
class RequestTiming:
    """Wall-clock marks of one request, for metrics and the request log."""

    submitted: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    finished: Optional[float] = None
    token_gaps: list = dataclasses.field(default_factory=list)


class QueueFullError(Exception):
    """More requests are in flight than `max_concurrency + max_queue`: the caller should retry later."""

    def __init__(self, in_flight: int, limit: int):
        super().__init__(f"the request queue is full ({in_flight} requests in flight, limit {limit}); retry later")
        self.in_flight = in_flight
        self.limit = limit


def core_params(params: Any) -> tuple:
    """(the fields of `_core.SamplingParams`, max_tokens or None) of sampling params.

    Accepts None ({}), a JSON string, a dict, `ninfer.SamplingParams` (its `n` must be 1, as one
    request is one completion) or any dataclass of core fields. max_tokens None (or absent)
    means as many as fit in the context after the prompt, as in `LLM`; the caller resolves it
    once the prompt's length is known.
    """
    if params is None:
        return {}, None
    if isinstance(params, str):
        params = json.loads(params)
    if isinstance(params, dict):
        fields = dict(params)
        return fields, fields.pop("max_tokens", None)
    if hasattr(params, "to_core_dict"):
        n = getattr(params, "n", 1)
        if n != 1:
            # One engine request is one completion: silently running one of `n` would lose the rest.
            raise InvalidRequestError(
                f"invalid request field `n`: {n} (an AsyncEngine request is one completion; submit_many "
                "one request per completion, or use LLM.generate)")
        fields = params.to_core_dict(1, getattr(params, "seed", None))
        del fields["max_tokens"]
        return fields, getattr(params, "max_tokens", None)
    if dataclasses.is_dataclass(params):
        fields = dataclasses.asdict(params)
        return fields, fields.pop("max_tokens", None)
    raise TypeError(f"sampling params must be a dict, a dataclass or None, got {type(params).__name__}")


def params_to_core(params: Any, room: int) -> "_core.SamplingParams":
    """`core_params` as the checked `_core.SamplingParams`, max_tokens None resolved to `room`."""
    fields, max_tokens = core_params(params)
    return _core.SamplingParams(**fields, max_tokens=room if max_tokens is None else max_tokens)


@dataclasses.dataclass
class ChatPrompt:
    """What `core.submit_chat` reports about a rendered conversation, for the server's parsers."""

    #: Tokens of the rendered prompt.
    prompt_tokens: int
    #: The prompt leaves a `<think>` block open: the output starts inside reasoning.
    starts_in_reasoning: bool
    #: The vocabulary holds `<think>` and `</think>`: the output may carry reasoning.
    has_thinking_tags: bool


class RequestStream:
    """The deltas of one or more submitted requests, in arrival order; closing it early aborts them.

    One stream can carry several requests (the `n` choices of one API call): iteration ends when
    all of them finished, and each delta names its request. A request that fails midway (finish
    reason "error") raises `GenerationError` in place of its last delta, which the exception
    carries; the stream ends there, and closing it aborts the other requests.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list, receive: MemoryObjectReceiveStream, timings: dict):
        self.engine = engine
        self.request_ids = list(request_ids)
        self.timings = timings
        self._receive = receive
        self._open = set(request_ids)
        #: For a conversation submitted with `submit_chat`: its prompt's length and reasoning flags.
        self.chat: Optional[ChatPrompt] = None

    @property
    def request_id(self) -> str:
        """The first (usually only) request id."""
        return self.request_ids[0]

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if not self._open:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except (anyio.ClosedResourceError, anyio.EndOfStream):
            self._open.clear()
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        if item.finish_reason == "error":
            self._open.discard(item.request_id)
            raise GenerationError(item.error or "the request failed", request_id=item.request_id, delta=item)
        if item.finished:
            self._open.discard(item.request_id)
        return item

    async def aclose(self) -> None:
        """Abort the requests that have not finished, and release the stream."""
        self.close()

    def close(self) -> None:
        """Synchronous form of `aclose` for `finally` blocks that cannot await."""
        for rid in list(self._open):
            self.engine.abort(rid)
        self._open.clear()
        self._receive.close()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncEngine:
    """Asynchronous driver of one `_core.Engine`: submit requests, iterate their deltas.

    Start it with `await AsyncEngine.start(model_dir)`, stream with `generate` (an async
    iterator) or `submit` (a `RequestStream` to iterate), and stop it with `shutdown()`.
    Requests without params sample with the model's generation_config.json defaults, as
    `LLM.generate` does; a max_tokens of None means as many as fit in the context.
    """

    def __init__(self, core: Any, *, max_queue: Optional[int] = None):
        self.core = core
        self.tokenizer = getattr(core, "tokenizer", None)
        #: Read once here: the chat route checks it per request without crossing into the core.
        self.has_chat_template = bool(self.tokenizer is not None and self.tokenizer.has_chat_template)
        self.max_context = int(core.max_context)
        self.eos_token_ids = list(getattr(core, "eos_token_ids", []) or [])
        #: The params of a request that gives none: generation_config.json's, as `LLM` uses.
        self.default_params = SamplingParams(**dict(getattr(core, "generation_defaults", None) or {}))
        info = core.info() if hasattr(core, "info") else {}
        self.max_concurrency = int(info.get("max_concurrency", 64) or 64)
        self.max_queue = max_queue
        self._streams: dict = {}
        self._timings: dict = {}
        self._aborting: dict = {}
        self._ids = itertools.count()
        self._pump_thread: Optional[threading.Thread] = None
        self._closed = False
        self.finished_listeners: list = []
        self.steps_polled = 0

    @classmethod
    async def start(
        cls,
        model_dir: Union[str, os.PathLike, None] = None,
        device: str = "cpu",
        *,
        core: Any = None,
        max_queue: Optional[int] = None,
        **engine_kwargs: Any,
    ) -> "AsyncEngine":
        """Load the model (off the event loop), start the engine thread and the output pump.

        `engine_kwargs` are `_core.Engine`'s (and `LLM`'s): max_context, kv_capacity,
        max_concurrency, prefill_chunk, prefix_reuse, num_threads, logits_dtype, kv_dtype, and the
        engine options async_scheduling, cuda_graphs, batch_invariant, device_sampling, device_profile,
        json_schema_open_objects, speculative decoding's spec, draft_tokens, drafter, spec_adaptive,
        lm_head_draft and lm_head_draft_size (`--spec dflash` on the bundled demo model defaults to
        its shipped drafter), and quantization on load's quantize and quantize_lm_head (`LLM`).
        `core` injects an already-built engine object with the `_core.Engine` interface (tests).
        """
        if core is None:
            from ninfer import _core

            path = os.fspath(model_dir)
            from ninfer.demo import default_drafter

            drafter = default_drafter(path, engine_kwargs.get("spec"), engine_kwargs.pop("drafter", None))
            if drafter is not None:
                engine_kwargs["drafter"] = drafter
            core = await anyio.to_thread.run_sync(lambda: _core.Engine(path, device=device, **engine_kwargs))
        core.start_background()
        engine = cls(core, max_queue=max_queue)
        if engine_kwargs.get("max_concurrency"):
            engine.max_concurrency = int(engine_kwargs["max_concurrency"])
        engine._start_pump(asyncio.get_running_loop())
        return engine

    async def shutdown(self) -> None:
        """Fail every open stream, stop the engine thread, and with it the output pump."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(RuntimeError("the engine was shut down"))
        await anyio.to_thread.run_sync(self.core.shutdown)
        if self._pump_thread is not None:
            await anyio.to_thread.run_sync(self._pump_thread.join, 5.0)

    def new_request_id(self, prefix: str = "req") -> str:
        """A process-unique request id."""
        return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    def encode_chat(self, messages: Messages, *, tools=None, chat_template_kwargs=None, add_generation_prompt=True) -> list:
        """Token ids of a conversation rendered with the chat template (the server's /tokenize)."""
        return list(self._tokenizer().encode_chat(
            json.dumps(list(messages)),
            json.dumps(tools) if tools else None,
            add_generation_prompt,
            json.dumps(chat_template_kwargs) if chat_template_kwargs else None,
        ))

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer

    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._streams)

    async def submit(self, prompt: Prompt, params: Any = None, request_id: Optional[str] = None, *,
                     tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None) -> RequestStream:
        """Queue one request and return its stream of deltas; bad input or a full queue raise here,
        before any delta.

        Takes what `generate` takes: `prompt` is a string (tokenized with special tokens), token
        ids, or chat messages (rendered with the chat template, with `tools` and
        `chat_template_kwargs`); `params` is None (the model's defaults), `SamplingParams`, a
        dict or JSON string of the core's fields. Iterate the stream, and close it (or leave its
        `async with`) to abort the request early. `generate` is this plus the iteration.
        """
        request_id = request_id or self.new_request_id()
        if _is_messages(prompt):
            return await self.submit_chat(prompt, params, request_ids=[request_id], tools=tools,
                                          chat_template_kwargs=chat_template_kwargs)
        if isinstance(prompt, str):
            ids = list(self._tokenizer().encode(prompt, add_special_tokens=True))
        else:
            ids = list(prompt)
        return await self.submit_many([ids], [params], [request_id])

    async def submit_many(self, prompts: Sequence[Sequence[int]], params: Sequence[Any],
                          request_ids: Sequence[str]) -> RequestStream:
        """Submit several tokenized requests that share one stream (e.g. the n choices of one call).

        All or nothing: if one is refused, those already submitted are aborted and the error
        raised. The core calls run on a worker thread: the core may hold its lock for up to one
        engine step, and the event loop must keep serving other streams meanwhile.
        """
        rids = self._check_room_for(request_ids)
        # Every params object built (and checked) before any request is registered: one refused
        # (a bad value, n > 1) must leave nothing in flight.
        jobs = [(rid, list(ids), params_to_core(self._or_default(p), max(self.max_context - len(ids), 1)))
                for ids, p, rid in zip(prompts, params, rids)]
        receive, timings = self._register(rids)
        submitted: list = []

        def run() -> None:
            for rid, ids, checked in jobs:
                self.core.submit(rid, ids, checked)
                submitted.append(rid)

        try:
            await anyio.to_thread.run_sync(run)
        except BaseException:
            self._unregister(rids)
            for rid in submitted:
                self._abort_in_core(rid)
            raise
        return RequestStream(self, rids, receive, timings)

    async def submit_chat(self, messages: Messages, params: Any = None, *, request_ids: Optional[Sequence[str]] = None,
                          tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None,
                          add_generation_prompt: bool = True,
                          default_max_tokens: Optional[int] = None) -> RequestStream:
        """Queue a conversation in one call into the core, which renders it with the chat
        template, tokenizes it and queues one request per id (several ids: the n choices of one
        API call, choice i sampling with seed + i). max_tokens None is `default_max_tokens`
        clamped to the context left, else all of it. The stream's `chat` tells the prompt's
        length and whether the output starts inside `<think>`. All or nothing, as `submit_many`.
        """
        rids = self._check_room_for(request_ids or [self.new_request_id()])
        fields, max_tokens = core_params(self._or_default(params))
        args = (json.dumps(list(messages)), _core.SamplingParams(**fields),
                json.dumps(tools) if tools else None,
                json.dumps(chat_template_kwargs) if chat_template_kwargs else None,
                max_tokens, default_max_tokens, add_generation_prompt)
        receive, timings = self._register(rids)
        queued: list = []

        def run() -> tuple:
            queued.append(self.core.submit_chat(rids, *args))
            return queued[0]

        try:
            prompt = await anyio.to_thread.run_sync(run)
        except BaseException:
            # Cancelled while the core call ran: the requests were queued, and nobody reads them.
            self._unregister(rids)
            for rid in rids if queued else ():
                self._abort_in_core(rid)
            raise
        stream = RequestStream(self, rids, receive, timings)
        stream.chat = ChatPrompt(*prompt)
        return stream

    def _or_default(self, params: Any) -> Any:
        return self.default_params if params is None else params

    def _check_room_for(self, request_ids: Sequence[str]) -> list:
        """The ids, checked: the engine is open, the queue has room, no id repeats or is in flight."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        rids = list(request_ids)
        if self.max_queue is not None:
            limit = self.max_concurrency + self.max_queue
            if len(self._streams) + len(rids) > limit:
                raise QueueFullError(len(self._streams), limit)
        if len(set(rids)) != len(rids) or any(rid in self._streams for rid in rids):
            raise ValueError(f"request ids {rids} repeat or are already in flight")
        return rids

    def _register(self, rids: list) -> tuple:
        """One memory stream for the requests, registered before they reach the core (the pump
        may deliver their first delta before the submitting call returns)."""
        send, receive = anyio.create_memory_object_stream(math.inf)
        timings = {}
        for rid in rids:
            timings[rid] = RequestTiming(submitted=time.monotonic())
            self._streams[rid] = send
            self._timings[rid] = timings[rid]
        return receive, timings

    def _unregister(self, rids: list) -> None:
        for rid in rids:
            self._streams.pop(rid, None)
            self._timings.pop(rid, None)

    async def generate(
        self,
        prompt: Prompt,
        params: Any = None,
        request_id: Optional[str] = None,
        *,
        tools: Optional[list] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> AsyncIterator[Delta]:
        """Yield the deltas of one request; breaking out or cancelling aborts it.

        Takes what `submit` takes (a string, token ids or chat messages; params None for the
        model's defaults). Bad input raises at the first iteration; a request that fails midway
        raises `ninfer.GenerationError` after the deltas it produced.
        """
        stream = await self.submit(prompt, params, request_id, tools=tools, chat_template_kwargs=chat_template_kwargs)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished); its blocks are freed next step.

        Its timing is kept until the engine confirms with a final "abort" delta, so that
        metrics and the request log still see the request.
        """
        if self._streams.pop(request_id, None) is not None:
            timing = self._timings.pop(request_id, None)
            if timing is not None:
                self._aborting[request_id] = timing
            self._abort_in_core(request_id)

    def _abort_in_core(self, request_id: str) -> None:
        """`core.abort` off the event loop (the core may hold its lock for a step)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.core.abort(request_id)
            return
        loop.run_in_executor(None, self.core.abort, request_id)

    async def score(self, token_ids: Sequence[int]):
        """Logits of every position of `token_ids` (numpy float32 [T, vocab]): `LLM.score`'s one
        forward, run by the engine thread between steps while this coroutine waits off the loop."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        ids = list(token_ids)
        return await anyio.to_thread.run_sync(lambda: self.core.score(ids))

    def stats(self) -> dict:
        """The core's counters (running, waiting, KV blocks, prefix hits, ...); may wait up to a step."""
        return dict(self.core.stats())

    async def astats(self) -> dict:
        """`stats()` from a worker thread, so the event loop keeps serving."""
        return await anyio.to_thread.run_sync(self.stats)

    def _start_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pump_thread = threading.Thread(target=self._pump, args=(loop,), name="ninfer-output-pump", daemon=True)
        self._pump_thread.start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        """The output pump's own thread: sleeps in `core.poll(None)` (GIL released) until the engine
        has deltas and hands them to the event loop; ends when the engine stops (a blocking poll
        returns nothing only then)."""
        while not self._closed:
            try:
                deltas = self.core.poll(None)
            except Exception as e:
                deltas, error = None, e
            else:
                if not deltas:
                    return
                error = None
            try:
                if error is not None:
                    loop.call_soon_threadsafe(self._fail_all, error)
                else:
                    loop.call_soon_threadsafe(self._dispatch, deltas)
            except RuntimeError:
                return  # the event loop is closed

    def _dispatch(self, deltas: list) -> None:
        """On the event loop: fan one poll's deltas (the core's `Delta` objects) out to the streams."""
        if self._closed:
            return
        self.steps_polled += 1
        now = time.monotonic()
        for delta in deltas:
            rid = delta.request_id
            send = self._streams.get(rid)
            if send is None:
                if delta.finished and rid in self._aborting:
                    self._finished(rid, delta, self._aborting.pop(rid), now)
                continue
            timing = self._timings.get(rid)
            if timing is not None:
                self._mark(timing, delta, now)
                if delta.finished:
                    self._finished(rid, delta, timing, now)
            send.send_nowait(delta)
            if delta.finished:
                self._streams.pop(rid, None)
                self._timings.pop(rid, None)

    def _fail_all(self, error: BaseException) -> None:
        """The engine failed: every open request ends with this error (and is aborted, best effort)."""
        for send in set(self._streams.values()):
            send.send_nowait(error)
        for rid in list(self._streams):
            try:
                self._abort_in_core(rid)
            except Exception:
                pass
        self._streams.clear()
        self._timings.clear()
        self._aborting.clear()

    def _finished(self, rid: str, delta: Delta, timing: RequestTiming, now: float) -> None:
        timing.finished = now
        for listener in self.finished_listeners:
            try:
                listener(rid, delta, timing)
            except Exception as e:
                print(f"ninfer: finished-request listener failed: {type(e).__name__}: {e}", file=sys.stderr)

    @staticmethod
    def _mark(timing: RequestTiming, delta: Delta, now: float) -> None:
        if delta.token_ids:
            if timing.first_token is None:
                timing.first_token = now
            else:
                timing.token_gaps.append((now - timing.last_token) / len(delta.token_ids))
            timing.last_token = now
        if delta.finished:
            timing.finished = now


def _is_messages(prompt: Any) -> bool:
    """Chat messages (a sequence of dicts), as opposed to a string or token ids."""
    return not isinstance(prompt, str) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
