"""Prefill throughput of the CUDA engine at 2k / 8k / 32k-token prompts, Llama-3-8B and
Qwen3.5-27B text shapes, against the bf16 GEMM rate of the same GPU.

For each shape, in one run on the GPU machine:
- a random bf16 checkpoint is built with transformers on the GPU (`--layers N` keeps the first N
  decoder layers: the 27B checkpoint is 54 GB, the disk 64 GiB; FLOPs are those of the layers
  kept, and the record says so),
- the peer: transformers bf16 (sdpa attention) forward of each prompt, last-position logits only,
  best of 2,
- ninfer: `_core.Engine(device="cuda")`, one request of `prompt` tokens and max_tokens 1; prefill
  tok/s = prompt / (time to the first token), best of 2 after a warm-up request,
- the ceiling: torch.matmul [8192, hidden] x [hidden, 4 * hidden] in bf16, best of 10; with
  `--quantize fp8` the FP8 tensor rate instead: torch._scaled_mm of float8_e4m3fn [8192, 8192] x
  [8192, 8192] (per-tensor scales, bf16 out), best of 10, with and without fast accumulation, the
  faster one (the other --quantize modes dequantize into bf16 tensor-core GEMMs: the bf16 rate).
fraction_of_ceiling = FLOPs per token x tok/s / ceiling rate, FLOPs per token = 2 x (decoder and
final-norm parameters: the embedding is a gather and the lm_head runs for one row) + attention
(4 x heads x head_dim x mean context per full-attention layer) + Gated DeltaNet (6 x dk x dv per
value head per linear-attention layer: state read, update and output).

The checkpoint is deleted when the run ends (`--keep-checkpoint` keeps it): the 27B one left on
the 64 GiB disk made the next benchmark of the same call fail for want of space.

`--quantize MODE` loads the bf16 checkpoint quantized (the engine's `quantize` option, as
gpu_bench's --quantize passes it); the records name the packed format in `weights` (bf16
without it).

Usage: python benches/gpu_prefill.py --out results.json --shape llama-3-8b --prompts 2048,8192
       [--layers 8] [--chunk 8192] [--commit SHA] [--skip-peer] [--keep-checkpoint] [--quantize fp8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def _gpu_bench():
    """benches/gpu_bench.py (its --quantize modes and the records' `weights` name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).with_name("gpu_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: The FP8 tensor-rate GEMM: [M, K] x [K, N], float8_e4m3fn in, bf16 out.
FP8_RATE_SHAPE = (8192, 8192, 8192)

SHAPES = {
    "llama-3-8b": dict(
        arch="llama", layers=32,
        config=dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                    intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
                    eos_token_id=128001, hidden_act="silu")),
    "qwen3_5-27b": dict(
        arch="qwen3_5", layers=64,
        config=dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                    head_dim=256, vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25})),
}


def parse_args(argv: list | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file for the records (appended to if present)")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3-8b")
    p.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    p.add_argument("--prompts", default="2048,8192,32768", help="prompt lengths, comma separated")
    p.add_argument("--chunk", type=int, default=8192, help="engine prefill_chunk (longer prompts go in chunks)")
    p.add_argument("--dir", default="/tmp/ninfer_prefill_ckpt")
    p.add_argument("--keep-checkpoint", action="store_true", help="leave the checkpoint in --dir after the run")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="after the timed runs, one prefill of TOKENS tokens under torch.profiler: kernel "
                        "table (GPU time per kernel name) into --profile-out")
    p.add_argument("--profile-out", default="prefill_profile.txt")
    p.add_argument("--quantize", choices=_gpu_bench().QUANTIZE_MODES, default=None,
                   help="load the bf16 checkpoint quantized (the engine's quantize option); fp8's ceiling is the "
                        "FP8 tensor rate measured in the same run")
    a = p.parse_args(argv)
    try:
        a.lengths = [int(x) for x in a.prompts.split(",")]
    except ValueError:
        p.error(f"--prompts {a.prompts!r}: comma-separated token counts, e.g. 2048,8192")
    if min(a.lengths) < 1:
        p.error(f"--prompts {a.prompts!r}: every prompt needs at least one token")
    if not 0 <= a.profile <= max(a.lengths):
        p.error(f"--profile {a.profile}: 0 (off) up to the longest of --prompts ({max(a.lengths)}), the engine's context")
    return a


def build_model(shape: str, layers: int, max_pos: int):
    """A random bf16 transformers model of the shape on the GPU (std 0.02 init)."""
    import transformers as tf

    s = SHAPES[shape]
    c = dict(s["config"], num_hidden_layers=layers, max_position_embeddings=max_pos, torch_dtype="bfloat16")
    if s["arch"] == "llama":
        cfg = tf.LlamaConfig(**c)
        cls = tf.LlamaForCausalLM
    else:
        c["layer_types"] = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
        cfg = tf.Qwen3_5TextConfig(**c)
        cls = tf.Qwen3_5ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model, cfg


def flops_per_token(model, cfg, shape: str, prompt: int) -> float:
    """2 x parameters touched per token + attention and GDN state FLOPs at mean context."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    layers = cfg.num_hidden_layers
    if SHAPES[shape]["arch"] == "llama":
        n_attn, n_gdn = layers, 0
    else:
        n_attn = sum(t == "full_attention" for t in cfg.layer_types)
        n_gdn = layers - n_attn
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * cfg.num_attention_heads * hd * (prompt + 1) / 2 * n_attn
    gdn = 0.0
    if n_gdn:
        gdn = 6 * cfg.linear_key_head_dim * cfg.linear_value_head_dim * cfg.linear_num_value_heads * n_gdn
    return 2 * params + attn + gdn


def gemm_rate(hidden: int) -> float:
    a = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(hidden, 4 * hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192 * hidden * 4 * hidden / best


def fp8_tensor_rate(reps: int = 10) -> dict:
    """The FP8 tensor rate: torch._scaled_mm of float8_e4m3fn matrices of FP8_RATE_SHAPE
    (per-tensor scales of 1, bf16 out), best of `reps` launches, FLOP/s, with and without fast
    accumulation; `rate` is the faster (the ceiling a prefill is held to)."""
    m, k, n = FP8_RATE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt takes it
    one = torch.tensor(1.0, device="cuda")
    rates = {}
    for fast in (False, True):
        def gemm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)

        for _ in range(3):
            gemm()
        best = float("inf")
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            gemm()
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        rates["fast_accum" if fast else "exact_accum"] = 2 * m * k * n / best
    del a, b
    torch.cuda.empty_cache()
    return {"rate": max(rates.values()), **rates}


def peer_prefill(model, prompt: list) -> float:
    ids = torch.tensor([prompt], device="cuda")
    best = float("inf")
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1, use_cache=False)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return len(prompt) / best


def ninfer_prefill(path: Path, prompts: list, chunk: int, profile: list | None = None,
                   profile_out: Path | None = None, quantize: str | None = None, device: str = "cuda") -> tuple:
    from ninfer import _core

    longest = max(len(p) for p in prompts)
    # Only a quantized run names the option: the older builds PREFILL_ORDER runs take no such keyword.
    options = {"quantize": quantize} if quantize else {}
    t0 = time.perf_counter()
    eng = _core.Engine(str(path), device=device, max_context=longest + 16, kv_capacity=longest + 64,
                       max_concurrency=2, prefill_chunk=chunk, prefix_reuse=False, **options)
    load_s = time.perf_counter() - t0
    fields = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    # A build from before the typed params (PREFILL_ORDER runs older commits) took them as JSON text.
    typed = getattr(_core, "SamplingParams", None)
    params = json.dumps(fields) if typed is None else typed(**fields)

    def first_token_s(rid: str, prompt: list) -> float:
        t = time.perf_counter()
        eng.submit(rid, prompt, params)
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t

    first_token_s("warmup", prompts[0][:512])
    out = []
    for i, p in enumerate(prompts):
        best = min(first_token_s(f"p{i}r{r}", p) for r in range(2))
        out.append(len(p) / best)
    if profile:
        profile_prefill(first_token_s, profile, profile_out)
    eng.shutdown()
    return out, load_s


def profile_prefill(first_token_s, prompt: list, out: Path) -> None:
    """Where a prefill's GPU time goes, per kernel name (CUPTI sees our kernels and cuBLAS's):
    the table that says which kernel to work on next."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = first_token_s("profiled", prompt)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(getattr(e, "device_time", 0.0) for e in kernels) / 1e3
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
    text = (f"prefill of {len(prompt)} tokens: wall {wall * 1e3:.1f} ms (under the profiler), GPU kernel time "
            f"{busy_ms:.1f} ms, {len(kernels)} kernels\n\n{table}\n")
    out.write_text(text)
    print(text[:6000], flush=True)


def main() -> None:
    a = parse_args()
    try:
        run(a)
    finally:
        if not a.keep_checkpoint:
            shutil.rmtree(a.dir, ignore_errors=True)


def run(a: argparse.Namespace) -> None:
    shape = SHAPES[a.shape]
    layers = a.layers or shape["layers"]
    lengths = a.lengths
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip().splitlines()[0]
    t = time.perf_counter()
    model, cfg = build_model(a.shape, layers, max(lengths) + 64)
    path = Path(a.dir)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_token_id,
                                                             "eos_token_id": cfg.eos_token_id}))
    print(f"{a.shape} x{layers} layers: checkpoint ready in {time.perf_counter() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = [[int(x) for x in torch.randint(1000, cfg.vocab_size - 1000, (n,), generator=g)] for n in lengths]
    peers = [None] * len(prompts) if a.skip_peer else [peer_prefill(model, p) for p in prompts]
    fl = [flops_per_token(model, cfg, a.shape, n) for n in lengths]
    del model
    torch.cuda.empty_cache()
    bf16_rate = gemm_rate(cfg.hidden_size)
    print(f"bf16 GEMM rate {bf16_rate / 1e12:.1f} TFLOP/s", flush=True)
    rate, ceiling = bf16_rate, {"ceiling": "bf16 GEMM rate: torch.matmul [8192, hidden] x [hidden, 4 hidden], best of 10"}
    if a.quantize == "fp8":
        fp8 = fp8_tensor_rate()
        rate = fp8["rate"]
        fm, fk, fn = FP8_RATE_SHAPE
        ceiling = {"ceiling": f"FP8 tensor rate: torch._scaled_mm float8_e4m3fn [{fm}, {fk}] x [{fk}, {fn}], per-tensor "
                              "scales, bf16 out, best of 10, the faster of exact and fast accumulation",
                   "fp8_tensor_rate_flop_s": round(rate),
                   "fp8_tensor_rate_exact_accum_flop_s": round(fp8["exact_accum"]),
                   "fp8_tensor_rate_fast_accum_flop_s": round(fp8["fast_accum"])}
        print(f"FP8 tensor rate {rate / 1e12:.1f} TFLOP/s (exact accumulation {fp8['exact_accum'] / 1e12:.1f}, "
              f"fast {fp8['fast_accum'] / 1e12:.1f})", flush=True)
    prof_prompt = None
    if a.profile:
        prof_prompt = [int(x) for x in torch.randint(1000, cfg.vocab_size - 1000, (a.profile,), generator=g)]
    ours, load_s = ninfer_prefill(path, prompts, a.chunk, prof_prompt, Path(a.out).parent / a.profile_out,
                                  quantize=a.quantize)
    weights = _gpu_bench().weights_format(path, a.quantize)
    ceiling_name = "FP8 tensor rate" if a.quantize == "fp8" else "GEMM rate"
    name = a.shape if layers == shape["layers"] else f"{a.shape} ({layers} of {shape['layers']} layers)"
    recs = []
    for n, v, peer, f in zip(lengths, ours, peers, fl):
        frac = f * v / rate
        print(f"{name} prefill {n}: ninfer {v:.0f} tok/s, {weights} weights ({frac:.3f} of the {ceiling_name}), "
              f"transformers {peer or 0:.0f} tok/s", flush=True)
        recs.append({
            "commit": a.commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            "command": "python " + " ".join(sys.argv),
            "model": a.shape,
            "config": {"layers": layers, "layers_full_model": shape["layers"], "prefill_chunk": a.chunk,
                       "dtype": "bf16", "quantize": a.quantize, "random_weights": True,
                       "ninfer_load_s": round(load_s, 1),
                       "note": "FLOPs and fraction are for the layers kept" if layers != shape["layers"] else ""},
            "metric": "prefill_tok_s",
            "value": round(v, 1),
            "weights": weights,
            "prompt_tokens": n,
            "flops_per_token": round(f),
            "gemm_rate_flop_s": round(bf16_rate),
            **ceiling,
            "fraction_of_ceiling": round(frac, 4),
            "peer": f"transformers {__import__('transformers').__version__} bf16 sdpa, same GPU",
            "peer_value": round(peer, 1) if peer else None,
        })
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + recs, indent=2) + "\n")


if __name__ == "__main__":
    main()
