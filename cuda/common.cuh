// Shared definitions for every NInfer kernel: the storage type (bf16, or fp16 where the
// architecture has no bf16 arithmetic worth using), conversions to and from f32, 16-byte vector
// access, and warp/block reductions. Kernels store activations and weights in `store_t` and
// accumulate in f32.
#pragma once

// Storage elements are raw 16-bit patterns converted with bit operations or single PTX
// instructions, so the kernels include no CUDA header: NVRTC from a bare wheel (no toolkit
// headers on the machine) compiles them for every architecture from sm_70 on.
typedef unsigned short store_t;

#if defined(NINFER_STORAGE_F16)
__device__ __forceinline__ float to_f32(store_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ store_t from_f32(float f) {
    store_t x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
}
#else
__device__ __forceinline__ float to_f32(store_t x) { return __uint_as_float(((unsigned)x) << 16); }
// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ store_t from_f32(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (store_t)((u >> 16) | 0x40u);
    return (store_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

#define NEG_INF __int_as_float(0xff800000)

// Eight storage elements in one 16-byte load or store.
struct __align__(16) vec8 {
    store_t v[8];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `scratch` holds at least 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
