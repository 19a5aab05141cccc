"""The HTTP layer against a real server process driving the deterministic fake core.

What the fake core would answer is computed by running the same fake in-process (its own
oracle); these tests check that the server carries it faithfully: SSE framing, usage, tool
calls, reasoning, errors, disconnects, concurrency and metrics.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

# A test dependency (pyproject's test extra); the GPU machine runs `pytest -m gpu` without it.
openai = pytest.importorskip("openai")

from fake_core import FakeCore, MidwayFailingFakeCore
from ninfer.server.metrics import parse_metrics
from server_process import ServerProcess

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    with ServerProcess(["--core-factory", "fake_core:FakeCore", "--model-id", MODEL,
                        "--request-log-jsonl", str(log)]) as s:
        s.request_log = log
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_output(prompt_ids: list, max_tokens: int, **params) -> dict:
    """What the fake engine generates for these ids, run in-process (no server)."""
    core = FakeCore()
    core.submit("x", prompt_ids, json.dumps(dict(params, max_tokens=max_tokens)))
    text, ids, reason = "", [], None
    while reason is None:
        for d in core.step():
            text += d["text"]
            ids += d["token_ids"]
            reason = d["finish_reason"]
    return {"text": text, "ids": ids, "finish_reason": reason}


def chat_ids(messages, **kwargs) -> list:
    tok = FakeCore().tokenizer
    return tok.encode(tok.apply_chat_template(json.dumps(messages), None, True,
                                              json.dumps({"enable_thinking": True, **kwargs})))


def metrics(server) -> dict:
    return parse_metrics(httpx.get(server.url + "/metrics").text)


def test_health_and_models_report_the_served_model(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_chat_nonstream_returns_engine_output_and_usage(client):
    msgs = [{"role": "user", "content": "hello there"}]
    want = expected_output(chat_ids(msgs), 12, temperature=0.0)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_ids(msgs))
    assert r.usage.completion_tokens == 12


def test_chat_stream_equals_nonstream_and_ends_with_usage_chunk(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "content "}, {"type": "text", "text": "parts"}]}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completions_accept_token_ids_strings_and_lists(client):
    want = expected_output([5, 6, 7], 4, temperature=0.0)
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert r.choices[0].text == want["text"]
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], "abc"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == want["text"]
    assert r.choices[1].text == expected_output(list(b"abc"), 4, temperature=0.0)["text"]
    assert r.usage.prompt_tokens == 6


def test_chat_logprobs_carry_engine_values(client):
    msgs = [{"role": "user", "content": "logprobs"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(c.logprob == -0.25 and len(c.top_logprobs) == 2 for c in content)


def joined_tool_calls(chunks) -> list:
    """(index, name, arguments) of each streamed call: its first item names it, the rest add arguments."""
    calls = []
    for c in chunks:
        for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if t.id is not None:
                assert t.index == len(calls) and t.type == "function"
                calls.append([t.index, t.function.name, t.function.arguments or ""])
            else:
                assert t.function.name is None
                calls[t.index][2] += t.function.arguments
    return [tuple(c) for c in calls]


def test_tool_call_json_parsed_streaming_and_not(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msgs = [{"role": "user", "content": "say:" + call}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    tc = r.choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in tc] == [("get_weather", '{"city": "Paris"}')]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=200, stream=True))
    assert joined_tool_calls(chunks) == [(0, "get_weather", '{"city": "Paris"}')]
    # The fake core writes a byte a step: the arguments arrive in many fragments, before the close tag.
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 5
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_streamed_qwen3_coder_xml_arguments_join_to_the_whole_ones(client):
    call = ('<tool_call>\n<function=edit>\n<parameter=path>\na "b" </c>\n</parameter>\n<parameter=n>\n12\n'
            '</parameter>\n</function>\n</tool_call>\n<tool_call>\n{"name": "x", "arguments": {"y": ["</", {}]}}\n</tool_call>')
    msgs = [{"role": "user", "content": "say:" + call}]
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=160)
    whole = [(k, t.function.name, t.function.arguments) for k, t in enumerate(r.choices[0].message.tool_calls)]
    assert whole == [(0, "edit", '{"path": "a \\"b\\" </c>", "n": 12}'), (1, "x", '{"y": ["</", {}]}')]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=160, stream=True))
    assert joined_tool_calls(chunks) == whole


def test_a_call_cut_by_max_tokens_keeps_the_arguments_written_streaming_and_not(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France"}}\n</tool_call>'
    msgs = [{"role": "user", "content": "say:" + call}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    # <tool_call> is one token, then a byte a token: 53 tokens end inside the city.
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=53)
    assert r.choices[0].finish_reason == "length"
    [tc] = r.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments) == ("get_weather", '{"city": "Pari')
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=53, stream=True))
    assert joined_tool_calls(chunks) == [(0, "get_weather", '{"city": "Pari')]


def test_a_tool_call_inside_the_reasoning_is_no_call_streaming_and_not(client):
    text = '<think>\nmaybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n</think>\n\nNo.'
    msgs = [{"role": "user", "content": "say:" + text}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=200)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop" and msg.content == "No."
    reasoning = 'maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    assert msg.model_extra["reasoning_content"] == reasoning
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=200, stream=True))
    assert joined_tool_calls(chunks) == []
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices) == reasoning


def test_tool_call_qwen3_coder_xml_parsed_with_schema_types(client):
    call = ("<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=label>\n7\n</parameter>\n"
            "</function>\n</tool_call>")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "label": {"type": "string"}}}}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say:" + call}],
                                       tools=tools, max_tokens=200)
    tc = r.choices[0].message.tool_calls[0]
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "label": "7"}


def test_reasoning_content_split_from_think_block(client):
    msgs = [{"role": "user", "content": "say:<think>\nweigh it\n</think>\n\nThe answer."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200)
    msg = r.choices[0].message
    assert msg.content == "The answer."
    assert msg.model_extra["reasoning_content"] == "weigh it\n"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "weigh it\n"
    assert "".join(d.content or "" for d in deltas) == "The answer."


def test_no_thinking_kwarg_reaches_the_template(server):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}
    toks = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    assert toks == chat_ids(body["messages"], enable_thinking=False)


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": "not a list"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    # Tool definitions the template and the tool-call parser cannot read (a 500 once the model
    # emitted a call, before).
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": "f"}]}, 400, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, 400, "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}]}, 400,
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": 5}}]}, 400,
     "tools[0].function.name"),
])
def test_malformed_requests_get_openai_errors_and_server_keeps_serving(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_inputs_that_raised_500s_are_400s_and_the_server_keeps_serving(server):
    """Found by probing the server: each of these was a 500 (an exception past the
    validators), one of them a dropped keep-alive connection."""
    url = server.url
    cases = [
        # token ids travel as u32
        ("/v1/completions", {"prompt": [4294967296], "max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [2 ** 40]], "max_tokens": 3}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ("/v1/messages", {"max_tokens": 3, "system": [{"text": 5}], "messages": [{"role": "user", "content": "hi"}]},
         "system[0].text"),
        ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"text": 5}]}]}]}, "messages[0].content[0].content[0].text"),
        ("/v1/messages", {"max_tokens": 3, "tools": 5, "messages": [{"role": "user", "content": "hi"}]}, "tools"),
        ("/v1/messages", {"max_tokens": 3, "tools": [{"name": "f", "input_schema": [1]}],
                          "messages": [{"role": "user", "content": "hi"}]}, "tools[0].function.parameters"),
    ]
    for path, body, param in cases:
        for stream in (False, True):
            b = dict(body, stream=True) if stream and path != "/tokenize" else body
            r = httpx.post(url + path, json=b)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            assert r.json()["error"]["param"] == param, (path, r.text)
    assert httpx.get(url + "/health").status_code == 200


def test_deep_nesting_and_integer_overflow_past_the_validators_are_400s():
    from ninfer.server.errors import to_api_error

    err = to_api_error(RecursionError("maximum recursion depth exceeded while encoding a JSON object"))
    assert err.status == 400 and "nested too deeply" in err.message
    err = to_api_error(OverflowError("out of range integral type conversion attempted"))
    assert err.status == 400 and "out of range" in err.message


def test_invalid_json_body_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_context_overflow_names_both_numbers(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 500, "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "500" in msg and "100" in msg and "512" in msg


def test_request_id_header_echoed_or_assigned(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert len(httpx.get(server.url + "/v1/models").headers["x-request-id"]) >= 16
    assert httpx.post(server.url + "/v1/completions", json={}).headers["x-request-id"]


def test_concurrent_requests_with_the_same_request_id_both_run(server):
    """A client that reuses its x-request-id across concurrent requests gets both answered (the
    engine ids were the header's, and the second was refused as already in flight)."""
    import concurrent.futures

    body = {"model": MODEL, "prompt": "same id", "max_tokens": 40, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: httpx.post(server.url + "/v1/completions", json=body,
                                                 headers={"x-request-id": "dup-1"}, timeout=60), range(2)))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert all(r.headers["x-request-id"] == "dup-1" for r in rs)


def test_n_choices_use_derived_seeds(client):
    r = client.completions.create(model=MODEL, prompt="seeded", max_tokens=6, n=3, seed=7, temperature=1.0)
    texts = [c.text for c in r.choices]
    ids = list(b"seeded")
    assert texts == [expected_output(ids, 6, temperature=1.0, seed=7 + i)["text"] for i in range(3)]


def test_tokenize_detokenize_round_trip(server):
    toks = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks}).json()["prompt"] == "héllo"
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_anthropic_messages_streaming_and_not(server):
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "say:Hello!"}]}
    r = httpx.post(server.url + "/v1/messages", json=body).json()
    assert r["content"] == [{"type": "text", "text": "Hello!"}] and r["stop_reason"] == "end_turn"
    with httpx.stream("POST", server.url + "/v1/messages", json=dict(body, stream=True)) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello!"


def test_32_concurrent_streams_equal_their_solo_output(server):
    import concurrent.futures

    def run(i):
        body = {"model": MODEL, "prompt": f"prompt number {i}", "max_tokens": 16, "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, range(32)))
    assert got == [expected_output(list(f"prompt number {i}".encode()), 16, temperature=0.0)["text"] for i in range(32)]
    assert metrics(server)["ninfer_max_batch_size_seen"] > 1


def test_prefix_cache_hit_counted_with_identical_output(client, server):
    msgs = [{"role": "user", "content": "a long shared system prompt " * 4}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    before = metrics(server)["ninfer_prefix_cache_hit_tokens_total"]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metrics(server)["ninfer_prefix_cache_hit_tokens_total"] > before
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_request_log_has_a_line_per_request(client, server):
    client.completions.create(model=MODEL, prompt="logged", max_tokens=2)
    time.sleep(0.1)
    lines = [json.loads(x) for x in server.request_log.read_text().splitlines()]
    last = lines[-1]
    assert last["completion_tokens"] == 2 and last["prompt_tokens"] == 6 and last["finish_reason"] == "length"
    assert last["queue_prefill_s"] >= 0 and last["decode_s"] >= 0


def test_metrics_expose_latency_histograms_and_engine_gauges(client, server):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    m = metrics(server)
    assert m["ninfer_time_to_first_token_seconds_count"] >= 1
    assert m["ninfer_inter_token_latency_seconds_count"] >= 1
    for key in ("ninfer_num_requests_running", "ninfer_num_requests_waiting", "ninfer_kv_blocks_used",
                "ninfer_generation_tokens_total", 'ninfer_requests_total{finish_reason="length"}'):
        assert key in m


def test_assistant_tool_call_history_and_tool_results_are_accepted(client):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        {"role": "user", "content": "say:It is 21C."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50)
    assert r.choices[0].message.content == "It is 21C."


def test_streamed_n_choices_carry_their_index(server):
    body = {"model": MODEL, "prompt": "many", "max_tokens": 4, "n": 2, "seed": 3, "temperature": 1.0, "stream": True}
    texts = {0: "", 1: ""}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    ids = list(b"many")
    assert [texts[0], texts[1]] == [expected_output(ids, 4, temperature=1.0, seed=3 + i)["text"] for i in range(2)]



def test_a_request_failing_midway_is_an_anthropic_error_event_on_messages():
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "please fail midway"}]}
    with ServerProcess(["--core-factory", "fake_core:MidwayFailingFakeCore", "--model-id", MODEL]) as s:
        r = httpx.post(s.url + "/v1/messages", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "response_format" and "grammar" in r.json()["error"]["message"]
        events = []
        with httpx.stream("POST", s.url + "/v1/messages", json=dict(body, stream=True)) as r:
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
        names = [n for n, _ in events]
        assert names[-1] == "error" and "message_stop" not in names and "message_delta" not in names, names
        assert events[-1][1] == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": MidwayFailingFakeCore.ERROR}}
        text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
        assert len(text) == 3, "the partial output streamed before the error"
        ok = httpx.post(s.url + "/v1/messages", json=dict(body, messages=[{"role": "user", "content": "hello"}]))
        assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"


def test_completion_suffix_is_refused_not_ignored(server):
    """`suffix` (fill in the middle) is not implemented: a non-empty one is a 400 naming it, rather
    than an answer that silently ignores the text after the insertion point."""
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 3}
    for suffix, code in (("):\n    return 1", "unsupported"), (7, None)):
        r = httpx.post(server.url + "/v1/completions", json=dict(body, suffix=suffix))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "suffix" and err["code"] == code and err["type"] == "invalid_request_error", err
    for suffix in (None, ""):
        assert httpx.post(server.url + "/v1/completions", json=dict(body, suffix=suffix)).status_code == 200
