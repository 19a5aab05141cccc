"""`_core.Engine` on tiny real checkpoints (CPU backend) against transformers as the oracle:
greedy generation, batching, chunked prefill, prefix reuse (with recurrent-state snapshots on the
hybrid Qwen3.5) and scoring."""

import json

import numpy as np
import pytest

from ninfer import _core

from tiny_models import load_reference, make_model

ARCHS = ["llama", "qwen3", "qwen3_5"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return request.param, str(path), load_reference(path)


def hf_greedy(model, prompt, n):
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def greedy(n):
    return _core.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(engine, reqs):
    for rid, (prompt, n) in reqs.items():
        engine.submit(rid, prompt, greedy(n))
    out = {rid: [] for rid in reqs}
    cached = {}
    while engine.has_unfinished():
        for d in engine.step():
            out[d["request_id"]] += d["token_ids"]
            cached[d["request_id"]] = d["cached_tokens"]
    return out, cached


def prompt(n, salt):
    return [(i * 37 + salt * 11 + 3) % 390 + 3 for i in range(n)]


def test_greedy_generation_matches_transformers_alone_and_batched(tiny):
    arch, path, ref = tiny
    reqs = {"a": (prompt(5, 1), 8), "b": (prompt(23, 2), 6), "c": (prompt(40, 3), 5)}
    out, _ = run(_core.Engine(path, max_context=128, kv_capacity=512), reqs)
    for rid, (p, n) in reqs.items():
        assert out[rid] == hf_greedy(ref, p, n), f"{arch} request {rid}"


def test_chunked_prefill_and_tiny_kv_pool_give_the_same_tokens(tiny):
    arch, path, _ = tiny
    reqs = {f"r{i}": (prompt(30 + i, i), 12) for i in range(3)}
    whole, _ = run(_core.Engine(path, max_context=64, kv_capacity=512, prefill_chunk=512), reqs)
    chunked, _ = run(_core.Engine(path, max_context=64, kv_capacity=64, prefill_chunk=7), reqs)
    assert whole == chunked


def test_prefix_reuse_matches_a_fresh_engine_and_skips_the_cached_tokens(tiny):
    arch, path, _ = tiny
    eng = _core.Engine(path, max_context=128, kv_capacity=512)
    p1 = prompt(37, 5)
    first, _ = run(eng, {"t1": (p1, 6)})
    p2 = p1 + first["t1"] + prompt(9, 6)
    before = eng.stats()["prefill_tokens_computed"]
    second, cached = run(eng, {"t2": (p2, 6)})
    fresh, fresh_cached = run(_core.Engine(path, max_context=128, kv_capacity=512), {"t2": (p2, 6)})
    assert second == fresh
    assert fresh_cached["t2"] == 0
    assert cached["t2"] == 32, f"{arch}: two full blocks of the first prompt are reused"
    assert eng.stats()["prefill_tokens_computed"] - before == len(p2) - 32


def test_score_matches_transformers_logits(tiny):
    import torch

    arch, path, ref = tiny
    p = prompt(21, 9)
    got = _core.Engine(path, max_context=64, kv_capacity=64, prefill_chunk=8).score(p)
    with torch.no_grad():
        want = ref(torch.tensor([p])).logits[0].numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    from tiny_tokenizer import make_tokenizer

    path = tmp_path_factory.mktemp("qwen3_tok")
    hf_tok = make_tokenizer(path, "qwen3", vocab_size=397)
    make_model(path, "qwen3", seed=4, vocab_size=397)
    return str(path), hf_tok


def collect(engine, rid, prompt, **params):
    engine.submit(rid, prompt, _core.SamplingParams(**{"max_tokens": 40, "temperature": 0, "ignore_eos": True, **params}))
    toks, text, finish = [], "", None
    while engine.has_unfinished():
        for d in engine.step():
            toks += d["token_ids"]
            text += d["text"]
            finish = d["finish_reason"] or finish
    return toks, text, finish


def test_streamed_text_and_stop_strings_with_a_real_tokenizer(tiny_with_tokenizer):
    path, hf_tok = tiny_with_tokenizer
    eng = _core.Engine(path, max_context=128, kv_capacity=256)
    assert eng.tokenizer is not None and eng.tokenizer.vocab_size == 397
    prompt_ids = hf_tok.encode("def fibonacci(n):", add_special_tokens=False)
    toks, text, finish = collect(eng, "ref", prompt_ids)
    assert finish == "length"
    full = hf_tok.decode(prompt_ids + toks, skip_special_tokens=True)
    assert text == full[len(hf_tok.decode(prompt_ids, skip_special_tokens=True)):]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3, text
    _, cut_text, finish = collect(eng, "stop", prompt_ids, stop=[stop])
    assert finish == "stop"
    assert cut_text == text[: text.find(stop)]


def test_ledger_workspace_is_measured_by_a_warm_up_step_of_the_largest_chunk(tiny):
    """The startup warm-up runs one --prefill-chunk-sized step, so the workspace line is the
    real high-water mark: it grows with the chunk, counts in the total, and the warm-up leaves
    no block or state behind (the next request still matches transformers)."""
    arch, path, ref = tiny
    small = _core.Engine(path, max_context=128, kv_capacity=512, prefill_chunk=8).info()
    large = _core.Engine(path, max_context=128, kv_capacity=512, prefill_chunk=128).info()
    assert 0 < small["workspace_bytes"] < large["workspace_bytes"]
    cfg = json.load(open(f"{path}/config.json"))
    # At least the residual stream of 128 rows in f32 (the CPU backend's activation type).
    assert large["workspace_bytes"] >= 128 * cfg["hidden_size"] * 4
    for info in (small, large):
        assert info["total_bytes"] == info["weight_bytes"] + info["kv_bytes"] + info["state_bytes"] + info["workspace_bytes"]
    eng = _core.Engine(path, max_context=128, kv_capacity=512, prefill_chunk=128)
    assert eng.stats()["kv_blocks_used"] == 0
    p = prompt(20, 9)
    out, cached = run(eng, {"x": (p, 6)})
    assert out["x"] == hf_greedy(ref, p, 6) and cached["x"] == 0
