"""What cuBLAS's first GEMM of a new M costs over its second, through torch (which calls the same
cuBLAS as the engine): for each M, the Llama-3-8B prefill projections (qkv, o, gate_up, down,
lm_head) run once and then again, each call synchronized and timed on the host.

Why: the engine's first prefill of a new token count was 10-35 ms slower than its second
(first_use_8b_82df186.log) and CUDA_MODULE_LOADING=EAGER did not remove it. Run with
CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 as well: if every call then pays what only the first paid,
the heuristic is the cost. It was not (cublas_first_use_82df186.log: ~0.35 ms a call without the
cache, 3.5-6 ms a first call either way); --kernels showed the cost follows the kernel: Hopper's
`nvjet` kernels take a tile that follows M in steps of 8, and a kernel already run pays nothing
(blas.rs `padded_rows` is the answer).

    python benches/diag_cublas_first_use.py [--kernels] [M ...]

--kernels names the kernel cuBLAS ran for each (shape, M) (torch.profiler over the second call):
whether two M values that each paid the first-call cost ran the same kernel tells a per-kernel
cost (loading it) from a per-shape one.
"""

import os
import sys
import time

import torch

# (N, K) of each prefill GEMM of the Llama-3-8B shape: qkv, o, gate_up, down, lm_head.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def kernel_name(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return "+".join(n[:60] for n in names) or "?"


def main() -> None:
    argv = sys.argv[1:]
    kernels = "--kernels" in argv
    ms = [int(x) for x in argv if x != "--kernels"] or [100, 117, 200, 800, 1600, 1601, 3000]
    dev = torch.device("cuda")
    w = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    # Contiguous activations of each K, as the engine's (a column slice of a wider one would
    # hand cuBLAS another leading dimension and perhaps another kernel).
    xs = {kk: torch.randn(max(ms + [4096]), kk, device=dev, dtype=torch.bfloat16) for kk in {4096, 14336}}
    # Every shape once at an M outside the list, so the first calls below pay only per-M work.
    for k, (n, kk) in SHAPES.items():
        timed_ms(lambda: xs[kk][:4096] @ w[k].T)
    print(f"# CUBLASLT_HEURISTICS_CACHE_CAPACITY={os.environ.get('CUBLASLT_HEURISTICS_CACHE_CAPACITY', 'unset')}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for m in ms:
        firsts, seconds = [], []
        for k, (n, kk) in SHAPES.items():
            a = xs[kk][:1 if k == "lm_head" else m]  # the engine's lm_head runs on the rows that want logits
            firsts.append(timed_ms(lambda: a @ w[k].T))
            seconds.append(timed_ms(lambda: a @ w[k].T))
        detail = ", ".join(f"{k} {f:.2f}/{s:.2f}" for k, f, s in zip(SHAPES, firsts, seconds))
        print(f"M={m}: first {sum(firsts):.2f} ms, second {sum(seconds):.2f} ms ({detail})", flush=True)
        if kernels:
            for k, (n, kk) in SHAPES.items():
                a = xs[kk][:1 if k == "lm_head" else m]
                print(f"    {k}: {kernel_name(lambda: a @ w[k].T)}", flush=True)


if __name__ == "__main__":
    main()
