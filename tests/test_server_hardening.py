"""The server against clients that misbehave: unknown chat roles, and clients that leave early.

One `ninfer serve` on the bundled demo model. A disconnect storm of 100 raw-socket clients, each
leaving after a seeded random 0-300 ms (before sending its body, mid-body, or while its answer
is generated, streaming and not), must leave no request running, no KV block in use and no
error-level line in the server's log, and the server must still answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import pytest

from ninfer.server.app import build_app
from ninfer.server.metrics import parse_metrics
from ninfer.server.protocol import ServerDefaults
from ninfer.server.state import ServerState
from server_process import ServerProcess

DEMO = Path(__file__).resolve().parents[1] / "python" / "ninfer" / "demo" / "model"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="demo model not trained yet")

MODEL = "demo"
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Lines a server prints only when something went wrong on its side (uvicorn's ERROR, a traceback).
ERROR_LINE = re.compile(r"^(ERROR|CRITICAL)\b|Traceback|Exception in ASGI", re.MULTILINE)


@pytest.fixture(scope="module")
def server():
    with ServerProcess([str(DEMO), "--model-id", MODEL, "--max-context", "1024", "--max-concurrency", "32"],
                       ready_timeout_s=300) as s:
        yield s


def metrics(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def test_unknown_chat_role_is_a_400_naming_it_and_the_accepted_roles(server):
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "wizard" in err["message"] and all(role in err["message"] for role in ROLES), err
    assert err["param"] == "messages[1].role"
    for role in ROLES[:3]:
        ok = dict(body, messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])
        assert httpx.post(server.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200, role


def test_unknown_anthropic_role_is_a_400_naming_it(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "wizard", "content": "abracadabra"}]}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "wizard" in r.text, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
@pytest.mark.parametrize("sent", [[], [b'{"messages": [']])
def test_a_client_leaving_before_or_while_its_body_is_read_is_a_quiet_client_cancel(path, sent):
    """At the ASGI level: the app returns normally (uvicorn logs an exception that escapes it at
    error level) and counts the cancel, whether no byte or part of the body arrived."""
    state = ServerState(ServerDefaults(model_id=MODEL))

    async def never_loads():
        await asyncio.sleep(3600)

    app = build_app(state, never_loads)
    messages = [{"type": "http.request", "body": b, "more_body": True} for b in sent] + [{"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if len(messages) > 1 else messages[0]

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert state.metrics.client_cancels == {"body": 1, "response": 0}
    assert 'ninfer_client_cancels_total{stage="body"} 1' in state.metrics.render({})


def _request(path: str, body: dict) -> tuple:
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    return head, raw


async def _leaving_client(port: int, kind: str, path: str, body: dict, delay_s: float, reset: bool) -> None:
    """One client that leaves `delay_s` after sending what its `kind` sends (a reset or a close)."""
    head, raw = _request(path, body)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    if kind == "mid_body":
        writer.write(raw[:len(raw) // 2])
    elif kind == "after_body":
        writer.write(raw)
    await writer.drain()
    await asyncio.sleep(delay_s)
    if reset:
        writer.transport.abort()
    else:
        writer.close()
        await writer.wait_closed()


def _storm_plan(seed: int, n: int) -> list:
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        kind = ("headers_only", "mid_body", "after_body", "after_body")[i % 4]
        stream = rng.random() < 0.5
        if rng.random() < 0.5:
            path, body = "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}]}
        else:
            path, body = "/v1/completions", {"model": MODEL, "prompt": f"def f{i}(x):\n"}
        body.update(max_tokens=200, ignore_eos=True, stream=stream, seed=i)
        plan.append((kind, path, body, rng.uniform(0.0, 0.3), rng.random() < 0.5))
    return plan


def test_disconnect_storm_leaves_nothing_running_and_logs_no_error(server):
    plan = _storm_plan(46, 100)
    before = metrics(server.url)

    async def storm():
        await asyncio.gather(*(_leaving_client(server.port, *p) for p in plan))

    asyncio.run(storm())
    deadline = time.monotonic() + 120
    while True:
        m = metrics(server.url)
        settled = (m["ninfer_num_requests_running"], m["ninfer_num_requests_waiting"], m["ninfer_kv_blocks_used"])
        if settled == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert settled == (0, 0, 0), f"running, waiting, KV blocks in use after the storm: {settled}"
    errors = ERROR_LINE.findall(server.log())
    assert not errors, server.log()[-4000:]
    early = [reset for kind, *_, reset in plan if kind in ("headers_only", "mid_body")]
    body_key = 'ninfer_client_cancels_total{stage="body"}'
    # A reset may reach the server before it read the request's headers (the kernel then drops
    # them, and no request exists); a close always comes after them.
    closed = early.count(False)
    assert closed <= m[body_key] - before[body_key] <= len(early), "a client that left before its body was read"
    response_key = 'ninfer_client_cancels_total{stage="response"}'
    assert 0 < m[response_key] - before[response_key] <= len(plan) - len(early)
    abort_key = 'ninfer_requests_total{finish_reason="abort"}'
    assert 0 < m.get(abort_key, 0) - before.get(abort_key, 0) <= len(plan) - len(early), "requests left mid-generation"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
