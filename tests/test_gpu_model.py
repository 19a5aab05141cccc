"""The CUDA model runner against transformers on the same GPU and against our CPU f32 path.

Two kinds of checkpoint:
- the bundled demo model (python/ninfer/demo/model): a *trained* Qwen3.5 hybrid whose next-token
  distributions are peaked, so bf16 rounding rarely flips a greedy choice. Against it: logits rel
  err (max abs diff / max abs reference) <= 2e-2 vs transformers bf16 and vs our CPU f32 path;
  held-out perplexity within 2% of the f32 figure training recorded; 64 greedy tokens through
  `ninfer.LLM(device="cuda")` equal transformers' bf16 greedy on >= 95% of prompts (20/20 with
  our logits rounded to bf16 as transformers' are; >= 80% with our f32 logits), and every
  divergence, there and between a batch and each prompt alone, happens at a near-tie (top-2
  gap < NEAR_TIE) of our logits.
- tiny random checkpoints (tests/tiny_models.py) of Llama, Qwen3 and Qwen3.5 with sizes the
  kernels take (head dims 64; the default tiny head dims 12-24 are below what the attention and
  Gated DeltaNet kernels are instantiated for, and `CudaModel` refuses them at load). Their
  logits are nearly flat over the vocabulary, so any bf16 implementation flips greedy tokens
  against any other; the oracle for them is transformers in f32 on the GPU, and our bf16 path
  must be as close to it as transformers' own bf16 path is (error within 2x + 5e-3), while
  chunked prefill equals whole prefill exactly (same kernels, same rows).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ninfer  # noqa: E402
from ninfer import LLM, SamplingParams, _core  # noqa: E402

from conftest import TINY_VOCAB, device_profile, gpu_compute_capability  # noqa: E402

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2

#: Top-2 logprob gap (nats) under which two bf16 implementations, or the same one at two batch
#: shapes (GEMV for one row, cuBLAS for several: different summation orders), may pick different
#: greedy tokens. The demo model's logits differ from transformers bf16 by about 0.1 at most, so a
#: divergence at a wider gap would be a bug, not rounding.
NEAR_TIE = 0.5

#: Sizes the kernels are instantiated for, per tiny architecture.
GPU_SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4),
}

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):",
    "SELECT name FROM users",
    "Once upon a time there was a tiny language model that wanted to answer every question.",
    "12 + 34 =",
    "The weather in Paris is",
    "今天天气很好",
    "user assistant system tool",
    "import numpy as np",
    "Dear Sir or Madam,",
]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _storage_dtype():
    """The type our engine stores weights, activations and "auto" logits in on this device:
    bf16 from 8.0 on, f16 below (sm_7x has no bf16 units; kernels.rs `StorageDType`)."""
    return torch.bfloat16 if gpu_compute_capability()[0] >= 8 else torch.float16


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_dir(request, tiny_checkpoints):
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    return tiny_checkpoints.get(request.param, **GPU_SHAPES[request.param])


@pytest.fixture(scope="module")
def hf_bf16(gpu_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_dir), dtype=torch.bfloat16).to("cuda").eval()
    model.generation_config.eos_token_id = None
    return model


def _rel_err(got, exp) -> float:
    return float(np.abs(got - exp).max() / np.abs(exp).max())


def _prompt(n: int, vocab: int, seed: int) -> list:
    return [int(t) for t in np.random.RandomState(seed).randint(3, vocab, size=n)]


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def _matched_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _hf_greedy(model, prompt: list, n: int, copies: int = 1) -> list:
    """transformers' greedy continuation of `prompt` on the GPU: `n` new token ids. With
    `copies` > 1 the prompt runs in a batch of that many identical rows (no padding) and the first
    row's continuation is returned: the same sums, in the order cuBLAS picks for that batch."""
    with torch.no_grad():
        r = model.generate(torch.tensor([prompt] * copies, device="cuda"),
                           attention_mask=torch.ones(copies, len(prompt), dtype=torch.long, device="cuda"),
                           do_sample=False, max_new_tokens=n, min_new_tokens=0, pad_token_id=0)
    return r[0, len(prompt):].tolist()


def _divergence_gap(out, other_ids: list):
    """(index of the first token where `out` and `other_ids` differ, `out`'s top-2 logprob gap
    there), or None when they agree throughout."""
    d = _matched_prefix(out.token_ids, other_ids)
    if d == len(out.token_ids):
        return None
    top = out.logprobs[d].top
    return d, top[0][1] - top[1][1]


def test_num_threads_on_the_gpu_is_refused_naming_it(gpu_dir):
    # It sizes the CPU backend's pool; accepted and ignored on the GPU would be a silent no-op.
    with pytest.raises(_core.DeviceError, match="num_threads 2"):
        _core.Model(str(gpu_dir), device="cuda", num_threads=2)
    with pytest.raises(_core.DeviceError, match="--num-threads"):
        LLM(gpu_dir, device="cuda", num_threads=3)


def test_kv_dtype_names_the_gpu_storage_type_and_refuses_another(gpu_dir):
    # The GPU keeps its KV cache in its storage type: bf16 on sm_80+ (f16 on sm_7x) by name is
    # accepted and runs as auto does; the other 16-bit type is refused naming the kept one.
    kept, other = ("bf16", "f16") if gpu_compute_capability()[0] >= 8 else ("f16", "bf16")
    with LLM(gpu_dir, device="cuda", max_context=256, kv_dtype=kept) as named:
        [a] = named.generate(PROMPTS[0], greedy(8))
    with LLM(gpu_dir, device="cuda", max_context=256) as auto:
        [b] = auto.generate(PROMPTS[0], greedy(8))
    assert a.token_ids == b.token_ids
    with pytest.raises(_core.ModelLoadError, match=f"{other} is not supported on cuda:0 .*its KV cache is {kept}"):
        LLM(gpu_dir, device="cuda", kv_dtype=other)


@pytest.mark.parametrize("arch", ["8.6", "7.5"])
def test_gpu_runs_an_older_architectures_code_when_asked(gpu_dir, hf_bf16, monkeypatch, capfd, arch):
    """NINFER_EMULATE_ARCH: the device runs as the named older GPU (its kernels PTX for that
    architecture, JIT-compiled by the driver; its routes and shared-memory limit; f16 storage
    below 8.0), says so once on stderr, and its logits track transformers f32 as closely as
    transformers bf16 does, prefill and a decode step alike. A bad value is refused naming
    the variable."""
    cc = tuple(int(c) for c in arch.split("."))
    if torch.cuda.get_device_capability() <= cc:
        pytest.skip(f"the GPU is not newer than {arch}")
    monkeypatch.setenv("NINFER_EMULATE_ARCH", "ampere")
    with pytest.raises(_core.ModelLoadError, match="NINFER_EMULATE_ARCH.*ampere"):
        _core.Model(str(gpu_dir), device="cuda")
    monkeypatch.setenv("NINFER_EMULATE_ARCH", arch)
    capfd.readouterr()
    emu = _core.Model(str(gpu_dir), device="cuda")
    err = capfd.readouterr().err
    assert f"runs as {arch} (NINFER_EMULATE_ARCH)" in err and f"compute_{arch.replace('.', '')}" in err, err
    vocab = emu.config["vocab_size"]
    ids = _prompt(70, vocab, seed=1)
    got = emu.logits(ids)
    hf_f32 = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_dir), dtype=torch.float32).to("cuda").eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        exp_bf16 = hf_bf16(x).logits[0].float().cpu().numpy()
        exp_f32 = hf_f32(x).logits[0].float().cpu().numpy()
    theirs = _rel_err(exp_bf16, exp_f32)
    ours = _rel_err(got, exp_f32)
    print(f"{gpu_dir.name[:8]} as {arch}: prefill logits rel err vs hf_f32 {ours:.2e} (hf_bf16 {theirs:.2e})")
    assert ours <= 2 * theirs + 5e-3
    # Decode: three sequences a step (the batched decode kernels); step s fed tokens[i][s], so
    # its logits are transformers f32's last row on the prompt and tokens[i][:s + 1].
    prompts = [_prompt(n, vocab, seed=n) for n in (9, 33, 70)]
    tokens, logits, _ = emu.decode_greedy(prompts, 2)
    for i, p in enumerate(prompts):
        for s in range(2):
            with torch.no_grad():
                ref = hf_f32(torch.tensor([p + tokens[i][:s + 1]], device="cuda")).logits[0, -1].float().cpu().numpy()
            step = _rel_err(logits[s][i], ref)
            print(f"{gpu_dir.name[:8]} as {arch}: decode step {s} logits of sequence {i} rel err vs hf_f32 {step:.2e}")
            assert step <= 2 * theirs + 5e-3


def test_gpu_logits_track_f32_as_closely_as_transformers_bf16(gpu_dir, hf_bf16):
    gpu = _core.Model(str(gpu_dir), device="cuda")
    vocab = gpu.config["vocab_size"]
    ids = _prompt(70, vocab, seed=1)
    got = gpu.logits(ids)
    assert got.dtype == np.float32 and got.shape == (70, vocab)
    hf_f32 = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_dir), dtype=torch.float32).to("cuda").eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        exp_bf16 = hf_bf16(x).logits[0].float().cpu().numpy()
        exp_f32 = hf_f32(x).logits[0].float().cpu().numpy()
    hf_eager = transformers.AutoModelForCausalLM.from_pretrained(
        str(gpu_dir), dtype=torch.bfloat16, attn_implementation="eager").to("cuda").eval()
    with torch.no_grad():
        exp_eager = hf_eager(x).logits[0].float().cpu().numpy()
    cpu = _core.Model(str(gpu_dir), device="cpu").logits(ids)
    ours_f32, theirs_f32 = _rel_err(got, exp_f32), _rel_err(exp_bf16, exp_f32)
    ours_bf16, paths = _rel_err(got, exp_bf16), _rel_err(exp_eager, exp_bf16)
    print(f"{gpu_dir.name[:8]}: rel err ours-vs-hf_f32 {ours_f32:.2e}, hf_bf16-vs-hf_f32 {theirs_f32:.2e}, "
          f"ours-vs-hf_bf16 {ours_bf16:.2e}, hf_bf16 eager-vs-sdpa {paths:.2e}, ours-vs-cpu_f32 {_rel_err(got, cpu):.2e}, "
          f"cpu_f32-vs-hf_f32 {_rel_err(cpu, exp_f32):.2e}")
    assert ours_f32 <= 2 * theirs_f32 + 5e-3
    assert _rel_err(got, cpu) <= 2 * theirs_f32 + 5e-3
    # The issue's 2e-2 against transformers bf16, or, where transformers' own eager and sdpa
    # attention paths already differ by more (two roundings of these small random logits, the max
    # over 31k of them), within 1.5x of that.
    assert ours_bf16 <= max(REL_TOL, 1.5 * paths), (ours_bf16, paths)


def test_gpu_greedy_tracks_f32_as_long_as_transformers_bf16(gpu_dir, hf_bf16):
    """Tokens before the first greedy divergence from transformers f32, ours vs transformers
    bf16: ours must last at least half as long on average (flat random logits flip early)."""
    with LLM(gpu_dir, device="cuda", max_context=512) as llm:
        prompts = [llm.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts, greedy(64))
    hf_f32 = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_dir), dtype=torch.float32).to("cuda").eval()
    hf_f32.generation_config.eos_token_id = None
    ours, theirs, exact = 0, 0, 0
    for prompt, out in zip(prompts, outs):
        ref = {}
        for name, model in (("f32", hf_f32), ("bf16", hf_bf16)):
            ref[name] = _hf_greedy(model, prompt, 64)
        assert len(out.token_ids) == 64 and len(ref["f32"]) == 64
        ours += _matched_prefix(out.token_ids, ref["f32"])
        theirs += _matched_prefix(ref["bf16"], ref["f32"])
        exact += out.token_ids == ref["bf16"]
    n = len(prompts)
    print(f"{gpu_dir.name[:8]}: mean tokens before divergence from hf_f32: ours {ours / n:.1f}, hf_bf16 "
          f"{theirs / n:.1f}; {exact}/{n} prompts equal hf_bf16 greedy")
    assert ours >= 0.5 * theirs


#: Tiny checkpoints with projection biases at sizes the kernels take: Qwen2 (q/k/v biases) and
#: Llama with `attention_bias` (q/k/v/o) and `mlp_bias` (gate/up/down); tests/tiny_models.py
#: sets every bias away from zero.
BIASED = {
    "qwen2": ("qwen2", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)),
    "llama-biased": ("llama", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                   attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(BIASED))
def test_gpu_projection_biases_match_transformers_and_the_cpu(name, tiny_checkpoints):
    """Projections with biases (`linear_bias`: the f32 sums plus the bias, rounded once): prefill
    logits as close to transformers f32 and to our CPU f32 path as transformers bf16 is, and
    within the 2e-2 of transformers bf16 (or 1.5x its eager-vs-sdpa spread where wider, as for the
    bias-free tiny models); greedy decoding, alone (the GEMV route, the fused RoPE and residual
    + norm epilogues left out) and in a batch of 10 (cuBLAS), as long on transformers f32's path
    as transformers bf16 stays on it, which a bias missed or added twice on either route breaks."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    arch, shape = BIASED[name]
    path = tiny_checkpoints.get(arch, **shape)
    vocab = TINY_VOCAB
    ids = _prompt(70, vocab, seed=1)
    got = _core.Model(str(path), device="cuda").logits(ids)
    x = torch.tensor([ids], device="cuda")
    hf = {}
    with torch.no_grad():
        for key, dtype, attn in (("f32", torch.float32, "sdpa"), ("bf16", torch.bfloat16, "sdpa"), ("eager", torch.bfloat16, "eager")):
            hf[key] = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn).to("cuda").eval()
            hf[key].generation_config.eos_token_id = None
        exp = {key: m(x).logits[0].float().cpu().numpy() for key, m in hf.items()}
    cpu = _core.Model(str(path), device="cpu").logits(ids)
    theirs32, ours32, ours_cpu = _rel_err(exp["bf16"], exp["f32"]), _rel_err(got, exp["f32"]), _rel_err(got, cpu)
    ours_bf16, paths = _rel_err(got, exp["bf16"]), _rel_err(exp["eager"], exp["bf16"])
    prompts = [_prompt(16 + 3 * i, vocab, seed=60 + i) for i in range(10)]
    with LLM(path, device="cuda", max_context=512) as llm:
        batch = [o.token_ids for o in llm.generate(prompts, greedy(64))]
        alone = [llm.generate([p], greedy(64))[0].token_ids for p in prompts]
    refs = {key: [_hf_greedy(hf[key], p, 64) for p in prompts] for key in ("f32", "bf16")}
    on_path = lambda outs: sum(_matched_prefix(o, r) for o, r in zip(outs, refs["f32"])) / len(outs)  # noqa: E731
    ours_batch, ours_alone = on_path(batch), on_path(alone)
    theirs_path = on_path(refs["bf16"])
    print(f"{name}: rel err ours-vs-hf_f32 {ours32:.2e}, hf_bf16-vs-hf_f32 {theirs32:.2e}, ours-vs-cpu_f32 {ours_cpu:.2e}, "
          f"ours-vs-hf_bf16 {ours_bf16:.2e}, hf_bf16 eager-vs-sdpa {paths:.2e}; tokens on hf_f32's greedy path: "
          f"ours in a batch of 10 {ours_batch:.1f}, ours alone {ours_alone:.1f}, hf_bf16 {theirs_path:.1f}")
    assert ours32 <= 2 * theirs32 + 5e-3
    assert ours_cpu <= 2 * theirs32 + 5e-3
    assert ours_bf16 <= max(REL_TOL, 1.5 * paths), (ours_bf16, paths)
    assert ours_batch >= 0.5 * theirs_path
    assert ours_alone >= 0.5 * theirs_path


@pytest.mark.parametrize("chunk", [7, 64])
def test_gpu_chunked_prefill_equals_whole_prefill(gpu_dir, chunk):
    # Whole prefill runs the prefill kernels (flash attention, chunked Gated DeltaNet), 7-token
    # chunks the recurrent GDN kernel: same math, different f32 rounding, so greedy tokens may
    # part only where the top two are near-tied.
    params = greedy(24, top_logprobs=2)
    with LLM(gpu_dir, device="cuda", max_context=512, prefill_chunk=512, prefix_reuse=False) as whole:
        prompt = _prompt(150, TINY_VOCAB, seed=3)
        [ref] = whole.generate(prompt, params)
    with LLM(gpu_dir, device="cuda", max_context=512, prefill_chunk=chunk, prefix_reuse=False) as chunked:
        [out] = chunked.generate(prompt, params)
    gap = _divergence_gap(out, ref.token_ids)
    assert gap is None or gap[1] < NEAR_TIE, gap


@pytest.mark.parametrize("chunk", [1, 17, 100])
def test_gpu_prefill_kernels_match_chunked_and_cpu_logits_at_300_tokens(gpu_dir, hf_bf16, chunk):
    """300 prompt tokens in one step (flash attention, chunked GDN: 300 >= 64) against the same
    prompt in chunks over a cached prefix (1: the decode kernels; 17: flash attention and
    recurrent GDN; 100: both prefill kernels from a nonzero state), and against the CPU f32
    path, all within the bf16 tolerance transformers itself shows against f32."""
    gpu = _core.Model(str(gpu_dir), device="cuda")
    vocab = gpu.config["vocab_size"]
    ids = _prompt(300, vocab, seed=5)
    whole = gpu.logits(ids)
    chunked = gpu.logits(ids, chunk=chunk)
    cpu = _core.Model(str(gpu_dir), device="cpu").logits(ids)
    hf_f32 = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_dir), dtype=torch.float32).to("cuda").eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        theirs = _rel_err(hf_bf16(x).logits[0].float().cpu().numpy(), hf_f32(x).logits[0].float().cpu().numpy())
    tol = 2 * theirs + 5e-3
    print(f"{gpu_dir.name[:8]} chunk {chunk}: whole-vs-cpu {_rel_err(whole, cpu):.2e}, "
          f"chunked-vs-whole {_rel_err(chunked, whole):.2e}, hf_bf16-vs-f32 {theirs:.2e}")
    assert _rel_err(whole, cpu) <= tol
    assert _rel_err(chunked, cpu) <= tol
    assert _rel_err(chunked, whole) <= tol


@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_attention_at_the_wgmma_head_sizes_matches_cpu_logits_at_300_tokens(tiny_checkpoints, head_dim):
    """The tiny models above have head size 64; on sm_90 the prefill attention at 128 and 256
    (the 8B's and the 27B's) is the wgmma kernel, whose K/V buffer rotation needs three or more
    key tiles to be exercised: 300 tokens are 3 tiles of 128 keys at d 128 and 10 of 32 at d 256.
    One step against one token a step (the decode kernels) and the CPU f32 path."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    path = tiny_checkpoints.get("qwen3", **{**GPU_SHAPES["qwen3"], "head_dim": head_dim})
    gpu = _core.Model(str(path), device="cuda")
    ids = _prompt(300, gpu.config["vocab_size"], seed=7)
    whole = gpu.logits(ids)
    stepped = gpu.logits(ids, chunk=1)
    cpu = _core.Model(str(path), device="cpu").logits(ids)
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        hf = {dt: transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).to("cuda").eval()(x)
              .logits[0].float().cpu().numpy() for dt in (torch.bfloat16, torch.float32)}
    tol = 2 * _rel_err(hf[torch.bfloat16], hf[torch.float32]) + 5e-3
    print(f"head_dim {head_dim}: whole-vs-cpu {_rel_err(whole, cpu):.2e}, whole-vs-stepped "
          f"{_rel_err(whole, stepped):.2e}, tol {tol:.2e}")
    assert _rel_err(whole, cpu) <= tol
    assert _rel_err(whole, stepped) <= tol


#: Batch vs alone is measured on f32 logits (logits_dtype "float32"): the claim is about the
#: model's arithmetic, and under the default bf16 logits a gap is only known to the bf16 grid
#: (0.25 at |logit| 32-64), where an exact tie goes to the lowest id either way.
def test_gpu_batch_differs_from_alone_only_at_near_ties(gpu_dir):
    params = greedy(24, top_logprobs=2)
    with LLM(gpu_dir, device="cuda", max_context=512, prefix_reuse=False, logits_dtype="float32") as llm:
        batched = llm.generate(PROMPTS, params)
        alone = [llm.generate(p, params)[0] for p in PROMPTS]
    gaps = [_divergence_gap(a, b.token_ids) for a, b in zip(alone, batched)]
    print(f"{gpu_dir.name[:8]}: {gaps.count(None)}/{len(PROMPTS)} batched outputs equal alone; divergences "
          f"(token, alone's top-2 gap): {[g for g in gaps if g]}")
    assert all(g is None or g[1] < NEAR_TIE for g in gaps)


def _prefix_hit_vs_miss(model_dir: Path, device: str) -> tuple:
    """Each of four prompts (100-139 tokens) run by an engine without prefix reuse (a miss), then
    twice by one with it: the first run fills the cache, the second resumes from it. Returns
    (cold outputs, first outputs, second outputs, the warm engine's prefix-hit tokens)."""
    params = greedy(24, top_logprobs=2)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [_prompt(100 + 13 * i, vocab, seed=60 + i) for i in range(4)]
    with LLM(model_dir, device=device, max_context=512, prefix_reuse=False, logits_dtype="float32") as cold:
        misses = [cold.generate(p, params)[0] for p in prompts]
    with LLM(model_dir, device=device, max_context=512, prefix_reuse=True, logits_dtype="float32") as warm:
        firsts = [warm.generate(p, params)[0] for p in prompts]
        hits = [warm.generate(p, params)[0] for p in prompts]
        hit_tokens = warm.engine.stats()["prefix_hit_tokens"]
    return misses, firsts, hits, hit_tokens


def test_gpu_prefix_cache_hit_differs_from_miss_only_at_near_ties(gpu_dir):
    """A prompt whose prefix is cached resumes from it: its KV blocks (and, on the hybrid, the
    GDN state snapshot at the hit) are reused and only the rest is prefilled, over the cached
    prefix (paged attention from a nonzero start; the GDN kernels from a restored state). Its
    greedy output equals a cold engine's but at near-ties, as batch vs alone (f32 logits)."""
    misses, firsts, hits, hit_tokens = _prefix_hit_vs_miss(gpu_dir, "cuda")
    assert hit_tokens > 0
    assert all(f.usage.cached_tokens == 0 for f in firsts), "random prompts share no prefix"
    assert all(h.usage.cached_tokens >= 64 for h in hits), [h.usage.cached_tokens for h in hits]
    gaps = [_divergence_gap(h, m.token_ids) for h, m in zip(hits, misses)]
    first_gaps = [_divergence_gap(f, m.token_ids) for f, m in zip(firsts, misses)]
    print(f"{gpu_dir.name[:8]}: prefix hits of {[h.usage.cached_tokens for h in hits]} tokens; "
          f"{gaps.count(None)}/{len(hits)} hit outputs equal the cold engine's, divergences (token, hit's top-2 "
          f"gap): {[g for g in gaps if g]}; first runs {first_gaps.count(None)}/{len(firsts)}")
    assert all(g is None or g[1] < NEAR_TIE for g in gaps + first_gaps)


def _storage_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor rounded to the storage type (`_storage_dtype`) by torch (round to
    nearest even) except `A_log` and `dt_bias`, which the loader keeps in f32: the same device
    weights through the loader's raw path that `src` (f32) gives through its conversion path."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            keep = ("A_log", "dt_bias")
            t = {k: v if k.endswith(keep) else v.to(_storage_dtype()) for k, v in load_file(str(f)).items()}
            save_file(t, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def _timed_load(path: Path):
    t = time.perf_counter()
    m = _core.Model(str(path), device="cuda")
    secs = time.perf_counter() - t
    gb = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e9
    print(f"{Path(path).name[:12]}: loaded {gb * 1e3:.1f} MB of checkpoint in {secs:.2f} s ({gb / secs:.2f} GB/s, "
          "kernels included)")
    return m


def test_gpu_loader_conversion_and_raw_paths_give_identical_logits(gpu_dir, tmp_path):
    """The tiny checkpoints are f32 (converted on the host while loading); their copy in the
    storage type (bf16, f16 on sm_7x) goes through positioned reads: both must put the same bits
    on the device, so the logits are bitwise equal."""
    ids = _prompt(40, TINY_VOCAB, seed=4)
    from_f32 = _timed_load(gpu_dir).logits(ids)
    raw_dir = _storage_copy(gpu_dir, tmp_path / "raw")
    from_raw = _timed_load(raw_dir).logits(ids)
    assert np.array_equal(from_f32, from_raw)


def test_unsupported_head_dim_is_refused_at_load(tiny_checkpoints):
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    with pytest.raises(_core.UnsupportedError, match="head_dim"):
        _core.Model(str(tiny_checkpoints.get("llama")), device="cuda")


DEMO = Path(ninfer.__file__).parent / "demo"


@pytest.fixture(scope="module")
def demo_dir():
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    if not (DEMO / "model" / "config.json").exists():
        pytest.skip("no bundled demo model")
    return DEMO / "model"


@pytest.fixture(scope="module")
def demo_windows():
    seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    return [seq[i:i + 24] for seq in seqs for i in (0, 300, 600)][:20]


def test_demo_model_logits_match_transformers_bf16_and_cpu_f32(demo_dir, demo_windows):
    ids = demo_windows[0] + demo_windows[1] + demo_windows[2]
    got = _core.Model(str(demo_dir), device="cuda").logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        exp = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    cpu = _core.Model(str(demo_dir), device="cpu").logits(ids)
    print(f"demo: rel err vs transformers bf16 {_rel_err(got, exp):.2e}, vs CPU f32 {_rel_err(got, cpu):.2e}")
    assert _rel_err(got, exp) <= REL_TOL
    assert _rel_err(got, cpu) <= REL_TOL


def test_demo_model_direct_load_matches_cpu_f32(demo_dir, demo_windows):
    """The bf16 demo checkpoint through the direct loader (positioned reads): logits within
    REL_TOL of the CPU f32 model."""
    ids = demo_windows[3] + demo_windows[4]
    got = _timed_load(demo_dir).logits(ids)
    cpu = _core.Model(str(demo_dir), device="cpu").logits(ids)
    print(f"demo: direct load, rel err vs CPU f32 {_rel_err(got, cpu):.2e}")
    assert _rel_err(got, cpu) <= REL_TOL


def test_demo_model_heldout_perplexity_matches_training_record(demo_dir):
    data = json.loads((DEMO / "heldout_tokens.json").read_text())
    m = _core.Model(str(demo_dir), device="cuda")
    nll, count = 0.0, 0
    for ids in data["sequences"]:
        logits = m.logits(ids).astype(np.float64)[:-1]
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll += float((lse - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    ppl = float(np.exp(nll / count))
    print(f"demo: held-out perplexity on the GPU {ppl:.4f}, recorded (f32) {data['perplexity']:.4f}")
    assert abs(ppl / data["perplexity"] - 1) < 0.02


def _greedy_vs_transformers(demo_dir, demo_windows, hf, **llm_kwargs):
    """(prompts whose 64 greedy tokens equal `hf`'s, the divergences (token, our top-2 gap))."""
    with LLM(demo_dir, device="cuda", max_context=512, **llm_kwargs) as llm:
        outs = llm.generate(demo_windows, greedy(64, top_logprobs=2))
    hf.generation_config.eos_token_id = None
    gaps = [_divergence_gap(out, _hf_greedy(hf, prompt, 64)) for prompt, out in zip(demo_windows, outs)]
    return gaps.count(None), [g for g in gaps if g]


def test_demo_model_greedy_64_tokens_match_transformers_bf16(demo_dir, demo_windows):
    """Default logits_dtype "auto": our logits rounded to bf16 as transformers' lm_head returns
    them, greedy taking the lowest id among equal values as torch.argmax: the brief's 95% of
    prompts (19/20) with the same 64 tokens (teacher-forced, argmax of our bf16-rounded decode
    logits agreed on 20/20); any divergence at a near-tie. Where the engine stores f16 (sm_7x,
    or NINFER_EMULATE_ARCH below 8.0), against transformers in f16: the same rounding."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=_storage_dtype()).to("cuda").eval()
    same, divergences = _greedy_vs_transformers(demo_dir, demo_windows, hf)
    print(f"demo: {same}/{len(demo_windows)} prompts equal transformers {str(_storage_dtype())[6:]} greedy (64 tokens, logits_dtype auto); "
          f"divergences (token, our top-2 gap): {divergences}")
    assert all(g[1] < NEAR_TIE for g in divergences)
    assert same >= 0.95 * len(demo_windows)


def test_demo_model_greedy_64_tokens_match_transformers_bf16_with_our_f32_logits(demo_dir, demo_windows):
    """logits_dtype "float32" against plain transformers bf16: our f32 logits resolve near-ties
    that transformers' bf16 logits make exact (lowest id wins there); measured 16/20, so this
    holds >= 80% with every divergence at a near-tie."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.bfloat16).to("cuda").eval()
    same, divergences = _greedy_vs_transformers(demo_dir, demo_windows, hf, logits_dtype="float32")
    print(f"demo: {same}/{len(demo_windows)} prompts equal transformers bf16 greedy (64 tokens, logits_dtype float32); "
          f"divergences (token, our top-2 gap): {divergences}")
    assert all(g[1] < NEAR_TIE for g in divergences)
    assert same >= 0.8 * len(demo_windows)


def test_demo_model_auto_logits_are_the_float32_logits_rounded_to_bf16(demo_dir, demo_windows):
    """The one rounding place per path: prefill logits (cuBLAS route, then round_f32_to_storage,
    and the GEMV route for <= 8 rows) and decode logits (the GEMV epilogue, in CUDA graphs) of
    logits_dtype "auto" equal torch's round-to-nearest-even bf16 of the "float32" logits, bit
    for bit."""
    auto = _core.Model(str(demo_dir), device="cuda")
    f32 = _core.Model(str(demo_dir), device="cuda", logits_dtype="float32")
    bf16 = lambda a: torch.from_numpy(a).to(_storage_dtype()).float().numpy()
    for ids in (demo_windows[0] + demo_windows[1], demo_windows[2][:5]):
        got, full = auto.logits(ids), f32.logits(ids)
        assert (full.view(np.uint32) & 0xFFFF).any(), "float32 logits keep their low bits"
        _assert_bitwise(got, bf16(full), f"prefill of {len(ids)} tokens: auto vs bf16(float32)")
    prompts = _decode_prompts(demo_dir, 3)
    a_tokens, a_logits, _ = auto.decode_greedy(prompts, 8)
    f_tokens, f_logits, _ = f32.decode_greedy(prompts, 8)
    # Step s decodes from inputs tokens[:s + 1] (tokens[0]: the prefill's argmax). Teacher forcing
    # is not available here: compare while both runs fed the same tokens (ties broken differently
    # by the two modes may end that early, but not before step 0 on these prompts).
    compared = 0
    for step in range(8):
        if any(a[:step + 1] != f[:step + 1] for a, f in zip(a_tokens, f_tokens)):
            break
        _assert_bitwise(a_logits[step], bf16(f_logits[step]), f"decode step {step}: auto vs bf16(float32)")
        compared += 1
    print(f"demo: auto decode logits == bf16(float32) over {compared}/8 steps")
    assert compared >= 1
    with pytest.raises(_core.UnsupportedError, match="logits_dtype `bfloat16`"):
        _core.Model(str(demo_dir), device="cuda", logits_dtype="bfloat16")


def _f32_head(model):
    """transformers' bf16 model with its lm_head evaluated in f32 on the bf16 final hidden
    state: what our runner does (bf16 weights and activations, f32 accumulation and f32 logits).
    Plain transformers bf16 rounds the logits to bf16 (a step of 1/16 at |logit| 8-16) and then
    takes the lowest index among the equal values, which flips greedy choices at gaps our f32
    logits resolve. A new f32 Linear replaces the head, so a head tied to the embedding stays
    bf16 where the embedding uses it."""
    old = model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, old.out_features, bias=False, device=old.weight.device, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(old.weight.float())
    head.register_forward_pre_hook(lambda _m, args: (args[0].float(),))
    model.set_output_embeddings(head)
    return model


def test_demo_model_greedy_64_tokens_match_transformers_with_f32_logits(demo_dir, demo_windows):
    """Against transformers bf16 whose logits are not rounded to bf16 (see `_f32_head`): the
    brief asks for 95% of prompts with the same 64 greedy tokens (met in the default mode, bf16
    logits against transformers' bf16 logits: 20/20); here f32 against f32 measured 18/20
    before the kernels rounded where transformers rounds and 16/20 since, so this holds 80% and
    requires every divergence to be at a near-tie. Ours with f32 logits too (logits_dtype
    "float32")."""
    with LLM(demo_dir, device="cuda", max_context=512, logits_dtype="float32") as llm:
        outs = llm.generate(demo_windows, greedy(64, top_logprobs=2))
    hf = _f32_head(transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.bfloat16).to("cuda").eval())
    hf.generation_config.eos_token_id = None
    gaps = []
    for prompt, out in zip(demo_windows, outs):
        gaps.append(_divergence_gap(out, _hf_greedy(hf, prompt, 64)))
    same = gaps.count(None)
    print(f"demo: {same}/{len(demo_windows)} prompts equal transformers bf16 with f32 logits (64 tokens); "
          f"divergences (token, our top-2 gap): {[g for g in gaps if g]}")
    assert all(g is None or g[1] < NEAR_TIE for g in gaps)
    assert same >= 0.8 * len(demo_windows)


def test_demo_model_batch_differs_from_alone_only_at_near_ties(demo_dir, demo_windows):
    params = greedy(32, top_logprobs=2)
    # f32 logits: see test_gpu_batch_differs_from_alone_only_at_near_ties.
    with LLM(demo_dir, device="cuda", max_context=512, prefix_reuse=False, logits_dtype="float32") as llm:
        batched = llm.generate(demo_windows, params)
        alone = [llm.generate(p, params)[0] for p in demo_windows]
    gaps = [_divergence_gap(a, b.token_ids) for a, b in zip(alone, batched)]
    print(f"demo: {gaps.count(None)}/{len(demo_windows)} batched outputs equal alone; divergences "
          f"(token, alone's top-2 gap): {[g for g in gaps if g]}")
    assert all(g is None or g[1] < NEAR_TIE for g in gaps)


def test_demo_model_alone_request_repeats_itself_after_batches(demo_dir, demo_windows):
    """A request carries nothing into the next: the same prompt alone gives the same tokens and
    logprobs bit for bit on a fresh engine and after batches of 20 and of 2 have used (and
    released) other state slots and KV blocks. It once caught delta-rule state slots spaced by
    conv + delta state when the kernels space them by the delta state alone, so a new sequence
    on any slot but 0 started from part of its slot's previous state."""
    params = greedy(32, top_logprobs=5)
    mine = demo_windows[:4]
    with LLM(demo_dir, device="cuda", max_context=512, prefix_reuse=False, logits_dtype="float32") as llm:
        alone = lambda: [llm.generate(p, params)[0] for p in mine]
        fresh = alone()
        llm.generate(demo_windows, params)
        after_20 = alone()
        again = alone()
        llm.generate(demo_windows[:2], params)
        after_2 = alone()
    for name, run in [("after a batch of 20", after_20), ("again", again), ("after a batch of 2", after_2)]:
        for i, (a, b) in enumerate(zip(fresh, run)):
            assert a.token_ids == b.token_ids, f"prompt {i} {name}: tokens differ from the fresh engine's"
            assert [p.top for p in a.logprobs] == [p.top for p in b.logprobs], f"prompt {i} {name}: logprobs differ"


def test_demo_model_prefill_kernels_match_chunked_and_cpu_logits(demo_dir, demo_windows):
    ids = sum(demo_windows[:13], [])[:300]
    gpu = _core.Model(str(demo_dir), device="cuda")
    whole = gpu.logits(ids)
    cpu = _core.Model(str(demo_dir), device="cpu").logits(ids)
    print(f"demo 300 tokens: whole-vs-cpu {_rel_err(whole, cpu):.2e}")
    assert _rel_err(whole, cpu) <= REL_TOL
    for chunk in (1, 17, 100):
        chunked = gpu.logits(ids, chunk=chunk)
        print(f"demo chunk {chunk}: chunked-vs-whole {_rel_err(chunked, whole):.2e}, vs cpu {_rel_err(chunked, cpu):.2e}")
        assert _rel_err(chunked, whole) <= REL_TOL
        assert _rel_err(chunked, cpu) <= REL_TOL


def test_demo_model_chunked_prefill_equals_whole_prefill(demo_dir, demo_windows):
    prompt = sum(demo_windows[:6], [])
    with LLM(demo_dir, device="cuda", max_context=512, prefill_chunk=512, prefix_reuse=False) as whole:
        [ref] = whole.generate(prompt, greedy(32))
    with LLM(demo_dir, device="cuda", max_context=512, prefill_chunk=16, prefix_reuse=False) as chunked:
        [out] = chunked.generate(prompt, greedy(32))
    assert out.token_ids == ref.token_ids


def test_gpu_ledger_reports_workspace_and_free_device_memory(demo_dir):
    """The startup ledger on CUDA: the warm-up step's activation workspace grows with the
    prefill chunk, and the free device memory is read after everything was allocated."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    small = _core.Engine(str(demo_dir), device="cuda", max_context=4096, kv_capacity=4096, prefill_chunk=16)
    small_info = small.info()
    large = _core.Engine(str(demo_dir), device="cuda", max_context=4096, kv_capacity=4096, prefill_chunk=2048)
    large_info = large.info()
    assert 0 < small_info["workspace_bytes"] < large_info["workspace_bytes"]
    total = torch.cuda.mem_get_info()[1]
    for info in (small_info, large_info):
        assert 0 < info["device_free_bytes"] < total
        assert info["total_bytes"] == info["weight_bytes"] + info["kv_bytes"] + info["state_bytes"] + info["workspace_bytes"]
    from ninfer.ledger import format_ledger

    text = format_ledger(large_info)
    assert "workspace" in text and "left after plan" in text, text


def test_gpu_workspace_plans_the_decode_scratch_and_sampler_for_the_concurrency(demo_dir):
    """The buffers a decode step of max_concurrency sequences needs are grown at startup and
    counted in the ledger's workspace: the f32 logits rows, the device sampler's processed logits
    (as many again) and the decode attention's split-K scratch (32 splits of every q head). So
    the ledger plans them, and a server does not allocate them (nor drop its captured decode
    graphs, as a growing attention scratch does) while its concurrency climbs."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    c = json.loads((Path(demo_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    vocab, heads, hd = c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    ws = {n: _core.Engine(str(demo_dir), device="cuda", max_context=2048, kv_capacity=4096, max_concurrency=n,
                          prefill_chunk=256).info()["workspace_bytes"] for n in (8, 64)}
    per_row = 2 * vocab * 4 + heads * 32 * hd * 4
    print(f"workspace at concurrency 8 / 64: {ws[8] / 2**20:.2f} / {ws[64] / 2**20:.2f} MiB; 56 rows of logits, "
          f"sampler and attention scratch: {56 * per_row / 2**20:.2f} MiB")
    assert ws[64] - ws[8] >= 56 * per_row


def test_logits_buffer_follows_the_rows_that_want_logits_not_the_prefill_chunk(demo_dir):
    """A prefill step wants one logits row a sequence, so the f32 logits buffer is sized by
    those rows, not by the step's tokens (which, on Qwen3.5's 248k vocabulary at an 8192-token
    chunk, would hold 7.6 GiB): raising the chunk from 64 to 4096 grows the workspace by the
    activations only, well under the 4032 logits rows it used to add. A scoring request, which
    wants every row, grows the buffer when it comes and gets the model's logits."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    vocab = json.loads((Path(demo_dir) / "config.json").read_text())["vocab_size"]
    small = _core.Engine(str(demo_dir), device="cuda", max_context=4096, kv_capacity=4096, prefill_chunk=64)
    large = _core.Engine(str(demo_dir), device="cuda", max_context=4096, kv_capacity=4096, prefill_chunk=4096)
    growth = large.info()["workspace_bytes"] - small.info()["workspace_bytes"]
    logits_rows_bytes = (4096 - 64) * vocab * 4
    print(f"workspace growth 64 -> 4096 tokens: {growth / 2**20:.1f} MiB (4032 logits rows: {logits_rows_bytes / 2**20:.1f} MiB)")
    assert 0 < growth < 0.75 * logits_rows_bytes
    ids = _prompt(300, vocab, 3)
    got = large.score(ids)
    exp = _core.Model(str(demo_dir), device="cuda").logits(ids)
    assert got.shape == (300, vocab)
    assert np.array_equal(got, exp)


def test_gpu_default_kv_pool_comes_from_free_device_memory(demo_dir):
    """Without --kv-capacity the CUDA engine plans the KV pool from free device memory (after
    the weights, step buffers and state slots; a reserve of 5% of the device, at least 1 GiB,
    stays free), not from the host's fixed 4 GiB budget: with enough concurrency to want more
    than 4 GiB the pool is larger than that budget, and the device keeps at least the reserve."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    free_before, total = torch.cuda.mem_get_info()
    eng = _core.Engine(str(demo_dir), device="cuda", max_context=4096, max_concurrency=4096, prefill_chunk=512)
    info = eng.info()
    four_gib_tokens = (4 << 30) // info["kv_bytes_per_token"]
    wanted = 4096 * 4096
    print(f"demo on cuda: default KV pool {info['kv_capacity_tokens']} tokens ({info['kv_bytes'] / 2**30:.1f} GiB), "
          f"state {info['state_bytes'] / 2**30:.1f} GiB, free before {free_before / 2**30:.1f} GiB, left {info['device_free_bytes'] / 2**30:.1f} GiB")
    assert four_gib_tokens < info["kv_capacity_tokens"] <= wanted
    assert info["device_free_bytes"] >= 0.9 * max(total // 20, 1 << 30)
    del eng


def _generate_with(model_dir, device_sampling: bool, prompts, params):
    """Generate on cuda with sampling on the device, or on the host (`device_sampling=False`):
    both paths see the same logits, so only sampling differs."""
    with LLM(model_dir, device="cuda", max_context=512, prefix_reuse=False, device_sampling=device_sampling) as llm:
        return llm.generate(prompts, params)


def _assert_same_tokens_and_logprobs(dev_outs, host_outs):
    for d, h in zip(dev_outs, host_outs):
        assert d.token_ids == h.token_ids
        if h.logprobs is None:
            assert d.logprobs is None
            continue
        for dl, hl in zip(d.logprobs, h.logprobs):
            assert dl.token_id == hl.token_id
            assert abs(dl.logprob - hl.logprob) <= 1e-4
            assert [t for t, _ in dl.top] == [t for t, _ in hl.top]
            assert np.allclose([v for _, v in dl.top], [v for _, v in hl.top], atol=1e-4)


#: Sampling settings the device sampler must reproduce token for token, given the request's seed
#: (the host and the device differ only for a draw within ~1e-6 of a CDF boundary, which a few
#: hundred draws do not meet in practice).
SEEDED = [
    dict(temperature=0.8, seed=7),
    dict(temperature=1.0, top_k=20, top_p=0.9, seed=8, logprobs=True, top_logprobs=3),
    dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=9),
    dict(temperature=1.2, top_p=0.5, logit_bias={5: 3.0, 9: -100.0}, seed=10),
]


def test_device_greedy_sampling_equals_host_sampling(gpu_dir):
    params = greedy(24, logprobs=True, top_logprobs=5)
    dev = _generate_with(gpu_dir, True, PROMPTS, params)
    host = _generate_with(gpu_dir, False, PROMPTS, params)
    _assert_same_tokens_and_logprobs(dev, host)


@pytest.mark.parametrize("kwargs", SEEDED)
def test_device_seeded_sampling_equals_host_and_repeats(gpu_dir, kwargs):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **kwargs)
    dev = _generate_with(gpu_dir, True, PROMPTS, params)
    again = _generate_with(gpu_dir, True, PROMPTS, params)
    host = _generate_with(gpu_dir, False, PROMPTS, params)
    assert [o.token_ids for o in dev] == [o.token_ids for o in again], "same seed, same tokens"
    _assert_same_tokens_and_logprobs(dev, host)


def test_demo_model_device_sampling_equals_host_sampling(demo_dir, demo_windows):
    for params in (greedy(32, top_logprobs=4), SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.9,
                                                               top_p=0.95, top_k=50, seed=3)):
        dev = _generate_with(demo_dir, True, demo_windows, params)
        host = _generate_with(demo_dir, False, demo_windows, params)
        _assert_same_tokens_and_logprobs(dev, host)


def _generate_async(model_dir, on: bool, batches):
    """Generate each batch of `(prompts, params)` in turn on one cuda engine (`prompts` may be a
    function of the previous batch's outputs) with asynchronous scheduling on or off
    (the engine option `async_scheduling`). Batch invariance is on: a lookahead
    step keeps a request that just ended in its batch, so the two modes run some steps at
    different batch sizes. Returns the outputs and the engine's stats."""
    with LLM(model_dir, device="cuda", max_context=512, async_scheduling=on, batch_invariant=True) as llm:
        assert llm.engine.info()["async_scheduling"] is on
        outs = []
        for prompts, params in batches:
            outs.append(llm.generate(prompts(outs[-1]) if callable(prompts) else prompts, params))
        return outs, llm.engine.stats()


_SCHEMA = {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 12}, "x": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["label", "x", "ok"], "additionalProperties": False}}}
#: Words and a closing answer: several tokens in any tokenizer, then the grammar completes (the
#: request stops while the next step's forward pass is queued).
_REGEX = {"type": "regex", "regex": "([a-z]{2,5} ){3,6}(yes|no)!"}


# Penalized requests run ahead too: a lookahead step's sampler counts its input token (the token
# still in flight, read on the device) as one more output occurrence, so the penalties see what
# the synchronous engine's history holds. Requests with a response_format run their forward pass
# ahead and sample after the step in flight is completed (their masks need its token): a split
# lookahead, counted in stats()["split_lookahead_steps"].
@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0, logprobs=True, top_logprobs=2),
    SEEDED[1],
    SEEDED[2],
    dict(temperature=0.0, repetition_penalty=1.5, logprobs=True),
    dict(temperature=0.0, presence_penalty=1.0, frequency_penalty=1.5, top_logprobs=2),
    dict(temperature=0.9, top_k=40, presence_penalty=0.8, frequency_penalty=1.2, seed=11, logprobs=True),
    dict(temperature=0.8, repetition_penalty=1.3, seed=12),
    dict(temperature=0.0, logprobs=True, top_logprobs=2, response_format={"type": "json_object"}),
    dict(temperature=0.9, top_k=40, seed=13, logprobs=True, response_format={"type": "json_object"}),
    dict(temperature=0.0, logprobs=True, response_format=_REGEX),
    dict(temperature=0.8, seed=14, frequency_penalty=0.5, logprobs=True, response_format=_REGEX),
    dict(temperature=0.0, repetition_penalty=1.2, response_format=_SCHEMA),
    dict(temperature=1.0, top_p=0.9, seed=15, logprobs=True, top_logprobs=3, response_format=_SCHEMA),
], ids=["greedy", "seeded", "seeded_all_penalties", "greedy_repetition", "greedy_presence_frequency",
        "seeded_presence_frequency", "seeded_repetition", "greedy_json_object", "seeded_json_object",
        "greedy_regex", "seeded_regex_frequency", "greedy_json_schema_repetition", "seeded_json_schema"])
def test_async_scheduling_gives_the_synchronous_tokens_and_logprobs(gpu_dir, kwargs):
    # Different lengths (EOS not ignored): requests end while the next step is already queued.
    # A request that ends unforeseen (EOS, a grammar completing) keeps a dropped row in the step
    # queued after it, so the two modes run that step at different batch sizes: bit-equal only
    # on the batch-invariant route, at most GEMV_MAX_M = 8 rows a step (cuBLAS above it).
    prompts = PROMPTS[:8]
    batch = [(prompts, [SamplingParams(max_tokens=6 + 5 * i, **kwargs) for i in range(len(prompts))])]
    (on,), stats = _generate_async(gpu_dir, True, batch)
    (off,), sync = _generate_async(gpu_dir, False, batch)
    assert sync["lookahead_steps"] == 0
    assert stats["lookahead_steps"] > 0, stats
    # Every lookahead holds a constrained request when they all have one.
    split = stats["lookahead_steps"] if "response_format" in kwargs else 0
    assert stats["split_lookahead_steps"] == split, stats
    _assert_same_tokens_and_logprobs(on, off)
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert [o.text for o in on] == [o.text for o in off]


def test_async_scheduling_keeps_prefix_and_state_snapshots_for_the_next_turn(gpu_dir):
    params = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)
    batches = [(PROMPTS[:4], params),
               (lambda first: [o.prompt_token_ids + o.token_ids + [5, 6, 7] for o in first], greedy(12))]
    (on1, on2), stats = _generate_async(gpu_dir, True, batches)
    (off1, off2), _ = _generate_async(gpu_dir, False, batches)
    assert stats["lookahead_steps"] > 0
    for a, b in zip(on1 + on2, off1 + off2):
        assert a.token_ids == b.token_ids
        assert a.usage.cached_tokens == b.usage.cached_tokens
    assert all(o.usage.cached_tokens > 0 for o in on2), "the second turn resumes from the first"


# Decode steps as CUDA graphs (one per batch bucket): replayed logits must equal eager logits bit
# for bit, and with batch_invariant a sequence decoded in a batch of <= 8 must equal the
# same sequence decoded alone bit for bit (one GEMV kernel per shape for every M, whose per-row
# summation does not depend on M; per-token attention splits).

def _decode_models(model_dir):
    return _core.Model(str(model_dir), device="cuda"), _core.Model(str(model_dir), device="cuda", cuda_graphs=False)


def _decode_prompts(model_dir, n):
    if model_dir == DEMO / "model":
        seqs = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
        return [seqs[i % len(seqs)][50 * i:50 * i + 9 + 5 * i] for i in range(n)]
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return [_prompt(9 + 5 * i, vocab, seed=40 + i) for i in range(n)]


def _assert_bitwise(a, b, what):
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} logits differ, first at flat index {diff[0]}, max abs diff {np.abs(a - b).max():.3e}"


@pytest.fixture(scope="module", params=["demo", "llama"])
def decode_dir(request, tiny_checkpoints):
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    if request.param == "demo":
        if not (DEMO / "model" / "config.json").exists():
            pytest.skip("no bundled demo model")
        return DEMO / "model"
    return tiny_checkpoints.get("llama", **GPU_SHAPES["llama"])


@pytest.mark.parametrize("n", [1, 3, 8])
def test_graph_replayed_decode_equals_eager_decode_bitwise(decode_dir, n):
    graphed, eager = _decode_models(decode_dir)
    prompts = _decode_prompts(decode_dir, n)
    g_tokens, g_logits, g_graphs = graphed.decode_greedy(prompts, 12)
    e_tokens, e_logits, e_graphs = eager.decode_greedy(prompts, 12)
    assert g_graphs >= 1, "decode steps did not run as CUDA graphs"
    assert e_graphs == 0, "cuda_graphs=False did not disable graphs"
    assert np.isfinite(g_logits).all()
    _assert_bitwise(g_logits, e_logits, f"{decode_dir.name[:8]} bucket of {n}: graph vs eager")
    assert g_tokens == e_tokens


@pytest.mark.parametrize("n", [2, 5, 8])
def test_decode_in_a_batch_equals_decode_alone_bitwise(decode_dir, n):
    # The default GEMV form runs faster kernels at batch 1 than in a batch (the last bits may
    # differ; test_*_batch_differs_from_alone_only_at_near_ties covers it): batch invariance is
    # the opt-in batch_invariant.
    model = _core.Model(str(decode_dir), device="cuda", batch_invariant=True)
    prompts = _decode_prompts(decode_dir, n)
    b_tokens, b_logits, _ = model.decode_greedy(prompts, 32)
    for i, p in enumerate(prompts):
        a_tokens, a_logits, _ = model.decode_greedy([p], 32)
        assert a_tokens[0] == b_tokens[i], f"sequence {i} of {n}: greedy tokens differ"
        _assert_bitwise(b_logits[:, i], a_logits[:, 0], f"{decode_dir.name[:8]} sequence {i} of {n}: batch vs alone")


# Routes a device profile may set (backend/cuda/plan/profile.rs): each comparison loads the
# model twice, under two profiles of this GPU that differ in one plan field, and decodes the
# same prompts greedily. A profile this GPU cannot run stops the load naming the field, so a
# comparison never runs the default route twice unnoticed.

def _decode_under_plans(decode_dir, tmp_path, on, off, n, steps, graphs=True):
    """`decode_greedy` of `n` prompts for `steps` tokens by a model loaded under plan overrides
    `on`, then by one loaded under `off` (CUDA graphs as `graphs` says)."""
    prompts = _decode_prompts(decode_dir, n)
    runs = []
    for name, plan in (("on", on), ("off", off)):
        model = _core.Model(str(decode_dir), device="cuda", cuda_graphs=graphs,
                            device_profile=device_profile(tmp_path, name, plan))
        runs.append(model.decode_greedy(prompts, steps))
        del model
    return runs


def _assert_plans_change_no_bit(decode_dir, tmp_path, on, off, graphs, n, what):
    """Greedy decode of `n` prompts under plan overrides `on` and `off` (CUDA graphs as `graphs`
    says): the same logits bit for bit and the same tokens."""
    (on_tokens, on_logits, on_graphs), (off_tokens, off_logits, off_graphs) = _decode_under_plans(
        decode_dir, tmp_path, on, off, n, 16, graphs)
    assert (on_graphs >= 1) == graphs and (off_graphs >= 1) == graphs
    assert np.isfinite(on_logits).all()
    _assert_bitwise(on_logits, off_logits, f"{decode_dir.name[:8]} n={n} graphs={graphs}: {what}")
    assert on_tokens == off_tokens


def _assert_plans_keep_logits_close(decode_dir, tmp_path, on, off, n, what, graphs=True, tol=2e-2):
    """Greedy decode of `n` prompts under plan overrides `on` and `off`: every logits row
    computed from the same tokens within the issue's 2e-2. Logits row s ([steps, sequences,
    vocab]) is the step fed token s, and tokens[0] (the prefill's) is shared, so a sequence's
    rows count up to its first differing token."""
    (on_tokens, on_logits, _), (off_tokens, off_logits, _) = _decode_under_plans(
        decode_dir, tmp_path, on, off, n, 12, graphs)
    assert np.isfinite(on_logits).all() and on_logits.shape == off_logits.shape
    worst = 0.0
    for i in range(n):
        same = next((s for s, (a, b) in enumerate(zip(on_tokens[i], off_tokens[i])) if a != b), len(on_tokens[i]))
        a, b = on_logits[:same, i], off_logits[:same, i]
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)))
    assert worst <= tol, f"{decode_dir.name[:8]}: {what}: rel err {worst:.3e} (bound {tol:.0e})"


# Programmatic Dependent Launch (sm_90+, the plan's `pdl`, on by default there) only changes
# when a kernel's blocks are scheduled, never what they compute: decode logits with it on and
# off must be identical bit for bit, in graphs (programmatic edges) and eagerly.

@pytest.mark.parametrize("graphs", [True, False])
def test_decode_with_pdl_equals_decode_without_pdl_bitwise(decode_dir, graphs, tmp_path):
    if gpu_compute_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+ (a profile asking for it is refused below)")
    _assert_plans_change_no_bit(decode_dir, tmp_path, {"pdl": True}, {"pdl": False}, graphs, 3, "PDL on vs off")


# The plan's `fused_rope` (on by default) against RoPE in a kernel of its own: the same bits, in
# graphs and eagerly. It fuses the decode step's RoPE and KV cache write into the batch-1 qkv
# projection (`gemv_qkv_rope_m1`, where the qkv weight's M = 1 GEMV is the CUDA-core kernel, no
# q/k norm, no output gate: the tiny Llama at one sequence), else, with the q/k head norms, into
# decode attention's direct tensor-core form (`flash_decode_direct_rope_*`, sm_80+: the tiny
# Llama at three sequences, the demo model's gated, normed, partially rotating heads at both);
# off, the GEMV or decode attention follows rope_kv_write[_normed].

@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_decode_with_fused_rope_equals_gemv_then_rope_kv_write_bitwise(decode_dir, graphs, n, tmp_path):
    _assert_plans_change_no_bit(decode_dir, tmp_path, {"fused_rope": True}, {"fused_rope": False}, graphs, n,
                                "fused rope vs gemv + rope_kv_write")


# Warps a block of the CUDA-core GEMV (the plan's `cc_warps`: 2 against 8) only changes how rows
# are grouped into blocks: the same bits, at batch 1 (every projection on CUDA cores, the fused
# RoPE one included) and 3, in graphs and eagerly.

@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_decode_with_2_warp_gemv_blocks_equals_8_warp_blocks_bitwise(decode_dir, graphs, n, tmp_path):
    _assert_plans_change_no_bit(decode_dir, tmp_path, {"cc_warps": 2}, {"cc_warps": 8}, graphs, n,
                                "2 vs 8 warps a CUDA-core GEMV block")


# K split in the CUDA-core GEMV (the plan's `cc_ksplit`: warps of a block sharing one warp's
# rows). It changes each sum's order, so against the unsplit GEMV the logits agree within the
# issue's 2e-2, not bit for bit; under one split the fused RoPE epilogue still equals the GEMV
# followed by rope_kv_write bit for bit, and smaller blocks equal 8-warp blocks.

@pytest.mark.parametrize("ksplit", [2, 4, 8])
def test_decode_with_k_split_gemv_matches_the_unsplit_gemv(decode_dir, ksplit, tmp_path):
    _assert_plans_keep_logits_close(decode_dir, tmp_path, {"cc_ksplit": ksplit, "cc_warps": 8}, {"cc_ksplit": 1}, 3,
                                    f"K split {ksplit} vs the unsplit GEMV")


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("ksplit", [2, 4])
def test_k_split_gemv_keeps_the_fused_rope_and_block_size_bitwise(decode_dir, graphs, ksplit, tmp_path):
    split = {"cc_ksplit": ksplit, "cc_warps": 8}
    _assert_plans_change_no_bit(decode_dir, tmp_path, {**split, "fused_rope": True}, {**split, "fused_rope": False},
                                graphs, 1, f"fused rope vs gemv + rope_kv_write, K split {ksplit}")
    # A block holds at least one warp per split.
    _assert_plans_change_no_bit(decode_dir, tmp_path, {**split, "cc_warps": ksplit}, split, graphs, 1,
                                f"{ksplit} vs 8 warps a CUDA-core GEMV block, K split {ksplit}")


# Decode attention on tensor cores with K/V loaded straight into the mma fragments (the plan's
# decode attention route, on from sm_80 where the head size is 64 / 128 / 256:
# `flash_decode_direct_*`) against the CUDA-core forms (scaled at 1-2 tokens, fixed beyond): a
# different summation (P V in bf16), every logits row from the same tokens within 3e-2, in
# graphs and eagerly, at batch 1, 5 and 20. The bound is bf16 rounding of P against forms that
# keep it in f32: transformers' own bf16 attention is 3.2e-2 from its f32 on these checkpoints.

@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_direct_tensor_core_decode_attention_matches_the_cuda_core_forms(decode_dir, graphs, n, tmp_path):
    if gpu_compute_capability() < (8, 0):
        pytest.skip("decode attention on tensor cores needs sm_80+")
    _assert_plans_keep_logits_close(decode_dir, tmp_path, {"decode_tensor_cores": True}, {"decode_tensor_cores": False},
                                    n, f"graphs={graphs}, {n} sequences: direct tensor-core vs CUDA-core forms",
                                    graphs, tol=3e-2)


@pytest.mark.parametrize("n", [1, 5])
def test_direct_tensor_core_decode_attention_at_head_size_256_matches_the_other_forms(tiny_checkpoints, n, tmp_path):
    # Qwen3.5-27B's attention head size (256: a pair of warps splits each tile's head dims).
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    if gpu_compute_capability() < (8, 0):
        pytest.skip("decode attention on tensor cores needs sm_80+")
    d256 = tiny_checkpoints.get("qwen3_5", **{**GPU_SHAPES["qwen3_5"], "head_dim": 256})
    _assert_plans_keep_logits_close(d256, tmp_path, {"decode_tensor_cores": True}, {"decode_tensor_cores": False}, n,
                                    f"head size 256, {n} sequences: direct tensor-core vs CUDA-core forms")


@pytest.mark.parametrize("change, named", [
    ({"plan": {"cc_warps": 3}}, "plan.cc_warps"),
    ({"plan": {"cc_ksplit": 3}}, "plan.cc_ksplit"),
    ({"plan": {"cc_ksplit": 8, "cc_warps": 4}}, "plan.cc_ksplit"),
    ({"plan": {"tc_prefetch_steps": 513}}, "plan.tc_prefetch_steps"),
    ({"plan": {"smem_carveout": 101}}, "plan.smem_carveout"),
    ({"plan": {"pdl": "sometimes"}}, "sometimes"),
    ({"plan": {"fused_rope": "perhaps"}}, "perhaps"),
    ({"plan": {"gemv_rules": [{"kernel": "w3u3"}]}}, "plan.gemv_rules"),
    # A route that no longer exists is an unknown field, not silently the default.
    ({"plan": {"tc_decode_attn": False}}, "tc_decode_attn"),
    ({"version": 99}, "version"),
    ({"device": "Some Other GPU"}, "Some Other GPU"),
    ({"compute_capability": "1.0"}, "compute_capability"),
])
def test_a_profile_this_gpu_cannot_run_stops_the_load_naming_what(decode_dir, change, named, tmp_path):
    profile = tmp_path / "bad.json"
    good = json.loads(Path(device_profile(tmp_path, "good", {})).read_text())
    profile.write_text(json.dumps({**good, **change}))
    with pytest.raises(Exception, match=re.escape(named)):
        _core.Model(str(decode_dir), device="cuda", device_profile=str(profile))


@pytest.mark.parametrize("option, value", [("cuda_graphs", "yes"), ("batch_invariant", "mostly"),
                                           ("device_sampling", 1.5), ("device_profile", 42)])
def test_a_wrong_typed_option_is_a_type_error(decode_dir, option, value):
    # The options that replaced the environment switches are typed: a value of another type is
    # refused before the load, never read as a default.
    with pytest.raises(TypeError):
        _core.Model(str(decode_dir), device="cuda", **{option: value})
    if option != "device_profile":
        with pytest.raises(TypeError):
            LLM(decode_dir, device="cuda", **{option: value})


#: Real shapes (tensor sizes of the published configs) with few layers: the kernels run at the
#: sizes users run, on random weights (transformers' own init, std 0.02).
REAL_SHAPES = {
    "llama-3-8b-2l": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "qwen3_5-27b-4l": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=4, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, vocab_size=248320, max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})),
}


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_real_shape_random_models_match_transformers_bf16(name, tmp_path):
    """Logits of a real-shape random model against transformers on the same GPU, in bf16 and in
    f32 (the same bf16-rounded weights, upcast): ours must be as close to f32 as transformers'
    own bf16 path is (within 2x + 5e-3, as for the tiny models). Greedy agreement over 64 tokens
    is measured: random weights give nearly flat logits over 128k-248k tokens, where any two bf16
    implementations flip near-ties within tens of tokens, so it is held to what transformers' own
    eager and sdpa attention paths reach against each other (ours at least half as many tokens
    before the first divergence), and printed with transformers alone vs in a batch of two."""
    if not _cuda_available():
        pytest.skip("torch sees no CUDA device")
    model_cls, cfg_cls, cfg = REAL_SHAPES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        built = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**cfg)).to(torch.bfloat16)
    built.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    # The references are loaded from the checkpoint, not the model built above: `.to(bfloat16)`
    # also rounds the rotary inv_freq buffer to bf16, which moves transformers' logits away from
    # ours by an error that grows with the position (3.5e-2 at position 63 on the Llama shape).
    del built
    vocab = cfg["vocab_size"]
    ids = _prompt(64, vocab, seed=5)
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        hf32 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).to("cuda").eval()
        exp32 = hf32(x).logits[0].float().cpu().numpy()
        del hf32
        torch.cuda.empty_cache()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).to("cuda").eval()
        exp = hf(x).logits[0].float().cpu().numpy()
    hf.generation_config.eos_token_id = None
    got = _core.Model(str(tmp_path), device="cuda", logits_dtype="float32").logits(ids)
    got_auto = _core.Model(str(tmp_path), device="cuda").logits(ids)
    err, ours32, theirs32 = _rel_err(got, exp), _rel_err(got, exp32), _rel_err(exp, exp32)
    prompts = [_prompt(16 + 3 * i, vocab, seed=60 + i) for i in range(10)]

    def agreement(llm_kwargs, ref_model):
        with LLM(tmp_path, device="cuda", max_context=512, **llm_kwargs) as llm:
            outs = llm.generate(prompts, greedy(64))
        same, prefix = 0, 0
        for prompt, out in zip(prompts, outs):
            ref = _hf_greedy(ref_model, prompt, 64)
            same += out.token_ids == ref
            prefix += _matched_prefix(out.token_ids, ref)
        return same, prefix / 10

    # Default logits_dtype "auto" (bf16 logits) against plain transformers bf16 (bf16 logits),
    # then ours with f32 logits against transformers with an f32 head.
    same_auto, prefix_auto = agreement({}, hf)
    # transformers against itself through its other attention path: eager (bf16 matmuls and an
    # f32 softmax) instead of sdpa, the same weights and GPU. Two bf16 implementations that sum
    # attention in different orders: how long they agree is what ours can be held to.
    hf_eager = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager").to("cuda").eval()
    hf_eager.generation_config.eos_token_id = None
    paths_same, paths_prefix = 0, 0
    for prompt in prompts:
        sdpa, eager = _hf_greedy(hf, prompt, 64), _hf_greedy(hf_eager, prompt, 64)
        paths_same += sdpa == eager
        paths_prefix += _matched_prefix(eager, sdpa) / 10
    del hf_eager
    torch.cuda.empty_cache()
    same, prefix = agreement({"logits_dtype": "float32"}, _f32_head(hf))
    # transformers against itself: the same prompt alone and as one row of a batch of two
    # identical rows (cuBLAS picks another kernel for M = 2, so the same sums run in another
    # order). What it gets is the most any other bf16 implementation can expect here.
    self_same, self_prefix = 0, 0
    for prompt in prompts:
        alone, paired = _hf_greedy(hf, prompt, 64), _hf_greedy(hf, prompt, 64, copies=2)
        self_same += alone == paired
        self_prefix += _matched_prefix(paired, alone)
    print(f"{name}: logits rel err ours-vs-hf_bf16 {err:.2e}, ours-vs-hf_f32 {ours32:.2e}, hf_bf16-vs-hf_f32 "
          f"{theirs32:.2e}; 64 greedy tokens equal transformers bf16 (f32 logits) on {same}/10 prompts, "
          f"{prefix:.1f} tokens agree on average before the first divergence; (bf16 logits, logits_dtype auto) "
          f"on {same_auto}/10 prompts, {prefix_auto:.1f} tokens before the first divergence; transformers bf16 "
          f"alone vs in a batch of two: {self_same}/10 prompts, {self_prefix / 10:.1f} tokens before the first divergence; "
          f"transformers bf16 eager vs sdpa attention: {paths_same}/10 prompts, {paths_prefix:.1f} tokens before the first divergence")
    assert ours32 <= 2 * theirs32 + 5e-3
    assert err <= REL_TOL, err
    # Ours (as users run it, bf16 logits) keeps transformers' greedy path at least half as long
    # as transformers' two attention paths keep each other's.
    assert prefix_auto >= 0.5 * paths_prefix, (prefix_auto, paths_prefix)
    # Prefill of 64 rows (cuBLAS, then round_f32_to_storage): auto is bf16(float32) bit for bit.
    _assert_bitwise(got_auto, torch.from_numpy(got).to(_storage_dtype()).float().numpy(), f"{name}: auto vs bf16(float32) logits")
