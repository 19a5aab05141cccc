"""Grammar-constrained decoding through the offline API: `SamplingParams(response_format=...)`.

The model is a tiny random checkpoint, so whatever it "wants" to say is noise: every output that
parses and validates does so because the grammar mask allowed nothing else. Validation uses the
`jsonschema` package (the oracle for the schema's meaning) when installed (json_schema_check.py).
"""

from __future__ import annotations

import json
import re

import pytest

from ninfer import LLM, InvalidRequestError, SamplingParams

from json_schema_check import validate

MAX_CONTEXT = 1024

#: Every field bounded, so that a random model always completes the object.
POINT_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "x", "tags", "ok"],
    "additionalProperties": False,
}

MESSAGES = [{"role": "user", "content": "Describe a point as JSON."}]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, max_context=MAX_CONTEXT)
    yield engine
    engine.close()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}


def test_json_schema_outputs_parse_and_validate(llm):
    params = SamplingParams(n=4, seed=1, temperature=1.0, max_tokens=900,
                            response_format=schema_format(POINT_SCHEMA))
    [out] = llm.chat(MESSAGES, params)
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        validate(json.loads(completion.text), POINT_SCHEMA)


def test_greedy_json_schema_output_validates(llm):
    [out] = llm.generate("Point:", SamplingParams(temperature=0.0, max_tokens=900,
                                                  response_format=schema_format(POINT_SCHEMA)))
    assert out.outputs[0].finish_reason == "stop"
    validate(json.loads(out.outputs[0].text), POINT_SCHEMA)


def test_json_object_outputs_are_objects(llm):
    params = SamplingParams(n=6, seed=3, temperature=1.0, max_tokens=900, response_format={"type": "json_object"})
    [out] = llm.generate("Some JSON:", params)
    finished = [c for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 3, [c.text for c in out.outputs]
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict), completion.text
    for completion in out.outputs:
        assert completion.text.lstrip().startswith("{"), completion.text


def test_regex_format_output_matches(llm):
    params = SamplingParams(n=3, seed=5, max_tokens=50, response_format={"type": "regex", "regex": "[0-9]{3}-[a-c]{2}"})
    [out] = llm.generate("Code:", params)
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", completion.text), completion.text


def test_text_format_equals_free_decoding(llm):
    free = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    text = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                response_format={"type": "text"}))
    assert free[0].outputs[0].token_ids == text[0].outputs[0].token_ids


def test_invalid_schema_is_rejected_naming_response_format(llm):
    bad = schema_format({"type": "object", "properties": {"a": {"type": "banana"}}})
    with pytest.raises(InvalidRequestError, match="response_format"):
        llm.generate("x", SamplingParams(max_tokens=5, response_format=bad))
    with pytest.raises(InvalidRequestError, match="response_format"):
        llm.generate("x", SamplingParams(max_tokens=5, response_format={"type": "yaml"}))


def test_response_format_must_be_an_object():
    with pytest.raises(InvalidRequestError, match="response_format"):
        SamplingParams(response_format="json")
