"""gpt-fast's int4 batch-1 decode of the Llama-3-8B shape: the peer of ninfer's 4-bit decode.

gpt-fast (github.com/pytorch-labs/gpt-fast) is imported from its checkout (--gpt-fast PATH),
never copied here: its `model.Transformer.from_name("llama-3-8b")` (--layers N keeps N decoder
layers, as gpu_bench's --layers does) with random bf16 weights (std 0.02, seeded), every Linear
quantized by its `WeightOnlyInt4QuantHandler` (asymmetric int4, --groupsize 64, the output head
included, as gpt-fast's int4 mode does), and its `generate.prefill` / `generate.decode_n_tokens`
(a `decode_one_token` loop) run the way its generate.py runs them: greedy (temperature 0), with
`--compile` its torch.compile(mode="reduce-overhead", fullgraph=True) of decode_one_token.

One adaptation at the call site, not in gpt-fast's files: since torch 2.5
`aten._convert_weight_to_int4pack` takes the 4-bit values packed two to a byte (uint8 [n, k/2],
the even column in the high nibble: torch's own int4 tests pack so) where gpt-fast passes int32
[n, k]. One quantized Linear is checked against its dequantized weights before any timing; a
wrong packing fails the run.

Timing: the prompt (--prompt random tokens) is prefilled, then --tokens decode steps are timed
(torch.cuda.synchronize before and after); a first run of --warmup decode steps (compilation,
CUDA graph capture) is not timed. Prints one JSON line (the last line of stdout): tok/s, the bytes
a decode step reads (the int4 weights with their scales and zeros, the bf16 norms and one
embedding row, the whole KV cache, which gpt-fast's masked attention reads every step), the
compile flag and the torch version.

Usage: python benches/peer_gptfast.py --gpt-fast PATH [--layers N] [--prompt 128] [--tokens 256]
       [--compile] [--tiny]
--tiny: gpu_bench's tiny Llama shape on the CPU, eager (a dry run of the script; torch's CPU int4
ops stand in for the CUDA ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

#: gpu_bench's TINY_SHAPES["llama-3-8b"] in gpt-fast's ModelArgs terms.
TINY_ARGS = dict(block_size=1024, n_layer=2, n_head=4, n_local_heads=2, dim=128, intermediate_size=256,
                 vocab_size=512, rope_base=500000)

#: The largest relative error (Frobenius norm) of a quantized Linear's output against the same
#: input times its dequantized weights in f32: bf16 rounding gives well under 1e-2; a wrong
#: nibble order or layout gives order 1.
INT4_CHECK_TOLERANCE = 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt-fast", required=True, metavar="PATH",
                   help="gpt-fast's checkout (holds model.py, quantize.py, generate.py)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 32)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens prefilled before the timed decode")
    p.add_argument("--tokens", type=int, default=256, help="decode tokens timed")
    p.add_argument("--warmup", type=int, default=16, help="decode tokens of the untimed first run")
    p.add_argument("--groupsize", type=int, default=64, choices=[32, 64, 128, 256])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(decode_one_token, mode='reduce-overhead', fullgraph=True), as gpt-fast runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU, eager (dry run)")
    a = p.parse_args(argv)
    root = Path(a.gpt_fast)
    missing = [f for f in ("model.py", "quantize.py", "generate.py") if not (root / f).is_file()]
    if missing:
        p.error(f"--gpt-fast {a.gpt_fast!r}: no {', '.join(missing)} there (gpt-fast's checkout)")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers {a.layers}: at least one decoder layer")
    if a.prompt < 1 or a.tokens < 1 or a.warmup < 1:
        p.error("--prompt, --tokens and --warmup: at least one token each")
    if a.tiny and a.compile:
        p.error("--tiny --compile: the dry run is eager (CUDA graphs need the GPU)")
    return a


def pack_int4_nibbles(w_int32):
    """int32 [n, k] of 4-bit values (0..15) -> uint8 [n, k/2], two values a byte, column 2j in the
    high nibble and 2j+1 in the low one: what `aten._convert_weight_to_int4pack` takes on CUDA since
    torch 2.5 (gpt-fast passes the int32 matrix itself, the form of torch < 2.5)."""
    import torch

    if w_int32.dim() != 2 or w_int32.shape[1] % 2:
        raise ValueError(f"int4 values {tuple(w_int32.shape)}: need a 2-D matrix with an even column count")
    if w_int32.numel() and (int(w_int32.min()) < 0 or int(w_int32.max()) > 15):
        raise ValueError(f"int4 values outside 0..15 (min {int(w_int32.min())}, max {int(w_int32.max())})")
    w = w_int32.to(torch.int32)
    return ((w[:, ::2] << 4) | w[:, 1::2]).to(torch.uint8)


def int4_pack_takes_uint8(version: str) -> bool:
    """Whether this torch's `_convert_weight_to_int4pack` takes packed uint8 (2.5 and later)."""
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 5)


def import_gpt_fast(path: str) -> types.SimpleNamespace:
    """gpt-fast's model, quantize and generate modules from its checkout. Its tokenizer module
    needs sentencepiece and tiktoken, which the run does not use (random token ids): when they
    are missing, a stand-in that refuses to build a tokenizer is imported in its place."""
    sys.path.insert(0, str(Path(path).resolve()))
    try:
        import tokenizer  # noqa: F401  (gpt-fast's, first on the path)
    except ImportError as e:
        stub = types.ModuleType("tokenizer")

        def get_tokenizer(*_args, **_kw):
            raise RuntimeError(f"gpt-fast's tokenizer is unavailable here ({e}); the peer uses token ids")

        stub.get_tokenizer = get_tokenizer
        sys.modules["tokenizer"] = stub
    import generate
    import model
    import quantize

    return types.SimpleNamespace(model=model, quantize=quantize, generate=generate)


def adapt_int4_ops(gf: types.SimpleNamespace, device: str) -> None:
    """Points gpt-fast's int4 packing (and on the CPU its int4 matmul) at the forms this torch
    takes, by replacing the two quantize-module functions its handler and Linear call."""
    import torch

    q = gf.quantize

    def prepare(weight_bf16, groupsize, inner_k_tiles):
        w_int32, scales_and_zeros = q.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
        return convert_int4(w_int32, inner_k_tiles), scales_and_zeros

    def convert_int4(w_int32, inner_k_tiles):
        if w_int32.device.type == "cpu":
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(w_int32, inner_k_tiles)
        if int4_pack_takes_uint8(torch.__version__):
            return torch.ops.aten._convert_weight_to_int4pack(pack_int4_nibbles(w_int32), inner_k_tiles)
        return torch.ops.aten._convert_weight_to_int4pack(w_int32, inner_k_tiles)

    q.prepare_int4_weight_and_scales_and_zeros = prepare
    if device == "cpu":
        def linear_forward_cpu(x, weight_int4pack, scales_and_zeros, out_features, groupsize):
            shape = x.shape
            c = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), weight_int4pack, groupsize,
                                                           scales_and_zeros)
            return c.reshape(*shape[:-1], out_features)

        q.linear_forward_int4 = linear_forward_cpu


def build_model(gf: types.SimpleNamespace, a: argparse.Namespace, device: str, block_size: int):
    """gpt-fast's Transformer of the Llama-3-8B shape (or the tiny one), random bf16 weights on
    `device`: linears and the embedding N(0, 0.02), norms 1."""
    import torch

    m = gf.model
    args = m.ModelArgs(**TINY_ARGS) if a.tiny else m.ModelArgs.from_name("llama-3-8b")
    if a.layers:
        args.n_layer = a.layers
    args.block_size = max(args.block_size, block_size)
    with torch.device("meta"):
        model = m.Transformer(args)
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def quantize_int4(gf: types.SimpleNamespace, model, groupsize: int, device: str) -> None:
    """gpt-fast's int4 weight-only flow: create_quantized_state_dict, convert_for_runtime,
    load_state_dict. The packed tensor's shape is torch's (it changed across versions): each
    int4 Linear's placeholder buffer takes it before the load."""
    import torch

    q = gf.quantize
    handler = q.WeightOnlyInt4QuantHandler(model, groupsize)
    state = handler.create_quantized_state_dict(use_cuda=device == "cuda")
    model = handler.convert_for_runtime()
    for name, mod in model.named_modules():
        if isinstance(mod, q.WeightOnlyInt4Linear):
            packed = state[f"{name}.weight"]
            mod.register_buffer("weight", torch.empty(packed.shape, dtype=packed.dtype))
    model.load_state_dict(state, assign=True)
    model.to(device)


def check_int4_linear(gf: types.SimpleNamespace, linear, weight_bf16, groupsize: int, device: str) -> float:
    """Relative error of one quantized Linear's output against its input times the dequantized
    weights (gpt-fast's own dequantization of the same int4 values), on one row (the decode
    case) and on eight; raises when it exceeds INT4_CHECK_TOLERANCE."""
    import torch

    q = gf.quantize
    w_int32, scales_and_zeros = q.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
    deq = q.group_dequantize_tensor(w_int32, scales_and_zeros.float(), 4, groupsize).float()
    g = torch.Generator(device=device).manual_seed(7)
    worst = 0.0
    for rows in (1, 8):
        x = torch.randn(1, rows, weight_bf16.shape[1], generator=g, device=device).to(torch.bfloat16)
        with torch.no_grad():
            got = linear(x).float()
        ref = x.float() @ deq.t()
        err = float((got - ref).norm() / ref.norm())
        worst = max(worst, err)
    if not worst <= INT4_CHECK_TOLERANCE:
        raise RuntimeError(f"gpt-fast int4 Linear disagrees with its dequantized weights: relative error {worst:.3g} "
                           f"> {INT4_CHECK_TOLERANCE} (the int4 packing does not match this torch "
                           f"{torch.__version__}'s _convert_weight_to_int4pack)")
    return worst


def bytes_read(gf: types.SimpleNamespace, model) -> dict:
    """What one decode step reads: the int4 Linears' packed weights with their scales and zeros,
    the other weights but the embedding table (bf16 norms) plus one embedding row, and the whole
    KV cache (gpt-fast's attention runs over all max_seq_length positions under a mask)."""
    q = gf.quantize
    int4 = n_int4 = 0
    kv = 0
    for mod in model.modules():
        if isinstance(mod, q.WeightOnlyInt4Linear):
            int4 += mod.weight.numel() * mod.weight.element_size()
            int4 += mod.scales_and_zeros.numel() * mod.scales_and_zeros.element_size()
            n_int4 += 1
        elif isinstance(mod, gf.model.KVCache):
            kv += sum(t.numel() * t.element_size() for t in (mod.k_cache, mod.v_cache))
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    emb = model.tok_embeddings.weight
    other += emb.shape[1] * emb.element_size()
    return {"int4_weight_bytes": int4, "int4_linears": n_int4, "other_weight_bytes_per_token": other,
            "kv_cache_bytes_per_token": kv, "bytes_per_token": int4 + other + kv}


def time_decode(gf: types.SimpleNamespace, model, a: argparse.Namespace, device: str, max_seq: int) -> tuple:
    """(decode tok/s over --tokens steps, seconds of the untimed first run): gpt-fast's prefill,
    then its decode_n_tokens loop, greedy."""
    import torch

    gen = gf.generate
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq)
    if a.compile:
        # decode_n_tokens calls the module's decode_one_token: gpt-fast's main() swaps it the same way.
        gen.decode_one_token = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(3, model.config.vocab_size, (a.prompt,), generator=g).to(device)
    sampling = {"temperature": 0.0, "top_k": None}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run(n: int) -> float:
        input_pos = torch.arange(0, a.prompt, device=device)
        next_token = gen.prefill(model, prompt.view(1, -1), input_pos, **sampling).clone()
        input_pos = torch.tensor([a.prompt], device=device, dtype=torch.int)
        sync()
        t = time.perf_counter()
        tokens, _ = gen.decode_n_tokens(model, next_token.view(1, -1), input_pos, n, **sampling)
        sync()
        secs = time.perf_counter() - t
        if len(tokens) != n:
            raise RuntimeError(f"decode_n_tokens returned {len(tokens)} tokens for {n}")
        return secs

    with torch.no_grad():
        warm = run(a.warmup)
        secs = run(a.tokens)
    return a.tokens / secs, warm


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    device = "cpu" if a.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("peer_gptfast: no CUDA device (use --tiny for a CPU dry run)")
    gf = import_gpt_fast(a.gpt_fast)
    adapt_int4_ops(gf, device)
    # gpt-fast's cache length: prompt + new tokens (its generate.py: T + max_new_tokens).
    max_seq = a.prompt + max(a.tokens, a.warmup) + 1
    t = time.perf_counter()
    model = build_model(gf, a, device, max_seq)
    probe = model.layers[0].attention.wqkv
    probe_weight = probe.weight.detach().clone()
    quantize_int4(gf, model, a.groupsize, device)
    rel_err = check_int4_linear(gf, model.layers[0].attention.wqkv, probe_weight, a.groupsize, device)
    del probe, probe_weight
    if device == "cuda":
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t
    print(f"gpt-fast int4: model built and quantized in {build_s:.1f} s; layers.0.attention.wqkv relative error "
          f"{rel_err:.2e} against its dequantized weights", file=sys.stderr, flush=True)
    tok_s, warm_s = time_decode(gf, model, a, device, max_seq)
    mode = "torch.compile" if a.compile else "eager"
    out = {
        "peer": f"gpt-fast int4 g{a.groupsize} ({mode})",
        "tok_s": tok_s,
        "compile": a.compile,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layers": model.config.n_layer,
        "groupsize": a.groupsize,
        "prompt_tokens": a.prompt,
        "decode_tokens": a.tokens,
        "max_seq_length": model.max_seq_length,
        "output_head_int4": True,
        "int4_check_relative_error": rel_err,
        "build_and_quantize_s": round(build_s, 1),
        "first_run_s": round(warm_s, 1),
        **bytes_read(gf, model),
    }
    print(f"gpt-fast int4 g{a.groupsize} ({mode}) bs1: {tok_s:.2f} tok/s, {out['bytes_per_token'] / 1e9:.3f} GB "
          "read per token", file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
