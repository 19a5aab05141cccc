"""`ninfer.Delta`: the core's typed delta, read by attribute or as the dict it used to be."""

from __future__ import annotations

import pytest

import ninfer
from ninfer import _core


def test_delta_is_the_cores_type_and_reads_by_attribute_or_key():
    d = ninfer.Delta("r1", [5, 6], "hi", "stop", 3, 2, 1, [{"token_id": 5, "logprob": -0.5, "top": []}])
    assert ninfer.Delta is _core.Delta
    assert (d.request_id, d.token_ids, d.text, d.finish_reason, d.error) == ("r1", [5, 6], "hi", "stop", None)
    assert d.finished and d.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert d["text"] == "hi" and d.get("cached_tokens") == 1 and d.get("nope", 7) == 7
    assert d["logprobs"][0]["token_id"] == 5
    assert set(d) == set(d.keys()) == {"request_id", "token_ids", "text", "logprobs", "finish_reason",
                                       "prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens",
                                       "error", "stop_reason", "spec"}
    assert d.reasoning_tokens == 0 and ninfer.Delta("r3", reasoning_tokens=4)["reasoning_tokens"] == 4
    assert d.stop_reason is None and ninfer.Delta("r3", stop_reason="END").stop_reason == "END"
    assert dict(d)["completion_tokens"] == 2
    with pytest.raises(KeyError):
        d["finished"]
    assert not ninfer.Delta("r2").finished


def test_the_engine_steps_out_deltas():
    core = _core.Engine.toy(vocab_size=32)
    core.submit("a", [1, 2, 3], _core.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    assert all(isinstance(d, ninfer.Delta) for d in deltas)
    assert sum(len(d.token_ids) for d in deltas) == 2 and deltas[-1].finish_reason == "length"


def test_the_stop_token_id_that_ended_a_request_is_its_stop_reason():
    core = _core.Engine.toy(vocab_size=32)
    core.submit("a", [1, 2, 3], _core.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = []
    while core.has_unfinished():
        first += [t for d in core.step() for t in d.token_ids]
    core.submit("b", [1, 2, 3], _core.SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first[1]]))
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", first[1])
    assert all(d.stop_reason is None for d in deltas[:-1])
