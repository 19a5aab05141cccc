"""Thinking budgets through a real `ninfer serve` on the bundled demo model.

The demo model reasons for 30-45 tokens before it answers, so with `max_tokens: 32` most seeded
requests end inside the reasoning with empty content. A budget of 8 tokens makes the engine close
the reasoning after 8 tokens and leaves room for the answer; `reasoning_effort` maps onto the
server's table (this server sets `low` to 8 tokens), and usage reports the engine's count of
reasoning tokens, which the reasoning text itself never exceeds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from ninfer import _core
from server_process import ServerProcess

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

MODEL_DIR = Path(__file__).resolve().parents[1] / "python" / "ninfer" / "demo" / "model"
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not trained yet")

MODEL = "demo"
MESSAGES = [{"role": "user", "content": "Return the sum of the numbers in a list."}]
SEEDS = range(10)
LOW = 8


@pytest.fixture(scope="module")
def server():
    with ServerProcess([str(MODEL_DIR), "--model-id", MODEL, "--max-context", "512",
                        "--reasoning-effort-budgets", f"low={LOW},medium=16"], ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    return _core.Tokenizer(str(MODEL_DIR))


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def answers(server, **fields) -> list:
    out = []
    for seed in SEEDS:
        r = chat(server, seed=seed, **fields)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def assert_within_budget(replies: list, budget: int, tokenizer) -> None:
    for r in replies:
        message, usage = r["choices"][0]["message"], r["usage"]
        reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
        assert reasoning <= budget, r
        text = (message.get("reasoning_content") or "").strip()
        assert text, r
        assert len(tokenizer.encode(text, False)) <= budget, r


def non_empty(replies: list) -> int:
    return sum(bool((r["choices"][0]["message"]["content"] or "").strip()) for r in replies)


def test_without_a_budget_the_demo_reasoning_runs_past_32_tokens(server):
    replies = answers(server)
    assert non_empty(replies) <= 5, "the baseline this feature fixes: most requests end inside the reasoning"
    assert max(r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in replies) > 25


def test_a_budget_of_8_leaves_room_for_the_answer(server, tokenizer):
    replies = answers(server, thinking_budget=8)
    assert non_empty(replies) >= 9, [r["choices"][0]["message"] for r in replies]
    assert_within_budget(replies, 8, tokenizer)
    for r in replies:
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8, r


def test_reasoning_effort_low_uses_the_server_table(server, tokenizer):
    replies = answers(server, reasoning_effort="low")
    assert non_empty(replies) >= 9, [r["choices"][0]["message"] for r in replies]
    assert_within_budget(replies, LOW, tokenizer)


def test_thinking_budget_wins_over_reasoning_effort(server, tokenizer):
    r = chat(server, seed=3, thinking_budget=2, reasoning_effort="medium", max_tokens=40)
    assert r.status_code == 200, r.text
    assert_within_budget([r.json()], 2, tokenizer)


def test_budget_zero_closes_the_reasoning_at_once(server):
    r = chat(server, seed=1, thinking_budget=0).json()
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert not (r["choices"][0]["message"].get("reasoning_content") or "").strip()
    assert r["choices"][0]["message"]["content"].strip()


def test_thinking_disabled_yields_no_reasoning(server):
    for seed in range(3):
        r = chat(server, seed=seed, thinking_budget=8, chat_template_kwargs={"enable_thinking": False}).json()
        message = r["choices"][0]["message"]
        assert not message.get("reasoning_content"), message
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_streaming_usage_reports_reasoning_tokens(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "seed": 4, "thinking_budget": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 6
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content.strip()


@pytest.mark.parametrize("fields, param, words", [
    ({"thinking_budget": 30}, "thinking_budget", ["30", "32"]),
    ({"thinking_budget": 29, "max_tokens": 32}, "thinking_budget", ["29", "32"]),
    ({"reasoning_effort": "low", "max_tokens": 3}, "reasoning_effort", ["low", "max_tokens 3"]),
    ({"thinking_budget": -1}, "thinking_budget", ["-1"]),
    ({"thinking_budget": "8"}, "thinking_budget", ["'8'"]),
    ({"thinking_budget": 2.5}, "thinking_budget", ["2.5"]),
    ({"thinking_budget": 2**40, "max_tokens": None}, "thinking_budget", [str(2**40)]),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", ["extreme", "low", "medium", "high"]),
    ({"reasoning_effort": 3}, "reasoning_effort", ["3"]),
])
def test_bad_budgets_are_400s_naming_the_field(server, fields, param, words):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for w in words:
        assert w in error["message"], error


def test_metrics_count_reasoning_apart_from_answer_tokens(server):
    chat(server, seed=2, thinking_budget=5)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^ninfer_(\w+) ([0-9.e+]+)$", text, re.M)}
    assert values["reasoning_tokens_total"] >= 5
    assert values["answer_tokens_total"] == values["generation_tokens_total"] - values["reasoning_tokens_total"]
    assert values["engine_reasoning_tokens_total"] >= values["reasoning_tokens_total"]


def _state(**defaults):
    from types import SimpleNamespace

    from ninfer.server.protocol import ServerDefaults
    from ninfer.server.state import ServerState

    state = ServerState(ServerDefaults(model_id=MODEL, **defaults))
    state.engine = SimpleNamespace(core=SimpleNamespace(thinking_closing_tokens=lambda message: 3 + len(message or "")))
    return state


def _fields(state, **body):
    from ninfer.server.protocol import parse_chat

    return state.thinking_fields(parse_chat({"messages": MESSAGES, **body}, state.defaults))


def test_the_server_default_budget_applies_only_where_it_leaves_room():
    state = _state(reasoning_budget=100, reasoning_budget_message="ab")
    assert _fields(state, max_tokens=200) == {"thinking_budget": 100, "thinking_budget_message": "ab"}
    assert _fields(state) == {"thinking_budget": 100, "thinking_budget_message": "ab"}
    # 100 + 5 closing tokens leave no room in 105: the default steps aside instead of a 400.
    assert _fields(state, max_tokens=105) == {"thinking_budget": None}
    assert _fields(state, reasoning_effort="high", max_tokens=105) == {}
    assert _fields(_state(), max_tokens=105) == {}


def test_an_effort_budget_without_room_takes_half_of_what_max_tokens_leaves():
    """`reasoning_effort` low (1024 in the default table) with the default or a small max_tokens
    still answers: the budget shrinks to half of max_tokens less the 3 closing tokens."""
    assert _fields(_state(), reasoning_effort="low", max_tokens=4000) == {"thinking_budget": 1024}
    assert _fields(_state(), reasoning_effort="low", max_tokens=105) == {"thinking_budget": 51}
    assert _fields(_state(), reasoning_effort="medium", max_tokens=512) == {"thinking_budget": 254}
    assert _fields(_state(), reasoning_effort="minimal", max_tokens=8) == {"thinking_budget": 0}
    with pytest.raises(Exception, match="max_tokens 3"):
        _fields(_state(), reasoning_effort="low", max_tokens=3)


def test_effort_budgets_flag_overrides_the_table_entries_it_names():
    from ninfer.server.protocol import REASONING_EFFORT_BUDGETS, parse_effort_budgets

    table = parse_effort_budgets("low=8, high=4096,medium=none")
    assert table == {**REASONING_EFFORT_BUDGETS, "low": 8, "medium": None, "high": 4096}
    for bad in ("low", "huge=3", "low=-1", "low=many"):
        with pytest.raises(ValueError):
            parse_effort_budgets(bad)


def test_the_stats_line_splits_reasoning_from_answer_throughput():
    from ninfer.server.request_log import stats_line

    line = stats_line({"generation_tokens_total": 100, "reasoning_tokens_total": 40},
                      {"generation_tokens_total": 50, "reasoning_tokens_total": 20}, 2.0)
    assert "gen_tok/s=25.0 (reasoning_tok/s=10.0 answer_tok/s=15.0)" in line
