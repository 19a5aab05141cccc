"""The Anthropic Messages API on the bundled demo model (a thinking model) through the official
`anthropic` SDK, against `ninfer serve`: thinking and text blocks, stop sequences, token counts,
thinking budgets, forced tool use and an agent's tool loop.

Greedy requests (temperature 0) with small `max_tokens` keep it fast and repeatable: a streamed
answer must equal the same request's non-streamed one.
"""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from server_process import ServerProcess
from test_demo_model import MODEL_DIR

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not trained yet")

MODEL = "ninfer-demo"
QUESTION = "Return the absolute value of a number."
#: Bounded fields: the demo model, never taught tool calls, writes runaway strings and digits
#: that the forced-call grammar alone cannot end.
WEATHER = {"name": "get_weather", "description": "The weather forecast of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model-id", MODEL]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def ask(client, stream: bool = False, **kw):
    """One greedy request, streamed through `messages.stream` or not (the SDK's `create` has no
    `temperature` argument any more: it goes in the body as an extra field)."""
    kw = dict(dict(model=MODEL, max_tokens=160, messages=user(QUESTION), extra_body={"temperature": 0}), **kw)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


def raw_events(server, body: dict) -> list:
    body = dict(dict(model=MODEL, max_tokens=160, temperature=0, messages=user(QUESTION)), **body, stream=True)
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def blocks(message) -> list:
    """The content blocks as dicts, without what differs between two answers of the same
    request (a tool call's id; a streamed message's text blocks carry a `parsed_output`)."""
    return [{k: v for k, v in b.model_dump().items() if k not in ("parsed_output", "id")} for b in message.content]


def test_thinking_then_text_blocks_streaming_and_not(client, server):
    r = ask(client)
    assert [b.type for b in r.content] == ["thinking", "text"], r.content
    assert r.content[0].thinking.strip() and r.content[1].text.strip()
    assert (r.stop_reason, r.stop_sequence) in (("end_turn", None), ("max_tokens", None))
    assert blocks(ask(client, stream=True)) == blocks(r)
    events = raw_events(server, {})
    kinds = [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block_")]
    assert kinds[0] == ("content_block_start", 0) and kinds[-1] == ("content_block_stop", 1)
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))


def test_thinking_disabled_answers_without_a_thinking_block(client):
    r = ask(client, thinking={"type": "disabled"})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()


def test_stop_sequence_cuts_the_answer_and_is_reported_streaming_and_not(client):
    free = ask(client)
    thinking, text = free.content[0].thinking, free.content[1].text
    # A word of the answer that the reasoning does not contain, so that it matches in the answer.
    words = [w for w in text.split() if len(w) > 2 and w not in thinking]
    assert words, text
    stop = words[len(words) // 2]
    for stream in (False, True):
        r = ask(client, stream=stream, stop_sequences=["never in the output", stop])
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
        assert [b.type for b in r.content] == ["thinking", "text"]
        assert r.content[0].thinking == thinking and r.content[1].text == text[:text.index(stop)]


def test_count_tokens_equals_the_usage_of_the_same_request(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Summarise it."}]}]
    for thinking in ({"type": "enabled", "budget_tokens": 16}, {"type": "disabled"}):
        kw = dict(model=MODEL, system="You are terse.", tools=[WEATHER], messages=msgs, thinking=thinking)
        counted = client.messages.count_tokens(**kw).input_tokens
        assert counted == ask(client, max_tokens=40, **kw).usage.input_tokens


def test_a_thinking_budget_leaves_room_for_the_answer(client):
    """Needs the thinking budget on the chat path (`thinking_budget`)."""
    questions = [QUESTION, "Split a path into its parts.", "Return True if the string is a number.",
                 "Join a list of lines.", "Read a config file."]
    answered = 0
    for q in questions:
        r = ask(client, max_tokens=32, messages=user(q), thinking={"type": "enabled", "budget_tokens": 8})
        text = "".join(b.text for b in r.content if b.type == "text")
        answered += bool(text.strip())
        assert r.usage.output_tokens <= 32
    assert answered >= len(questions) - 1


def check_call(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_tool_choice_any_makes_a_tool_use_block_streaming_and_not(client, server):
    """Needs forced tool calls on the chat path (`tool_choice` required / named)."""
    kw = dict(tools=[WEATHER], messages=user("What is the weather in Paris?"), max_tokens=200)
    # One call each (left free, the greedy demo model calls again and again until max_tokens).
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        r = ask(client, tool_choice=choice, **kw)
        calls = [b for b in r.content if b.type == "tool_use"]
        assert len(calls) == 1 and r.stop_reason == "tool_use", r.content
        check_call(calls[0])
        assert blocks(ask(client, stream=True, tool_choice=choice, **kw)) == blocks(r)
        events = raw_events(server, dict(kw, tool_choice=choice))
        starts = [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
        for s, c in zip(starts, calls, strict=True):
            assert (s["content_block"]["name"], s["content_block"]["input"]) == ("get_weather", {})
            fragments = [e["delta"]["partial_json"] for e in events
                         if e["type"] == "content_block_delta" and e["index"] == s["index"]]
            assert json.loads("".join(fragments)) == c.input


def test_agent_tool_loop_through_the_sdk(client):
    """An agent's loop: a forced tool call, the tool run in Python, its result sent back, and
    the model's final answer, with no call, which ends the loop (the demo model's answer is toy
    code that may well run to max_tokens). Needs forced tool calls on the chat path."""
    ran = []

    def get_weather(city: str, days: int = 1) -> str:
        ran.append(city)
        return f"{city}: sunny, 21 C for {days} day(s)"

    messages = user("What is the weather in Paris?")
    first = ask(client, max_tokens=200, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                messages=messages)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    for c in calls:
        check_call(c)
    messages = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": get_weather(**c.input)}
                                     for c in calls]}]
    second = ask(client, max_tokens=64, tools=[WEATHER], messages=messages)
    assert ran and second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content if b.type != "thinking"] == ["text"] and second.content[-1].text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_budget_without_room_for_an_answer_is_a_400_naming_budget_tokens(client):
    """Needs the thinking budget on the chat path (`thinking_budget`)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 16})
    assert e.value.body["error"]["param"] == "thinking.budget_tokens"
    assert "16" in e.value.body["error"]["message"] and "max_tokens" in e.value.body["error"]["message"]
