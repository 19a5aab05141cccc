"""Structured output as client libraries send it, against `ninfer serve` on the bundled demo model.

instructor's JSON_SCHEMA mode sends a `json_schema` without `additionalProperties` (and without
`strict`); LangChain's `with_structured_output(method="json_schema")` sends a strict one. Both
must come back as exactly the listed keys, finished with `stop`, in a few tokens: objects admit
no keys they do not list unless the server runs with `--json-schema-open-objects`, and JSON is
laid out with `, ` and `: ` and no other whitespace. Every request is seeded (the demo model is a
toy: whatever it writes inside a string, the grammar decides where the object ends).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from ninfer import _core
from server_process import ServerProcess

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

from ninfer.demo import MODEL_DIR

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not trained yet")

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "demo"
SERVER_ARGS = ["--model-id", MODEL, "--max-context", "1024"]
SEEDS = range(10)
MESSAGES = [{"role": "user", "content": "Extract the person: Alice is 30 years old."}]
#: Room to run on: a grammar that admitted more keys or whitespace would reach it.
MAX_TOKENS = 120


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=150)


#: The schema as instructor sends it: pydantic's, with no `additionalProperties`.
PERSON_SCHEMA = Person.model_json_schema()


def schema_format(schema: dict, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema, **extra}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVER_ARGS, ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def open_server():
    with ServerProcess([*SERVER_ARGS, "--json-schema-open-objects"], ready_timeout_s=300) as s:
        yield s


def chat(server, response_format: dict, seed: int, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "seed": seed,
                         "response_format": response_format, **body})
    assert r.status_code == 200, r.text
    return r.json()


def layout(text: str) -> str:
    """The JSON text with every string emptied: what is left is punctuation, numbers and spacing."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def assert_compact(text: str) -> None:
    """No whitespace but one space after each `:` and `,` (strings aside)."""
    skeleton = layout(text)
    assert not re.search(r"\s", skeleton.replace(": ", ":").replace(", ", ",")), text


@pytest.fixture(scope="module")
def person_outputs(server) -> list:
    return [chat(server, schema_format(PERSON_SCHEMA), seed) for seed in SEEDS]


def test_schema_without_additional_properties_gives_only_the_listed_keys_and_stops(person_outputs):
    assert "additionalProperties" not in PERSON_SCHEMA
    good = []
    for r in person_outputs:
        choice = r["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        value = json.loads(choice["message"]["content"])
        assert list(value) == ["name", "age"], value
        Person.model_validate(value)
        assert_compact(choice["message"]["content"])
        good.append(r)
    assert len(good) >= 9, [r["choices"][0] for r in person_outputs]


def test_two_field_object_costs_at_most_40_tokens(person_outputs):
    tokens = [r["usage"]["completion_tokens"] for r in person_outputs if r["choices"][0]["finish_reason"] == "stop"]
    assert sum(t <= 40 for t in tokens) >= 9, tokens


def test_json_object_is_laid_out_compactly(server):
    outputs = [chat(server, {"type": "json_object"}, seed)["choices"][0] for seed in SEEDS]
    finished = [c["message"]["content"] for c in outputs if c["finish_reason"] == "stop"]
    assert len(finished) >= 5, outputs
    for text in finished:
        assert isinstance(json.loads(text), dict), text
        assert_compact(text)


def test_strict_schema_admitting_more_keys_is_a_400_naming_where(server):
    schema = {"type": "object", "properties": {"meta": {"type": "object", "additionalProperties": True}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                         "response_format": schema_format(schema, strict=True)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format", error
    assert "#/properties/meta/additionalProperties" in error["message"] and "strict" in error["message"], error
    without_strict = chat(server, schema_format(schema), 0, max_tokens=8)
    assert without_strict["choices"][0]["message"]["content"].startswith("{"), without_strict


#: An object that lists no property: closed, it can only be `{}`.
NO_KEYS = {"type": "object", "properties": {}}


def test_open_objects_flag_keeps_json_schemas_open_default(server, open_server):
    closed = [chat(server, schema_format(NO_KEYS), seed)["choices"][0] for seed in SEEDS]
    assert [(c["message"]["content"], c["finish_reason"]) for c in closed] == [("{}", "stop")] * len(SEEDS)
    opened = [chat(open_server, schema_format(NO_KEYS), seed)["choices"][0]["message"]["content"] for seed in SEEDS]
    assert any(o != "{}" for o in opened), opened
    for text in opened:
        assert text.startswith("{"), text
    strict = [chat(open_server, schema_format(NO_KEYS, strict=True), seed)["choices"][0] for seed in SEEDS]
    assert [c["message"]["content"] for c in strict] == ["{}"] * len(SEEDS), "strict never admits more keys"


def test_llm_takes_the_open_objects_option_too():
    from ninfer import LLM, SamplingParams

    outputs = {}
    for open_objects in (False, True):
        with LLM(MODEL_DIR, max_context=512, json_schema_open_objects=open_objects) as llm:
            params = [SamplingParams(max_tokens=MAX_TOKENS, seed=seed, response_format=schema_format(NO_KEYS))
                      for seed in SEEDS]
            outputs[open_objects] = [o.outputs[0].text for o in llm.chat([MESSAGES] * len(SEEDS), params,
                                                                          chat_template_kwargs={"enable_thinking": False})]
    assert outputs[False] == ["{}"] * len(SEEDS)
    assert any(text != "{}" for text in outputs[True]), outputs[True]


def test_instructor_json_schema_mode_extracts_the_model(server):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.JSON_SCHEMA)
    from instructor.core import InstructorError

    extracted, failed = [], []
    for seed in SEEDS:
        try:
            person, completion = client.chat.completions.create_with_completion(
                model=MODEL, messages=MESSAGES, response_model=Person, max_retries=0, seed=seed, max_tokens=MAX_TOKENS)
        except InstructorError as e:  # a cut-off or invalid answer (max_retries=0: no second try)
            failed.append((seed, str(e)[:200]))
            continue
        assert isinstance(person, Person)
        if completion.choices[0].finish_reason == "stop":
            extracted.append(person)
    assert len(extracted) >= 9, (extracted, failed)


def test_langchain_json_schema_structured_output_extracts_the_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    extracted = []
    for seed in SEEDS:
        llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, seed=seed,
                                          max_tokens=MAX_TOKENS, max_retries=0)
        out = llm.with_structured_output(Person, method="json_schema", include_raw=True).invoke(MESSAGES)
        if out["raw"].response_metadata.get("finish_reason") == "stop" and out["parsing_error"] is None:
            assert isinstance(out["parsed"], Person)
            extracted.append(out["parsed"])
    assert len(extracted) >= 9, extracted
