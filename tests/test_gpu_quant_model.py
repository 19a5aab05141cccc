"""`--quantize` on the CUDA backend: the projections quantized on load (fused q|k|v, gate|up and
the GDN input projection encoded whole, which decodes to exactly the CPU model's values: the
loader's host tests) or handed in as GGUF tensors (a fused projection's rows of blocks
concatenated), run through the fused-dequantization GEMV (decode) and the dequantized workspace +
cuBLAS (prefill). Checked against the CPU backend with the same `--quantize`: logits
within the dense suite's bounds, greedy output equal but at near-ties, the demo model's held-out
perplexity within 1e-3 relative, and the bytes the runner reports equal to `ninfer plan`'s.

The CPU reference runs f32 activations on the decoded weights; the GPU runs bf16 activations on
the same decoded weights, so the bounds are those of tests/test_gpu_model.py for dense weights.
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

pytestmark = pytest.mark.gpu

#: As tests/test_gpu_model.py: logits rel err (max abs diff / max abs reference) of the trained
#: demo model against the CPU f32 path, and the top-2 logprob gap under which two summation
#: orders may pick different greedy tokens.
REL_TOL = 2e-2
NEAR_TIE = 0.5
#: The random tiny checkpoints have nearly flat logits; their bound is looser (as the dense GPU
#: suite's, measured against transformers' own bf16 error there).
TINY_REL_TOL = 5e-2
#: Demo perplexity on CUDA against the CPU's, same --quantize.
PPL_REL_TOL = 1e-3

#: The --quantize modes the CUDA loader takes (nvfp4 is refused there).
MODES = ["w8", "q4", "q5", "q6", "fp8"]

#: Sizes the kernels are instantiated for (tests/test_gpu_model.py).
GPU_SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4),
}

DEMO = Path(os.environ.get("NINFER_DEMO_DIR", Path(ninfer.__file__).parent / "demo"))
REPO = Path(__file__).resolve().parent.parent


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


def _prompt(name: str, vocab: int, n: int = 48) -> list:
    if name == "demo":
        return json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"][0][:n]
    return [int(t) for t in np.random.RandomState(7).randint(3, vocab, size=n)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["demo", "qwen3_5", "llama"])
def test_quantized_logits_match_the_cpu_with_the_same_quantize(name, mode, request):
    """Prefill logits (48 rows, past QUANT_GEMV_MAX_M: the workspace + cuBLAS route) track the
    CPU backend holding the same quantized weights; decode (the fused GEMV) is the greedy test's."""
    model_dir = _model_dir(name, request)
    cpu = _core.Model(str(model_dir), device="cpu", logits_dtype="float32", quantize=mode)
    gpu = _core.Model(str(model_dir), device="cuda", logits_dtype="float32", quantize=mode)
    ids = _prompt(name, cpu.config["vocab_size"])
    want, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
    assert got.shape == want.shape and np.isfinite(got).all()
    tol = REL_TOL if name == "demo" else TINY_REL_TOL
    err = _rel_err(got, want)
    print(f"{name} --quantize {mode}: prefill logits rel err vs CPU {err:.2e} (tol {tol:.0e})")
    assert err <= tol
    # The quantized bytes the runner holds are the ones `ninfer plan` counts.
    plan = _core.plan(str(model_dir), device="cuda:0", quantize=mode)
    assert gpu.config["weight_bytes"] == sum(w["bytes"] for w in plan["weights"])
    assert gpu.config["weight_bytes"] < _core.Model(str(model_dir), device="cuda").config["weight_bytes"]


def _greedy(model_dir, device, mode, prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=2)
    with LLM(model_dir, device=device, max_concurrency=4, max_context=512, logits_dtype="float32", quantize=mode) as llm:
        return llm.generate([llm.encode(p) for p in prompts], params)


@pytest.mark.parametrize("mode", ["q4", "fp8"])
@pytest.mark.parametrize("name", ["demo", "qwen3_5"])
def test_quantized_greedy_output_matches_the_cpu_but_at_near_ties(name, mode, request):
    model_dir = _model_dir(name, request)
    prompts = ["def add(a, b):\n    return", "The quick brown fox", "for i in range(10):\n"]
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
            print(f"{name} --quantize {mode}: diverges at token {n}, CPU top-2 gap {gap:.3f}")
            assert gap < NEAR_TIE


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
    for what, kwargs in runs:
        ppl = {}
        for device in ("cpu", "cuda"):
            model = _core.Model(str(DEMO / "model"), device=device, logits_dtype="float32", **kwargs)
            ppl[device] = perplexity(model, windows)
        rel = abs(ppl["cuda"] / ppl["cpu"] - 1.0)
        print(f"demo {what}: perplexity CPU {ppl['cpu']:.4f}, CUDA {ppl['cuda']:.4f} (rel {rel:.1e})")
        assert rel <= PPL_REL_TOL


def test_nvfp4_is_refused_on_cuda_naming_tensor_format_and_device():
    _needs_cuda()
    if not (DEMO / "model" / "config.json").exists():
        pytest.skip("no bundled demo model")
    with pytest.raises(_core.NinferError) as e:
        _core.Model(str(DEMO / "model"), device="cuda:0", quantize="nvfp4")
    msg = str(e.value)
    assert "cuda:0" in msg and "NVFP4" in msg and "down_proj.weight" in msg, msg
