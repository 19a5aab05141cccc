"""Sampling ranges are checked once, by the core: a request out of range gets the core's
InvalidRequestError as a 400 naming the field, from the chat and the completions routes alike,
and `ninfer.SamplingParams` values meet the same check."""

from __future__ import annotations

import time

import pytest

from fake_core import FakeCore
from ninfer import InvalidRequestError, SamplingParams, _core
from ninfer.engine import AsyncEngine

BAD = [("top_p", 0), ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -2.5),
       ("repetition_penalty", 0), ("logit_bias", {"1": 500})]


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from ninfer.server.app import build_app
    from ninfer.server.protocol import ServerDefaults
    from ninfer.server.state import ServerState

    state = ServerState(ServerDefaults(model_id="fake"))

    async def factory():
        return await AsyncEngine.start(core=FakeCore())

    with TestClient(build_app(state, factory)) as c:
        deadline = time.monotonic() + 30
        while state.engine is None and time.monotonic() < deadline:
            time.sleep(0.02)
        c.state = state
        yield c


@pytest.mark.parametrize("field,value", BAD)
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3}),
])
def test_an_out_of_range_field_is_a_400_from_the_cores_check(client, path, body, field, value):
    r = client.post(path, json=dict(body, **{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"invalid request field `{field}`" in err["message"], err
    assert client.state.engine.in_flight() == 0


@pytest.mark.parametrize("field,value", BAD)
def test_the_offline_params_meet_the_same_check(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match=f"field `{field}`"):
        p.to_core(max_tokens=4, seed=None)
    with pytest.raises(InvalidRequestError, match=f"field `{field}`"):
        _core.SamplingParams(**p.to_core_dict(4, None))
