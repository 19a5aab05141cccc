"""Python-to-Rust crossings of one chat request, counted by wrapping the core.

The real `_core.Engine` over the bundled demo model is wrapped in a proxy that logs every call
and every property read that runs Rust code (the engine's and its tokenizer's). The count runs
from the chat route (or `AsyncEngine.generate` with messages) up to the call that queues the
request. Before, the chat route crossed six times (a `has_chat_template` read, template render,
encode, two `token_to_id`, submit) and `AsyncEngine.generate` three; now rendering,
tokenizing, the reasoning check and submission are one call into the engine. The typed sampling
params that call carries (`_core.SamplingParams`, checked when built) are counted too: built
once per request.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from ninfer import _core
from ninfer.engine import AsyncEngine

DEMO = Path(__file__).resolve().parent.parent / "python" / "ninfer" / "demo" / "model"

#: The calls that queue a request: the window ends with the first of them.
QUEUEING = {"submit", "submit_chat"}
#: The output side (the pump's thread), not part of a request's way in.
OUTPUT_SIDE = {"poll"}


class Counting:
    """Proxy that logs every crossing into a `_core` object (calls and property reads)."""

    def __init__(self, target, log: list, name: str):
        self._target = target
        self._log = log
        self._name = name

    def __getattr__(self, attr):
        value = getattr(self._target, attr)
        if attr in OUTPUT_SIDE:
            return value
        if callable(value):
            def call(*args, **kwargs):
                self._log.append(f"{self._name}.{attr}")
                return self._wrap(value(*args, **kwargs))
            return call
        # A property of a pyclass is a getter: Rust code runs.
        self._log.append(f"{self._name}.{attr}")
        return self._wrap(value)

    def _wrap(self, value):
        if isinstance(value, _core.Tokenizer):
            return Counting(value, self._log, "tokenizer")
        return value


class CountingCoreModule:
    """Stands for `ninfer._core` in `ninfer.engine`: logs each `SamplingParams` built."""

    def __init__(self, log: list):
        self._log = log

    def __getattr__(self, name):
        return getattr(_core, name)

    def SamplingParams(self, **fields):  # noqa: N802 (the class it stands for)
        self._log.append("SamplingParams()")
        return _core.SamplingParams(**fields)


@pytest.fixture
def log(monkeypatch) -> list:
    """The crossings, typed-params constructions included."""
    import ninfer.engine

    entries: list = []
    monkeypatch.setattr(ninfer.engine, "_core", CountingCoreModule(entries))
    return entries


#: One request's way in: its params built (and checked) once, then one call into the engine.
ONE_CROSSING = ["SamplingParams()", "engine.submit_chat"]


def until_queued(log: list) -> list:
    """The crossings up to and including the first queueing call."""
    for i, entry in enumerate(log):
        if entry.split(".")[-1] in QUEUEING:
            return log[:i + 1]
    raise AssertionError(f"no queueing call among {log}")


def test_one_crossing_per_chat_request_through_the_chat_route(log):
    from starlette.testclient import TestClient

    from ninfer.server.app import build_app
    from ninfer.server.protocol import ServerDefaults
    from ninfer.server.state import ServerState

    state = ServerState(ServerDefaults(model_id="demo"))

    async def factory():
        core = Counting(_core.Engine(str(DEMO), max_context=512), log, "engine")
        return await AsyncEngine.start(core=core)

    with TestClient(build_app(state, factory)) as client:
        deadline = time.monotonic() + 120
        while state.engine is None and state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.engine is not None, state.load_error
        log.clear()
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 0
    assert until_queued(log) == ONE_CROSSING


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_one_crossing_per_chat_request_through_async_engine(anyio_backend, log):
    core = Counting(await anyio.to_thread.run_sync(lambda: _core.Engine(str(DEMO), max_context=512)), log, "engine")
    engine = await AsyncEngine.start(core=core)
    try:
        log.clear()
        deltas = [d async for d in engine.generate([{"role": "user", "content": "Hello"}], {"max_tokens": 3})]
        assert deltas[-1].finished
    finally:
        await engine.shutdown()
    assert until_queued(log) == ONE_CROSSING


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_chat_call_sizes_max_tokens_from_the_prompt_it_renders(anyio_backend):
    """max_tokens None: the server default clamped to the context left, else all of it; a prompt
    that leaves no room is a ContextOverflowError the server reports on `messages`."""
    from ninfer.server.errors import to_api_error

    engine = await AsyncEngine.start(DEMO, max_context=64)
    try:
        msgs = [{"role": "user", "content": "Hi"}]
        stream = await engine.submit_chat(msgs, {"temperature": 0, "ignore_eos": True}, default_max_tokens=3)
        async with stream:
            deltas = [d async for d in stream]
        assert deltas[-1].completion_tokens == 3 and deltas[-1].prompt_tokens == stream.chat.prompt_tokens
        stream = await engine.submit_chat(msgs, {"temperature": 0, "ignore_eos": True})
        async with stream:
            deltas = [d async for d in stream]
        assert deltas[-1].completion_tokens == 64 - stream.chat.prompt_tokens
        with pytest.raises(_core.ContextOverflowError, match="leaves no room") as e:
            await engine.submit_chat([{"role": "user", "content": "word " * 80}], {})
        err = to_api_error(e.value)
        assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
        assert engine.in_flight() == 0
    finally:
        await engine.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_engine_defaults_are_llms_generation_config_ones(anyio_backend):
    from ninfer import LLM

    engine = await AsyncEngine.start(DEMO, max_context=1024)
    try:
        with LLM(DEMO, max_context=1024) as llm:
            assert engine.default_params == llm.get_default_sampling_params()
        assert engine.default_params.max_tokens == 512  # the demo's max_new_tokens
    finally:
        await engine.shutdown()
