"""Greedy output hashes of the real-shape benchmarks (random weights, the first N layers), at batch 1
and 8: one process per build, the same checkpoints and prompts for every build, so that two builds
that must write the same tokens can be compared in one call (`.ci/gpu-parts probe`, PROBE_ORDER
naming the builds).

Usage: python benches/gpu_output_hashes.py [LAYERS] [tiny]     (LAYERS defaults to 4; `tiny` runs
the tiny shapes on the CPU, a dry run)
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench as gb  # noqa: E402

MODELS = ["llama-3-8b", "qwen2-7b", "qwen3_5-27b"]


def greedy_tokens(b: gb.Bench, path: Path, vocab: int, batch: int) -> dict:
    """Request id -> greedy token ids of `batch` seeded random prompts of different lengths."""
    eng, _ = gb.ninfer_engine(b, path, max_context=1024, kv_capacity=8192, max_concurrency=8, prefill_chunk=512)
    params = gb._core_params(json.dumps({"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}))
    prompts = {f"r{i}": gb.random_prompt(37 + 11 * i, vocab, 1000 + i) for i in range(batch)}
    for rid, p in prompts.items():
        eng.submit(rid, p, params)
    out: dict = {rid: [] for rid in prompts}
    while eng.has_unfinished():
        for d in eng.step():
            out[d["request_id"]] += list(d["token_ids"])
    eng.shutdown()
    return out


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
    tmp = Path(tempfile.gettempdir())
    a = gb.parse_args(["--out", str(tmp / "output_hashes_unused.json"), "--layers", str(layers), "--keep-checkpoints",
                       "--workdir", str(tmp / "ninfer_hash")] + (["--tiny"] if "tiny" in sys.argv else []))
    b = gb.Bench(a)
    import ninfer

    print("ninfer from", ninfer.__file__)
    for model in MODELS:
        s = b.shape(model)
        path = b.checkpoint(model)
        for batch in (1, 8):
            t = time.perf_counter()
            out = greedy_tokens(b, path, s["vocab"], batch)
            h = hashlib.sha256(json.dumps([out[r] for r in sorted(out)]).encode()).hexdigest()[:16]
            tokens = sum(out.values(), [])
            print(f"HASH {model} batch={batch} layers={s['layers']} tokens={len(tokens)} distinct={len(set(tokens))} "
                  f"hash={h} secs={time.perf_counter() - t:.2f}", flush=True)


if __name__ == "__main__":
    main()
