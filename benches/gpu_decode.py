"""Batch-1 decode throughput of the CUDA engine on a random Llama-3-8B-shaped checkpoint.

Writes the random bf16 checkpoint on the GPU machine itself (torch random tensors saved with
safetensors), measures in the same run:
- the device copy rate (torch device-to-device copy of 2 GiB, bytes read + written / time),
- ninfer: `_core.Engine(device="cuda")`, one request, greedy, tokens per second over the decode
  steps after the first token (engine step, logits copy and host sampling included),
- the peer: transformers `generate` (bf16, eager, same GPU), decode tokens per second from the
  difference between a 1-token and an N-token generate,
and prints / writes JSON records (benches/results/gpu_decode.json schema).

Usage: python benches/gpu_decode.py --out results.json [--layers 32] [--commit SHA]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, head_dim=128)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file for the records")
    p.add_argument("--dir", default="/tmp/llama3_8b_random", help="where the random checkpoint is written")
    p.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (32 for the real shape)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=256, help="decode tokens timed")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--only-checkpoint", action="store_true", help="write the checkpoint and exit")
    return p.parse_args()


def write_checkpoint(path: Path, layers: int) -> None:
    """Random bf16 weights (std 0.02, norms 1) written shard by shard to keep host memory low."""
    from safetensors.torch import save_file

    s = SHAPE
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
        "intermediate_size": s["ffn"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"], "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    }
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    h, kvd = s["hidden"], s["kv_heads"] * s["head_dim"]
    index = {}
    shards = [("embed", None)] + [(f"layer{i}", i) for i in range(layers)] + [("head", None)]
    for n, (name, li) in enumerate(shards):
        if li is None and name == "embed":
            t = {"model.embed_tokens.weight": rnd(s["vocab"], h)}
        elif li is None:
            t = {"lm_head.weight": rnd(s["vocab"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
        else:
            p = f"model.layers.{li}"
            t = {
                f"{p}.self_attn.q_proj.weight": rnd(h, h), f"{p}.self_attn.k_proj.weight": rnd(kvd, h),
                f"{p}.self_attn.v_proj.weight": rnd(kvd, h), f"{p}.self_attn.o_proj.weight": rnd(h, h),
                f"{p}.mlp.gate_proj.weight": rnd(s["ffn"], h), f"{p}.mlp.up_proj.weight": rnd(s["ffn"], h),
                f"{p}.mlp.down_proj.weight": rnd(h, s["ffn"]),
                f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        fname = f"model-{n:05d}.safetensors"
        save_file(t, str(path / fname), metadata={"format": "pt"})
        index.update({k: fname for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    # Last, so that a present config.json means a complete checkpoint.
    (path / "config.json").write_text(json.dumps(cfg))


def bytes_read_per_token(layers: int, context: int) -> int:
    """Weights every decode step reads (all layers, final norm, lm_head, one embedding row) plus
    the KV cache at `context` tokens, in bf16."""
    s = SHAPE
    h, kvd = s["hidden"], s["kv_heads"] * s["head_dim"]
    per_layer = (h * h * 2 + 2 * kvd * h + 3 * s["ffn"] * h + 2 * h) * 2
    kv = layers * 2 * kvd * context * 2
    return layers * per_layer + (s["vocab"] * h + 2 * h) * 2 + kv


def copy_rate() -> float:
    """Device copy bytes (read + written) per second, best of 20."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    best = float("inf")
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / best


def ninfer_decode(path: Path, prompt: list, n: int) -> tuple:
    from ninfer import _core

    t0 = time.perf_counter()
    eng = _core.Engine(str(path), device="cuda", max_context=2048, kv_capacity=4096, max_concurrency=4,
                       prefill_chunk=512, prefix_reuse=False)
    load_s = time.perf_counter() - t0
    params = json.dumps({"max_tokens": n + 1, "temperature": 0.0, "ignore_eos": True})

    def run(rid: str) -> tuple:
        eng.submit(rid, prompt, params)
        got = 0
        while got == 0:
            got += sum(len(d["token_ids"]) for d in eng.step())
        t = time.perf_counter()
        while eng.has_unfinished():
            got += sum(len(d["token_ids"]) for d in eng.step())
        return got - 1, time.perf_counter() - t

    run("warmup")
    toks, secs = run("timed")
    eng.shutdown()
    return toks / secs, load_s


def peer_decode(path: Path, prompt: list, n: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.tensor([prompt], device="cuda")
    mask = torch.ones_like(ids)

    def gen(k: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k, min_new_tokens=k,
                           pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(4)
    one, full = gen(1), gen(n + 1)
    del model
    torch.cuda.empty_cache()
    return n / (full - one)


def main() -> None:
    a = parse_args()
    path = Path(a.dir)
    t = time.perf_counter()
    if not (path / "config.json").exists():
        write_checkpoint(path, a.layers)
    print(f"checkpoint ready in {time.perf_counter() - t:.1f} s", flush=True)
    if a.only_checkpoint:
        return
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip().splitlines()[0]
    rate = copy_rate()
    print(f"device copy rate {rate / 1e12:.2f} TB/s (read + write)", flush=True)
    prompt = [int(x) for x in torch.randint(1000, 100000, (a.prompt,), generator=torch.Generator().manual_seed(1))]
    tok_s, load_s = ninfer_decode(path, prompt, a.tokens)
    ctx = a.prompt + a.tokens // 2
    frac = bytes_read_per_token(a.layers, ctx) * tok_s / rate
    print(f"ninfer decode bs1: {tok_s:.1f} tok/s (load {load_s:.1f} s), {frac:.3f} of the copy rate", flush=True)
    peer = None if a.skip_peer else peer_decode(path, prompt, min(a.tokens, 128))
    if peer:
        print(f"transformers generate bs1: {peer:.1f} tok/s", flush=True)
    model = "llama-3-8b" if a.layers == SHAPE["layers"] else f"llama-3-8b shape, {a.layers} of 32 layers"
    rec = {
        "commit": a.commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "command": "python " + " ".join(sys.argv),
        "model": model,
        "config": {"prompt_tokens": a.prompt, "decode_tokens": a.tokens, "batch": 1, "dtype": "bf16",
                   "random_weights": True, "ninfer_load_s": round(load_s, 1)},
        "metric": "decode_bs1_tok_s",
        "value": round(tok_s, 2),
        "copy_rate_bytes_s": round(rate),
        "bytes_read_per_token": bytes_read_per_token(a.layers, ctx),
        "fraction_of_ceiling": round(frac, 4),
        "peer": "transformers generate (bf16, eager, same GPU)",
        "peer_value": round(peer, 2) if peer else None,
    }
    Path(a.out).write_text(json.dumps([rec], indent=2) + "\n")
    print(json.dumps(rec, indent=2))


if __name__ == "__main__":
    main()
