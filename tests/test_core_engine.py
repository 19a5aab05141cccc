"""The `_core.Engine` binding over the toy model: the shared API contract as Python sees it."""

import pytest

from ninfer import _core

STATS_KEYS = {
    "running", "waiting", "kv_blocks_used", "kv_blocks_total", "prefix_hit_tokens", "prompt_tokens_total",
    "generation_tokens_total", "prefill_tokens_computed", "max_batch_size_seen", "steps", "lookahead_steps",
    "split_lookahead_steps", "reasoning_tokens_total",
}
DELTA_KEYS = {"request_id", "token_ids", "text", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
              "error", "reasoning_tokens", "stop_reason", "spec"}


def greedy(n, **extra):
    return _core.SamplingParams(max_tokens=n, temperature=0, **extra)


def run_inline(engine):
    out = {}
    while engine.has_unfinished():
        for d in engine.step():
            assert set(d) == DELTA_KEYS
            assert (d["error"] is not None) == (d["finish_reason"] == "error"), d
            r = out.setdefault(d["request_id"], {"tokens": [], "finish": None})
            r["tokens"] += d["token_ids"]
            if d["finish_reason"]:
                r["finish"] = d["finish_reason"]
    return out


def test_batched_requests_match_each_request_alone():
    prompts = {"a": [1, 2, 3], "b": list(range(5, 45)), "c": [9] * 20}
    eng = _core.Engine.toy()
    for rid, p in prompts.items():
        eng.submit(rid, p, greedy(12))
    together = run_inline(eng)
    for rid, p in prompts.items():
        alone = _core.Engine.toy()
        alone.submit(rid, p, greedy(12))
        assert run_inline(alone)[rid]["tokens"] == together[rid]["tokens"]
        assert together[rid]["finish"] == "length"
    stats = eng.stats()
    assert STATS_KEYS <= set(stats)
    assert stats["max_batch_size_seen"] == 3 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_overlapped_steps_give_the_same_deltas_inline_and_in_the_background(hybrid):
    """Asynchronous scheduling (a toy that overlaps steps as the CUDA runner does): the same
    tokens and finish reasons as the synchronous engine, inline and from the engine thread."""
    prompts = {"a": [1, 2, 3], "b": list(range(5, 45)), "c": [9] * 20}
    sync = _core.Engine.toy(hybrid=hybrid)
    for rid, p in prompts.items():
        sync.submit(rid, p, greedy(12 + len(p) % 5))
    want = run_inline(sync)
    eng = _core.Engine.toy(hybrid=hybrid, overlapping=True)
    assert eng.info()["async_scheduling"] is True
    for rid, p in prompts.items():
        eng.submit(rid, p, greedy(12 + len(p) % 5))
    assert run_inline(eng) == want
    assert eng.stats()["lookahead_steps"] > 0 and eng.stats()["kv_blocks_used"] == 0
    eng.start_background()
    for rid, p in prompts.items():
        eng.submit(rid, p, greedy(12 + len(p) % 5))
    got = {}
    while len([r for r in got.values() if r["finish"]]) < len(prompts):
        for d in eng.poll(2.0):
            r = got.setdefault(d["request_id"], {"tokens": [], "finish": None})
            r["tokens"] += d["token_ids"]
            r["finish"] = r["finish"] or d["finish_reason"]
    assert got == want
    eng.shutdown()


def test_async_scheduling_option_turns_overlap_off_and_a_wrong_value_stops_the_start():
    assert _core.Engine.toy(overlapping=True, async_scheduling=False).info()["async_scheduling"] is False
    assert _core.Engine.toy(overlapping=False, async_scheduling=True).info()["async_scheduling"] is False, \
        "effective only where the runner overlaps steps"
    for overlapping in (True, False):
        with pytest.raises(TypeError, match="async_scheduling"):
            _core.Engine.toy(overlapping=overlapping, async_scheduling="sometimes")


def test_bad_requests_raise_typed_errors_at_submit():
    eng = _core.Engine.toy(max_context=64)
    with pytest.raises(_core.InvalidRequestError):
        eng.submit("a", [], greedy(4))
    with pytest.raises(_core.ContextOverflowError) as e:
        eng.submit("a", [1] * 60, greedy(10))
    assert "60" in str(e.value) and "64" in str(e.value)
    with pytest.raises(_core.InvalidRequestError):
        eng.submit("a", [1], _core.SamplingParams(temperature=-1))
    with pytest.raises(_core.InvalidRequestError):
        eng.submit("a", [1], _core.SamplingParams(no_such_field=1))
    assert not eng.has_unfinished()


def test_eos_logprobs_and_score():
    eng = _core.Engine.toy(vocab_size=32)
    eng.submit("ref", [4, 5, 6], greedy(20))
    ref = run_inline(eng)["ref"]["tokens"]
    eos = ref[4]
    eng = _core.Engine.toy(vocab_size=32, eos_token_ids=[eos])
    assert eng.eos_token_ids == [eos]
    eng.submit("x", [4, 5, 6], greedy(20, logprobs=True, top_logprobs=3))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    assert (deltas[-1]["finish_reason"], deltas[-1]["stop_reason"]) == ("stop", None), "EOS is no stop reason"
    assert [d["token_ids"][0] for d in deltas] == ref[: ref.index(eos) + 1]
    lp = deltas[0]["logprobs"][0]
    assert lp["token_id"] == deltas[0]["token_ids"][0] and len(lp["top"]) == 3
    assert isinstance(lp["top"][0][0], int) and lp["top"][0][0] == lp["token_id"]
    scores = eng.score([4, 5, 6])
    assert scores.shape == (3, 32) and scores.dtype.name == "float32"
    assert int(scores[-1].argmax()) == ref[0]


def test_background_thread_delivers_every_delta_and_aborts():
    eng = _core.Engine.toy()
    eng.start_background()
    eng.submit("long", [3, 4], greedy(eng.max_context - 2))
    with pytest.raises(_core.InvalidRequestError):
        eng.submit("long", [1], greedy(2))
    eng.abort("long")
    eng.submit("short", [1, 2], greedy(6))
    got, finished = {}, {}
    while len(finished) < 2:
        for d in eng.poll(2.0):
            got.setdefault(d["request_id"], []).extend(d["token_ids"])
            if d["finish_reason"]:
                finished[d["request_id"]] = d["finish_reason"]
    assert len(got["short"]) == 6 and finished["short"] == "length"
    assert finished["long"] == "abort" and len(got["long"]) < eng.max_context - 2
    assert not eng.has_unfinished()
    assert eng.poll(0.05) == []
    assert eng.score([1, 2]).shape[0] == 2
    assert eng.stats()["kv_blocks_used"] == 0
    eng.shutdown()


def test_info_reports_the_memory_ledger():
    info = _core.Engine.toy(hybrid=True, max_concurrency=4, max_context=128, kv_capacity=256).info()
    assert info["kv_capacity_tokens"] == 256 and info["num_blocks"] == 16
    assert info["kv_bytes"] == 256 * info["kv_bytes_per_token"]
    assert info["state_slots_running"] == 5 and info["state_slots_snapshot"] == 4
    assert info["total_bytes"] == info["weight_bytes"] + info["kv_bytes"] + info["state_bytes"] + info["workspace_bytes"]
    # Host runners run each step before returning: nothing to overlap (the CUDA runner does).
    assert info["async_scheduling"] is False
    with pytest.raises(_core.ModelLoadError) as e:
        _core.Engine.toy(max_context=128, kv_capacity=100)
    assert "100" in str(e.value) and "128" in str(e.value)


def test_submit_does_not_wait_for_a_poll_in_progress():
    import threading
    import time

    eng = _core.Engine.toy()
    eng.start_background()
    got = []
    poller = threading.Thread(target=lambda: got.extend(eng.poll(3.0)))
    poller.start()
    time.sleep(0.2)
    t = time.monotonic()
    eng.submit("a", [1, 2, 3], greedy(2))
    assert time.monotonic() - t < 1.0, "submit blocked behind poll"
    poller.join()
    assert got and got[0]["request_id"] == "a"
    eng.shutdown()
