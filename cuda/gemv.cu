// Decode GEMV: y[M, N] = x[M, K] * W[N, K]^T for small M (1..8 rows of activations).
// Decode is bound by reading the weights, so every weight byte is read exactly once, with
// 16-byte loads coalesced across the warp: one warp owns one output column n (a row of W),
// the block holds GEMV_WARPS such columns, and each lane keeps M f32 partial sums that a warp
// reduction combines. x is small and served from L1/L2. K must be a multiple of 8.
#include "common.cuh"

#define GEMV_WARPS 8

template <int M, bool F32_OUT>
__device__ __forceinline__ void gemv_body(const store_t* __restrict__ x,
                                          const store_t* __restrict__ w, void* __restrict__ y,
                                          int n_out, int k) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (n >= n_out) return;
    const int k8 = k / 8;
    const vec8* wrow = reinterpret_cast<const vec8*>(w + (long long)n * k);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    for (int i = lane; i < k8; i += 32) {
        const vec8 wv = wrow[i];
        float wf[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) wf[j] = to_f32(wv.v[j]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const vec8 xv = reinterpret_cast<const vec8*>(x + (long long)m * k)[i];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m] = fmaf(wf[j], to_f32(xv.v[j]), acc[m]);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float s = warp_sum(acc[m]);
        if (lane == 0) {
            if (F32_OUT)
                reinterpret_cast<float*>(y)[(long long)m * n_out + n] = s;
            else
                reinterpret_cast<store_t*>(y)[(long long)m * n_out + n] = from_f32(s);
        }
    }
}

#define GEMV_INSTANCE(M)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_m##M(const store_t* x, const store_t* w, store_t* y, int n_out, int k) {          \
        gemv_body<M, false>(x, w, y, n_out, k);                                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_f32out_m##M(const store_t* x, const store_t* w, float* y, int n_out, int k) {     \
        gemv_body<M, true>(x, w, y, n_out, k);                                                 \
    }

GEMV_INSTANCE(1)
GEMV_INSTANCE(2)
GEMV_INSTANCE(3)
GEMV_INSTANCE(4)
GEMV_INSTANCE(5)
GEMV_INSTANCE(6)
GEMV_INSTANCE(7)
GEMV_INSTANCE(8)
