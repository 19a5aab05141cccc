"""What capturing a decode step's CUDA graph costs a running engine: each batch level (1-64
sequences, 100-token prompts, 60 new tokens) runs twice with identical shapes; the first run
meets its (bucket, block-table stride) graphs uncaptured, the second finds them captured, so the
difference of their decode steps' summed wall time is the capture (plus any other first-use
work). Then 8 sequences whose contexts cross a stride doubling (256 and 512 tokens).

Why: decode graphs are captured lazily (rust_core/src/model/cuda_graphs.rs), at the first step
of each new shape, while requests are running; this measures the stall a streaming client sees
then. Run on the GPU machine with ninfer importable (a random checkpoint of the shape, written by
gpu_bench's Bench into /tmp/ckpt):

    NINFER_ASYNC_SCHEDULING=0 python benches/graph_capture_cost.py llama-3-8b 32
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench as gb  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gb.add_probe_shape_args(p)
    a = p.parse_args(argv)
    gb.check_probe_shape_args(p, a)
    return a


def main() -> None:
    args = parse_args()
    model, layers = args.model, args.layers
    s, path = gb.probe_checkpoint(model, layers)
    from ninfer import _core

    eng = _core.Engine(str(path), device="cuda", prefix_reuse=False, max_context=4096, kv_capacity=64 * 1100,
                       max_concurrency=64, prefill_chunk=16384)

    def run_level(n: int, plen: int, toks: int, tag: str) -> list:
        params = _core.SamplingParams(max_tokens=toks, temperature=0.0, ignore_eos=True)
        for i in range(n):
            eng.submit(f"{tag}-{i}", gb.random_prompt(plen, s["vocab"], 100 + i), params)
        times = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t) * 1e3)
        return times

    run_level(1, 16, 8, "warm")
    print(f"# {model} {layers} layers, async scheduling {os.environ.get('NINFER_ASYNC_SCHEDULING', 'default')}")
    for n in [1, 2, 4, 8, 16, 24, 32, 48, 64]:
        t1 = run_level(n, 100, 60, f"a{n}")
        t2 = run_level(n, 100, 60, f"b{n}")
        d1, d2 = t1[1:], t2[1:]  # the first step is the prefill (one chunk)
        print(f"n={n}: prefill step {t1[0]:.1f} / {t2[0]:.1f} ms; decode steps sum {sum(d1):.1f} / {sum(d2):.1f} ms "
              f"(capture ~{sum(d1) - sum(d2):.1f} ms); max {max(d1):.1f} / {max(d2):.1f}; median "
              f"{statistics.median(d2):.2f}", flush=True)
    for plen in [240, 500]:
        t1 = run_level(8, plen, 40, f"s{plen}")
        t2 = run_level(8, plen, 40, f"t{plen}")
        print(f"stride crossing, n=8 prompt {plen}: decode sums {sum(t1[1:]):.1f} / {sum(t2[1:]):.1f} ms; max "
              f"{max(t1[1:]):.1f} / {max(t2[1:]):.1f}", flush=True)


if __name__ == "__main__":
    main()
