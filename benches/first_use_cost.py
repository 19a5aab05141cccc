"""What the first prefill of a new token count costs over the second: one request of each prompt
length runs twice (different tokens, prefix reuse off, one output token); the first meets the
length's GEMM and attention shapes for the first time in the process, the second does not. Also
the engine's construction time and the GPU memory in use once it is built.

Why: the startup warm-up step runs one full `prefill_chunk`, so kernels of other sizes used to
first run during a user's request: cuBLAS's generated Hopper kernels, one per tile its M calls
for (~4 ms each), and the decode buffers grown as concurrency climbed. Before 4f5cb10's row
buckets and startup GEMM run, the 8B paid 83-95 ms over the default lengths (10-24 ms a length up
to 1600), the 27B shape with 8 layers 121.5 ms; after, 3.7 and -1.4 (results/first_use_*.log).
It stays the check that no request pays for a first use. CUDA_MODULE_LOADING=EAGER (read by the
driver at initialisation: every module loads at startup) tells lazy module loading apart; it
did not change the figures. On the GPU machine with ninfer importable (a random checkpoint of
the shape, written by gpu_bench's Bench into /tmp/ckpt; `.ci/gpu-parts probe` runs it on several
builds):

    python benches/first_use_cost.py llama-3-8b 32
    CUDA_MODULE_LOADING=EAGER python benches/first_use_cost.py llama-3-8b 32
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench as gb  # noqa: E402

DEFAULT_LENGTHS = "16,100,117,200,400,800,1600,3200,6400"
# The checkpoints gpu_bench writes have an 8192-token context; one token is the output.
MAX_PROMPT = 8191


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gb.add_probe_shape_args(p)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                   help=f"prompt lengths in tokens, comma-separated, each 1 to {MAX_PROMPT} (default {DEFAULT_LENGTHS})")
    a = p.parse_args(argv)
    gb.check_probe_shape_args(p, a)
    try:
        a.lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths {a.lengths!r}: not a comma-separated list of integers")
    bad = [n for n in a.lengths if not 1 <= n <= MAX_PROMPT]
    if bad:
        p.error(f"--lengths: {bad[0]} is outside 1 to {MAX_PROMPT} (the checkpoint's context less the output token)")
    return a


def gpu_memory_used_mib() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (nvidia-smi did not answer)"


def main() -> None:
    args = parse_args()
    s, path = gb.probe_checkpoint(args.model, args.layers)
    from ninfer import _core

    t0 = time.perf_counter()
    eng = _core.Engine(str(path), device="cuda", prefix_reuse=False, max_context=MAX_PROMPT + 1,
                       kv_capacity=2 * (MAX_PROMPT + 1), max_concurrency=8, prefill_chunk=MAX_PROMPT + 1)
    built = time.perf_counter() - t0
    params = _core.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill_ms(plen: int, seed: int) -> float:
        """The request's whole time (its prefill and one sampled token): with asynchronous
        scheduling a step returns before its kernels finish, so the steps are not timed alone."""
        t = time.perf_counter()
        eng.submit(f"p{plen}-{seed}", gb.random_prompt(plen, s["vocab"], seed), params)
        while eng.has_unfinished():
            eng.step()
        return (time.perf_counter() - t) * 1e3

    print(f"# {args.model} {args.layers} layers, CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset')}: "
          f"engine built in {built:.2f} s; GPU memory in use {gpu_memory_used_mib()}", flush=True)
    extra = 0.0
    for plen in args.lengths:
        first, second = prefill_ms(plen, 1), prefill_ms(plen, 2)
        extra += first - second
        print(f"prompt {plen}: first prefill {first:.1f} ms, second {second:.1f} ms (first use ~{first - second:.1f} ms)",
              flush=True)
    print(f"first-use cost summed over the lengths: {extra:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
