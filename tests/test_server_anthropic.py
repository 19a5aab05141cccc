"""/v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK, against a real
server process driving the deterministic fake core (tests/fake_core.py: a prompt whose last
`say:` is followed by text makes the "model" write exactly that text), plus the body translation.

What the server must carry: content blocks (thinking, text, tool_use) streaming and not, stop
sequences, tool_result histories, tool_choice and thinking mapped onto the chat body, token
counts equal to the usage of the same request.
"""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from ninfer.server.anthropic_body import TOOL_ERROR_PREFIX, to_chat_body
from ninfer.server.errors import ApiError
from server_process import ServerProcess

MODEL = "fake-model"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--model-id", MODEL, "--max-context", "2048"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def raw_events(server, body: dict) -> list:
    """The parsed `data:` of every event of a streamed /v1/messages request."""
    with httpx.stream("POST", server.url + "/v1/messages", json=dict(body, stream=True), timeout=60) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def check_block_order(events: list) -> None:
    """Blocks start at index 0, 1, ... and each stops before the next starts."""
    opened = None
    starts = 0
    for e in events:
        if e["type"] == "content_block_start":
            assert opened is None and e["index"] == starts, events
            opened, starts = e["index"], starts + 1
        elif e["type"] == "content_block_delta":
            assert e["index"] == opened, events
        elif e["type"] == "content_block_stop":
            assert e["index"] == opened, events
            opened = None
    assert opened is None


def blocks(message) -> list:
    """The content blocks as dicts, without what differs between two answers of the same
    request (a tool call's id; a streamed message's text blocks carry a `parsed_output`)."""
    return [{k: v for k, v in b.model_dump().items() if k not in ("parsed_output", "id")} for b in message.content]


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_text_streaming_and_not(client):
    r = client.messages.create(model=MODEL, max_tokens=50, messages=user("say:Hello there!"))
    assert [(b.type, b.text) for b in r.content] == [("text", "Hello there!")]
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("end_turn", None, len("Hello there!") + 1)
    with client.messages.stream(model=MODEL, max_tokens=50, messages=user("say:Hello there!")) as s:
        assert "".join(s.text_stream) == "Hello there!"
        final = s.get_final_message()
    assert blocks(final) == blocks(r) and final.stop_reason == "end_turn" and final.usage == r.usage


def test_stop_sequence_is_reported_streaming_and_not(client, server):
    # One-character stop sequences: the fake core does not hold back the start of a longer one
    # (the real core's cut is tested on the demo model).
    kw = dict(model=MODEL, max_tokens=50, messages=user("say:one two; three, four"), stop_sequences=["|", ","])
    r = client.messages.create(**kw)
    assert [b.text for b in r.content] == ["one two; three"]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", ",")
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (blocks(final), final.stop_reason, final.stop_sequence) == (blocks(r), "stop_sequence", ",")
    delta = [e for e in raw_events(server, kw) if e["type"] == "message_delta"]
    assert [e["delta"] for e in delta] == [{"stop_reason": "stop_sequence", "stop_sequence": ","}]
    unmatched = client.messages.create(**dict(kw, stop_sequences=["absent"]))
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)
    capped = client.messages.create(**dict(kw, max_tokens=3, stop_sequences=["absent"]))
    assert (capped.stop_reason, capped.stop_sequence) == ("max_tokens", None)


def test_thinking_blocks_streaming_and_not(client, server):
    kw = dict(model=MODEL, max_tokens=100, messages=user("say:<think>\nweigh it\n</think>\n\nThe answer."))
    r = client.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (r.content[0].thinking, r.content[0].signature, r.content[1].text) == ("weigh it\n", "", "The answer.")
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert blocks(final) == blocks(r)
    events = raw_events(server, kw)
    check_block_order(events)
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert "thinking_delta" in kinds and kinds.index("signature_delta") < kinds.index("text_delta")


def test_tool_use_blocks_streaming_and_not(client, server):
    kw = dict(model=MODEL, max_tokens=200, tools=[WEATHER], messages=user("say:Let me check." + CALL))
    r = client.messages.create(**kw)
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.stop_reason == "tool_use"
    call = r.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 2}) and call.id
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris", "days": 2})
    events = raw_events(server, kw)
    check_block_order(events)
    start = [e["content_block"] for e in events if e["type"] == "content_block_start"][1]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {} and start["id"]
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == 1]
    assert json.loads("".join(fragments)) == {"city": "Paris", "days": 2}


def test_a_tool_call_cut_by_max_tokens_is_a_tool_use_block_with_the_fragments_written(client, server):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France"}}\n</tool_call>'
    # <tool_call> is one token, then a byte a token: 53 tokens end inside the city.
    kw = dict(model=MODEL, max_tokens=53, tools=[WEATHER], messages=user("say:" + call))
    r = client.messages.create(**kw)
    assert r.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {})]
    events = raw_events(server, kw)
    check_block_order(events)
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta") == '{"city": "Pari'
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    # The SDK's partial parse drops an unfinished string: the same input as the whole answer's.
    assert final.stop_reason == "max_tokens" and final.content[0].input == {}


def test_two_tool_calls_are_two_blocks_in_order(server):
    second = CALL.replace("Paris", "Oslo")
    events = raw_events(server, {"model": MODEL, "max_tokens": 300, "tools": [WEATHER],
                                 "messages": user("say:" + CALL + second)})
    check_block_order(events)
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["tool_use", "tool_use"] and blocks[0]["id"] != blocks[1]["id"]
    args = ["".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == i)
            for i in (0, 1)]
    assert [json.loads(a)["city"] for a in args] == ["Paris", "Oslo"]


def history(result_content, is_error=False) -> list:
    """A conversation with one tool call and its result."""
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}
    if is_error:
        result["is_error"] = True
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]},
    ]


def chat_history(result_text: str) -> list:
    """The chat messages `history` stands for."""
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": result_text},
        {"role": "user", "content": "Thanks."},
    ]


@pytest.mark.parametrize("content, is_error, text", [
    ("sunny, 21 C", False, "sunny, 21 C"),
    ([{"type": "text", "text": "sunny, "}, {"type": "text", "text": "21 C"}], False, "sunny, 21 C"),
    ([{"type": "text", "text": "city not found"}], True, TOOL_ERROR_PREFIX + "city not found"),
])
def test_tool_result_histories_render_as_the_chat_messages_they_stand_for(client, server, content, is_error, text):
    msgs = history(content, is_error)
    assert to_chat_body({"max_tokens": 5, "messages": msgs})["messages"] == chat_history(text)
    counted = client.messages.count_tokens(model=MODEL, messages=msgs, system="Be brief.", tools=[WEATHER])
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    ids = httpx.post(server.url + "/tokenize", json={
        "messages": [{"role": "system", "content": "Be brief."}] + chat_history(text), "tools": tools}).json()["tokens"]
    assert counted.input_tokens == len(ids)
    r = client.messages.create(model=MODEL, max_tokens=20, messages=msgs, system="Be brief.", tools=[WEATHER])
    assert r.usage.input_tokens == counted.input_tokens


def test_count_tokens_equals_the_usage_of_the_same_request(client):
    for thinking in ({"type": "enabled", "budget_tokens": 16}, {"type": "disabled"}):
        kw = dict(model=MODEL, system=[{"type": "text", "text": "You are terse."}], tools=[WEATHER],
                  messages=user("say:ok"), thinking=thinking)
        counted = client.messages.count_tokens(**kw).input_tokens
        assert counted == client.messages.create(max_tokens=64, **kw).usage.input_tokens
    enabled = client.messages.count_tokens(model=MODEL, messages=user("hi")).input_tokens
    disabled = client.messages.count_tokens(model=MODEL, messages=user("hi"), thinking={"type": "disabled"}).input_tokens
    assert disabled > enabled, "thinking disabled renders the template's empty think block"


def test_agent_loop_tool_use_then_tool_result_then_answer(client):
    """The SDK's tool loop: the model asks for a tool, the client runs it and sends the result
    back, the model answers from it (the fake core writes what the tool result tells it to)."""
    def get_weather(city: str, days: int = 1) -> str:
        return f"say:{city} will be sunny for {days} days."

    messages = user("say:" + CALL)
    first = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=messages)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": get_weather(**c.input)}
                                              for c in calls]}]
    second = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=messages)
    assert second.stop_reason == "end_turn"
    assert [b.text for b in second.content if b.type == "text"] == ["Paris will be sunny for 2 days."]


@pytest.mark.parametrize("block, param", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
     "messages[0].content[0]"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
     "messages[0].content[0].content[0]"),
    ({"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": "yes"}, "messages[0].content[0].is_error"),
])
def test_unsupported_blocks_are_a_400_naming_the_block(client, block, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [block]}])
    assert e.value.status_code == 400 and e.value.body["error"]["param"] == param
    if "image" in json.dumps(block):
        assert "image blocks are not supported" in e.value.body["error"]["message"]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather"}, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "auto", "disable_parallel_tool_use": False}, {"tool_choice": "auto"}),
])
def test_tool_choice_maps_onto_the_chat_body(choice, expected):
    chat = to_chat_body({"max_tokens": 5, "tools": [WEATHER], "tool_choice": choice, "messages": user("x")})
    assert {k: chat[k] for k in ("tool_choice", "parallel_tool_calls") if k in chat} == expected


@pytest.mark.parametrize("thinking, expected", [
    ({"type": "enabled", "budget_tokens": 8}, {"thinking_budget": 8, "chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "enabled", "budget_tokens": 0}, {"thinking_budget": 0, "chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "enabled"}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "adaptive"}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "disabled"}, {"chat_template_kwargs": {"enable_thinking": False}}),
])
def test_thinking_maps_onto_the_chat_body(thinking, expected):
    chat = to_chat_body({"max_tokens": 50, "thinking": thinking, "messages": user("x")})
    assert {k: chat[k] for k in ("thinking_budget", "chat_template_kwargs") if k in chat} == expected


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any", "disable_parallel_tool_use": 1}}, "tool_choice.disable_parallel_tool_use"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2.5}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages[0].content[0].input"),
])
def test_bad_anthropic_fields_are_a_400_naming_them(body, param):
    with pytest.raises(ApiError) as e:
        to_chat_body({"max_tokens": 50, "tools": [WEATHER], "messages": user("x"), **body})
    assert (e.value.status, e.value.param) == (400, param)


def test_count_tokens_route_checks_its_body(server):
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "other", "messages": user("x")})
    assert r.status_code == 404


def stream_events(*deltas) -> list:
    """The events `BlockStream` makes of these chat delta fields, parsed."""
    from ninfer.server.routes_anthropic import BlockStream

    s = BlockStream()
    raw = [e for d in deltas for e in s.feed(d)] + s.close()
    return [json.loads(e.split(b"data: ", 1)[1]) for e in raw]


def test_tool_calls_streamed_as_fragments_become_input_json_deltas_of_one_block_each():
    """The chat path's streamed tool calls: a first item with id and name, then argument
    fragments by index; two calls, text before them."""
    events = stream_events(
        {"reasoning_content": "think"}, {"content": "Let me check."},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}},
                        {"index": 1, "function": {"arguments": 'ty": "Oslo"}'}}]})
    check_block_order(events)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b.get("id")) for b in starts] == [("thinking", None), ("text", None), ("tool_use", "call_a"),
                                                          ("tool_use", "call_b")]
    assert starts[0]["signature"] == "" and starts[2]["input"] == {}
    args = ["".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == i)
            for i in (2, 3)]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0] == [
        "thinking_delta", "signature_delta"]


def test_a_whole_tool_call_in_one_item_is_one_block_with_one_input_json_delta():
    events = stream_events({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                            "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert events[1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}}, "thinking"),
])
def test_count_tokens_refuses_a_malformed_body_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert param in r.text, r.text
