"""Batched decode throughput of the CUDA engine on the checkpoint benches/gpu_decode.py writes.

For each batch size B: B greedy requests of a 128-token random prompt are submitted at once;
after every request has its first token (prefill done), the decode steps that follow are timed
until all finish. Reports output tokens per second over those steps and the weight bytes read per second they
imply (weights read once per step) as a fraction of the device copy rate (read + write), the
convention of docs/performance.md.

Usage: python benches/gpu_batch_decode.py --dir /tmp/llama3_8b_random --out results.json \
           [--batches 1,8,32,64] [--tokens 128] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def copy_rate() -> float:
    """Device copy bytes (read + written) per second, best of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/llama3_8b_random")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    from ninfer import _core

    batches = [int(b) for b in args.batches.split(",")]
    rate = copy_rate()
    weights = sum(f.stat().st_size for f in Path(args.dir).glob("*.safetensors"))
    eng = _core.Engine(str(args.dir), device="cuda", max_context=1024, kv_capacity=max(batches) * 512,
                       max_concurrency=max(batches), prefill_chunk=2048, prefix_reuse=False)
    vocab = json.loads((Path(args.dir) / "config.json").read_text())["vocab_size"]
    params = json.dumps({"max_tokens": args.tokens + 1, "temperature": 0.0, "ignore_eos": True})
    records = []
    for bsz in [1] + batches:  # the first run warms up (kernels, graph capture of bucket 1)
        rng = np.random.RandomState(bsz)
        for i in range(bsz):
            eng.submit(f"b{bsz}-{i}-{len(records)}", [int(t) for t in rng.randint(3, vocab, size=128)], params)
        started = set()
        while len(started) < bsz:
            for d in eng.step():
                if d["token_ids"]:
                    started.add(d["request_id"])
        t = time.perf_counter()
        got, steps = 0, 0
        while eng.has_unfinished():
            got += sum(len(d["token_ids"]) for d in eng.step())
            steps += 1
        secs = time.perf_counter() - t
        rec = {"batch": bsz, "tok_s": got / secs, "step_ms": 1e3 * secs / max(steps, 1),
               "fraction_of_copy_rate": (weights * steps / secs) / rate, "copy_rate_bytes_s": rate,
               "commit": args.commit}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    eng.shutdown()
    Path(args.out).write_text(json.dumps(records[1:], indent=1))


if __name__ == "__main__":
    main()
