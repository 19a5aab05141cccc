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

// Gated DeltaNet output norm, out = rmsnorm(x) * w * silu(z), in two steps that rmsnorm_gated
// (norm.cu) and the fused decode kernel gdn_recurrent_gated_dk* (gdn.cu) share, so both round
// the same expressions: the reciprocal RMS from the row's sum of squares, then one element.
__device__ __forceinline__ float gated_norm_rstd(float sum_sq, int dim, float eps) {
    return rsqrtf(sum_sq / (float)dim + eps);
}
__device__ __forceinline__ store_t gated_norm_out(float x, float rstd, float w, float z) {
    const float n = x * rstd * w;
    return from_f32(n * silu_f(z));
}

// Programmatic Dependent Launch (sm_90+). A kernel the host launches with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (`launch_pdl` in ops/mod.rs) may start
// while the kernel before it on the stream is still running: its blocks get scheduled early and
// can do work that depends on no earlier kernel (a GEMV's first weight loads) before
// `pdl_wait()`, which returns once the previous kernel has completed and its writes are
// visible. `pdl_launch_dependents()` lets the next kernel start being scheduled.
//
// SAFETY INVARIANT: a kernel launched with the attribute must execute `pdl_wait()` in every
// block before any early return, before reading anything an earlier kernel wrote and before
// writing anything. Ordering through the chain is transitive only because of that: kernel N
// waits for N-1 to complete, and N-1 completes only after its own wait on N-2 returned. A
// block that exited without waiting would let N complete before N-1, and N+1 would then read
// N-1's outputs unfinished. On older architectures (and on launches without the attribute)
// both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" :::);
}
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_launch_dependents() {}
#endif

// The common prologue of a kernel launched with PDL that has nothing to do before its inputs
// are ready: wait for the previous kernel, then let the next one be scheduled (after the wait,
// so that at most one kernel's blocks sit waiting for this one).
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}
