"""AsyncEngine over the fake core, in-process: deltas, early exit aborts, one poll per step."""

from __future__ import annotations

import json

import anyio
import pytest

from fake_core import FakeCore, SlowFakeCore
from ninfer._core import ContextOverflowError
from ninfer.engine import AsyncEngine, QueueFullError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class CountingCore(FakeCore):
    """FakeCore that counts poll calls (GIL crossings)."""

    polls = 0

    def poll(self, timeout_s):
        out = super().poll(timeout_s)
        if out:
            self.polls += 1
        return out


async def collect(gen):
    return [d async for d in gen]


async def test_generate_yields_text_tokens_and_usage():
    engine = await AsyncEngine.start(core=FakeCore())
    try:
        deltas = await collect(engine.generate([{"role": "user", "content": "say:hi!"}], {"max_tokens": 50}))
        assert "".join(d.text for d in deltas) == "hi!"
        last = deltas[-1]
        assert last.finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])
        assert last.usage["completion_tokens"] == len([t for d in deltas for t in d.token_ids]) == 4
        assert last.usage["prompt_tokens"] > 0
    finally:
        await engine.shutdown()


async def test_breaking_out_of_the_loop_aborts_the_request():
    core = SlowFakeCore()
    engine = await AsyncEngine.start(core=core)
    try:
        stream = await engine.submit(core.tokenizer.encode("x"), {"max_tokens": 400})
        async with stream:
            async for _ in stream:
                break
        with anyio.fail_after(5):
            while core.stats()["running"] or core.has_unfinished():
                await anyio.sleep(0.01)
        assert core.stats()["kv_blocks_used"] == 0
        assert engine.in_flight() == 0
    finally:
        await engine.shutdown()


async def test_cancelling_a_consumer_aborts_its_request():
    core = SlowFakeCore()
    engine = await AsyncEngine.start(core=core)
    try:
        with anyio.move_on_after(0.2):
            await collect(engine.generate("cancel me", {"max_tokens": 400}))
        with anyio.fail_after(5):
            while core.has_unfinished():
                await anyio.sleep(0.01)
        assert engine.in_flight() == 0
    finally:
        await engine.shutdown()


async def test_bad_request_raises_before_the_first_delta():
    engine = await AsyncEngine.start(core=FakeCore(max_context=64))
    try:
        with pytest.raises(ContextOverflowError, match="64"):
            await engine.submit(list(range(60)), {"max_tokens": 10})
        assert engine.in_flight() == 0
    finally:
        await engine.shutdown()


async def test_one_poll_serves_all_requests_of_a_step():
    core = CountingCore(step_delay_s=0.01)
    engine = await AsyncEngine.start(core=core)
    try:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(collect, engine.generate(f"prompt {i}", {"max_tokens": 20, "temperature": 0}))
        total_steps = core.stats()["steps"]
        assert core.polls <= total_steps + 1
        assert core.stats()["generation_tokens_total"] == 16 * 20
        assert core.stats()["max_batch_size_seen"] > 1
    finally:
        await engine.shutdown()


async def test_concurrent_requests_match_their_solo_outputs():
    solo_engine = await AsyncEngine.start(core=FakeCore())
    try:
        solo = [
            "".join(d.text for d in await collect(solo_engine.generate(f"p{i}", {"max_tokens": 8, "temperature": 0})))
            for i in range(8)]
    finally:
        await solo_engine.shutdown()
    engine = await AsyncEngine.start(core=FakeCore())
    got = [None] * 8
    try:
        async def one(i):
            got[i] = "".join(d.text for d in await collect(engine.generate(f"p{i}", {"max_tokens": 8,
                                                                                      "temperature": 0})))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert got == solo
    finally:
        await engine.shutdown()


async def test_queue_limit_refuses_extra_requests():
    engine = await AsyncEngine.start(core=SlowFakeCore(max_concurrency=1), max_queue=1)
    try:
        a = await engine.submit([1, 2], {"max_tokens": 100})
        b = await engine.submit([1, 2], {"max_tokens": 100})
        with pytest.raises(QueueFullError):
            await engine.submit([1, 2], {"max_tokens": 100})
        a.close()
        b.close()
    finally:
        await engine.shutdown()


async def test_sampling_params_objects_are_serialised():
    import dataclasses

    @dataclasses.dataclass
    class Params:
        max_tokens: int = 3
        temperature: float = 0.0

    core = FakeCore()
    engine = await AsyncEngine.start(core=core)
    try:
        deltas = await collect(engine.generate([9, 9], Params()))
        assert deltas[-1].completion_tokens == 3
        deltas = await collect(engine.generate([9, 9], json.dumps({"max_tokens": 2})))
        assert deltas[-1].completion_tokens == 2
    finally:
        await engine.shutdown()


def test_async_engine_is_exported_from_the_package():
    import ninfer
    from ninfer.engine import AsyncEngine as Direct

    assert ninfer.AsyncEngine is Direct


async def test_sampling_params_asking_for_several_completions_are_refused_not_cut_to_one():
    """One engine request is one completion: `SamplingParams(n=3)` through `generate`/`submit` is
    refused naming `n` (it used to run one completion and drop the other two silently)."""
    from ninfer import InvalidRequestError, SamplingParams

    engine = await AsyncEngine.start(core=FakeCore())
    try:
        with pytest.raises(InvalidRequestError, match="field `n`: 3"):
            await collect(engine.generate([9, 9], SamplingParams(n=3, max_tokens=2)))
        with pytest.raises(InvalidRequestError, match="field `n`: 2"):
            await engine.submit([9, 9], SamplingParams(n=2, max_tokens=2))
        assert engine.in_flight() == 0
        with pytest.raises(InvalidRequestError, match="field `n`: 2"):
            await engine.submit_many([[9, 9], [8, 8]], [SamplingParams(max_tokens=2), SamplingParams(n=2)], ["a", "b"])
        assert engine.in_flight() == 0, "the first request of a refused submit_many is not left in flight"
        deltas = await collect(engine.generate([9, 9], SamplingParams(n=1, max_tokens=2)))
        assert deltas[-1].completion_tokens == 2
    finally:
        await engine.shutdown()
