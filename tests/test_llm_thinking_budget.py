"""`SamplingParams(thinking_budget=...)` and `LLM(thinking_budget=...)` on the bundled demo model:
the engine closes the reasoning at the budget, counts it in `usage.reasoning_tokens`, and the
answer follows within max_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer import _core

if not hasattr(_core, "Engine"):
    pytest.skip("_core.Engine is not built yet", allow_module_level=True)

from ninfer import LLM, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[1] / "python" / "ninfer" / "demo" / "model"
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not trained yet")

MESSAGES = [{"role": "user", "content": "Return the sum of the numbers in a list."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL_DIR, max_context=512) as engine:
        yield engine


def content(text: str) -> str:
    return text.split("</think>", 1)[1].strip() if "</think>" in text else ""


def test_a_budget_closes_the_reasoning_and_the_answer_follows(llm):
    prompt = llm.chat_prompt_ids(MESSAGES)
    outs = llm.generate([prompt] * 4, [SamplingParams(max_tokens=32, seed=s, thinking_budget=8) for s in range(4)])
    for o in outs:
        assert o.usage.reasoning_tokens == 8, o.text
        think = o.text.split("</think>", 1)[0]
        assert think.startswith("<think>") and len(llm.encode(think[len("<think>"):].strip(), False)) <= 8, o.text
        assert content(o.text), o.text


def test_a_budget_message_is_forced_before_the_end_tag(llm):
    msg = "Out of thinking time."
    [o] = llm.chat(MESSAGES, SamplingParams(max_tokens=40, seed=2, thinking_budget=4, thinking_budget_message=msg))
    assert f"{msg}\n</think>\n\n" in o.text, o.text
    assert o.usage.reasoning_tokens == 4


def test_no_room_for_an_answer_is_refused_naming_both_numbers(llm):
    with pytest.raises(_core.InvalidRequestError, match=r"thinking_budget.*\b30\b.*max_tokens 32"):
        llm.chat(MESSAGES, SamplingParams(max_tokens=32, thinking_budget=30))
    with pytest.raises(_core.InvalidRequestError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)


def test_llm_thinking_budget_is_the_default_of_calls_without_params():
    with LLM(MODEL_DIR, max_context=1024, thinking_budget=5) as engine:
        assert engine.get_default_sampling_params().thinking_budget == 5
        # Unseeded (the defaults carry no seed): the demo reasons for 25-45 tokens unbudgeted.
        outs = engine.chat([MESSAGES] * 3)
        assert all(o.usage.reasoning_tokens <= 5 for o in outs), [o.text for o in outs]


def test_ninfer_run_thinking_budget_flag(llm, ninfer_env):
    import subprocess
    import sys

    prompt = MESSAGES[0]["content"]
    [ref] = llm.chat(MESSAGES, SamplingParams(max_tokens=32, seed=3, thinking_budget=6))
    proc = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", str(MODEL_DIR), "--prompt", prompt,
                           "--max-new", "32", "--seed", "3", "--thinking-budget", "6", "--max-context", "512"],
                          capture_output=True, env=ninfer_env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == ref.text
    assert ref.usage.reasoning_tokens == 6 and "</think>" in ref.text


@pytest.mark.parametrize("budget", [0, 8])
def test_a_budget_under_ngram_drafts_closes_where_plain_decoding_does(budget):
    """Speculative decoding verifies drafts at every position with the request's own row: the
    budget's forced closing applies inside accepted drafts too, so the output is plain decoding's."""
    with LLM(MODEL_DIR, max_context=512) as plain_llm:
        prompt = plain_llm.chat_prompt_ids(MESSAGES)
        params = [SamplingParams(max_tokens=48, temperature=0.0, thinking_budget=budget),
                  SamplingParams(max_tokens=48, seed=5, thinking_budget=budget)]
        plain = [(o.token_ids, o.usage.reasoning_tokens) for o in plain_llm.generate([prompt] * 2, params)]
    with LLM(MODEL_DIR, max_context=512, spec="ngram", draft_tokens=3) as spec_llm:
        spec = [(o.token_ids, o.usage.reasoning_tokens) for o in spec_llm.generate([prompt] * 2, params)]
    assert spec == plain
    assert all(r == budget for _, r in plain)
