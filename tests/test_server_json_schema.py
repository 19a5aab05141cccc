"""`response_format` through a real `ninfer serve` process and the official `openai` client.

A tiny random checkpoint produces noise, so JSON that parses and validates against the request's
schema shows the grammar mask at work. The schema's meaning is checked by the `jsonschema`
package (the oracle); a schema the compiler rejects is a 400 naming `response_format`.
"""

from __future__ import annotations

import json

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
