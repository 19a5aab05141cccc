"""Tool-call and reasoning parsers: streamed pieces add up to the whole-text parse."""

from __future__ import annotations

import json

import pytest

from ninfer.server.choices import ChoiceBuilder
from ninfer.server.reasoning import ReasoningParser, split_reasoning
from ninfer.server.tool_parsers import ToolCallParser, parse_tool_calls

QWEN3 = 'Let me check.<tool_call>\n{"name": "lookup", "arguments": {"q": "a<b", "n": 2}}\n</tool_call>'
CODER = ("<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=depth>\n3\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=stop>\n</function>\n</tool_call>")
CODER_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"properties": {
    "cmd": {"type": "string"}, "depth": {"type": "integer"}, "opts": {"type": "object"}}}}}]

#: Outputs whose every chunking must parse as the whole text does: nested JSON, strings with
#: escapes, quotes, unicode and `</` inside, several calls, both formats, malformed blocks.
SAMPLES = [
    QWEN3,
    CODER,
    'a<tool_call>\n{"name": "edit", "arguments": {"path": "x/\\"q\\".py", "body": "if a</b:\\n\\tpass \\u00e9 caf\u00e9 \U0001f600",'
    ' "spans": [[1, 2], {"k": [true, null, -1.5e3]}], "s": "}]{["}}\n</tool_call>\n<tool_call>\n'
    '{"name": "second", "parameters": {}}\n</tool_call>tail',
    "<tool_call>\n<function=run>\n<parameter=cmd>\necho \"hi\" \\ </b> caf\u00e9\n\nline2\n\n</parameter>\n"
    '<parameter=opts>\n{"a": [1, "</"]}\n</parameter>\n<parameter=extra>\nplain words\n</parameter>\n'
    "<parameter=n>\n-2\n</parameter>\n</function>\n</tool_call>",
    "x <tool_call>{not json}</tool_call> y <tool_call>just words</tool_call>",
    '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call><tool_call>{"name": "s", "arguments": "{\\"a\\": 2}"}'
    "</tool_call>",
    '<tool_call>junk<function=f><parameter=a>1</parameter></function></tool_call>',
    '<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>\n</tool_call>',
    '<tool_call>\n{"name": "cut", "arguments": {"a": "unfinished',
    "<tool_call>\n<function=run>\n<parameter=cmd>\nunfinished",
    "<tool_call><function=f><parameter=a</function><parameter=b>1</parameter></tool_call>",
]


def assemble(items):
    """Calls from streamed delta items: a call's first item has its id and name, later ones add arguments."""
    calls = []
    for item in items:
        if "id" in item:
            assert item["index"] == len(calls) and item["type"] == "function"
            calls.append({"id": item["id"], "type": "function", "function": dict(item["function"])})
        else:
            assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
            calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
    return calls


def stream_chunks(chunks, tools=None):
    p = ToolCallParser(tools)
    content, items = "", []
    for piece in chunks:
        c, new = p.feed(piece)
        content += c
        items += new
    c, new = p.feed("", final=True)
    calls = assemble(items + new)
    assert calls == p.calls
    return content + c, calls


def stream_tools(text, size, tools=None):
    return stream_chunks([text[i:i + size] for i in range(0, len(text), size)], tools)


def without_ids(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def strip_ids(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_qwen3_json_tool_calls_equal_whole_parse(size):
    whole = parse_tool_calls(QWEN3)
    streamed = stream_tools(QWEN3, size)
    assert streamed[0] == whole[0] == "Let me check."
    assert without_ids(streamed[1]) == without_ids(whole[1]) == [("lookup", '{"q": "a<b", "n": 2}')]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_qwen3_coder_xml_tool_calls_equal_whole_parse(size):
    content, calls = stream_tools(CODER, size, CODER_TOOLS)
    assert content == ""
    assert without_ids(calls) == [("run", '{"cmd": "ls -l", "depth": 3}'), ("stop", "{}")]


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_every_split_point_and_random_chunking_parse_as_the_whole_text(sample):
    import random

    text = SAMPLES[sample]
    content, calls = parse_tool_calls(text, CODER_TOOLS)
    want = (content, without_ids(calls))
    got = stream_chunks(list(text), CODER_TOOLS)
    assert (got[0], without_ids(got[1])) == want
    for k in range(len(text) + 1):
        got = stream_chunks([text[:k], text[k:]], CODER_TOOLS)
        assert (got[0], without_ids(got[1])) == want, k
    rng = random.Random(sample)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got = stream_chunks(pieces, CODER_TOOLS)
        assert (got[0], without_ids(got[1])) == want, pieces


def test_json_arguments_are_the_object_as_written():
    content, calls = parse_tool_calls(SAMPLES[2])
    assert content == "atail"
    args = calls[0]["function"]["arguments"]
    assert args == SAMPLES[2].split('"arguments": ', 1)[1].split("}\n</tool_call>", 1)[0]
    assert json.loads(args) == {"path": 'x/"q".py', "body": "if a</b:\n\tpass \u00e9 caf\u00e9 \U0001f600",
                                "spans": [[1, 2], {"k": [True, None, -1500.0]}], "s": "}]{["}
    assert without_ids(calls)[1] == ("second", "{}")


def test_xml_values_become_a_json_object_typed_by_the_schema():
    content, calls = parse_tool_calls(SAMPLES[3], CODER_TOOLS)
    assert content == ""
    args = calls[0]["function"]["arguments"]
    assert json.loads(args) == {"cmd": 'echo "hi" \\ </b> caf\u00e9\n\nline2', "opts": {"a": [1, "</"]},
                                "extra": "plain words", "n": -2}
    assert args == json.dumps(json.loads(args), ensure_ascii=False)


def test_json_arguments_stream_as_they_are_written():
    p = ToolCallParser()
    assert p.feed("Hi <tool_call>\n{\"name\": \"f\", ") == ("Hi", [])
    _, items = p.feed('"arguments": {"q": "ab')
    assert items == [{"index": 0, "id": p.calls[0]["id"], "type": "function",
                      "function": {"name": "f", "arguments": '{"q": "ab'}}]
    # Only what could still be the close tag is held back.
    assert p.feed('c</')[1] == [{"index": 0, "function": {"arguments": "c"}}]
    assert p.feed('x"}')[1] == [{"index": 0, "function": {"arguments": '</x"}'}}]
    assert p.feed("}\n</tool_call>") == ("", [])
    assert p.calls[0]["function"]["arguments"] == '{"q": "abc</x"}'


def test_xml_arguments_stream_name_then_string_fragments_then_held_values():
    p = ToolCallParser(CODER_TOOLS)
    _, items = p.feed("<tool_call>\n<function=run>\n<parameter=cmd>\nls")
    assert items == [{"index": 0, "id": p.calls[0]["id"], "type": "function",
                      "function": {"name": "run", "arguments": '{"cmd": "ls'}}]
    # Trailing newlines may be the value's last (stripped) ones, and `</` a tag: both wait.
    assert p.feed(' "a"\n</')[1] == [{"index": 0, "function": {"arguments": ' \\"a\\"'}}]
    assert p.feed("parameter>\n<parameter=depth>\n1")[1] == [{"index": 0, "function": {"arguments": '", "depth": '}}]
    assert p.feed("2\n</parameter>\n")[1] == [{"index": 0, "function": {"arguments": "12"}}]
    assert p.feed("</function>\n</tool_call>")[1] == [{"index": 0, "function": {"arguments": "}"}}]
    assert json.loads(p.calls[0]["function"]["arguments"]) == {"cmd": 'ls "a"', "depth": 12}


def test_malformed_tool_call_is_kept_as_content():
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert stream_tools(text, 1) == (text, [])
    # The whitespace before a block that is no call stays with it.
    assert parse_tool_calls(SAMPLES[4]) == (SAMPLES[4], [])


def test_an_xml_function_ends_at_its_first_close_tag():
    assert without_ids(parse_tool_calls(SAMPLES[10])[1]) == [("f", "{}")]


def test_other_json_layouts_are_read_whole_at_the_close_tag():
    content, calls = parse_tool_calls(SAMPLES[5])
    assert content == "" and without_ids(calls) == [("late", '{"a": 1}'), ("s", '{"a": 2}')]


def test_unclosed_tool_call_at_end_is_still_parsed():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}')
    assert strip_ids(calls) == [("f", {})]


def test_output_cut_inside_arguments_keeps_the_call_with_what_was_written():
    assert without_ids(parse_tool_calls(SAMPLES[8])[1]) == [("cut", '{"a": "unfinished')]
    # XML arguments are closed where the call ends, as the whole-text reading did.
    assert without_ids(parse_tool_calls(SAMPLES[9], CODER_TOOLS)[1]) == [("run", '{"cmd": "unfinished"}')]


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


class _Delta:
    """The fields of an engine delta ChoiceBuilder reads."""

    def __init__(self, text, finished):
        self.text, self.finished, self.finish_reason = text, finished, "stop" if finished else None
        self.token_ids, self.logprobs = [], None
        self.completion_tokens = self.prompt_tokens = self.cached_tokens = 0


THINKING_CALL = ('<think>\nI could write <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> here.\n'
                 '</think>\n\nNo call needed.')


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_tool_call_inside_the_reasoning_stays_reasoning(size):
    b = ChoiceBuilder(0, reasoning=ReasoningParser(), tools=[{"type": "function", "function": {"name": "f"}}])
    streamed = {"reasoning_content": "", "content": "", "tool_calls": []}
    pieces = [THINKING_CALL[i:i + size] for i in range(0, len(THINKING_CALL), size)]
    for k, piece in enumerate(pieces):
        out = b.feed(_Delta(piece, k == len(pieces) - 1))
        for key, value in out.items():
            streamed[key] += value
    msg = b.message()
    assert "tool_calls" not in msg and b.finish_reason == "stop"
    assert msg["reasoning_content"] == streamed["reasoning_content"] == THINKING_CALL[8:].split("</think>")[0]
    assert msg["content"] == streamed["content"] == "No call needed."
    assert streamed["tool_calls"] == []


@pytest.mark.parametrize("size", [1, 1000])
def test_choice_builder_message_calls_are_the_streamed_items_joined(size):
    text = "<think>\nplan\n</think>\n\n" + CODER
    b = ChoiceBuilder(0, reasoning=ReasoningParser(), tools=CODER_TOOLS)
    items = []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        items += b.feed(_Delta(piece, k == len(pieces) - 1)).get("tool_calls", [])
    msg = b.message()
    assert msg["content"] is None and b.finish_reason == "tool_calls"
    assert msg["tool_calls"] == assemble(items)
    assert without_ids(msg["tool_calls"]) == [("run", '{"cmd": "ls -l", "depth": 3}'), ("stop", "{}")]
