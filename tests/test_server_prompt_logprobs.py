"""`/v1/completions` with `echo` and `logprobs`: the prompt scored as loglikelihood evaluation tools
(lm-evaluation-harness's `local-completions`) score a model over HTTP.

One `ninfer serve` on the bundled demo model; the reference is `LLM.score` on the same token
ids in this process, log-softmaxed in float64: every prompt token's logprob within 1e-5, the
first token's null.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ninfer.server.prompt_logprobs import prompt_logprob_entries
from server_process import ServerProcess

DEMO = Path(__file__).resolve().parents[1] / "python" / "ninfer" / "demo" / "model"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="demo model not trained yet")

MODEL = "demo"
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
IDS = [480, 289, 1300, 269, 1120, 525, 1419, 315, 17, 18, 19]


@pytest.fixture(scope="module")
def server():
    with ServerProcess([str(DEMO), "--model-id", MODEL, "--max-context", "1024"], ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    from ninfer import LLM

    with LLM(DEMO, max_context=1024) as m:
        yield m


def reference(llm, ids: list) -> np.ndarray:
    """log-softmax of `LLM.score`'s logits, float64: row i scores the token after position i."""
    logits = np.asarray(llm.score(ids), dtype=np.float64)
    peak = logits.max(axis=1, keepdims=True)
    return logits - (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_logprobs(llm, lp: dict, ids: list, top: int) -> None:
    """The first len(ids) entries of a legacy logprobs object against `LLM.score`."""
    ref = reference(llm, ids)
    n = len(ids)
    assert lp["tokens"][:n] == [llm.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:n], dtype=np.float64)
    np.testing.assert_allclose(got, ref[np.arange(n - 1), ids[1:]], rtol=0, atol=1e-5)
    for row, tops in zip(ref, lp["top_logprobs"][1:n]):
        assert len(tops) <= top
        best = np.sort(row)[::-1][:top]
        # Keyed by token text: tokens that decode alike share one entry.
        assert all(np.min(np.abs(best - v)) < 1e-5 for v in tops.values())
        assert max(tops.values()) == pytest.approx(best[0], abs=1e-5)
    assert lp["text_offset"][:n] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:n - 1]]))


def test_max_tokens_0_scores_text_and_token_id_prompts_like_llm_score(server, llm):
    r = complete(server, prompt=[TEXT, IDS], echo=True, logprobs=3, max_tokens=0)
    text_ids = llm.encode(TEXT)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice, ids, text in zip(r["choices"], (text_ids, IDS), (TEXT, llm.decode(IDS, skip_special_tokens=False))):
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_prompt_logprobs(llm, choice["logprobs"], ids, 3)
    assert r["usage"] == {"prompt_tokens": len(text_ids) + len(IDS), "completion_tokens": 0,
                          "total_tokens": len(text_ids) + len(IDS)}
    twice = complete(server, prompt=[IDS, TEXT], echo=True, max_tokens=0, n=2)
    assert [(c["index"], c["text"], c["logprobs"]) for c in twice["choices"]] == [
        (0, r["choices"][1]["text"], None), (1, r["choices"][1]["text"], None), (2, TEXT, None), (3, TEXT, None)]


def test_loglikelihood_of_a_continuation_as_an_evaluation_harness_asks_for_it(server, llm):
    """lm-evaluation-harness sends context + continuation as token ids (a batch of them) with
    echo, logprobs 1 and max_tokens 0 or 1, and sums token_logprobs after the context."""
    context, continuation = llm.encode("def add(a, b):\n"), llm.encode("    return a + b\n", add_special_tokens=False)
    batch = [context + continuation, IDS]
    for max_tokens in (0, 1):
        r = complete(server, prompt=batch, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
        lp = r["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(batch[0]) + max_tokens
        ref = reference(llm, batch[0])
        want = sum(ref[i - 1, batch[0][i]] for i in range(len(context), len(batch[0])))
        got = sum(lp["token_logprobs"][len(context):len(batch[0])])
        assert got == pytest.approx(want, abs=1e-4)
        check_prompt_logprobs(llm, r["choices"][1]["logprobs"], IDS, 1)


def test_echo_with_generation_puts_the_prompt_before_the_completion(server, llm):
    plain = complete(server, prompt=TEXT, max_tokens=5, temperature=0, logprobs=2, n=2, seed=1)
    echoed = complete(server, prompt=TEXT, max_tokens=5, temperature=0, logprobs=2, n=2, seed=1, echo=True)
    ids = llm.encode(TEXT)
    for p, e in zip(plain["choices"], echoed["choices"]):
        assert e["text"] == TEXT + p["text"]
        lp = e["logprobs"]
        assert lp["tokens"][len(ids):] == p["logprobs"]["tokens"]
        # The same tokens; their logprobs may differ in the last bits (the prompt came from the prefix cache).
        np.testing.assert_allclose(lp["token_logprobs"][len(ids):], p["logprobs"]["token_logprobs"], rtol=0, atol=1e-5)
        check_prompt_logprobs(llm, lp, ids, 2)
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [echoed["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    without_logprobs = complete(server, prompt=TEXT, max_tokens=5, temperature=0, echo=True)
    assert without_logprobs["choices"][0]["text"] == TEXT + plain["choices"][0]["text"]
    assert without_logprobs["choices"][0]["logprobs"] is None


def stream_choices(server, **body) -> dict:
    """Per choice index: its chunks' choice objects, in order."""
    out: dict = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    out.setdefault(c["index"], []).append(c)
    return out


def test_a_stream_echoes_the_prompt_in_its_first_chunk(server, llm):
    body = dict(prompt=[TEXT, IDS], max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = complete(server, **body)
    streamed = stream_choices(server, **body)
    for choice in whole["choices"]:
        chunks = streamed[choice["index"]]
        n = len(llm.encode(TEXT)) if choice["index"] == 0 else len(IDS)
        assert chunks[0]["text"] == choice["text"][:len(chunks[0]["text"])] and len(chunks[0]["logprobs"]["tokens"]) == n
        assert "".join(c["text"] for c in chunks) == choice["text"]
        for key in ("tokens", "text_offset"):
            assert sum((c["logprobs"][key] for c in chunks), []) == choice["logprobs"][key], key
        streamed_lps = sum((c["logprobs"]["token_logprobs"] for c in chunks), [])
        assert streamed_lps[0] is None and choice["logprobs"]["token_logprobs"][0] is None
        # Generated tokens' logprobs may differ in the last bits with the batch they ran in.
        np.testing.assert_allclose(streamed_lps[1:], choice["logprobs"]["token_logprobs"][1:], rtol=0, atol=1e-5)
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    only = stream_choices(server, prompt=IDS, max_tokens=0, logprobs=1, echo=True)
    assert len(only[0]) == 1 and only[0][0]["finish_reason"] == "length"
    check_prompt_logprobs(llm, only[0][0]["logprobs"], IDS, 1)


def test_the_openai_client_reads_echoed_logprobs(server, llm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt=[IDS], echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    check_prompt_logprobs(llm, lp.model_dump(), IDS, 1)


def test_max_tokens_0_needs_echo_and_a_prompt_the_engine_could_run(server):
    cases = (({"prompt": TEXT, "max_tokens": 0}, "max_tokens", "needs `echo`"),
             ({"prompt": TEXT, "max_tokens": -1, "echo": True}, "max_tokens", "got -1"),
             ({"prompt": "", "max_tokens": 0, "echo": True}, "prompt", "empty"),
             ({"prompt": [5] * 1025, "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt", "1025 tokens exceeds"))
    for body, param, says in cases:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err


def test_scoring_a_long_prompt_leaves_the_event_loop_free(server):
    """The forward runs on the engine thread and the log-softmax on a worker thread: /health
    answers meanwhile."""
    ids = [(i * 7919) % 5000 + 10 for i in range(1000)]
    done = {}

    def send():
        t = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True,
                                                             "logprobs": 5, "max_tokens": 0}, timeout=300)
        done["status"], done["s"] = r.status_code, time.monotonic() - t

    th = threading.Thread(target=send)
    th.start()
    time.sleep(0.05)
    worst = 0.0
    while th.is_alive():
        t = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=300).status_code == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.02)
    th.join()
    assert done["status"] == 200
    assert worst < 0.5 * done["s"], f"/health waited {worst:.2f} s of the {done['s']:.2f} s request"


def test_prompt_logprob_entries_rank_ties_by_id_and_leave_the_first_token_null():
    logits = np.array([[0, 1, 1, 3], [2, 2, 2, 0], [5, 0, 0, 0]], dtype=np.float32)
    entries = prompt_logprob_entries(logits, [1, 2, 3, 0], 3)
    assert entries[0] == {"token_id": 1, "logprob": None, "top": None}
    assert [e["token_id"] for e in entries] == [1, 2, 3, 0]
    assert [t for t, _ in entries[1]["top"]] == [3, 1, 2]
    assert [t for t, _ in entries[2]["top"]] == [0, 1, 2]
    logz = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
    assert entries[3]["logprob"] == pytest.approx(5 - logz[2], abs=1e-12)
    assert prompt_logprob_entries(logits, [1, 2], 0)[1]["top"] == []
    assert prompt_logprob_entries(logits, [1], 2) == [{"token_id": 1, "logprob": None, "top": None}]
