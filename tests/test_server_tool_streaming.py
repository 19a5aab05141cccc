"""Streamed tool-call arguments on a real server with the bundled demo model.

The demo model does not call tools on its own, so a `response_format` lark grammar makes it
write calls in each format (Qwen3 JSON, Qwen3-Coder XML) with sampled argument text; with `tools`
given the server parses them. Over seeded requests, the fragments a stream carries join to the
arguments of the same request answered whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from server_process import ServerProcess

MODEL = "demo"
DEMO_DIR = Path(os.environ.get("NINFER_DEMO_DIR", Path(__file__).resolve().parents[1] / "python" / "ninfer" / "demo"))
pytestmark = pytest.mark.skipif(not (DEMO_DIR / "model" / "config.json").exists(), reason="demo model not trained yet")
SEEDS = range(5)

#: A JSON string's text: an escaped quote, then letters, `</`, escapes and a non-ASCII letter, then `</`.
_TEXT = r'/\\"([a-z <\/é]|\\"|\\\\|\\n){1,10}<\//'
JSON_CALLS = r'''
start: call "\n" call2
call: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" TEXT "\", \"days\": [" INT ", " INT "], \"opts\": {\"unit\": \"" TEXT "\", \"deep\": {\"k\": [" INT "]}}}}\n</tool_call>"
call2: "<tool_call>\n{\"name\": \"run\", \"arguments\": {\"cmd\": \"" TEXT "\"}}\n</tool_call>"
TEXT: ''' + _TEXT + r'''
INT: /-?(0|[1-9][0-9]{0,2})/
'''
XML_CALL = r'''
start: "<tool_call>\n<function=run>\n<parameter=cmd>\n" CMD "\n</parameter>\n<parameter=depth>\n" INT "\n</parameter>\n<parameter=note>\n" CMD "\n</parameter>\n</function>\n</tool_call>"
CMD: /[a-z "\\<\/é\n]{1,16}/
INT: /-?(0|[1-9][0-9]{0,2})/
'''
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}, "days": {"type": "array"}, "opts": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
             "cmd": {"type": "string"}, "depth": {"type": "integer"}, "note": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def client():
    with ServerProcess([str(DEMO_DIR / "model"), "--model-id", MODEL]) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def request(client, lark: str, seed: int, stream: bool):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Call the tools."}], tools=TOOLS, max_tokens=200,
        temperature=1.0, seed=seed, stream=stream, extra_body={"response_format": {"type": "lark", "lark": lark}})


def streamed_calls(chunks) -> tuple:
    """((index, id, name, joined arguments) per call, number of chunks that carried tool-call items)."""
    calls, carrying = [], 0
    for c in chunks:
        items = (c.choices[0].delta.tool_calls or []) if c.choices else []
        carrying += bool(items)
        for t in items:
            if t.id is not None:
                assert t.index == len(calls) and t.type == "function" and t.function.name
                calls.append([t.index, t.id, t.function.name, t.function.arguments or ""])
            else:
                assert t.function.name is None and t.index == len(calls) - 1
                calls[t.index][3] += t.function.arguments
    return [tuple(c) for c in calls], carrying


def check_stream_joins_to_whole(client, lark: str, seed: int) -> list:
    whole = request(client, lark, seed, stream=False).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    chunks = list(request(client, lark, seed, stream=True))
    calls, carrying = streamed_calls(chunks)
    assert [(name, args) for _, _, name, args in calls] == want
    # The arguments came in fragments, as the model wrote them, not one item per call.
    assert carrying > 2 * len(calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return [(name, json.loads(args)) for name, args in want]


@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_qwen3_json_arguments_join_to_the_non_streamed_ones(client, seed):
    calls = check_stream_joins_to_whole(client, JSON_CALLS, seed)
    assert [name for name, _ in calls] == ["get_weather", "run"]
    args = calls[0][1]
    assert set(args) == {"city", "days", "opts"} and len(args["days"]) == 2 and set(args["opts"]) == {"unit", "deep"}
    assert isinstance(calls[1][1]["cmd"], str)


@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_qwen3_coder_xml_arguments_join_to_the_non_streamed_ones(client, seed):
    [(name, args)] = check_stream_joins_to_whole(client, XML_CALL, seed)
    assert name == "run" and list(args) == ["cmd", "depth", "note"]
    assert isinstance(args["cmd"], str) and isinstance(args["depth"], int) and isinstance(args["note"], str)
