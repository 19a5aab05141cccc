"""`--quantize` on the CUDA backend: the projections quantized on load (fused q|k|v, gate|up and
the GDN input projection encoded whole, or for NVFP4 as each part's own payload with the parts
its layout cannot hold as the dense tail, which decodes to exactly the CPU model's values: the
loader's host tests) or handed in as GGUF tensors (a fused projection's rows of blocks
concatenated), run through the fused-dequantization GEMV (decode) and the dequantized workspace +
cuBLAS (prefill). Checked against the CPU backend with the same `--quantize`: logits
within the dense suite's bounds, greedy output equal but at near-ties, the demo model's held-out
perplexity within 1e-3 relative, and the bytes the runner reports equal to `ninfer plan`'s.
Quantized HF checkpoints (FP8 block, AWQ, GPTQ, compressed-tensors) written by the test run as
stored on CUDA against the CPU loader reading the same files (dense last parts of a fused
projection, as in the official Qwen3.5 FP8 releases, as its dense tail); a dense part before a
quantized one stays refused there. --quantize-lm-head runs the head through the f32-output
GEMV (decode) and the chunked dequantize + cuBLAS route (prefill).

The CPU reference runs f32 activations on the decoded weights; the GPU runs bf16 activations on
the same decoded weights, so the bounds are those of tests/test_gpu_model.py for dense weights.
`--quantize fp8` prefill on compute capability 8.9 and newer runs FP8 tensor cores instead
(cuda/fp8_gemm.cu: each projection's input quantized to E4M3 with a multiplier per row), and
`--quantize nvfp4` prefill on 10.0 and newer FP4 tensor cores (cuda/fp4_gemm.cu: each input row
quantized to NVFP4), which the CPU does not: their bounds add twice the error those activations
alone cause in an f32 simulation of the same model (`_simulation`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ninfer  # noqa: E402
from ninfer import LLM, SamplingParams, _core  # noqa: E402
from conftest import device_profile  # noqa: E402

pytestmark = pytest.mark.gpu

#: As tests/test_gpu_model.py: logits rel err (max abs diff / max abs reference) of the trained
#: demo model against the CPU f32 path, and the top-2 logprob gap under which two summation
#: orders may pick different greedy tokens.
REL_TOL = 2e-2
NEAR_TIE = 0.5
#: The random tiny checkpoints have nearly flat logits; their bound is looser: at least this, and
#: at least what the unquantized checkpoint's bf16 CUDA path shows against the CPU on the same
#: prompt (`_tiny_tol`), as the dense GPU suite bounds itself by transformers' own bf16 error.
TINY_REL_TOL = 5e-2
#: Demo perplexity on CUDA against the CPU's, same --quantize.
PPL_REL_TOL = 1e-3

#: The --quantize modes the CUDA loader takes.
MODES = ["w8", "q4", "q5", "q6", "fp8", "nvfp4"]

#: Sizes the kernels are instantiated for (tests/test_gpu_model.py).
GPU_SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4),
}

DEMO = Path(os.environ.get("NINFER_DEMO_DIR", Path(ninfer.__file__).parent / "demo"))
REPO = Path(__file__).resolve().parent.parent


#: Compute capability from which `--quantize fp8` prefill (steps of more than 16 rows) runs FP8
#: tensor cores on E4M3 activations (rust_core/src/model/cuda/linear.rs `QuantPrefill`).
FP8_GEMM_CC = (8, 9)


#: Compute capability from which `--quantize nvfp4` prefill runs FP4 tensor cores on NVFP4
#: activations (the same `QuantPrefill`).
FP4_GEMM_CC = (10, 0)


def _activations_quantized(mode: str) -> bool:
    """Whether `mode`'s prefill on this GPU quantizes the projections' inputs (FP8 / FP4 routes)."""
    cc = torch.cuda.get_device_capability()
    return (mode == "fp8" and cc >= FP8_GEMM_CC) or (mode == "nvfp4" and cc >= FP4_GEMM_CC)


def _e4m3(v):
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)


def _fp8_rows(w):
    """`w` [N, K] as FP8_E4M3FN_ROW_BF16S decodes it (rust_core/src/quant/fp8_row.rs's encoder:
    a bf16 multiplier amax / 448 a row, the smallest subnormal where that rounds to zero)."""
    amax = w.abs().amax(dim=1, keepdim=True)
    s = (amax / 448.0).to(torch.bfloat16).to(torch.float32)
    s = torch.where((s == 0) & (amax > 0), torch.full_like(s, 9.183549615799121e-41), s)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, _e4m3(w / safe) * s, torch.zeros_like(w))


def _fp8_activations(x):
    """x's rows as cuda/fp8_gemm.cu's `fp8_quantize_rows` leaves them: E4M3 codes of x / s,
    s = amax / 448 a row, times s."""
    s = x.abs().amax(dim=-1, keepdim=True) / 448.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, _e4m3(x / safe) * s, torch.zeros_like(x))


#: E2M1's magnitudes and the midpoints between them, the tie going to the even word
#: (`quant::scalars::f32_to_e2m1`: ties at 0.25, 1.25, 2.5 and 5 round down, at 0.75, 1.75 and
#: 3.5 up).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1(v):
    a = v.abs()
    idx = torch.zeros_like(a, dtype=torch.long)
    for mid, tie_up in _E2M1_UP:
        idx += (a >= mid).long() if tie_up else (a > mid).long()
    return torch.tensor(_E2M1, dtype=v.dtype)[idx] * torch.sign(v)


def _nvfp4(v, d):
    """`v` [..., K] as NVFP4 decodes it under divisor `d` (broadcast over the rows): an E4M3
    scale e4m3(amax / 6 * d) per 16 values (the smallest subnormal where a nonzero group rounds
    to zero), E2M1 codes of v * d / s (rust_core/src/quant/nvfp4.rs's encoder)."""
    g = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
    d = d[..., None, None]
    amax = g.abs().amax(dim=-1, keepdim=True)
    s = _e4m3(amax / 6.0 * d)
    s = torch.where((s == 0) & (amax > 0), torch.full_like(s, 2.0**-9), s)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    out = torch.where(s > 0, _e2m1(g * (d / safe)) * s / d, torch.zeros_like(g))
    return out.reshape(v.shape)


def _divisor(amax):
    return torch.where(amax > 0, 2688.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))


def _nvfp4_weight(w):
    """`w` [N, K] as `--quantize nvfp4` decodes it: one divisor 2688 / amax for the matrix."""
    return _nvfp4(w, _divisor(w.abs().amax()).expand(w.shape[0]))


def _nvfp4_activations(x):
    """x's rows as cuda/fp4_gemm.cu's `nvfp4_quantize_rows` leaves them: each row an NVFP4
    matrix of its own (divisor 2688 / amax over the row), decoded."""
    return _nvfp4(x, _divisor(x.abs().amax(dim=-1)))


#: Per mode with an activation-quantizing route: the weight as the mode decodes it, the
#: activations as the route quantizes them, and which [N, K] projections take the route (the GDN
#: input projection never: fused with its b / a parts, FP8's N rule and NVFP4's 128-row tiles
#: leave it on the dequantize route).
_ROUTES = {
    "fp8": (_fp8_rows, _fp8_activations, lambda n, k: n % 16 == 0 and k % 16 == 0),
    "nvfp4": (_nvfp4_weight, _nvfp4_activations, lambda n, k: n % 128 == 0 and k % 64 == 0),
}


def _simulation(model_dir: Path, sequences: list, mode: str = "fp8") -> list:
    """transformers in f32 on the CPU with every projection's weight as `--quantize mode`
    decodes it: per sequence, the logits with f32 activations (what the CPU backend runs) and
    with the inputs of the projections the mode's tensor-core route takes quantized as it
    quantizes them (`_ROUTES`)."""
    from transformers import AutoModelForCausalLM

    weight, activations, takes = _ROUTES[mode]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    quantize_inputs = [False]
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (name.endswith("_proj") or ".in_proj_" in name):
            with torch.no_grad():
                mod.weight.copy_(weight(mod.weight.float()))
            n, k = mod.weight.shape
            if takes(n, k) and ".in_proj_" not in name:
                mod.register_forward_pre_hook(lambda m, a: (activations(a[0]),) if quantize_inputs[0] else None)
    out = []
    with torch.no_grad():
        for ids in sequences:
            pair = []
            for q in (False, True):
                quantize_inputs[0] = q
                pair.append(model(torch.tensor([ids])).logits[0].float().numpy())
            out.append(tuple(pair))
    return out


def _logprobs(logits):
    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def _rel_err(got, exp) -> float:
    return float(np.abs(got - exp).max() / np.abs(exp).max())


def _model_dir(name: str, request) -> Path:
    _needs_cuda()
    if name == "demo":
        if not (DEMO / "model" / "config.json").exists():
            pytest.skip("no bundled demo model")
        return DEMO / "model"
    return request.getfixturevalue("tiny_checkpoints").get(name, **GPU_SHAPES[name])


def _prompt(name: str, vocab: int, n: int = 48, seed: int = 7) -> list:
    if name == "demo":
        return json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"][0][:n]
    return [int(t) for t in np.random.RandomState(seed).randint(3, vocab, size=n)]


#: Prompts (seeds) a random tiny checkpoint's prefill logits are checked on. Its flat logits
#: make single prompts erratic: the same weights range over several times across prompts in
#: every mode, while the unquantized bf16 path stays near its bound, so the median is what is
#: bounded: a decoding fault moves every prompt.
TINY_SEEDS = (7, 8, 9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["demo", "qwen3_5", "llama"])
def test_quantized_logits_match_the_cpu_with_the_same_quantize(name, mode, request):
    """Prefill logits (48 rows, past QUANT_GEMV_MAX_M: the workspace + cuBLAS route) track the
    CPU backend holding the same quantized weights; decode (the fused GEMV) is the greedy test's."""
    model_dir = _model_dir(name, request)
    cpu = _core.Model(str(model_dir), device="cpu", logits_dtype="float32", quantize=mode)
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32", quantize=mode)
    errs, tols = [], []
    for seed in (TINY_SEEDS[:1] if name == "demo" else TINY_SEEDS):
        ids = _prompt(name, cpu.config["vocab_size"], seed=seed)
        want, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
        assert got.shape == want.shape and np.isfinite(got).all()
        tol = REL_TOL if name == "demo" else _tiny_tol(model_dir, ids)
        if _activations_quantized(mode):
            # The route's quantized activations: twice the error they cause in the f32
            # simulation (FP8 measured there: 3.4e-2 on the demo, 1.5e-1 on the random tiny
            # models, whose flat logits and outlier channels suit a multiplier per row least).
            f32, aq = _simulation(model_dir, [ids], mode)[0]
            sim = _rel_err(aq, f32)
            tol += 2 * sim
            print(f"{name} --quantize {mode}: quantized activations move the simulated logits by {sim:.2e}")
        errs.append(_rel_err(got, want))
        tols.append(tol)
        print(f"{name} --quantize {mode} (prompt {seed}): prefill logits rel err vs CPU {errs[-1]:.2e} (tol {tol:.2e})")
    assert float(np.median(errs)) <= float(np.median(tols))
    # The quantized bytes the runner holds are the ones `ninfer plan` counts.
    plan = _core.plan(str(model_dir), device="cuda:0", quantize=mode)
    assert gpu.config["weight_bytes"] == sum(w["bytes"] for w in plan["weights"])
    assert gpu.config["weight_bytes"] < _core.Model(str(model_dir), device="cuda").config["weight_bytes"]


_BF16_ERR: dict = {}


def _tiny_tol(model_dir, ids) -> float:
    """The bound of a tiny checkpoint's quantized logits against the CPU's: the bf16 CUDA path's
    own error on the unquantized weights (same prompt), doubled plus 5e-3, and no less than
    TINY_REL_TOL. Quantized weights change the values, not the bf16 roundings of activations."""
    key = (str(model_dir), tuple(ids))
    if key not in _BF16_ERR:
        cpu = _core.Model(str(model_dir), device="cpu", logits_dtype="float32")
        gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32")
        _BF16_ERR[key] = _rel_err(np.asarray(gpu.logits(ids)), np.asarray(cpu.logits(ids)))
    return max(TINY_REL_TOL, 2 * _BF16_ERR[key] + 5e-3)


def _greedy(model_dir, device, mode, prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=2)
    with LLM(model_dir, device=device, max_concurrency=4, max_context=512, logits_dtype="float32", quantize=mode) as llm:
        return llm.generate([llm.encode(p) for p in prompts], params)


@pytest.mark.parametrize("mode", ["q4", "fp8", "nvfp4"])
@pytest.mark.parametrize("name", ["demo", "qwen3_5"])
def test_quantized_greedy_output_matches_the_cpu_but_at_near_ties(name, mode, request):
    """Prefill steps of more than 16 rows (the three prompts scheduled together) run the
    prefill route (`--quantize fp8` on FP8 tensor cores from sm_89, `--quantize nvfp4` on FP4
    tensor cores from sm_100: the near-tie gap grows by twice the largest log-probability change
    their quantized activations cause in the f32 simulation), decode the fused GEMV."""
    model_dir = _model_dir(name, request)
    prompts = ["def add(a, b):\n    return", "The quick brown fox", "for i in range(10):\n"]
    near_tie = NEAR_TIE
    if _activations_quantized(mode):
        vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0
        f32, aq = _simulation(model_dir, [_prompt(name, vocab)], mode)[0]
        near_tie += 2 * float(np.abs(_logprobs(aq) - _logprobs(f32)).max())
    cpu = _greedy(model_dir, "cpu", mode, prompts, 24)
    gpu = _greedy(model_dir, "cuda", mode, prompts, 24)
    for c, g in zip(cpu, gpu):
        assert len(g.token_ids) == len(c.token_ids) == 24
        n = 0
        while n < 24 and c.token_ids[n] == g.token_ids[n]:
            n += 1
        if n < 24:
            top = c.logprobs[n].top
            gap = top[0][1] - top[1][1]
            print(f"{name} --quantize {mode}: diverges at token {n}, CPU top-2 gap {gap:.3f} (near tie below {near_tie:.3f})")
            assert gap < near_tie


@pytest.mark.parametrize("name", ["demo", "qwen3_5"])
def test_q4_gemv_forms_decode_the_same_bits(name, request, tmp_path):
    """The tiled 4-bit GEMV's two forms (the plan's `q4_ring`, which a device profile may fix;
    by default each model's smallest K picks one) sum in the same order: greedy decode, CUDA
    graphs on, gives the same logits bit for bit and the same tokens in either form."""
    model_dir = _model_dir(name, request)
    if os.environ.get("NINFER_EMULATE_ARCH") or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tiled GEMV's two forms are sm_80+ code (a profile naming one is refused below)")
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0
    prompts = [_prompt(name, vocab, n=48, seed=40 + i)[5 * i:5 * i + 9 + 5 * i] for i in range(3)]
    runs = []
    for ring in (True, False):
        profile = device_profile(tmp_path, f"q4_ring_{ring}", {"q4_ring": ring})
        model = _core.Model(str(model_dir), device="cuda", quantize="q4", device_profile=profile)
        runs.append(model.decode_greedy(prompts, 16))
        del model
    (ring_tokens, ring_logits, _), (pass_tokens, pass_logits, _) = runs
    assert np.isfinite(ring_logits).all() and ring_logits.shape == pass_logits.shape
    diff = np.flatnonzero(ring_logits.view(np.uint32) != pass_logits.view(np.uint32))
    assert diff.size == 0, f"{name}: {diff.size} logits differ between the forms, max abs diff {np.abs(ring_logits - pass_logits).max():.3e}"
    assert ring_tokens == pass_tokens


def test_demo_perplexity_per_format_on_cuda_is_the_cpus():
    _needs_cuda()
    if not (DEMO / "model" / "config.json").exists():
        pytest.skip("no bundled demo model")
    sys.path.insert(0, str(REPO / "benches"))
    from quant_perplexity import perplexity

    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"][:8]
    runs = [(f"--quantize {mode}", dict(quantize=mode)) for mode in MODES]
    pytest.importorskip("gguf")
    from quant_perplexity import gguf_q8_0_tensors

    runs.append(("GGUF Q8_0 handed in", dict(quant_tensors=gguf_q8_0_tensors(DEMO / "model"))))
    route_tol = {}
    for mode in (m for m in MODES if _activations_quantized(m)):
        # Prefill on FP8 / FP4 tensor cores: twice the perplexity change the route's quantized
        # activations cause in the f32 simulation.
        from ninfer.demo import perplexity as pooled

        sim = _simulation(DEMO / "model", windows, mode)
        f32, aq = (pooled([p[i] for p in sim], windows) for i in (0, 1))
        route_tol[mode] = PPL_REL_TOL + 2 * abs(aq / f32 - 1.0)
        print(f"demo --quantize {mode}: quantized activations move the simulated perplexity {f32:.4f} -> {aq:.4f}")
    for what, kwargs in runs:
        ppl = {}
        for device in ("cpu", "cuda"):
            model = _core.Model(str(DEMO / "model"), device=device, logits_dtype="float32", **kwargs)
            ppl[device] = perplexity(model, windows)
        rel = abs(ppl["cuda"] / ppl["cpu"] - 1.0)
        tol = route_tol.get(kwargs.get("quantize"), PPL_REL_TOL)
        print(f"demo {what}: perplexity CPU {ppl['cpu']:.4f}, CUDA {ppl['cuda']:.4f} (rel {rel:.1e}, tol {tol:.1e})")
        assert rel <= tol


def test_nvfp4_decode_rows_match_the_cpu(request):
    """NVFP4's decode GEMV (8 rows: fused dequantization, each part's tensor divisor) against the
    CPU model holding the same NVFP4 weights, on the hybrid whose GDN in_proj keeps b / a as the
    dense tail."""
    model_dir = _model_dir("qwen3_5", request)
    cpu = _core.Model(str(model_dir), device="cpu", logits_dtype="float32", quantize="nvfp4")
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32", quantize="nvfp4")
    ids = _prompt("qwen3_5", cpu.config["vocab_size"], 8)
    err = _rel_err(np.asarray(gpu.logits(ids)), np.asarray(cpu.logits(ids)))
    print(f"qwen3_5 --quantize nvfp4 (8 rows): logits rel err vs CPU {err:.2e}")
    assert err <= TINY_REL_TOL


# --- quantized Hugging Face checkpoints (FP8 block, AWQ, GPTQ, compressed-tensors) ---------------

#: The tiny shapes of the HF checkpoints: GPU_SHAPES', the Qwen3.5 with 16 value heads so that
#: its GDN in_proj_b / in_proj_a (16 rows each) fill whole FP8 blocks and AWQ words.
HF_SHAPES = {"llama": GPU_SHAPES["llama"], "qwen3_5": {**GPU_SHAPES["qwen3_5"], "linear_num_value_heads": 16}}
HF_METHODS = ["awq", "gptq", "compressed", "fp8"]


def _hf_checkpoint(src: Path, dst: Path, method: str, keep_dense=()) -> Path:
    """`src` rewritten as a quantized HF checkpoint of `method` (tests/test_quantized_model.py's
    packers), projections named in `keep_dense` left bf16. GPTQ runs act-order with one input
    permutation for every weight of a width, so that a fused projection's parts share g_idx."""
    sys.path.insert(0, str(REPO / "tests"))
    from safetensors.torch import load_file, save_file
    from test_quantized_model import QUANT_CONFIGS, is_projection, pack_awq, pack_compressed, pack_fp8_block, pack_gptq

    tensors = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    out = {}
    for name, t in sorted(tensors.items()):
        if not is_projection(name) or any(k in name for k in keep_dense):
            out[name] = t.to(torch.bfloat16)
            continue
        module, w = name[: -len(".weight")], t.numpy()
        parts = {"awq": lambda: pack_awq(w, 8), "gptq": lambda: pack_gptq(w, 8, seed=w.shape[1]),
                 "compressed": lambda: pack_compressed(w, 8), "fp8": lambda: pack_fp8_block(w, 16, 16)}[method]()[0]
        for suffix, v in parts.items():
            out[f"{module}.{suffix}"] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_text(f.read_text())
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[method]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("method", HF_METHODS)
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_quantized_hf_checkpoint_logits_match_the_cpu_loader(name, method, request, tmp_path):
    """The checkpoint's own quantized tensors on CUDA (fused projections gathered by whole row
    units, run by cuda/quant_hf.cu's decoders) against the CPU loader reading the same files:
    prefill (48 rows: workspace + cuBLAS) and decode-sized steps (8 rows: the fused GEMV)."""
    _needs_cuda()
    src = request.getfixturevalue("tiny_checkpoints").get(name, **HF_SHAPES[name])
    qdir = _hf_checkpoint(src, tmp_path / method, method)
    cpu = _core.Model(str(qdir), device="cpu", logits_dtype="float32")
    gpu = _core.Model(str(qdir), device="cuda", logits_dtype="float32")
    for n in (48, 8):
        ids = _prompt(name, cpu.config["vocab_size"], n)
        want, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
        assert got.shape == want.shape and np.isfinite(got).all()
        err, tol = _rel_err(got, want), _tiny_tol(src, ids)
        print(f"{name} {method} ({n} rows): logits rel err vs CPU {err:.2e} (tol {tol:.2e})")
        assert err <= tol
    # The bytes held are the stored tensors, as `ninfer plan` counts them for a GPU.
    plan = _core.plan(str(qdir), device="cuda:0")
    assert gpu.config["weight_bytes"] == plan["weight_bytes"]
    assert gpu.config["weight_bytes"] < _core.Model(str(src), device="cuda").config["weight_bytes"]


def test_hf_dense_last_parts_run_as_the_weights_dense_tail(request, tmp_path):
    """As the official Qwen3.5 FP8 releases store it: the GDN in_proj_b / in_proj_a in bf16 after
    FP8 in_proj_qkv / in_proj_z. CUDA holds them as the fused weight's dense tail, read by the
    same kernels; its logits track the CPU loader's. A dense part before a quantized one
    (k_proj between q_proj and v_proj) is refused as not supported yet."""
    _needs_cuda()
    src = request.getfixturevalue("tiny_checkpoints").get("qwen3_5", **HF_SHAPES["qwen3_5"])
    qdir = _hf_checkpoint(src, tmp_path / "fp8_tail", "fp8", keep_dense=("in_proj_b", "in_proj_a"))
    cpu = _core.Model(str(qdir), device="cpu", logits_dtype="float32")
    gpu = _core.Model(str(qdir), device="cuda", logits_dtype="float32")
    for n in (48, 8):
        ids = _prompt("qwen3_5", cpu.config["vocab_size"], n)
        err, tol = _rel_err(np.asarray(gpu.logits(ids)), np.asarray(cpu.logits(ids))), _tiny_tol(src, ids)
        print(f"qwen3_5 fp8 with a dense in_proj tail ({n} rows): logits rel err vs CPU {err:.2e} (tol {tol:.2e})")
        assert err <= tol
    assert gpu.config["weight_bytes"] == _core.plan(str(qdir), device="cuda:0")["weight_bytes"]
    middle = _hf_checkpoint(src, tmp_path / "fp8_middle", "fp8", keep_dense=("k_proj",))
    with pytest.raises(_core.NinferError) as e:
        _core.Model(str(middle), device="cuda:0")
    msg = str(e.value)
    assert "not supported yet" in msg and "HF_FP8_BLOCK" in msg and "k_proj.weight" in msg, msg


@pytest.mark.parametrize("mode", ["q4", "nvfp4"])
@pytest.mark.parametrize("name", ["demo", "llama"])
def test_quantized_lm_head_logits_match_the_cpu(name, mode, request):
    """--quantize-lm-head on CUDA (the tied demo head a quantized copy of the embedding, the
    untied Llama head quantized) against the CPU model holding the same weights: prefill (48
    rows: the head dequantized a chunk of vocabulary rows at a time, then cuBLAS) and decode-sized
    steps (8 rows: the f32-output GEMV); the bytes held are `ninfer plan`'s."""
    model_dir = _model_dir(name, request)
    cpu = _core.Model(str(model_dir), device="cpu", logits_dtype="float32", quantize=mode, quantize_lm_head=True)
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32", quantize=mode, quantize_lm_head=True)
    tol = REL_TOL if name == "demo" else TINY_REL_TOL
    for n in (48, 8):
        ids = _prompt(name, cpu.config["vocab_size"], n)
        want, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
        assert got.shape == want.shape and np.isfinite(got).all()
        err = _rel_err(got, want)
        print(f"{name} --quantize {mode} --quantize-lm-head ({n} rows): logits rel err vs CPU {err:.2e} (tol {tol:.0e})")
        assert err <= tol
    plan = _core.plan(str(model_dir), device="cuda:0", quantize=mode, quantize_lm_head=True)
    assert gpu.config["weight_bytes"] == sum(w["bytes"] for w in plan["weights"])
    # logits_dtype auto: the quantized head's logits rounded to bf16 like the dense head's.
    auto = _core.Model(str(model_dir), device="cuda", quantize=mode, quantize_lm_head=True)
    got = np.asarray(auto.logits(_prompt(name, cpu.config["vocab_size"], 8)), dtype=np.float32)
    assert np.array_equal(got, torch.from_numpy(got).to(torch.bfloat16).to(torch.float32).numpy())
