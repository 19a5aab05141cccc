"""The forced-tool-call grammar (`ninfer.server.tool_grammar`), compiled by the core and run.

Outputs come from the demo model decoding under the grammar through the offline API: the demo
model was never taught tool calls, so every output that parses as a call of an allowed tool with
schema-valid arguments does so because the grammar admitted nothing else. The tool-call parser
of the server (tool_parsers.py) reads the calls back; `jsonschema` checks the arguments.
"""

from __future__ import annotations

import json

import pytest

from ninfer import LLM, SamplingParams
from ninfer.demo import MODEL_DIR
from ninfer.server.reasoning import split_reasoning
from ninfer.server.tool_grammar import (REASONING_NONE, REASONING_OPEN, REASONING_OPTIONAL, ToolSyntax,
                                        arguments_schema, closed_schema, forced_tools, reasoning_mode,
                                        tool_call_grammar)
from ninfer.server.tool_parsers import parse_tool_calls

from json_schema_check import validate

#: Every argument bounded, so that a model that never saw a tool call still completes one.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"]}}}
#: XML values: a string parameter is raw text, the others JSON.
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 10},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                   "urgent": {"type": "boolean"},
                   "level": {"type": "string", "enum": ["low", "high"]}},
    "required": ["title", "urgent", "level"]}}}
TOOLS = [WEATHER, ADD, NOTE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(4)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL_DIR)


@pytest.fixture(scope="module")
def syntax(llm):
    return ToolSyntax.of(llm._tokenizer)


def run(llm, grammar: str, seed: int, *, thinking: bool = False, max_tokens: int = 120):
    out = llm.chat([MESSAGES], SamplingParams(max_tokens=max_tokens, seed=seed, temperature=0.8,
                                              response_format={"type": "lark", "lark": grammar}),
                   tools=TOOLS, chat_template_kwargs={"enable_thinking": thinking})
    return out[0].outputs[0]


def calls_of(text: str) -> tuple:
    """(reasoning or None, content, calls) of one output, as the server splits it."""
    reasoning, content = split_reasoning(text)
    content, calls = parse_tool_calls(content, TOOLS)
    return reasoning, content, calls


def check_calls(calls: list, allowed: set) -> None:
    for call in calls:
        name = call["function"]["name"]
        assert name in allowed
        validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_the_demo_model_writes_qwen3_json_calls_with_literal_tags(syntax):
    # The demo template shows `<tool_call>{"name": ...}`; `<think>` / `</think>` are added tokens
    # that are not special, and `<tool_call>` is no token at all: all four are literal text.
    assert not syntax.xml and syntax.thinking
    assert syntax.tags == {t: json.dumps(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")}


def test_a_template_that_writes_function_tags_picks_the_xml_format(tmp_path, qwen3_dir):
    from ninfer import _core
    from tiny_tokenizer import make_tokenizer

    make_tokenizer(tmp_path, style="qwen3", vocab_size=448, template="qwen3_coder.jinja")
    xml = ToolSyntax.of(_core.Tokenizer(str(tmp_path)))
    assert xml.xml and not xml.thinking
    assert not ToolSyntax.of(_core.Tokenizer(str(qwen3_dir))).xml


class _SpecialTags:
    """A tokenizer stand-in whose `<think>` tags are special tokens (decode skips them)."""

    chat_template = "{{ '<think>' }}"

    def token_to_id(self, token):
        return {"<think>": 5, "</think>": 6}.get(token)

    def decode(self, ids, skip_special_tokens=True):
        return "" if skip_special_tokens else "<think>"


def test_special_token_tags_are_named_as_tokens():
    syntax = ToolSyntax.of(_SpecialTags())
    assert syntax.tags["<think>"] == "<think>" and syntax.tags["</think>"] == "</think>"
    assert syntax.tags["<tool_call>"] == '"<tool_call>"'
    grammar = tool_call_grammar([ADD], syntax, parallel=False, reasoning=REASONING_OPEN)
    assert "/(?s:.*)/ </think>" in grammar


def test_reasoning_mode_follows_the_rendered_prompt():
    assert reasoning_mode("<|im_start|>assistant\n<think>\n", True) == REASONING_OPEN
    assert reasoning_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n", True) == REASONING_NONE
    assert reasoning_mode("<|im_start|>assistant\n", True) == REASONING_OPTIONAL
    # An earlier turn's closed block does not close this one.
    assert reasoning_mode("<think>a</think>b<|im_start|>assistant\n", True) == REASONING_OPTIONAL
    assert reasoning_mode("<|im_start|>assistant\n<think>\n", False) == REASONING_NONE


def test_forced_tools_are_all_for_required_and_the_named_one_otherwise():
    assert forced_tools(TOOLS, "required") == TOOLS
    assert forced_tools(TOOLS, {"type": "function", "function": {"name": "add"}}) == [ADD]


def test_schemas_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"a": {}}},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "free": {"type": "object"},
        "list": {"type": "array", "items": {"properties": {"b": {}}}},
        "ref": {"$ref": "#/$defs/D"}},
        "$defs": {"D": {"properties": {"c": {}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["free"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's schema is left as it was
    assert arguments_schema({"name": "f"})["x-guidance"] == {"whitespace_flexible": False}


@pytest.mark.parametrize("xml", [False, True], ids=["json", "xml"])
def test_one_call_of_any_tool_with_valid_arguments(llm, syntax, xml):
    grammar = tool_call_grammar(TOOLS, ToolSyntax(xml=xml, tags=syntax.tags), parallel=False)
    for seed in SEEDS:
        out = run(llm, grammar, seed)
        reasoning, content, calls = calls_of(out.text)
        assert out.finish_reason == "stop", out.text
        assert reasoning is None and content == "" and len(calls) == 1, out.text
        check_calls(calls, set(SCHEMAS))
        if not xml:
            # Compact arguments: no whitespace outside strings.
            args = out.text.split('"arguments": ', 1)[1]
            assert json.dumps(json.loads(args[:args.rindex("}\n</tool_call>")]), separators=(",", ":"),
                              ensure_ascii=False) == args[:args.rindex("}\n</tool_call>")]


@pytest.mark.parametrize("xml", [False, True], ids=["json", "xml"])
def test_a_named_tool_is_the_only_one_called(llm, syntax, xml):
    for tool in TOOLS:
        grammar = tool_call_grammar([tool], ToolSyntax(xml=xml, tags=syntax.tags), parallel=False)
        out = run(llm, grammar, seed=1)
        _, _, calls = calls_of(out.text)
        assert len(calls) == 1, out.text
        check_calls(calls, {tool["function"]["name"]})


@pytest.mark.parametrize("xml", [False, True], ids=["json", "xml"])
def test_parallel_calls_are_one_or_more_complete_calls(llm, syntax, xml):
    grammar = tool_call_grammar([ADD, WEATHER], ToolSyntax(xml=xml, tags=syntax.tags), parallel=True)
    counts = []
    for seed in SEEDS:
        out = run(llm, grammar, seed, max_tokens=160)
        _, _, calls = calls_of(out.text)
        closed = out.text.count("</tool_call>")
        assert closed >= 1, out.text
        # Every closed call was parsed; max_tokens may cut the last one short (the XML parser
        # still reads such a tail, the JSON one leaves it as text).
        assert len(calls) in (closed, closed + 1)
        check_calls(calls[:closed], {"add", "get_weather"})
        counts.append(closed)
    assert max(counts) > 1  # the demo model, never taught to stop, goes on calling


def test_reasoning_comes_first_when_the_model_opens_it(llm, syntax):
    grammar = tool_call_grammar([WEATHER], syntax, parallel=False, reasoning=REASONING_OPTIONAL)
    finished = 0
    for seed in SEEDS:
        out = run(llm, grammar, seed, thinking=True, max_tokens=200)
        reasoning, content, calls = calls_of(out.text)
        assert out.text.startswith("<think>")
        if out.finish_reason == "stop":
            finished += 1
            assert reasoning and content == "" and len(calls) == 1, out.text
            check_calls(calls, {"get_weather"})
        else:  # cut by max_tokens: in the reasoning, or in the call after it
            assert content == "" or content.startswith("<tool_call>"), out.text
    assert finished >= len(SEEDS) // 2


def test_a_forced_grammar_with_no_reasoning_starts_with_the_call(llm, syntax):
    grammar = tool_call_grammar([ADD], syntax, parallel=False, reasoning=REASONING_NONE)
    out = run(llm, grammar, seed=0, thinking=False)
    assert out.text.startswith("<tool_call>\n{\"name\": \"add\", \"arguments\": {")


def test_reasoning_the_prompt_opened_is_closed_before_the_call(llm, syntax):
    # As after a template that opens <think> itself: the output continues the block, closes it
    # with the model's own </think>, and only then calls.
    grammar = tool_call_grammar([ADD], syntax, parallel=False, reasoning=REASONING_OPEN)
    finished = 0
    for seed in SEEDS:
        out = run(llm, grammar, seed, thinking=True, max_tokens=200)
        if out.finish_reason != "stop":
            continue
        finished += 1
        reasoning, content = split_reasoning(out.text, in_reasoning=True)
        content, calls = parse_tool_calls(content, TOOLS)
        assert reasoning is not None and "</think>" not in reasoning
        assert content == "" and len(calls) == 1, out.text
        check_calls(calls, {"add"})
    assert finished >= len(SEEDS) // 2


def test_the_end_of_thinking_token_is_admitted_anywhere_in_the_reasoning(llm, syntax):
    # A thinking budget closes the reasoning by forcing `</think>`; here logit biases make the
    # model open it and close it as soon as the grammar lets it (a budget of 0): the added
    # tokens `<think>` and `</think>` themselves are admitted, and the call follows.
    tok = llm._tokenizer
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    grammar = tool_call_grammar([ADD], syntax, parallel=False, reasoning=REASONING_OPTIONAL)
    for seed in SEEDS:
        out = llm.chat([MESSAGES], SamplingParams(max_tokens=80, seed=seed, logit_bias={think: 50.0, close: 100.0},
                                                  response_format={"type": "lark", "lark": grammar}),
                       tools=TOOLS, chat_template_kwargs={"enable_thinking": True})[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[:2] == [think, close], out.text
        reasoning, content, calls = calls_of(out.text)
        assert reasoning == "" and content == "" and len(calls) == 1
        check_calls(calls, {"add"})
