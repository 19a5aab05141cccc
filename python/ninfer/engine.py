"""AsyncEngine: the asyncio face of the Rust engine, shared by the server and async users.

The Rust engine runs on its own OS thread (`core.start_background()`). One pump task waits in
`core.poll` with the GIL released and gets every delta of the finished step(s) at once, then
fans them out to one anyio memory stream per request. So Python crosses into the core once per
engine step, never once per token per request. Leaving a request's iterator early (break,
cancellation, a client that disconnects) aborts the request, which frees its KV blocks in the
engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import sys
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence, Union

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from ninfer._core import InvalidRequestError
from ninfer.outputs import GenerationError

Messages = Sequence[dict]
Prompt = Union[str, Sequence[int], Messages]


@dataclasses.dataclass
class Delta:
    """New output of one request after one engine step (text never splits a UTF-8 sequence)."""

    request_id: str
    token_ids: list
    text: str
    finish_reason: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: Optional[list] = None
    #: Why the request failed midway: set with finish_reason "error" on its last delta.
    error: Optional[str] = None

    @classmethod
    def from_core(cls, d: dict) -> "Delta":
        """Build from the dict `core.poll()` returns."""
        return cls(
            request_id=d["request_id"],
            token_ids=list(d.get("token_ids") or ()),
            text=d.get("text") or "",
            finish_reason=d.get("finish_reason"),
            prompt_tokens=int(d.get("prompt_tokens") or 0),
            completion_tokens=int(d.get("completion_tokens") or 0),
            cached_tokens=int(d.get("cached_tokens") or 0),
            logprobs=d.get("logprobs"),
            error=d.get("error"),
        )

    @property
    def finished(self) -> bool:
        """True on the last delta of a request."""
        return self.finish_reason is not None

    @property
    def usage(self) -> dict:
        """OpenAI-style token usage as of this delta."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


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


def params_to_json(params: Any, room: Optional[int] = None) -> str:
    """Turn sampling params into the JSON the core reads.

    Accepts None, a JSON string, a dict, `ninfer.SamplingParams` (its max_tokens None means all
    of `room`, the context left after the prompt; its `n` must be 1, as one request is one
    completion) or any dataclass of core fields.
    """
    if params is None:
        return "{}"
    if isinstance(params, str):
        return params
    if isinstance(params, dict):
        return json.dumps(params)
    if hasattr(params, "to_core_json"):
        n = getattr(params, "n", 1)
        if n != 1:
            # One engine request is one completion: silently running one of `n` would lose the rest.
            raise InvalidRequestError(
                f"invalid request field `n`: {n} (an AsyncEngine request is one completion; submit_many "
                "one request per completion, or use LLM.generate)")
        max_tokens = getattr(params, "max_tokens", None) or room
        return params.to_core_json(max_tokens, getattr(params, "seed", None))
    if dataclasses.is_dataclass(params):
        return json.dumps(dataclasses.asdict(params))
    raise TypeError(f"sampling params must be a dict, a dataclass or None, got {type(params).__name__}")


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


def _tokenizer_of(model_dir: str):
    """The model directory's tokenizer when the core does not expose one (None without tokenizer.json)."""
    import os

    from ninfer import _core

    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return None
    return _core.Tokenizer(model_dir)


class AsyncEngine:
    """Asynchronous driver of one `_core.Engine`: submit requests, iterate their deltas."""

    def __init__(self, core: Any, *, poll_timeout_s: float = 0.05, max_queue: Optional[int] = None):
        self.core = core
        self.tokenizer = getattr(core, "tokenizer", None)
        self.max_context = int(core.max_context)
        self.eos_token_ids = list(getattr(core, "eos_token_ids", []) or [])
        info = core.info() if hasattr(core, "info") else {}
        self.max_concurrency = int(info.get("max_concurrency", 64) or 64)
        self.max_queue = max_queue
        self.poll_timeout_s = poll_timeout_s
        self._streams: dict = {}
        self._timings: dict = {}
        self._aborting: dict = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._pump_task: Optional[asyncio.Task] = None
        self._closed = False
        self.finished_listeners: list = []
        self.steps_polled = 0

    @classmethod
    async def start(
        cls,
        model_dir: Optional[str] = None,
        device: str = "cpu",
        *,
        core: Any = None,
        poll_timeout_s: float = 0.05,
        max_queue: Optional[int] = None,
        **engine_kwargs: Any,
    ) -> "AsyncEngine":
        """Load the model (off the event loop), start the engine thread and the pump task.

        `core` injects an already-built engine object with the `_core.Engine` interface (tests).
        """
        if core is None:
            from ninfer import _core

            core = await anyio.to_thread.run_sync(lambda: _core.Engine(model_dir, device=device, **engine_kwargs))
        core.start_background()
        engine = cls(core, poll_timeout_s=poll_timeout_s, max_queue=max_queue)
        if engine.tokenizer is None and model_dir is not None:
            engine.tokenizer = await anyio.to_thread.run_sync(_tokenizer_of, model_dir)
        if engine_kwargs.get("max_concurrency"):
            engine.max_concurrency = int(engine_kwargs["max_concurrency"])
        engine._pump_task = asyncio.get_running_loop().create_task(engine._pump())
        return engine

    async def shutdown(self) -> None:
        """Stop the pump, fail every open stream, and stop the engine thread."""
        if self._closed:
            return
        self._closed = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(RuntimeError("the engine was shut down"))
        await anyio.to_thread.run_sync(self.core.shutdown)

    def new_request_id(self, prefix: str = "req") -> str:
        """A process-unique request id."""
        return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    def encode_prompt(
        self,
        prompt: Prompt,
        *,
        tools: Optional[list] = None,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
    ) -> list:
        """Token ids of a prompt: a string (tokenized with special tokens), token ids, or chat messages."""
        if isinstance(prompt, str):
            return list(self._tokenizer().encode(prompt, add_special_tokens=True))
        seq = list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            return seq
        return list(self._tokenizer().encode(
            self.render_chat(seq, tools=tools, chat_template_kwargs=chat_template_kwargs,
                             add_generation_prompt=add_generation_prompt),
            add_special_tokens=False,
        ))

    def render_chat(self, messages: Messages, *, tools=None, chat_template_kwargs=None, add_generation_prompt=True) -> str:
        """The chat template applied to messages, as text."""
        tok = self._tokenizer()
        return tok.apply_chat_template(
            json.dumps(list(messages)),
            json.dumps(tools) if tools else None,
            add_generation_prompt,
            json.dumps(chat_template_kwargs) if chat_template_kwargs else None,
        )

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer

    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._streams)

    async def submit(self, prompt_token_ids: Sequence[int], params: Any = None,
                     request_id: Optional[str] = None) -> RequestStream:
        """Submit a tokenized request; raises on bad input or a full queue, before any delta.

        Returns the request's stream of deltas; iterate it, and close it (or leave its
        `async with`) to abort the request early.
        """
        return await self.submit_many([prompt_token_ids], [params], [request_id or self.new_request_id()])

    async def submit_many(self, prompts: Sequence[Sequence[int]], params: Sequence[Any],
                          request_ids: Sequence[str]) -> RequestStream:
        """Submit several requests that share one stream (e.g. the n choices of one call).

        All or nothing: if one is refused, those already submitted are aborted and the error
        raised. The core calls run on a worker thread: the core may hold its lock for up to one
        engine step, and the event loop must keep serving other streams meanwhile.
        """
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if self.max_queue is not None:
            limit = self.max_concurrency + self.max_queue
            if len(self._streams) + len(prompts) > limit:
                raise QueueFullError(len(self._streams), limit)
        rids = list(request_ids)
        if len(set(rids)) != len(rids) or any(rid in self._streams for rid in rids):
            raise ValueError(f"request ids {rids} repeat or are already in flight")
        # Every params object serialised before any request is registered: one refused (a bad
        # type, n > 1) must leave nothing in flight.
        jobs = [(rid, list(ids), params_to_json(p, max(self.max_context - len(ids), 1)))
                for ids, p, rid in zip(prompts, params, rids)]
        send, receive = anyio.create_memory_object_stream(math.inf)
        timings = {}
        for rid, _, _ in jobs:
            timings[rid] = RequestTiming(submitted=time.monotonic())
            self._streams[rid] = send
            self._timings[rid] = timings[rid]
        submitted: list = []

        def run() -> None:
            for rid, ids, pj in jobs:
                self.core.submit(rid, ids, pj)
                submitted.append(rid)

        try:
            await anyio.to_thread.run_sync(run)
        except BaseException:
            for rid in rids:
                self._streams.pop(rid, None)
                self._timings.pop(rid, None)
            for rid in submitted:
                self._abort_in_core(rid)
            raise
        self._wake.set()
        return RequestStream(self, rids, receive, timings)

    async def generate(
        self,
        prompt: Prompt,
        params: Any = None,
        *,
        request_id: Optional[str] = None,
        tools: Optional[list] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> AsyncIterator[Delta]:
        """Yield the deltas of one request; breaking out or cancelling aborts it.

        A request that fails midway raises `ninfer.GenerationError` after the deltas it produced.
        """
        ids = self.encode_prompt(prompt, tools=tools, chat_template_kwargs=chat_template_kwargs)
        stream = await self.submit(ids, params, request_id)
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

    def stats(self) -> dict:
        """The core's counters (running, waiting, KV blocks, prefix hits, ...); may wait up to a step."""
        return dict(self.core.stats())

    async def astats(self) -> dict:
        """`stats()` from a worker thread, so the event loop keeps serving."""
        return await anyio.to_thread.run_sync(self.stats)

    async def _pump(self) -> None:
        """The one loop that polls the core and fans deltas out to request streams."""
        while True:
            if not self._streams and not self._aborting:
                self._wake.clear()
                await self._wake.wait()
            try:
                deltas = await anyio.to_thread.run_sync(self.core.poll, self.poll_timeout_s, abandon_on_cancel=True)
            except Exception as e:
                self._fail_all(e)
                continue
            if not deltas:
                continue
            self.steps_polled += 1
            now = time.monotonic()
            for d in deltas:
                rid = d["request_id"]
                send = self._streams.get(rid)
                if send is None:
                    if d.get("finish_reason") is not None and rid in self._aborting:
                        self._finished(rid, Delta.from_core(d), self._aborting.pop(rid), now)
                    continue
                delta = Delta.from_core(d)
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

