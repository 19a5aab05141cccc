"""Decode-batch GEMMs (M = 9..64 rows against a weight [N, K]): how fast cuBLAS's default pick
is against every algorithm cublasLt's heuristic offers for the same call, weights cold in L2.

Why: at batch 16-64 the decode step's projections are cuBLAS GEMMs (the tensor-core GEMV serves
M <= 8), and the profiles of the 8B at batch 64 show the qkv / o / down projections reading
their weights at 2.9-3.3 TB/s against a copy rate of ~4.1 (decode_profile_8b_b64_nopdl_c206865.txt).
If another algorithm of the same library streams them faster, the engine can pick it per shape.

Each (shape, M) runs R weight copies in turn (R x N x K x 2 bytes >= 512 MiB, so every call
reads its weights from HBM, as in a model whose layers each have their own), captured in a CUDA
graph so the host's launch rate does not pace the GPU. Prints, per algorithm, us a call and the
weight read rate; and torch.matmul (cublasGemmEx's default, what ninfer's blas.rs calls) first.
Usage: python benches/diag_cublaslt_algos.py [--json OUT.json]
"""

import argparse
import ctypes
import json
import sys

import torch

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
# cublasLtMatmulAlgoConfigAttributes_t
CFG_ID, CFG_TILE_ID, CFG_SPLITK_NUM, CFG_REDUCTION_SCHEME, CFG_STAGES_ID = 0, 1, 2, 3, 9


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt():
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no libcublasLt found")


LT = None  # libcublasLt, loaded by main() after the arguments parse
vp = ctypes.c_void_p


def ck(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


class LtGemm:
    """y[M, N] = x[M, K] W[N, K]^T as blas.rs asks cuBLAS for it (column-major y^T = W^T^T x^T)."""

    def __init__(self, handle, m, n, k):
        self.h = handle
        self.desc = vp()
        ck(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        ta, tb = ctypes.c_int32(OP_T), ctypes.c_int32(OP_N)
        ck(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, ctypes.byref(ta), 4), "transa")
        ck(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSB, ctypes.byref(tb), 4), "transb")
        self.a, self.b, self.c = vp(), vp(), vp()
        ck(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), CUDA_R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(n), ctypes.c_int64(k)), "A")
        ck(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), CUDA_R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(m), ctypes.c_int64(k)), "B")
        ck(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), CUDA_R_16BF, ctypes.c_uint64(n), ctypes.c_uint64(m), ctypes.c_int64(n)), "C")

    def heuristics(self, ws_bytes, count=64):
        pref = vp()
        ck(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(ws_bytes)
        ck(LT.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref ws")
        res = (HeuristicResult * count)()
        got = ctypes.c_int(0)
        ck(LT.cublasLtMatmulAlgoGetHeuristic(self.h, self.desc, self.a, self.b, self.c, self.c, pref, count, res,
                                             ctypes.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def run(self, algo, x, w, y, ws, ws_bytes, stream):
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        ck(LT.cublasLtMatmul(self.h, self.desc, ctypes.byref(alpha), vp(w.data_ptr()), self.a, vp(x.data_ptr()), self.b,
                             ctypes.byref(beta), vp(y.data_ptr()), self.c, vp(y.data_ptr()), self.c, ctypes.byref(algo),
                             vp(ws.data_ptr()), ctypes.c_size_t(ws_bytes), vp(stream)), "matmul")


def algo_attr(algo, attr):
    v = ctypes.c_uint32(0)
    written = ctypes.c_size_t(0)
    LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written))
    return v.value


def time_graph(fn, calls):
    """Capture `fn` (which issues `calls` GEMMs) in a graph; median us a GEMM over 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(s.cuda_stream)  # warm (and lets cuBLAS set up outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(torch.cuda.current_stream().cuda_stream)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    return times[2]


SHAPES = {  # (N, K) of the decode projections
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3_5-27b": {"gdn_in": (16384, 5120), "attn_qkv": (14336, 5120), "o": (5120, 6144), "gate_up": (34816, 5120),
                    "down": (5120, 17408)},
}


def row_counts(text: str) -> list:
    """--ms: comma-separated row counts >= 1, or an argparse error naming the value."""
    try:
        ms = [int(v) for v in text.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated row counts >= 1, e.g. 16,32,64")
    return ms


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ms", type=row_counts, default=[16, 32, 64])
    ap.add_argument("--max-algos", type=int, default=24)
    return ap.parse_args(argv)


def main():
    global LT
    args = parse_args()
    LT = load_lt()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best_copy = float("inf")
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        best_copy = min(best_copy, a.elapsed_time(b) * 1e-3)
    copy_tb_s = 2 * src.numel() / best_copy / 1e12
    print(f"device copy rate (read + write, 1 GiB copy, best of 20): {copy_tb_s:.2f} TB/s", flush=True)
    del src, dst
    handle = vp()
    ck(LT.cublasLtCreate(ctypes.byref(handle)), "create")
    ws_bytes = 32 << 20
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    rows = []
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            wbytes = n * k * 2
            reps = max(2, -(-(512 << 20) // wbytes))
            ws_list = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(reps)]
            for m in args.ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                ref = x @ ws_list[0].t()

                def default(_stream):
                    for w in ws_list:
                        torch.matmul(x, w.t(), out=y)

                t_def = time_graph(default, reps)
                gemm = LtGemm(handle, m, n, k)
                results = []
                for i, hr in enumerate(gemm.heuristics(ws_bytes)[: args.max_algos]):
                    algo = hr.algo

                    def lt(stream, algo=algo):
                        for w in ws_list:
                            gemm.run(algo, x, w, y, ws, ws_bytes, stream)

                    try:
                        t = time_graph(lt, reps)
                    except RuntimeError as e:
                        print(f"  algo {i}: {e}")
                        continue
                    gemm.run(algo, x, ws_list[0], y, ws, ws_bytes, torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize()
                    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    cfg = {"id": algo_attr(algo, CFG_ID), "tile": algo_attr(algo, CFG_TILE_ID),
                           "splitk": algo_attr(algo, CFG_SPLITK_NUM), "stages": algo_attr(algo, CFG_STAGES_ID)}
                    results.append((t, i, cfg, err, hr.workspaceSize))
                best = min(results) if results else None
                line = f"{model} {name} N={n} K={k} M={m}: default {t_def:7.2f} us {wbytes / t_def / 1e6:5.2f} TB/s"
                if best:
                    t, i, cfg, err, wsz = best
                    line += (f" | best lt #{i} {t:7.2f} us {wbytes / t / 1e6:5.2f} TB/s ({t_def / t:.3f}x) {cfg} ws {wsz}"
                             f" err {err:.1e} | lt #0 {results[0][0]:7.2f} us")
                print(line, flush=True)
                rows.append({"model": model, "proj": name, "n": n, "k": k, "m": m, "default_us": t_def,
                             "lt": [{"rank": i, "us": t, "cfg": cfg, "rel_err": err, "workspace": wsz}
                                    for t, i, cfg, err, wsz in results]})
            del ws_list
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": copy_tb_s, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
