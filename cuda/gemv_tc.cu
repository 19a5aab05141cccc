// Decode GEMV on tensor cores (sm_80+): y[M, N] = x[M, K] * W[N, K]^T for M = 1..8 rows, the
// route of every small-M projection on sm_80+ (ops/gemv.rs `gemv_form`; cuda/gemv.cu, the SIMT
// GEMV, serves sm_7x). Why: the SIMT GEMV does 2 M FLOP per weight element plus conversions on
// the CUDA cores, so from M = 4 on it is bound by instruction issue, not by reading the weights
// (1.15 TB/s at M = 8 on the H200 against 3.7 at M = 1). mma.sync m16n8k16 does the 16 x 8 x 16
// products of a tile in one instruction per warp, so every M of 1..8 costs the same issue and
// the kernel stays bound by the weight stream.
//
// Layout. A block owns one tile of 16 weight rows (the mma's A, 16 rows x 16 k per mma) and its
// WARPS warps split K: warp w takes the k32 steps w, w + WARPS, w + 2 WARPS, ... in
// ascending order. In one k32 step, lane (g = lane / 4, t = lane % 4) loads 16 bytes (8 k) of
// weight row g and 16 bytes of row g + 8 at k = 32 s + 8 t (the 4 lanes of a row read 64
// contiguous bytes, a block of 8 warps 512), and 16 bytes of x row g (the mma's B column g;
// zero for g >= M, so x is padded to 8 columns with zeros) at the same k. Those registers are the
// fragments of two mmas directly, through a k permutation that is the same for A and B: the
// mma's logical k 2t, 2t + 1 / 2t + 8, 2t + 9 are the physical k 8t + 0, 1 / 8t + 2, 3 in the
// first mma and 8t + 4, 5 / 8t + 6, 7 in the second. A dot product summed over a permuted k is
// the same dot product, so no shuffle, shared-memory staging or ldmatrix sits between the
// 16-byte loads and the mma; every weight byte is loaded once. K needs only be a multiple of 8:
// chunks at or past K load zeros for both operands (the last step of a K that is not a
// multiple of 32).
//
// Exactness. Each element of an mma's D depends only on its row of A and its column of B, so
// output (row n, x row m) is the same chain of mma accumulations (the warp's steps in
// ascending order), then the same fixed-order reduction over the block's warps (warp 0 + 1 +
// ... + WARPS - 1 through shared memory), whatever M is and whatever the other rows of the tile
// are: row r of an M-row launch equals the one-row launch bit for bit (batch == alone), and the
// SwiGLU tile (8 gate + 8 up rows) gives the gate and up sums bit for bit as the plain GEMV
// gives them for the fused weight (gemv_gateup_swiglu == gemv + swiglu). M is a launch
// argument, not a template parameter: one code path for every M.
//
// Instances. WARPS (warps per block, each taking every WARPS-th k32 step: 16-row tiles alone
// would give N / 16 warps, 256 at N = 4096, too few loads in flight to stream the weights),
// UNROLL (k32 steps a warp loads per iteration before multiplying them) and HOLD are template
// parameters, instanced as gemv_tc{,_f32out,_gateup_swiglu}_w{W}_u{U}{h} (GEMV_TC_INSTANCE at the
// end): how many bytes a shape needs in flight depends on how many tiles it has (N / 16 blocks
// against 132 SMs on the H200) and how long each warp's stream is (K / 32 / WARPS steps), so the
// launcher picks one per weight shape (ops/gemv.rs `gemv_tc_config`). HOLD: ptxas does not keep
// an iteration's loads in flight together as the source orders them; it software-pipelines
// them (sm_90 SASS of the u4 kernel: two steps loaded, then each mma waits for its step's loads
// and the next loads issue behind it, ~2-3 steps in flight for any UNROLL). With HOLD the first
// mma of an iteration takes a zero that depends on every weight load of the iteration (through a
// value the compiler cannot prove zero), so all 2 UNROLL loads of a lane issue before it.
// Neither UNROLL nor HOLD changes any sum (the warp's steps are accumulated in ascending order
// either way; OR-ing zero leaves the bits); WARPS changes which steps a warp sums, so results
// are bit-exact across M for one WARPS, and a shape must keep one WARPS for every M.
#include "common.cuh"

// sm_80+ only (KernelFamily::min_arch): sm_7x has no m16n8k16 and runs cuda/gemv.cu.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "gemv_tc.cu needs sm_80 (mma.sync m16n8k16); sm_7x runs gemv.cu"
#endif

// The epilogues (as cuda/gemv.cu's GEMV_OUT_*): storage type, f32 (the lm_head's logits) or
// SwiGLU of gate/up pairs.
#define GEMV_TC_OUT_STORE 0
#define GEMV_TC_OUT_F32 1
#define GEMV_TC_OUT_SWIGLU 2


// 16 bytes of 8 storage elements as the four 32-bit registers of mma fragments (element 2i in
// the low half of r[i]: the lower k of a pair, as the mma expects).
struct __align__(16) tc_frag {
    unsigned r[4];
};

// Weights: read once, so through the read-only path without allocating in L1 (which keeps x's
// lines there). Written as PTX because the weight pointer also feeds the L2 prefetch's asm, after
// which the compiler no longer proves the plain load read-only (it emitted ld.global, not
// ld.global.nc, for the SIMT GEMV's weights once the prefetch was added).
__device__ __forceinline__ tc_frag tc_load_w(const store_t* p) {
    tc_frag f;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
        : "l"(p));
    return f;
}

// x: read by every warp of the block (and of the other blocks), so cached in L1; written by the
// kernel before this one, and read-only while this one runs.
__device__ __forceinline__ tc_frag tc_load_x(const store_t* p) {
    tc_frag f;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
        : "l"(p));
    return f;
}

// f where keep, zeros elsewhere: a select, so a lane's x load needs no branch (lanes of x rows
// >= M load row M - 1, the same lines as that row's lanes, and drop it).
__device__ __forceinline__ tc_frag tc_keep(const tc_frag& f, bool keep) {
    tc_frag r;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.r[i] = keep ? f.r[i] : 0u;
    return r;
}

__device__ __forceinline__ tc_frag tc_zero() {
    tc_frag f;
#pragma unroll
    for (int i = 0; i < 4; ++i) f.r[i] = 0u;
    return f;
}

// d += A * B for one m16n8k16 tile: a0..a3 and b0, b1 in the mma.sync fragment layout.
__device__ __forceinline__ void tc_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1) {
#if defined(NINFER_STORAGE_F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// One k32 step: the two mmas over a lane's 16 bytes of weight rows g (lo) and g + 8 (hi) and of
// x row g, under the k permutation above.
__device__ __forceinline__ void tc_step(float (&d)[4], const tc_frag& lo, const tc_frag& hi,
                                        const tc_frag& b) {
    tc_mma(d, lo.r[0], hi.r[0], lo.r[1], hi.r[1], b.r[0], b.r[1]);
    tc_mma(d, lo.r[2], hi.r[2], lo.r[3], hi.r[3], b.r[2], b.r[3]);
}

// Output columns of y one block stores: the 16 rows of its tile, or 8 activations (8 gate rows
// n0 .. n0 + 7 as tile rows 0..7, their up rows n_out later as tile rows 8..15) for SwiGLU.
template <int OUT>
__device__ constexpr int gemv_tc_cols() {
    return OUT == GEMV_TC_OUT_SWIGLU ? 8 : 16;
}

template <int OUT, int WARPS>
__device__ __forceinline__ void gemv_tc_store(const float (&red)[WARPS][4][32], void* y, int m,
                                              int n_out, int n0, int round_out);

// y[m, n] for x rows m < M, output columns n of the block (ragged N: tile rows past n_out read
// row n_out - 1 and store nothing). GEMV_TC_OUT_SWIGLU: W is the fused gate_up weight [2 n_out,
// K] and y = act[M, n_out] = silu(gate) * up, each sum rounded to the storage type as the GEMV
// stores it and the activation computed as cuda/activation.cu's swiglu computes it
// (common.cuh's swiglu_out), so act is bit for bit this kernel's GEMV of the
// fused weight followed by swiglu.
// `prefetch`: the k32 steps of the block (the first ones, warp w taking w, w + WARPS, ...)
// whose weight lines are fetched into L2 before the PDL wait, 0 for none; a launch argument
// (the route plan's tc_prefetch_steps, 16 = 16 KB a block). It changes no value.
template <int OUT, int WARPS, int UNROLL, bool HOLD>
__device__ __forceinline__ void gemv_tc_body(const store_t* __restrict__ x,
                                             const store_t* __restrict__ w, void* y, int m,
                                             int n_out, int k, int prefetch, int round_out = 0) {
    __shared__ float red[WARPS][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * gemv_tc_cols<OUT>();
    const long long row_lo = min(n0 + g, n_out - 1);
    const long long row_hi =
        OUT == GEMV_TC_OUT_SWIGLU ? row_lo + n_out : (long long)min(n0 + g + 8, n_out - 1);
    const store_t* wlo = w + row_lo * k + 8 * t;
    const store_t* whi = w + row_hi * k + 8 * t;
    const store_t* xg = x + (long long)min(g, m - 1) * k + 8 * t;
    const bool x_row = g < m;
    const int full = k / 32;            // k32 steps with all four chunks inside K
    const int steps = (k + 31) / 32;    // and the partial one, if K % 32 != 0
    // The weights never depend on an earlier kernel, so under PDL (launch_pdl) the warp's steps
    // among the block's first `prefetch` are fetched into L2 before waiting for the kernel that
    // wrote x.
    const int prefetch_end = min(prefetch, full);
    for (int s = warp; s < prefetch_end; s += WARPS) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wlo + 32 * s));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(whi + 32 * s));
    }
    pdl_enter();
    // Zero (M >= 1), but not to the compiler: HOLD's dependency of the mmas on the loads.
    const unsigned hold_zero = m < 0 ? 0xffffffffu : 0u;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // Main loop: UNROLL steps of the warp per iteration, all loads before the mmas. The
    // three pointers advance, and the steps are constant offsets from them (32 WARPS elements
    // apart), so the loads need no address registers of their own and the compiler
    // keeps every load of the iteration in flight (per-step 64-bit addresses made it interleave
    // loads with mmas to save registers: a memory latency per step instead of per iteration).
    constexpr int STRIDE = 32 * WARPS;
    int s = warp;
    {
        const store_t* plo = wlo + 32 * s;
        const store_t* phi = whi + 32 * s;
        const store_t* px = xg + 32 * s;
        for (; s + (UNROLL - 1) * WARPS < full; s += UNROLL * WARPS) {
            tc_frag lo[UNROLL], hi[UNROLL], b[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                lo[u] = tc_load_w(plo + u * STRIDE);
                hi[u] = tc_load_w(phi + u * STRIDE);
                b[u] = tc_keep(tc_load_x(px + u * STRIDE), x_row);
            }
            if constexpr (HOLD) {
                unsigned dep = 0u;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) dep ^= lo[u].r[0] ^ hi[u].r[0];
                b[0].r[0] |= dep & hold_zero;
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) tc_step(d, lo[u], hi[u], b[u]);
            plo += UNROLL * STRIDE;
            phi += UNROLL * STRIDE;
            px += UNROLL * STRIDE;
        }
    }
    for (; s < steps; s += WARPS) {
        const int kk = 32 * s;
        const bool in_k = kk + 8 * t < k;
        const tc_frag lo = in_k ? tc_load_w(wlo + kk) : tc_zero();
        const tc_frag hi = in_k ? tc_load_w(whi + kk) : tc_zero();
        const tc_frag b = in_k ? tc_keep(tc_load_x(xg + kk), x_row) : tc_zero();
        tc_step(d, lo, hi, b);
    }
    // Fixed-order reduction over the warps: warp 0's partial sums, plus warp 1's, ..., in f32.
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][j][lane] = d[j];
    __syncthreads();
    if (warp == 0) gemv_tc_store<OUT, WARPS>(red, y, m, n_out, n0, round_out);
}

// Warp 0 of a block: sums the warps' partials in warp order and stores the block's outputs.
// `round_out` (f32 output only, nonzero): each logit rounded to the storage type and kept as f32
// (the model's logits_dtype "auto", as gemv.cu's f32 store), in this epilogue so that decode
// gains no kernel.
template <int OUT, int WARPS>
__device__ __forceinline__ void gemv_tc_store(const float (&red)[WARPS][4][32], void* y, int m,
                                              int n_out, int n0, int round_out) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = red[0][j][lane];
#pragma unroll
        for (int ww = 1; ww < WARPS; ++ww) v[j] += red[ww][j][lane];
    }
    // Lane (g, t) holds D[g][2t], D[g][2t + 1] in v[0], v[1] and D[g + 8][2t], D[g + 8][2t + 1]
    // in v[2], v[3]: tile rows g, g + 8 (output columns) for x rows 2t, 2t + 1.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        if (r >= m) continue;
        if constexpr (OUT == GEMV_TC_OUT_SWIGLU) {
            const int n = n0 + g;
            if (n < n_out) {
                reinterpret_cast<store_t*>(y)[(long long)r * n_out + n] =
                    swiglu_out(round_st(v[i]), round_st(v[2 + i]));
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + g + 8 * h;
                if (n >= n_out) continue;
                if constexpr (OUT == GEMV_TC_OUT_F32) {
                    const float l = v[2 * h + i];
                    reinterpret_cast<float*>(y)[(long long)r * n_out + n] = round_out ? round_st(l) : l;
                } else
                    reinterpret_cast<store_t*>(y)[(long long)r * n_out + n] = from_f32(v[2 * h + i]);
            }
        }
    }
}

// The three epilogues of one (WARPS, UNROLL, HOLD), the name ending in H (empty or h): plain
// GEMV, f32 logits and the fused gate_up weight's SwiGLU (act[M, inter]). Every one takes
// `prefetch` (gemv_tc_body) after k. Launch bounds follow WARPS.
#define GEMV_TC_INSTANCE(W, U, HOLD, H)                                                     \
    extern "C" __global__ void __launch_bounds__(W * 32)                                    \
        gemv_tc_w##W##_u##U##H(const store_t* x, const store_t* w, store_t* y, int m,       \
                               int n_out, int k, int prefetch) {                            \
        gemv_tc_body<GEMV_TC_OUT_STORE, W, U, HOLD>(x, w, y, m, n_out, k, prefetch);        \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(W * 32)                                    \
        gemv_tc_f32out_w##W##_u##U##H(const store_t* x, const store_t* w, float* y, int m,  \
                                      int n_out, int k, int prefetch, int round_out) {      \
        gemv_tc_body<GEMV_TC_OUT_F32, W, U, HOLD>(x, w, y, m, n_out, k, prefetch, round_out); \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(W * 32)                                    \
        gemv_tc_gateup_swiglu_w##W##_u##U##H(const store_t* x, const store_t* w, store_t* act, \
                                             int m, int inter, int k, int prefetch) {       \
        gemv_tc_body<GEMV_TC_OUT_SWIGLU, W, U, HOLD>(x, w, act, m, inter, k, prefetch);     \
    }

GEMV_TC_INSTANCE(4, 4, false, )
GEMV_TC_INSTANCE(4, 4, true, h)
GEMV_TC_INSTANCE(4, 8, true, h)
GEMV_TC_INSTANCE(8, 4, false, )
GEMV_TC_INSTANCE(8, 4, true, h)
GEMV_TC_INSTANCE(8, 8, true, h)
GEMV_TC_INSTANCE(16, 4, false, )
GEMV_TC_INSTANCE(16, 4, true, h)
GEMV_TC_INSTANCE(16, 8, true, h)
