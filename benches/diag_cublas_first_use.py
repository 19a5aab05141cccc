"""What cuBLAS's first GEMM of a new M costs over its second, through torch (which calls the same
cuBLAS as the engine): for each M, the Llama-3-8B prefill projections (qkv, o, gate_up, down,
lm_head) run once and then again, each call synchronized and timed on the host.

Why: the engine's first prefill of a new token count is 10-35 ms slower than its second
(graph_capture_cost_*.log, first_use_*.log) and CUDA_MODULE_LOADING=EAGER does not remove it,
so the question is whether cuBLAS's per-shape work (its heuristic for a shape it has not seen)
is that cost. Run with CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 as well: if every call then pays
what only the first paid, the heuristic is the cost.

    python benches/diag_cublas_first_use.py [M ...]
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


def main() -> None:
    ms = [int(x) for x in sys.argv[1:]] or [100, 117, 200, 800, 1600, 1601, 3000]
    dev = torch.device("cuda")
    w = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    x = torch.randn(max(ms), 14336, device=dev, dtype=torch.bfloat16)
    # Every shape once at an M outside the list, so the first calls below pay only per-M work.
    for k, (n, kk) in SHAPES.items():
        timed_ms(lambda: x[:4096, :kk] @ w[k].T)
    print(f"# CUBLASLT_HEURISTICS_CACHE_CAPACITY={os.environ.get('CUBLASLT_HEURISTICS_CACHE_CAPACITY', 'unset')}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for m in ms:
        firsts, seconds = [], []
        for k, (n, kk) in SHAPES.items():
            a = x[:m, :kk]
            if k == "lm_head":
                a = x[:1, :kk]  # the engine's lm_head runs on the rows that want logits only
            firsts.append(timed_ms(lambda: a @ w[k].T))
            seconds.append(timed_ms(lambda: a @ w[k].T))
        detail = ", ".join(f"{k} {f:.2f}/{s:.2f}" for k, f, s in zip(SHAPES, firsts, seconds))
        print(f"M={m}: first {sum(firsts):.2f} ms, second {sum(seconds):.2f} ms ({detail})", flush=True)


if __name__ == "__main__":
    main()
