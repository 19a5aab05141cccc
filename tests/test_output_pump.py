"""The output pump: one thread of its own that sleeps in `core.poll()` until there is output.

It must not wake on a timer (every poll returns deltas, but the last one at shutdown), must not
hold a thread of anyio's pool (which tokenization and submission share), and must wake when the
engine shuts down, with the real core as with the fake.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from fake_core import SlowFakeCore
from ninfer import _core
from ninfer.engine import AsyncEngine

pytestmark = pytest.mark.anyio

DEMO = Path(__file__).resolve().parent.parent / "python" / "ninfer" / "demo" / "model"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RecordingCore(SlowFakeCore):
    """SlowFakeCore that records how many deltas each poll returned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.poll_sizes: list = []

    def poll(self, timeout_s=None):
        out = super().poll(timeout_s)
        self.poll_sizes.append(len(out))
        return out


async def test_the_pump_wakes_only_for_output_and_holds_no_pool_thread():
    core = RecordingCore()
    engine = await AsyncEngine.start(core=core)
    try:
        await anyio.sleep(0.3)  # idle: the pump sleeps in poll, no timer wakes it
        assert core.poll_sizes == []
        stream = await engine.submit([1, 2, 3], {"max_tokens": 8, "temperature": 0})
        async with stream:
            async for delta in stream:
                # Streaming: the pump holds no token of anyio's default thread limiter.
                assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
        assert delta.finished and delta.completion_tokens == 8
        await anyio.sleep(0.2)
    finally:
        await engine.shutdown()
    assert core.poll_sizes and all(n > 0 for n in core.poll_sizes[:-1]), core.poll_sizes
    assert not engine._pump_thread.is_alive()


def test_a_blocking_poll_of_the_real_core_returns_when_it_shuts_down():
    core = _core.Engine(str(DEMO), max_context=256)
    core.start_background()
    got: list = []
    poller = threading.Thread(target=lambda: got.append(core.poll()))
    poller.start()
    time.sleep(0.3)
    assert poller.is_alive(), "poll() without a timeout returned with nothing to report"
    core.shutdown()
    poller.join(timeout=10)
    assert not poller.is_alive() and got == [[]]


def test_a_blocking_poll_returns_the_deltas_of_a_request():
    core = _core.Engine(str(DEMO), max_context=256)
    core.start_background()
    try:
        core.submit("a", [5, 6, 7], _core.SamplingParams(max_tokens=3, temperature=0))
        deltas: list = []
        while not (deltas and deltas[-1]["finish_reason"]):
            deltas += core.poll()
        assert sum(len(d["token_ids"]) for d in deltas) == 3
    finally:
        core.shutdown()
