"""Forced tool calls (`tool_choice` "required" / a named function) through `ninfer serve`.

On the demo model (Qwen3 JSON calls; it was never taught tool calls, so a schema-valid call is
the grammar's doing) and on a tiny random Qwen3 whose template writes Qwen3-Coder XML calls.
The official `openai` client sends the requests; `jsonschema` checks every call's arguments.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ninfer import _core
from server_process import ServerProcess

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

openai = pytest.importorskip("openai")
from json_schema_check import validate

MODEL = "demo"
#: Bounded arguments, so that a model that never saw a tool call still completes one.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SEEDS = range(5)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model-id", MODEL]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: list, allowed: set) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"]
        name = call["function"]["name"]
        assert name in allowed
        validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def streamed(stream) -> tuple:
    """(tool calls, finish_reason, content) assembled from a chat stream: a call's first item
    carries its id and name, later items argument fragments; one item may hold a whole call."""
    calls, finish, content = {}, None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or ():
                if item.id:
                    calls[item.index] = {"id": item.id, "type": "function",
                                         "function": {"name": item.function.name, "arguments": ""}}
                calls[item.index]["function"]["arguments"] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_a_forced_call_always_comes_back_with_valid_arguments(client, choice):
    allowed = set(SCHEMAS) if choice == "required" else {"add"}
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, seed=seed, max_tokens=80, extra_body=NO_THINKING)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        assert c.message.content is None
        calls = [t.model_dump() for t in c.message.tool_calls]
        assert len(calls) == 1
        check_calls(calls, allowed)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_streamed_forced_call_has_valid_arguments(client, choice):
    allowed = set(SCHEMAS) if choice == "required" else {"get_weather"}
    for seed in SEEDS:
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=False, seed=seed, max_tokens=80, stream=True,
                                                extra_body=NO_THINKING)
        calls, finish, content = streamed(stream)
        assert finish == "tool_calls" and content == ""
        assert len(calls) == 1
        check_calls(calls, allowed)


def test_a_named_function_is_called_once_even_with_parallel_calls_allowed(client):
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1


def test_required_with_parallel_calls_admits_several(client):
    counts = []
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           seed=seed, max_tokens=120, extra_body=NO_THINKING)
        c = r.choices[0]
        calls = [t.model_dump() for t in c.message.tool_calls or ()]
        assert c.finish_reason in ("tool_calls", "length")
        # A call cut short by max_tokens keeps the arguments written so far (as OpenAI does);
        # every call before it is complete and valid.
        complete = calls if c.finish_reason == "tool_calls" else calls[:-1]
        assert calls
        if complete:
            check_calls(complete, set(SCHEMAS))
        counts.append(len(calls))
    assert max(counts) > 1


def test_reasoning_comes_first_and_stays_apart(client):
    """Thinking on: the demo model writes its <think> block, then the call; the reasoning parser
    still splits the block off (a tool grammar is not treated as a plain constrained answer)."""
    complete = 0
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=seed, max_tokens=300)
        c = r.choices[0]
        reasoning = c.message.model_dump().get("reasoning_content")
        assert reasoning, c.message
        assert "<think>" not in reasoning and "</think>" not in reasoning
        if c.finish_reason == "tool_calls":
            complete += 1
            assert c.message.content is None
            check_calls([t.model_dump() for t in c.message.tool_calls], set(SCHEMAS))
        else:  # max_tokens cut the reasoning or the call after it: no other content
            assert c.finish_reason == "length"
            assert (c.message.content or "<tool_call>").startswith("<tool_call>")
    assert complete >= len(SEEDS) // 2


def test_a_named_function_that_is_not_a_tool_is_a_400_naming_it_and_the_tools(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "lookup"}})
    err = e.value.body
    assert err["param"] == "tool_choice"
    assert "'lookup'" in err["message"] and "get_weather, add" in err["message"]


def test_a_tool_schema_the_grammar_cannot_compile_is_a_400_naming_the_tools(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[bad], tool_choice="required",
                                       max_tokens=4)
    assert e.value.body["param"] == "tools"


@pytest.fixture(scope="module")
def coder_dir(qwen3_dir, tmp_path_factory):
    """The tiny random Qwen3 with a template that writes Qwen3-Coder XML calls."""
    from tiny_tokenizer import make_tokenizer

    path = tmp_path_factory.mktemp("qwen3_coder") / "model"
    shutil.copytree(qwen3_dir, path)
    make_tokenizer(path, style="qwen3", vocab_size=448, template="qwen3_coder.jinja")
    return path


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 8},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                   "urgent": {"type": "boolean"}},
    "required": ["title", "urgent"]}}}


def test_a_qwen3_coder_template_gets_xml_calls(coder_dir):
    with ServerProcess([str(coder_dir), "--model-id", "coder", "--max-context", "1024"]) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for seed in SEEDS:
            for stream in (False, True):
                kwargs = dict(model="coder", messages=MESSAGES, tools=[NOTE, ADD], parallel_tool_calls=False,
                              tool_choice={"type": "function", "function": {"name": "note"}}, seed=seed,
                              max_tokens=300, stream=stream,
                              extra_body=None if stream else {"return_token_ids": True})
                if stream:
                    calls, finish, _ = streamed(client.chat.completions.create(**kwargs))
                else:
                    r = client.chat.completions.create(**kwargs)
                    finish = r.choices[0].finish_reason
                    calls = [t.model_dump() for t in r.choices[0].message.tool_calls or ()]
                    text = _core.Tokenizer(str(coder_dir)).decode(r.choices[0].model_dump()["token_ids"], False)
                    assert text.startswith("<tool_call>\n<function=note>\n<parameter=title>\n")
                assert finish == "tool_calls" and len(calls) == 1
                assert calls[0]["function"]["name"] == "note"
                validate(json.loads(calls[0]["function"]["arguments"]), NOTE["function"]["parameters"])
