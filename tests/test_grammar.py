"""Grammar-constrained decoding through the offline API: `SamplingParams(response_format=...)`.

The model is a tiny random checkpoint, so whatever it "wants" to say is noise: every output that
parses and validates does so because the grammar mask allowed nothing else. Validation uses the
`jsonschema` package (the oracle for the schema's meaning) when installed (json_schema_check.py).
"""

from __future__ import annotations

import json
import re

import anyio
import pytest

from ninfer import LLM, GenerationError, InvalidRequestError, SamplingParams

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


#: A regex llguidance compiles but whose lexer grows too complex once the output reaches the
#: `c`s: whatever the model picks for the `[ab]` bytes, the request fails a few tokens in.
FAILS_MIDWAY = {"type": "regex", "regex": "[ab]{3}c{100000}"}


def test_a_grammar_that_fails_midway_raises_after_every_prompt_finished(llm):
    failing = SamplingParams(seed=1, temperature=1.0, max_tokens=50, response_format=FAILS_MIDWAY)
    normal = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate("Hello", normal)
    with pytest.raises(GenerationError, match="field `response_format`.*too many expressions") as e:
        llm.generate(["Code:", "Hello"], [failing, normal])
    assert isinstance(e.value, InvalidRequestError)
    bad, good = e.value.outputs
    assert bad.finish_reason == "error" and "response_format" in bad.error
    assert re.fullmatch(r"[ab]{3}c*", bad.text), bad.text
    assert bad.outputs[0].usage.completion_tokens == len(bad.token_ids) > 0
    assert good.finish_reason == "length" and good.error is None
    assert good.token_ids == alone[0].token_ids, "the neighbour in the batch is untouched"
    assert llm.generate("Hello", normal)[0].token_ids == alone[0].token_ids, "the engine keeps serving"


def test_a_grammar_that_fails_midway_raises_from_stream_after_the_partial_output(llm):
    deltas = []
    with pytest.raises(GenerationError, match="response_format") as e:
        for d in llm.stream("Code:", SamplingParams(seed=1, temperature=1.0, max_tokens=50,
                                                      response_format=FAILS_MIDWAY)):
            deltas.append(d)
    assert deltas and all(d["finish_reason"] is None for d in deltas)
    assert e.value.delta["finish_reason"] == "error" and e.value.delta["token_ids"] == []
    text = "".join(d["text"] for d in deltas) + e.value.delta["text"]
    assert re.fullmatch(r"[ab]{3}c*", text), text


def test_a_grammar_that_fails_midway_raises_from_the_async_engine(qwen3_dir):
    from ninfer.engine import AsyncEngine

    async def main():
        engine = await AsyncEngine.start(str(qwen3_dir), max_context=MAX_CONTEXT)
        try:
            deltas = []
            params = {"max_tokens": 50, "seed": 1, "temperature": 1.0, "response_format": FAILS_MIDWAY}
            with pytest.raises(GenerationError, match="response_format") as e:
                async for d in engine.generate("Code:", params):
                    deltas.append(d)
            assert deltas and not any(d.finished for d in deltas)
            assert e.value.delta.finish_reason == "error" and e.value.delta.error == str(e.value)
            normal = [d async for d in engine.generate("Hello", {"max_tokens": 4, "ignore_eos": True})]
            assert normal[-1].finish_reason == "length"
        finally:
            await engine.shutdown()

    anyio.run(main)
