// Decode GEMV: y[M, N] = x[M, K] * W[N, K]^T for small M (1..8 rows of activations).
// Decode is bound by reading the weights, so every weight byte is read exactly once, with
// 16-byte loads coalesced across the warp: one warp owns C output columns (rows of W),
// the block holds GEMV_WARPS such warps, and each lane keeps M f32 partial sums that a warp
// reduction combines. x is small and served from L1/L2. K must be a multiple of 8.
#include "common.cuh"

#define GEMV_WARPS 8
// Weight vectors per lane prefetched into L2 before the PDL wait.
#define GEMV_PREFETCH 4

// A warp computes C adjacent output columns (C = 1 for M = 1, 2 for M = 2..4, 4 for M = 5..8;
// the launcher's cols_per_warp in ops/gemv.rs mirrors this): each x vector it loads serves C
// weight vectors, so with several rows of x the x traffic from L1 per weight byte stays
// bounded. Every (column, row) sum is one f32 chain over the lane's k-slices in ascending
// order, eight elements each in order, then the same warp reduction, whatever M and C are:
// row r of an M-row launch equals the one-row launch of that row bit for bit.
template <int M, int C, bool F32_OUT>
__device__ __forceinline__ void gemv_body(const store_t* __restrict__ x,
                                          const store_t* __restrict__ w, void* __restrict__ y,
                                          int n_out, int k) {
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * C;
    const int k8 = k / 8;
    // Rows past n_out (the last warp of a ragged grid) read row n_out - 1 and store nothing.
    const vec8* wrow[C];
#pragma unroll
    for (int c = 0; c < C; ++c)
        wrow[c] = reinterpret_cast<const vec8*>(w + (long long)min(n0 + c, n_out - 1) * k);
    // The weights never depend on an earlier kernel, so under PDL (launch_pdl) the lane's
    // first GEMV_PREFETCH weight vectors are fetched into L2 before waiting for the kernel that
    // wrote x: the weight stream starts while the small kernels before this GEMV still run.
    // The loop below is unchanged (a register preload that split it measured ~3% slower).
#pragma unroll
    for (int p = 0; p < GEMV_PREFETCH; ++p) {
        const int i = lane + 32 * p;
#pragma unroll
        for (int c = 0; c < C; ++c)
            if (i < k8) asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[c] + i));
    }
    pdl_enter();
    if (n0 >= n_out) return;
    float acc[C][M];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;
    for (int i = lane; i < k8; i += 32) {
        float wf[C][8];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const vec8 wv = wrow[c][i];
#pragma unroll
            for (int j = 0; j < 8; ++j) wf[c][j] = to_f32(wv.v[j]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const vec8 xv = reinterpret_cast<const vec8*>(x + (long long)m * k)[i];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float xf = to_f32(xv.v[j]);
#pragma unroll
                for (int c = 0; c < C; ++c) acc[c][m] = fmaf(wf[c][j], xf, acc[c][m]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int n = n0 + c;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = warp_sum(acc[c][m]);
            if (lane == 0 && n < n_out) {
                if (F32_OUT)
                    reinterpret_cast<float*>(y)[(long long)m * n_out + n] = s;
                else
                    reinterpret_cast<store_t*>(y)[(long long)m * n_out + n] = from_f32(s);
            }
        }
    }
}

#define GEMV_INSTANCE(M, C)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_m##M(const store_t* x, const store_t* w, store_t* y, int n_out, int k) {          \
        gemv_body<M, C, false>(x, w, y, n_out, k);                                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_f32out_m##M(const store_t* x, const store_t* w, float* y, int n_out, int k) {     \
        gemv_body<M, C, true>(x, w, y, n_out, k);                                              \
    }

GEMV_INSTANCE(1, 1)
GEMV_INSTANCE(2, 2)
GEMV_INSTANCE(3, 2)
GEMV_INSTANCE(4, 2)
GEMV_INSTANCE(5, 4)
GEMV_INSTANCE(6, 4)
GEMV_INSTANCE(7, 4)
GEMV_INSTANCE(8, 4)

// SwiGLU folded into the down projection: y[M, N] = act[M, K] * W[N, K]^T where act[m, i] =
// silu(gate[m, i]) * up[m, i], read from the fused gate_up projection (gate and up rows
// `gu_stride` apart, up starting `K` elements after gate). Decode runs this instead of the
// swiglu kernel and a GEMV: one kernel boundary less per layer, and no act round trip.
//
// Exactness: each activation is rounded to the storage type (from_f32) exactly as the swiglu
// kernel stores it, then widened as gemv_body widens x, and every (column, row) sum is the same
// f32 chain over the same lane k-slices in the same order, then the same warp reduction: the
// result equals swiglu followed by gemv_m<M> bit for bit (and row r of an M-row launch equals
// the one-row launch). The GEMV_SWIGLU_VECS * C weight vectors a lane loads per tile are
// issued before the tile's activations are computed, so the weight stream is not held up by it.
//
// The activation of x is computed once per block, not once per warp: every warp of a block
// reads all K elements of every row, and silu (an exp and a division) per element per warp
// would cost more instruction issue than the weight stream takes (4096 warps x 14336 elements
// at Llama-3-8B's down projection). The block stages a tile of GEMV_SWIGLU_VECS * 32 vectors of
// each row in shared memory (double buffered: one barrier per tile), and each warp reads its
// lane's vectors from there.
//
// Vectors per lane per tile, GEMV_SWIGLU_VECS = 8 / C: eight weight vectors in flight per lane
// whatever C (as many registers as C = 4 with two tiles), and M * 32 * 8 / C vectors of shared
// memory per buffer (8 KiB at M = 1, 16 KiB at M = 2..8 with both buffers).
template <int M, int C>
__device__ __forceinline__ void gemv_swiglu_body(const store_t* __restrict__ gate,
                                                 const store_t* __restrict__ up,
                                                 long long gu_stride,
                                                 const store_t* __restrict__ w,
                                                 store_t* __restrict__ y, int n_out, int k) {
    constexpr int V = 8 / C;
    constexpr int TILE = 32 * V;
    __shared__ vec8 xs[2][M][TILE];
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * C;
    const int k8 = k / 8;
    const vec8* wrow[C];
#pragma unroll
    for (int c = 0; c < C; ++c)
        wrow[c] = reinterpret_cast<const vec8*>(w + (long long)min(n0 + c, n_out - 1) * k);
#pragma unroll
    for (int p = 0; p < GEMV_PREFETCH; ++p) {
        const int i = lane + 32 * p;
#pragma unroll
        for (int c = 0; c < C; ++c)
            if (i < k8) asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[c] + i));
    }
    pdl_enter();
    // No early return for warps past n_out (a ragged last block): every warp takes part in
    // computing the activations and in the barriers; those warps compute on the clamped row
    // and store nothing.
    float acc[C][M];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;
    for (int base = 0, tile = 0; base < k8; base += TILE, ++tile) {
        const int buf = tile & 1;
        vec8 wv[V][C];
#pragma unroll
        for (int u = 0; u < V; ++u) {
            const int i = base + lane + 32 * u;
#pragma unroll
            for (int c = 0; c < C; ++c)
                if (i < k8) wv[u][c] = wrow[c][i];
        }
        // The tile's activations, M * TILE vectors over the block's threads. The buffer written
        // here was last read two tiles ago, before the barrier of the previous tile.
        for (int e = threadIdx.x; e < M * TILE; e += GEMV_WARPS * 32) {
            const int m = e / TILE;
            const int i = base + (e - m * TILE);
            if (i < k8) {
                const vec8 g = reinterpret_cast<const vec8*>(gate + m * gu_stride)[i];
                const vec8 u = reinterpret_cast<const vec8*>(up + m * gu_stride)[i];
                vec8 a;
#pragma unroll
                for (int j = 0; j < 8; ++j) a.v[j] = from_f32(silu_f(to_f32(g.v[j])) * to_f32(u.v[j]));
                xs[buf][m][e - m * TILE] = a;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < V; ++u) {
            const int i = base + lane + 32 * u;
            if (i < k8) {
                float wf[C][8];
#pragma unroll
                for (int c = 0; c < C; ++c)
#pragma unroll
                    for (int j = 0; j < 8; ++j) wf[c][j] = to_f32(wv[u][c].v[j]);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const vec8 xv = xs[buf][m][lane + 32 * u];
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const float xf = to_f32(xv.v[j]);
#pragma unroll
                        for (int c = 0; c < C; ++c) acc[c][m] = fmaf(wf[c][j], xf, acc[c][m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int n = n0 + c;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = warp_sum(acc[c][m]);
            if (lane == 0 && n < n_out) y[(long long)m * n_out + n] = from_f32(s);
        }
    }
}

// C as in GEMV_INSTANCE (the launcher's cols_per_warp).
#define GEMV_SWIGLU_INSTANCE(M, C)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_swiglu_m##M(            \
        const store_t* gate, const store_t* up, long long gu_stride, const store_t* w,         \
        store_t* y, int n_out, int k) {                                                        \
        gemv_swiglu_body<M, C>(gate, up, gu_stride, w, y, n_out, k);                           \
    }

GEMV_SWIGLU_INSTANCE(1, 1)
GEMV_SWIGLU_INSTANCE(2, 2)
GEMV_SWIGLU_INSTANCE(3, 2)
GEMV_SWIGLU_INSTANCE(4, 2)
GEMV_SWIGLU_INSTANCE(5, 4)
GEMV_SWIGLU_INSTANCE(6, 4)
GEMV_SWIGLU_INSTANCE(7, 4)
GEMV_SWIGLU_INSTANCE(8, 4)
