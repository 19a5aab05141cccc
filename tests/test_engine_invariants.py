"""Engine invariants seen through the offline API, on a plain (Llama) and a hybrid (Qwen3.5) model.

- greedy output through the engine equals transformers' `generate` token for token;
- chunked prefill (1, 7 and 64 tokens per step) equals one whole prefill;
- a batch of different prompts equals each prompt run alone;
- a seeded sampled request gives the same output alone and inside a batch;
- a prefix-cache hit gives the same output as a miss.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer import LLM, SamplingParams

ARCHS = ["llama", "qwen3_5"]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):",
    "SELECT name FROM users",
    "Once upon a time there was a tiny language model that wanted to answer every question.",
    "12 + 34 =",
    "The weather in Paris is",
    "今天天气很好",
    "user assistant system tool",
]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tiny_checkpoints):
    return tiny_checkpoints.get(request.param)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _long_prompt(llm: LLM, n_tokens: int) -> list:
    ids = []
    i = 0
    while len(ids) < n_tokens:
        ids += llm.encode(PROMPTS[i % len(PROMPTS)] + " ", add_special_tokens=(i == 0))
        i += 1
    return ids[:n_tokens]


def test_greedy_64_tokens_equal_transformers_generate(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with LLM(model_dir, max_context=512) as llm:
        prompt = llm.encode("Once upon a time there was")
        [out] = llm.generate(prompt, greedy(64))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=64, min_new_tokens=0, pad_token_id=0)
    expected = ref[0, len(prompt):].tolist()
    assert len(expected) == 64
    assert out.token_ids == expected


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole_prefill(model_dir, chunk):
    params = greedy(16, logprobs=True)
    with LLM(model_dir, max_context=512, prefill_chunk=512, prefix_reuse=False) as whole:
        prompt = _long_prompt(whole, 150)
        [ref] = whole.generate(prompt, params)
    with LLM(model_dir, max_context=512, prefill_chunk=chunk, prefix_reuse=False) as chunked:
        [out] = chunked.generate(prompt, params)
        assert chunked.engine.stats()["steps"] >= -(-len(prompt) // chunk)
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs], [lp.logprob for lp in ref.logprobs],
                               atol=1e-3)


def test_batch_of_8_different_prompts_equals_each_alone(model_dir):
    params = greedy(24, logprobs=True)
    with LLM(model_dir, max_context=512, prefix_reuse=False) as llm:
        batched = llm.generate(PROMPTS, params)
        assert llm.engine.stats()["max_batch_size_seen"] >= 2
        alone = [llm.generate(p, params)[0] for p in PROMPTS]
    assert len({tuple(o.prompt_token_ids) for o in batched}) == len(PROMPTS)
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose([lp.logprob for lp in b.logprobs], [lp.logprob for lp in a.logprobs],
                                   atol=1e-3)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model_dir):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=77, ignore_eos=True)
    with LLM(model_dir, max_context=512) as llm:
        [alone] = llm.generate(PROMPTS[0], params)
        [again] = llm.generate(PROMPTS[0], params)
        batch = llm.generate(PROMPTS, [params] + [SamplingParams(temperature=1.0, max_tokens=20, seed=s)
                                                  for s in range(1, len(PROMPTS))])
    assert alone.token_ids == again.token_ids
    assert batch[0].token_ids == alone.token_ids


def test_prefix_cache_hit_equals_miss(model_dir):
    params = greedy(12, logprobs=True)
    with LLM(model_dir, max_context=512, prefix_reuse=False) as cold:
        prompt = _long_prompt(cold, 100)
        [miss] = cold.generate(prompt, params)
    with LLM(model_dir, max_context=512, prefix_reuse=True) as warm:
        [first] = warm.generate(prompt, params)
        [hit] = warm.generate(prompt, params)
        assert hit.usage.cached_tokens > 0
        assert warm.engine.stats()["prefix_hit_tokens"] > 0
    assert first.token_ids == miss.token_ids
    assert hit.token_ids == miss.token_ids
    np.testing.assert_allclose([lp.logprob for lp in hit.logprobs], [lp.logprob for lp in miss.logprobs],
                               atol=1e-3)
