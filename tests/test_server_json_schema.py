"""`response_format` through a real `ninfer serve` process and the official `openai` client.

A tiny random checkpoint produces noise, so JSON that parses and validates against the request's
schema shows the grammar mask at work. The schema's meaning is checked by the `jsonschema`
package (the oracle); a schema the compiler rejects is a 400 naming `response_format`, and so is
a grammar that fails midway (a stream ends with an error event instead of a finish chunk).
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

from ninfer import _core
from server_process import ServerProcess

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

openai = pytest.importorskip("openai")
from json_schema_check import validate

MODEL = "tiny"
MAX_CONTEXT = 1024

#: Every field bounded, so that a random model always completes the object.
ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "in_stock": {"type": "boolean"},
    },
    "required": ["name", "count", "colors", "in_stock"],
    "additionalProperties": False,
}

MESSAGES = [{"role": "user", "content": "Describe one item in the shop as JSON."}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with ServerProcess([str(qwen3_dir), "--model-id", MODEL, "--max-context", str(MAX_CONTEXT)],
                       ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}}


def test_json_schema_non_stream_output_parses_and_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=1.0, seed=7, n=2,
                                       response_format=schema_format(ITEM_SCHEMA))
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        validate(json.loads(choice.message.content), ITEM_SCHEMA)


def test_json_schema_stream_output_parses_and_validates(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=1.0,
                                                 seed=11, stream=True, response_format=schema_format(ITEM_SCHEMA)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"], text
    validate(json.loads(text), ITEM_SCHEMA)


def test_json_schema_output_is_content_even_with_thinking_enabled(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=0,
                                       response_format=schema_format(ITEM_SCHEMA),
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    validate(json.loads(r.choices[0].message.content), ITEM_SCHEMA)


def test_json_object_outputs_are_objects(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=1.0, seed=3, n=4,
                                       response_format={"type": "json_object"})
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished, [c.message.content for c in r.choices]
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=1.0,
                                                 seed=4, stream=True, response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.lstrip().startswith("{"), text


def test_completions_accept_response_format_too(client):
    r = client.completions.create(model=MODEL, prompt="An item:", max_tokens=900, temperature=1.0, seed=5,
                                  extra_body={"response_format": schema_format(ITEM_SCHEMA)})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].text), ITEM_SCHEMA)


def test_invalid_schema_is_a_400_naming_response_format(client):
    bad = schema_format({"type": "object", "properties": {"a": {"type": "banana"}}})
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, stream=stream,
                                           response_format=bad)
        assert e.value.status_code == 400
        assert e.value.body["param"] == "response_format", e.value.body
        assert "json_schema.schema" in e.value.body["message"]


def test_malformed_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                       response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format"


#: A regex llguidance compiles but whose lexer grows too complex once the output reaches the
#: `c`s: whatever the model picks for the `[ab]` bytes, the request fails a few tokens in.
FAILS_MIDWAY = {"type": "regex", "regex": "[ab]{3}c{100000}"}
PARTIAL = re.compile(r"[ab]{3}c*")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def sse_events(server, path: str, body: dict) -> list:
    """(event name or None, data text) of every SSE event of a streamed request."""
    events, name = [], None
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, line[6:]))
                name = None
    return events


def failing_bodies() -> dict:
    """A failing request per route that takes `response_format` (/v1/messages has no such field)."""
    return {"/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "temperature": 1.0,
                                     "seed": 1, "response_format": FAILS_MIDWAY},
            "/v1/completions": {"model": MODEL, "prompt": "Code:", "max_tokens": 50, "temperature": 1.0, "seed": 1,
                                "response_format": FAILS_MIDWAY}}


def assert_names_the_grammar_failure(error: dict) -> None:
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == "response_format", error
    assert "grammar matcher failed" in error["message"] and "too many expressions" in error["message"], error


def test_grammar_failing_midway_is_a_400_naming_response_format(server):
    for path, body in failing_bodies().items():
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert set(r.json()) == {"error"}, r.json()
        assert_names_the_grammar_failure(r.json()["error"])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_grammar_failing_midway_ends_an_openai_stream_with_an_error_event_then_done(server):
    for path in ("/v1/chat/completions", "/v1/completions"):
        events = sse_events(server, path, failing_bodies()[path])
        assert events[-1] == (None, "[DONE]"), events
        error = json.loads(events[-2][1])
        assert set(error) == {"error"}, error
        assert_names_the_grammar_failure(error["error"])
        chunks = [json.loads(d) for _, d in events[:-2]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks), "no normal finish chunk"
        key = "text" if path == "/v1/completions" else None
        text = "".join((c["choices"][0]["text"] if key else c["choices"][0]["delta"].get("content") or "")
                       for c in chunks)
        assert PARTIAL.fullmatch(text), (path, text)


def test_grammar_failing_midway_streams_the_text_held_back_for_a_stop_string_before_the_error(server):
    """Stop strings that start with every possible `[ab]{3}` hold the whole partial output back;
    the failed request's last delta carries it, and the stream sends it before the error event
    (it used to be dropped, so the stream showed none of the output the request produced)."""
    stops = [f"{a}{b}{c}z" for a in "ab" for b in "ab" for c in "ab"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        events = sse_events(server, path, dict(failing_bodies()[path], stop=stops))
        assert events[-1] == (None, "[DONE]"), events
        assert_names_the_grammar_failure(json.loads(events[-2][1])["error"])
        chunks = [json.loads(d) for _, d in events[:-2]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks), "no normal finish chunk"
        text = "".join((c["choices"][0]["text"] if path == "/v1/completions"
                        else c["choices"][0]["delta"].get("content") or "") for c in chunks)
        assert PARTIAL.fullmatch(text), (path, text)


def test_grammar_failing_midway_is_an_error_to_the_openai_client(client):
    body = failing_bodies()["/v1/chat/completions"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.APIError, match="grammar matcher failed"):
        list(client.chat.completions.create(**body, stream=True))


def test_grammar_failing_midway_leaves_a_concurrent_request_untouched(server):
    normal = {"model": MODEL, "prompt": "Hello there", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    alone = post(server, "/v1/completions", normal).json()["choices"][0]

    def failing(i):
        path = ["/v1/chat/completions", "/v1/completions"][i // 2 % 2]
        body = dict(failing_bodies()[path], temperature=0.5 + i * 0.1)
        if i % 2:
            return sse_events(server, path, body)[-1]
        return post(server, path, body).status_code

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        together = pool.submit(post, server, "/v1/completions", normal)
        outcomes = list(pool.map(failing, range(4)))
        got = together.result().json()["choices"][0]
    assert got["token_ids"] == alone["token_ids"] and got["finish_reason"] == "length"
    assert outcomes[0::2] == [400, 400] and outcomes[1::2] == [(None, "[DONE]")] * 2, outcomes
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r'ninfer_requests_total\{finish_reason="error"\} ([0-9]+)', metrics), metrics
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
