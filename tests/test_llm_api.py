"""The offline API: `LLM.generate`, `LLM.chat`, `LLM.score`, `LLM.stream` and `SamplingParams`.

Expected values come from oracles computed in the test: transformers' tokenizer and chat
template for prompts, `LLM.score` (one forward over the whole sequence) for log-probabilities,
and the engine's own greedy run for stop conditions.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ninfer import (
    LLM,
    ContextOverflowError,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
    UnsupportedError,
)

MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, max_context=MAX_CONTEXT)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_string_prompt_is_tokenized_like_transformers_and_decoded_text_matches(llm, hf_tokenizer):
    prompt = "The quick brown fox"
    [out] = llm.generate(prompt, greedy(12))
    assert out.prompt == prompt
    assert out.prompt_token_ids == hf_tokenizer(prompt)["input_ids"]
    assert len(out.token_ids) == 12
    assert out.finish_reason == "length"
    assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(out.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(out.prompt_token_ids) + 12


def test_token_id_prompt_gives_the_same_output_as_its_string(llm):
    [by_text] = llm.generate("Once upon a time", greedy(10))
    [by_ids] = llm.generate(by_text.prompt_token_ids, greedy(10))
    assert by_ids.prompt is None
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.text == by_text.text


def test_batch_of_mixed_prompts_returns_outputs_in_order_equal_to_single_runs(llm):
    prompts = ["Hello world", [5, 6, 7, 8, 9], "def fibonacci(n):", [100, 3, 200]]
    batched = llm.generate(prompts, greedy(9))
    assert len(batched) == len(prompts)
    for prompt, out in zip(prompts, batched):
        [alone] = llm.generate([prompt] if isinstance(prompt, str) else [prompt], greedy(9))
        assert out.prompt_token_ids == alone.prompt_token_ids
        assert out.token_ids == alone.token_ids


def test_list_of_token_id_lists_is_a_batch_and_an_empty_list_is_no_prompts(llm):
    outs = llm.generate([[1, 2, 3], [4, 5]], greedy(3))
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]]
    assert llm.generate([], greedy(3)) == []


def test_params_per_prompt_apply_to_their_own_prompt(llm):
    outs = llm.generate(["a", "b"], [greedy(2), greedy(5)])
    assert [len(o.token_ids) for o in outs] == [2, 5]


def test_chat_prompt_equals_transformers_chat_template(llm, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    [out] = llm.chat(messages, greedy(6))
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(out.token_ids) == 6


def test_chat_template_kwargs_reach_the_template(llm, hf_tokenizer):
    messages = [{"role": "user", "content": "Think about it"}]
    [thinking] = llm.chat(messages, greedy(2))
    [plain] = llm.chat(messages, greedy(2), chat_template_kwargs={"enable_thinking": False})
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                            enable_thinking=False)
    assert plain.prompt_token_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain.prompt_token_ids != thinking.prompt_token_ids


def test_chat_with_a_list_of_conversations_returns_one_output_each(llm):
    conversations = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two, longer"}]]
    outs = llm.chat(conversations, greedy(4))
    assert len(outs) == 2
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids
    [first] = llm.chat(conversations[0], greedy(4))
    assert outs[0].token_ids == first.token_ids


def test_logprobs_equal_log_softmax_of_score_rows(llm):
    [out] = llm.generate("Machine learning is", greedy(8, logprobs=True, top_logprobs=5))
    prompt = out.prompt_token_ids
    assert out.logprobs is not None and len(out.logprobs) == 8
    rows = log_softmax(np.asarray(llm.score(prompt + out.token_ids[:-1]))[len(prompt) - 1:])
    assert rows.shape[0] == 8
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp["token_id"] == tok
        assert tok == int(rows[i].argmax()), "greedy must pick the argmax of the scored row"
        assert lp["logprob"] == pytest.approx(rows[i, tok], abs=2e-3)
        expected_top = np.argsort(-rows[i])[:5]
        assert [t for t, _ in lp["top"]] == expected_top.tolist()
        for t, v in lp["top"]:
            assert v == pytest.approx(rows[i, t], abs=2e-3)


def test_score_returns_one_row_of_vocab_logits_per_token(llm):
    logits = np.asarray(llm.score([1, 2, 3, 4]))
    assert logits.shape == (4, llm.tokenizer.vocab_size)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()


def test_max_tokens_finishes_with_length(llm):
    [out] = llm.generate("count", greedy(7))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 7


def test_stop_token_id_finishes_with_stop_at_its_first_occurrence(llm):
    [ref] = llm.generate("The weather in Paris", greedy(16))
    k = 5
    stop_id = ref.token_ids[k]
    first = ref.token_ids.index(stop_id)
    [out] = llm.generate("The weather in Paris", greedy(16, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop"
    assert out.token_ids[:first] == ref.token_ids[:first]
    assert len(out.token_ids) in (first, first + 1)


def _stop_string_from(text: str) -> str:
    for start in range(len(text) // 2, len(text) - 2):
        cand = text[start:start + 2]
        if "\ufffd" not in cand and cand.strip():
            return cand
    pytest.skip(f"no usable stop string in the reference text {text!r}")


def test_stop_string_truncates_the_text_before_it_and_finishes_with_stop(llm):
    prompt = "Once upon a time there was"
    [ref] = llm.generate(prompt, greedy(40))
    stop = _stop_string_from(ref.text)
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:ref.text.index(stop)]
    assert stop not in out.text


def test_eos_finishes_with_stop_unless_ignore_eos(llm):
    eos = llm.eos_token_ids[0]
    bias = {eos: 100.0}
    [stopped] = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias))
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) <= 1
    [ignored] = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias,
                                                     ignore_eos=True))
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == [eos] * 10


def test_same_seed_gives_the_same_sampled_output(llm):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=1234, ignore_eos=True)
    [a] = llm.generate("Tell me a story", params)
    [b] = llm.generate("Tell me a story", params)
    assert a.token_ids == b.token_ids
    assert a.text == b.text


def test_different_seeds_give_different_sampled_outputs(llm):
    outs = [llm.generate("Tell me a story", SamplingParams(temperature=1.0, max_tokens=24, seed=s,
                                                           ignore_eos=True))[0].token_ids
            for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3


def test_n_completions_use_seed_plus_index(llm):
    [out] = llm.generate("Roll the dice", SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=40,
                                                         ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        [alone] = llm.generate("Roll the dice", SamplingParams(temperature=1.0, max_tokens=12, seed=40 + i,
                                                               ignore_eos=True))
        assert completion.token_ids == alone.token_ids
    assert out.usage.completion_tokens == 36


def test_stream_deltas_concatenate_to_the_generate_output(llm):
    [ref] = llm.generate("Streaming works", greedy(15))
    deltas = list(llm.stream("Streaming works", greedy(15)))
    assert len(deltas) > 1
    assert [t for d in deltas for t in d["token_ids"]] == ref.token_ids
    assert "".join(d["text"] for d in deltas) == ref.text
    assert deltas[-1]["finish_reason"] == "length"
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_closing_a_stream_early_aborts_and_frees_its_kv_blocks(llm):
    baseline = llm.engine.stats()["kv_blocks_used"]
    stream = llm.stream("x " * 40, greedy(100))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats()["kv_blocks_used"] <= baseline
    [after] = llm.generate("still works", greedy(3))
    assert len(after.token_ids) == 3


def test_empty_prompt_raises_invalid_request(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[]], greedy(4))
    with pytest.raises(InvalidRequestError):
        llm.generate("", greedy(4))
    assert not llm.engine.has_unfinished()


def test_prompt_too_long_raises_context_overflow_naming_both_numbers(llm):
    prompt = [7] * 250
    with pytest.raises(ContextOverflowError) as e:
        llm.generate(prompt, greedy(20))
    assert "250" in str(e.value) and str(MAX_CONTEXT) in str(e.value)
    with pytest.raises(ContextOverflowError) as e:
        llm.generate([7] * 300, SamplingParams(temperature=0.0))
    assert "300" in str(e.value) and str(MAX_CONTEXT) in str(e.value)


def test_a_bad_prompt_in_a_batch_submits_nothing_and_leaves_the_engine_clean(llm):
    with pytest.raises(ContextOverflowError):
        llm.generate([[1, 2, 3], [7] * 300], greedy(4))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], greedy(4))[0].token_ids) == 4


def test_max_tokens_none_fills_the_context(llm):
    [out] = llm.generate([3] * (MAX_CONTEXT - 5), SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_out_of_range_values_are_rejected_by_the_engine_naming_the_field(llm):
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.generate("hi", SamplingParams(temperature=-1.0, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="top_p"):
        llm.generate("hi", SamplingParams(top_p=0.0, max_tokens=2))


@pytest.mark.parametrize("field,value", [("n", 0), ("max_tokens", 0), ("max_tokens", -3),
                                         ("temperature", "hot"), ("seed", -1), ("stop", 5),
                                         ("top_k", 1.5), ("logit_bias", {"x": 1.0})])
def test_sampling_params_reject_wrong_types_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_build_the_engines_typed_params():
    p = SamplingParams(temperature=0.5, stop="END", logit_bias={"3": 2}, top_logprobs=2, seed=9)
    d = json.loads(p.to_core(max_tokens=17, seed=p.seed_for(1)).to_json())
    assert d["max_tokens"] == 17 and d["seed"] == 10
    assert d["stop"] == ["END"]
    assert d["logit_bias"] == {"3": 2.0}
    assert d["logprobs"] is True and d["top_logprobs"] == 2


def test_defaults_come_from_generation_config_when_no_params_are_given(qwen3_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7})
    gen_path.write_text(json.dumps(gen))
    with LLM(model, max_context=MAX_CONTEXT) as engine:
        defaults = engine.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 20, 7)
        [out] = engine.generate("hello")
        assert len(out.token_ids) <= 7

    gen.update({"do_sample": False})
    gen_path.write_text(json.dumps(gen))
    with LLM(model, max_context=MAX_CONTEXT) as engine:
        assert engine.get_default_sampling_params().temperature == 0.0
        [a] = engine.generate("hello")
        [b] = engine.generate("hello", SamplingParams(temperature=0.0, max_tokens=7))
        assert a.token_ids == b.token_ids


def test_kv_dtype_accepts_the_cpu_cache_type_by_name_and_refuses_another(qwen3_dir, llm):
    """kv_dtype as --kv-dtype: "f32" is the CPU's KV cache type and gives auto's tokens; "bf16" is
    refused naming float32, a quantized format as later work."""
    with LLM(qwen3_dir, max_context=MAX_CONTEXT, kv_dtype="f32") as named:
        [a] = named.generate("hello", greedy(6))
    [b] = llm.generate("hello", greedy(6))
    assert a.token_ids == b.token_ids
    with pytest.raises(ModelLoadError, match="bf16 is not supported on cpu: its KV cache is float32"):
        LLM(qwen3_dir, kv_dtype="bf16")
    with pytest.raises(UnsupportedError, match="kv_dtype `int8`.*later work"):
        LLM(qwen3_dir, kv_dtype="int8")


def test_engine_string_options_take_none_as_their_default_and_name_a_wrong_type(qwen3_dir, llm):
    """`kv_dtype=None` (as `max_context=None`) is the default, auto; a non-string is a TypeError
    naming the argument (the core's says only "'int' object is not an instance of 'str'")."""
    with LLM(qwen3_dir, max_context=MAX_CONTEXT, kv_dtype=None, logits_dtype=None, device=None) as engine:
        [a] = engine.generate("hello", greedy(4))
    assert a.token_ids == llm.generate("hello", greedy(4))[0].token_ids
    for name, value in (("kv_dtype", 123), ("kv_dtype", b"float32"), ("logits_dtype", 1.0), ("device", 0)):
        with pytest.raises(TypeError, match=rf"LLM\({name}=\.\.\.\) must be a string.*got {type(value).__name__}"):
            LLM(qwen3_dir, **{name: value})
    with pytest.raises(UnsupportedError, match="kv_dtype ``"):
        LLM(qwen3_dir, kv_dtype="")


def test_engine_options_reach_the_core_and_a_wrong_type_stops_the_load(qwen3_dir, llm):
    """`async_scheduling`, `cuda_graphs`, `batch_invariant` and `device_sampling` are `LLM`
    arguments (not environment switches); the CUDA ones change nothing on the CPU."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = llm.generate("The capital of France is", params)[0].token_ids
    with LLM(qwen3_dir, max_context=MAX_CONTEXT, async_scheduling=False, cuda_graphs=False,
             batch_invariant=True, device_sampling=False) as other:
        assert other.engine.info()["async_scheduling"] is False
        assert other.generate("The capital of France is", params)[0].token_ids == want
    for name in ("async_scheduling", "cuda_graphs", "batch_invariant", "device_sampling"):
        with pytest.raises(TypeError, match=name):
            LLM(qwen3_dir, max_context=MAX_CONTEXT, **{name: "sometimes"})
