"""Tool-call and reasoning parsers: streamed pieces add up to the whole-text parse."""

from __future__ import annotations

import json

import pytest

from ninfer.server.reasoning import ReasoningParser, split_reasoning
from ninfer.server.tool_parsers import ToolCallParser, parse_tool_calls

QWEN3 = 'Let me check.<tool_call>\n{"name": "lookup", "arguments": {"q": "a<b", "n": 2}}\n</tool_call>'
CODER = ("<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=depth>\n3\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=stop>\n</function>\n</tool_call>")


def stream_tools(text, size, tools=None):
    p = ToolCallParser(tools)
    content, calls = "", []
    for i in range(0, len(text), size):
        c, new = p.feed(text[i:i + size])
        content += c
        calls += new
    c, new = p.feed("", final=True)
    return content + c, calls + new


def strip_ids(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_qwen3_json_tool_calls_equal_whole_parse(size):
    whole = parse_tool_calls(QWEN3)
    streamed = stream_tools(QWEN3, size)
    assert streamed[0] == whole[0] == "Let me check."
    assert strip_ids(streamed[1]) == strip_ids(whole[1]) == [("lookup", {"q": "a<b", "n": 2})]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_qwen3_coder_xml_tool_calls_equal_whole_parse(size):
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"properties": {
        "cmd": {"type": "string"}, "depth": {"type": "integer"}}}}}]
    content, calls = stream_tools(CODER, size, tools)
    assert content == ""
    assert strip_ids(calls) == [("run", {"cmd": "ls -l", "depth": 3}), ("stop", {})]


def test_malformed_tool_call_is_kept_as_content():
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_unclosed_tool_call_at_end_is_still_parsed():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}')
    assert strip_ids(calls) == [("f", {})]


def test_text_that_only_resembles_a_tag_prefix_is_released():
    content, calls = stream_tools("a < b <tool", 1)
    assert content == "a < b <tool" and calls == []


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_streamed_reasoning_split_equals_whole_split(size):
    text = "<think>\nstep one\nstep two\n</think>\n\nFinal answer"
    p = ReasoningParser()
    r = c = ""
    for i in range(0, len(text), size):
        a, b = p.feed(text[i:i + size])
        r, c = r + a, c + b
    a, b = p.feed("", final=True)
    assert (r + a, c + b) == split_reasoning(text) == ("step one\nstep two\n", "Final answer")


def test_output_that_starts_in_reasoning_splits_at_the_close_tag():
    # Whether a prompt leaves <think> open is the core's (tokenizer/chat_prompt.rs, tested there).
    assert split_reasoning("plan</think>\n\nok", in_reasoning=True) == ("plan", "ok")


def test_output_without_think_has_no_reasoning():
    assert split_reasoning("just text") == (None, "just text")
