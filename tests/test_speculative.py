"""Speculative decoding with the n-gram drafter (`spec="ngram"`, on the bundled demo model and
tiny random Llama and Qwen3.5 checkpoints) and the MTP head (`spec="mtp"`, on the demo model and a
tiny random Qwen3.5 given a random MTP head) through the offline API: greedy output equals plain
greedy output token for token (alone, in a batch of 8 with mixed parameters, with chunked prefill,
prefix-cache hits, a json_schema grammar, stop strings, EOS and max_tokens), seeded sampling
equals plain seeded sampling, and bad options are refused naming the flag.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ninfer import LLM, SamplingParams, _core

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo"))
DEMO_MODEL = DEMO_DIR / "model"

#: Repetitive prompts, where prompt lookup finds drafts that are accepted.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "SELECT name FROM users; SELECT name FROM",
    "a b c a b c a b c a b",
    "12 + 34 = 46. 12 + 34 =",
    "The weather in Paris is nice. The weather in",
]


#: (method, model) pairs the tests run: the n-gram drafter needs no weights; the MTP head runs on
#: checkpoints with `mtp.*` (the demo model's is trained, the tiny one's random).
CASES = [("ngram", "llama"), ("ngram", "qwen3_5"), ("ngram", "demo"), ("mtp", "qwen3_5_mtp"), ("mtp", "demo")]


@pytest.fixture(scope="module")
def qwen3_5_mtp(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3.5 checkpoint (with its tokenizer) given a random MTP head."""
    from tiny_models import add_mtp_head

    path = tmp_path_factory.mktemp("spec_mtp") / "qwen3_5_mtp"
    shutil.copytree(tiny_checkpoints.get("qwen3_5"), path)
    return add_mtp_head(path, seed=5)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{n}" for m, n in CASES])
def case(request, tiny_checkpoints):
    """(method, model directory)."""
    method, name = request.param
    if name == "demo":
        if not (DEMO_MODEL / "config.json").exists():
            pytest.skip("demo model not shipped")
        return method, DEMO_MODEL
    if name == "qwen3_5_mtp":
        return method, request.getfixturevalue("qwen3_5_mtp")
    return method, tiny_checkpoints.get(name)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _run(model_dir, prompts, params, **engine):
    engine.setdefault("max_context", 512)
    with LLM(model_dir, max_concurrency=8, **engine) as llm:
        ids = [llm.encode(p) for p in prompts]
        outs = llm.generate(ids, params)
        return [(o.token_ids, o.finish_reason) for o in outs], llm.engine.stats()


def _assert_as_plain(method, params, spec, plain):
    """Greedy requests output plain decoding's tokens, and so do seeded sampled requests under
    n-gram drafts (a point-mass draft verified by one draw per token keeps the draws). Sampled
    requests under MTP drafts (drawn from the head's distribution, verified by the speculative
    sampling rule) follow plain sampling's distribution, not its tokens (the chi-square test in
    rust_core engine::tests::spec_sampling): they end alike."""
    assert len(spec) == len(plain)
    for (tokens, finish), (want, want_finish), p in zip(spec, plain, params):
        if method == "ngram" or p.temperature == 0:
            assert (tokens, finish) == (want, want_finish)
        else:
            assert (len(tokens), finish) == (len(want), want_finish) == (p.max_tokens, "length")


def _mixed_params():
    return [
        greedy(40),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
        greedy(1),
        greedy(25, frequency_penalty=0.5, logit_bias={5: 1.0}),
        SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=33, ignore_eos=True, presence_penalty=0.3),
        greedy(7),
        greedy(48, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
    ]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_drafts_equals_plain_greedy_alone(case, k):
    method, model_dir = case
    plain, _ = _run(model_dir, PROMPTS[:2], greedy(48))
    spec, stats = _run(model_dir, PROMPTS[:2], greedy(48), spec=method, draft_tokens=k)
    assert spec == plain
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_verify_steps"] > 0
    assert len(stats["spec_acceptance_by_position"]) <= k
    if method == "mtp" and model_dir == DEMO_MODEL:
        # The demo's trained head is accepted more often than not.
        assert stats["spec_mean_accepted_length"] > 1.0, stats


def test_a_batch_of_8_with_mixed_parameters_and_chunked_prefill_equals_plain(case):
    method, model_dir = case
    params = _mixed_params()
    plain, _ = _run(model_dir, PROMPTS, params)
    spec, stats = _run(model_dir, PROMPTS, params, spec=method, draft_tokens=4, prefill_chunk=16)
    _assert_as_plain(method, params, spec, plain)
    if method == "mtp":
        again, _ = _run(model_dir, PROMPTS, params, spec=method, draft_tokens=4, prefill_chunk=16)
        assert again == spec, "seeded requests draw the same drafts and tokens on every run"
    for (tokens, _), p in zip(spec, params):
        assert len(tokens) == p.max_tokens, "ignore_eos: exactly max_tokens, never more"
    assert stats["spec_drafted_tokens"] > 0
    if model_dir == DEMO_MODEL:
        # A trained model continues repeated text: drafts are accepted (random tiny ones rarely do).
        assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["kv_blocks_used"] == 0


def test_a_tight_kv_pool_preempts_and_recomputes_with_drafts_as_without(case):
    method, model_dir = case
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=60, ignore_eos=True) for i in range(8)]
    # 32 blocks of 16 for 8 requests of ~80 tokens: some are preempted and recomputed.
    plain, plain_stats = _run(model_dir, PROMPTS, params, kv_capacity=512, max_context=256)
    spec, stats = _run(model_dir, PROMPTS, params, kv_capacity=512, max_context=256, spec=method, draft_tokens=4)
    _assert_as_plain(method, params, spec, plain)
    assert plain_stats["preemptions"] > 0 and stats["spec_drafted_tokens"] > 0
    # On the random checkpoints drafts are mostly rejected and the speculative run preempts too;
    # the demo's accepted drafts finish requests before the pool runs out.
    assert stats["preemptions"] > 0 or model_dir == DEMO_MODEL


def test_prefix_cache_hits_with_drafts_equal_misses_and_plain_greedy(case):
    """The same prompt again, a second turn (the first turn's prompt and answer, then more),
    and a prompt sharing only some blocks: each hits the cache and outputs what it outputs
    without prefix reuse and without drafts. Under --spec mtp a hit's MTP rows are those a
    fresh prefill writes (a cached block is keyed with the token after it, which its last MTP
    row reads)."""
    method, model_dir = case
    prompt = PROMPTS[0] * 3
    with LLM(model_dir, max_context=512, spec=method, draft_tokens=3) as llm:
        ids = llm.encode(prompt)
        [first] = llm.generate(ids, greedy(30))
        [second] = llm.generate(ids, greedy(30))
        turn2 = ids + first.token_ids + llm.encode(PROMPTS[3])
        [third] = llm.generate(turn2, greedy(30))
        branch = ids[:40] + llm.encode(PROMPTS[2])
        [fourth] = llm.generate(branch, greedy(30))
    with LLM(model_dir, max_context=512, prefix_reuse=False) as llm:
        miss = [o.token_ids for o in llm.generate([ids, turn2, branch], greedy(30))]
    assert first.token_ids == second.token_ids == miss[0]
    assert third.token_ids == miss[1]
    assert fourth.token_ids == miss[2]
    # The second turn resumes past the first one's prompt (from a snapshot a step with drafts
    # took, on the hybrid checkpoints).
    cached = [o.usage.cached_tokens for o in (first, second, third)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > len(ids), cached


def test_stop_strings_and_eos_inside_drafts_end_the_request_as_without(case):
    method, model_dir = case
    with LLM(model_dir, max_context=512) as llm:
        ids = llm.encode(PROMPTS[2])
        [free] = llm.generate(ids, greedy(40))
        text = free.outputs[0].text if hasattr(free, "outputs") else free.text
        eos = free.token_ids[len(free.token_ids) // 2]
    stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 6 else None
    cases = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos])]
    if stop and stop.strip():
        cases.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
    for params in cases:
        with LLM(model_dir, max_context=512) as llm:
            [a] = llm.generate(ids, params)
        with LLM(model_dir, max_context=512, spec=method, draft_tokens=5) as llm:
            [b] = llm.generate(ids, params)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert a.finish_reason == "stop"


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_json_schema_grammar_with_drafts_equals_plain(tiny_checkpoints, method, request):
    model_dir = DEMO_MODEL if (DEMO_MODEL / "config.json").exists() else request.getfixturevalue("qwen3_5_mtp")
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
              "required": ["xs"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "xs", "schema": schema}}
    params = [SamplingParams(temperature=0.0, max_tokens=120, response_format=fmt),
              SamplingParams(temperature=0.9, seed=2, max_tokens=120, response_format=fmt)]
    prompts = ['{"xs": [1, 2, 3]} {"xs": [1, 2, 3]} {"xs": [1, 2, ', PROMPTS[1]]
    with LLM(model_dir, max_context=512) as llm:
        plain = [(o.text, o.finish_reason) for o in llm.generate([llm.encode(p) for p in prompts], params)]
    with LLM(model_dir, max_context=512, spec=method, draft_tokens=4) as llm:
        spec = [(o.text, o.finish_reason) for o in llm.generate([llm.encode(p) for p in prompts], params)]
    # The seeded sampled request under MTP drafts follows plain sampling in distribution only.
    assert spec == plain if method == "ngram" else spec[0] == plain[0]
    for text, finish in spec:
        if finish == "stop":
            json.loads(text)


def test_the_last_delta_carries_the_requests_draft_counts(tiny_checkpoints):
    core = _core.Engine(str(tiny_checkpoints.get("llama")), max_context=256, spec="ngram", draft_tokens=3)
    assert core.info()["spec"] == "ngram" and core.info()["draft_tokens"] == 3
    tok = core.tokenizer
    core.submit("r", list(tok.encode(PROMPTS[5], True)), _core.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    last = None
    while core.has_unfinished():
        for d in core.step():
            assert d.spec is None or d.finished
            last = d
    assert last.finished and last.spec is not None
    s = last.spec
    assert s["drafted"] >= s["accepted"] and s["verify_steps"] > 0
    assert s["mean_accepted_length"] >= 1.0
    assert core.stats()["spec_drafted_tokens"] == s["drafted"]


@pytest.mark.parametrize("kwargs,needle", [
    ({"spec": "ngram", "draft_tokens": 0}, "--draft-tokens"),
    ({"spec": "ngram", "draft_tokens": 9}, "--draft-tokens"),
    ({"draft_tokens": 3}, "--draft-tokens"),
    ({"spec": "mtp"}, "--spec mtp needs the model's mtp.* weights; this checkpoint has none"),
    ({"spec": "dflash", "draft_tokens": 7}, "--spec dflash needs --drafter"),
    ({"spec": "medusa"}, "--spec"),
])
def test_bad_speculation_options_are_refused_naming_the_flag(tiny_checkpoints, kwargs, needle):
    with pytest.raises(Exception) as e:
        LLM(tiny_checkpoints.get("llama"), max_context=256, **kwargs)
    assert needle in str(e.value)


def test_metrics_the_stats_line_and_the_request_log_carry_the_draft_counts(tiny_checkpoints, tmp_path):
    from types import SimpleNamespace

    from ninfer.server.metrics import ServerMetrics, parse_metrics
    from ninfer.server.request_log import RequestLog, stats_line

    core = _core.Engine(str(tiny_checkpoints.get("qwen3_5")), max_context=256, spec="ngram", draft_tokens=2)
    ids = list(core.tokenizer.encode(PROMPTS[5], True))
    core.submit("r", ids, _core.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    last = None
    while core.has_unfinished():
        for d in core.step():
            last = d
    stats = core.stats()
    m = parse_metrics(ServerMetrics().render(stats))
    assert m["ninfer_spec_drafted_tokens_total"] == stats["spec_drafted_tokens"] > 0
    assert m["ninfer_spec_accepted_tokens_total"] == stats["spec_accepted_tokens"]
    assert m["ninfer_spec_mean_accepted_length"] >= 1.0
    assert 'ninfer_spec_acceptance_rate{position="0"}' in m
    assert "spec_accept=" in stats_line(stats, None, 1.0) and "spec_mean_len=" in stats_line(stats, None, 1.0)
    log = RequestLog(str(tmp_path / "log.jsonl"))
    log.request_finished("r", last, SimpleNamespace(first_token=1.0, finished=2.0, submitted=0.5))
    log.close()
    record = json.loads((tmp_path / "log.jsonl").read_text())
    assert record["spec"]["drafted"] == stats["spec_drafted_tokens"]
    assert set(record["spec"]) == {"verify_steps", "drafted", "accepted", "mean_accepted_length", "acceptance_by_position"}


def test_per_request_draft_tokens_mix_in_a_batch_and_need_spec(case):
    method, model_dir = case
    params = [dataclass_replace(p, draft_tokens=i % 5) for i, p in enumerate(_mixed_params())]
    plain, _ = _run(model_dir, PROMPTS, _mixed_params())
    spec, stats = _run(model_dir, PROMPTS, params, spec=method, draft_tokens=8)
    _assert_as_plain(method, params, spec, plain)
    assert stats["spec_drafted_tokens"] > 0
    assert len(stats["spec_acceptance_by_position"]) <= 4, "no request drafts more than its own 4"
    with LLM(model_dir, max_context=256) as llm:
        with pytest.raises(Exception, match="draft_tokens"):
            llm.generate([llm.encode("hi")], greedy(3, draft_tokens=2))
    with pytest.raises(Exception, match="draft_tokens"):
        SamplingParams(draft_tokens=9)


def dataclass_replace(params, **changes):
    import dataclasses

    return dataclasses.replace(params, **changes)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_server_with_drafts_answers_as_without_and_reports_them(tiny_checkpoints, tmp_path, method, request):
    import httpx

    from ninfer.server.metrics import parse_metrics
    from server_process import ServerProcess

    model = str(tiny_checkpoints.get("qwen3_5") if method == "ngram" else request.getfixturevalue("qwen3_5_mtp"))
    body = {"model": "m", "prompt": PROMPTS[5], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    answers = []
    log = tmp_path / "requests.jsonl"
    for extra in ([], ["--spec", method, "--draft-tokens", "3", "--request-log-jsonl", str(log)]):
        with ServerProcess([model, "--model-id", "m", "--device", "cpu", "--max-context", "256", *extra]) as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            m = parse_metrics(httpx.get(s.url + "/metrics", timeout=10).text)
            # The request field `draft_tokens`: K for this request (0: none, the answer is the
            # same); a K above 0 is refused naming it by a server without --spec.
            for k in (0, 1):
                r = httpx.post(s.url + "/v1/completions", json={**body, "draft_tokens": k}, timeout=60)
                if extra or k == 0:
                    assert r.status_code == 200 and r.json()["choices"][0]["text"] == answers[-1], r.text
                else:
                    assert r.status_code == 400 and "draft_tokens" in r.json()["error"]["message"], r.text
            r = httpx.post(s.url + "/v1/chat/completions", json={"model": "m", "draft_tokens": 9, "max_tokens": 4,
                                                                   "messages": [{"role": "user", "content": "hi"}]},
                           timeout=60)
            assert r.status_code == 400 and "draft_tokens" in r.json()["error"]["message"], r.text
    assert answers[0] == answers[1]
    assert m["ninfer_spec_drafted_tokens_total"] > 0
    assert json.loads(log.read_text().splitlines()[-1])["spec"]["drafted"] > 0


def async_answer(model, prompt, params, **engine):
    """(tokens, last delta) of one request through `AsyncEngine` on the CPU, in its own event loop."""
    import anyio

    from ninfer import AsyncEngine

    async def answer():
        eng = await AsyncEngine.start(model, device="cpu", max_context=256, **engine)
        try:
            tokens, last = [], None
            async for d in eng.generate(prompt, params):
                tokens += d.token_ids
                last = d
            return tokens, last
        finally:
            await eng.shutdown()

    return anyio.run(answer)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_the_async_engine_takes_the_speculation_options(tiny_checkpoints, method, request):
    model = tiny_checkpoints.get("llama") if method == "ngram" else request.getfixturevalue("qwen3_5_mtp")
    params = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    plain, _ = async_answer(model, PROMPTS[1], params)
    spec, last = async_answer(model, PROMPTS[1], params, spec=method, draft_tokens=3)
    assert spec == plain
    assert last.spec is not None and last.spec["drafted"] > 0


def test_logprobs_come_for_every_accepted_token(case):
    method, model_dir = case
    params = greedy(30, logprobs=True, top_logprobs=2)
    with LLM(model_dir, max_context=512) as llm:
        ids = llm.encode(PROMPTS[1])
        [plain] = llm.generate(ids, params)
    with LLM(model_dir, max_context=512, spec=method, draft_tokens=3) as llm:
        [spec] = llm.generate(ids, params)
    assert spec.token_ids == plain.token_ids
    assert [lp.token_id for lp in spec.logprobs] == spec.token_ids
    for a, b in zip(plain.logprobs, spec.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-3
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
