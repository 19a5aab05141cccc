// Quantized weights on the GPU: the operands every format's kernels take, exact decoders of the
// small float words the formats store, and the two kernel bodies each format instantiates with
// its own decoder (quant_ninfer.cu, quant_gguf.cu, quant_hf.cu):
// - quant_gemv: decode GEMV y[m, N] = x[m, K] W[N, K]^T for m <= 16 rows with the weight
//   decoded in registers as it streams (each weight byte read once, every row of x reusing it),
//   into the storage type (projections) or f32 (quant_gemv_f32: a quantized LM head's logits);
// - quant_dequant: rows of the weight decoded into f32 (the tests' bit-exact check against the
//   CPU decoders of rust_core/src/quant) or into the storage type (the prefill route's
//   workspace, multiplied by cuBLAS; a quantized LM head a chunk of vocabulary rows at a time).
// The layouts are defined once, in rust_core/src/quant's module docs; each decoder here follows
// its format's CPU decoder expression for expression. Every product is written with __fmul_rn /
// __fsub_rn / __fdiv_rn so that NVRTC cannot contract it into an FMA: a decoded value is the
// same binary32 value the CPU computes, bit for bit.
#pragma once
#include "common.cuh"

// Threads per block of both bodies: one warp per output row in the GEMV.
#define QUANT_WARPS 8

// One quantized weight as its kernels see it: the data bytes (the whole payload for NInfer and
// GGUF formats, the packed data tensor for HF ones), the HF companions (null where absent) and
// three format parameters the launcher fills (ops/quant.rs `QuantArgs`: plane offsets, group
// sizes, companion dtypes). `n` is the rows the decoders read; rows `n .. n_all` are a dense
// tail in the storage type (`tail`, row `n` first): a fused projection whose last parts a
// quantized checkpoint keeps dense (null and n_all = n for a weight without one).
struct qweight {
    const unsigned char* data;
    const unsigned char* scale;
    const unsigned char* zero;
    const int* g_idx;
    int n;
    int k;
    long long p0;
    long long p1;
    long long p2;
    const store_t* tail;
    int n_all;
};

// Values k0 .. k0 + 7 of row `row`: decoder D's for the quantized rows, the dense tail's (exact
// in f32) for the rest. One warp owns a row, so the branch never diverges inside it.
template <class D>
__device__ __forceinline__ void quant_decode8(const qweight& w, int row, int k0, float (&v)[8]) {
    if (row < w.n) {
        D::decode8(w, row, k0, v);
        return;
    }
    const vec8 t = *reinterpret_cast<const vec8*>(w.tail + (long long)(row - w.n) * w.k + k0);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_f32(t.v[j]);
}

__device__ __forceinline__ float q_f16(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float q_bf16(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

// A 2-byte aligned little-endian half word (one load): every 16-bit field of the formats sits
// at an even offset (GGUF blocks are 34 to 210 bytes, all even, and only 2-byte aligned).
__device__ __forceinline__ unsigned short q_u16(const unsigned char* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}

// A 4-byte aligned little-endian word (one load).
__device__ __forceinline__ unsigned q_u32a(const unsigned char* p) {
    return __ldg(reinterpret_cast<const unsigned*>(p));
}

// E4M3FN word -> binary32, exact (scalars.rs e4m3_to_f32): no infinity, the two NaN words NaN.
__device__ __forceinline__ float q_e4m3(unsigned b) {
    b &= 0xffu;
    if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    // Subnormal: m * 2^-9 (exact); normal: (1 + m/8) * 2^(e-7) as its binary32 fields.
    const float mag = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
}

// E2M1 nibble -> binary32, exact (scalars.rs e2m1_to_f32).
__device__ __forceinline__ float q_e2m1(unsigned c) {
    const unsigned a = c & 7u;
    // 0, 0.5, 1, 1.5, 2, 3, 4, 6
    const float mag = a < 4 ? (float)a * 0.5f : (float)(1u << (a / 2 - 1)) * (a & 1u ? 1.5f : 1.0f);
    return (c & 8u) ? -mag : mag;
}

// Element `i` of an F32 (kind 0), F16 (1) or BF16 (2) companion tensor, exact.
__device__ __forceinline__ float q_float_at(const unsigned char* t, long long i, long long kind) {
    if (kind == 0) return __ldg(reinterpret_cast<const float*>(t) + i);
    const unsigned short h = __ldg(reinterpret_cast<const unsigned short*>(t) + i);
    return kind == 1 ? q_f16(h) : q_bf16(h);
}

// The GEMV body of decoder D (D::decode8(w, row, k0, v): values k0 .. k0 + 7 of `row`, k0 a
// multiple of 8) for up to MT rows of x (`m` of them live): warp `row` of the grid owns one
// output row; its lanes take the K range in slices of 8 values, lane l slices l, l + 32, ...,
// so a warp's loads of one step are consecutive bytes of the row. Each (row of x, output) sum is
// one f32 chain over the lane's slices in ascending order, eight fmaf each, then the warp
// reduction; `bias` (or null) is added to the sum before its one rounding to the storage type
// (add_bias_to_storage's order). F32: y is f32, each sum stored as is or, with `round`, rounded
// to the storage type and kept as f32 (the logits' `round_out`). K must be a multiple of 8 and x
// 16-byte aligned.
template <class D, int MT, bool F32>
__device__ __forceinline__ void quant_gemv_body(const store_t* __restrict__ x, const qweight& w,
                                                void* __restrict__ y, const store_t* __restrict__ bias,
                                                int m, int round) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5);
    if (row >= w.n_all) return;
    float acc[MT];
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[r] = 0.0f;
    // Unrolled so that several slices' loads are in flight per lane (the weight stream needs
    // bytes in flight; the loop carries only the sums).
#pragma unroll 4
    for (int k0 = lane * 8; k0 < w.k; k0 += 256) {
        float v[8];
        quant_decode8<D>(w, row, k0, v);
#pragma unroll
        for (int r = 0; r < MT; ++r) {
            if (r < m) {
                const vec8 xv = *reinterpret_cast<const vec8*>(x + (long long)r * w.k + k0);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[r] = fmaf(v[j], to_f32(xv.v[j]), acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MT; ++r) {
        if (r < m) {
            const float s = warp_sum(acc[r]);
            if (lane == 0) {
                const long long at = (long long)r * w.n_all + row;
                const float v = bias ? s + to_f32(bias[row]) : s;
                if constexpr (F32) {
                    reinterpret_cast<float*>(y)[at] = round ? round_st(v) : v;
                } else {
                    reinterpret_cast<store_t*>(y)[at] = from_f32(v);
                }
            }
        }
    }
}

// The dequantize body of decoder D: every slice of 8 values of rows row0 .. row0 + rows of W,
// grid-stride, into `out` from its start, in f32 (`f32_out`: the values exactly) or in the
// storage type (rounded once, to nearest even: the prefill workspace). K must be a multiple of 8.
template <class D>
__device__ __forceinline__ void quant_dequant_body(const qweight& w, void* __restrict__ out, int f32_out, int row0, int rows) {
    const long long per_row = w.k / 8;
    const long long slices = (long long)rows * per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < slices; u += stride) {
        const int r = (int)(u / per_row);
        const int k0 = (int)(u % per_row) * 8;
        float v[8];
        quant_decode8<D>(w, row0 + r, k0, v);
        const long long off = (long long)r * w.k + k0;
        if (f32_out) {
            float4* o = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + off);
            o[0] = make_float4(v[0], v[1], v[2], v[3]);
            o[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            vec8 o;
#pragma unroll
            for (int j = 0; j < 8; ++j) o.v[j] = from_f32(v[j]);
            *reinterpret_cast<vec8*>(reinterpret_cast<store_t*>(out) + off) = o;
        }
    }
}

#define QUANT_W_PARAMS                                                                              \
    const unsigned char *data, const unsigned char *scale, const unsigned char *zero,            \
        const int *g_idx, int n, int k, long long p0, long long p1, long long p2,                \
        const store_t *tail, int n_all
#define QUANT_W qweight{data, scale, zero, g_idx, n, k, p0, p1, p2, tail, n_all}

// The kernels of one format: quant_dequant_<NAME>, quant_gemv_<NAME>_m<MT> and
// quant_gemv_f32_<NAME>_m<MT> for MT = 1, 2, 4, 8, 16 (the launcher picks the smallest
// MT >= m). Parameters: x, the weight (QUANT_W_PARAMS), y, bias, m for the GEMV; x, the weight,
// y (f32), m, round for the f32 GEMV; the weight, out, f32_out, row0, rows for the dequantize
// kernel.
#define QUANT_GEMV_INSTANCE(NAME, D, MT)                                                           \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_gemv_##NAME##_m##MT(const store_t* x, QUANT_W_PARAMS, store_t* y, const store_t* bias, int m) { \
        quant_gemv_body<D, MT, false>(x, QUANT_W, y, bias, m, 0);                                  \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_gemv_f32_##NAME##_m##MT(const store_t* x, QUANT_W_PARAMS, float* y, int m, int round) { \
        quant_gemv_body<D, MT, true>(x, QUANT_W, y, nullptr, m, round);                            \
    }
#define QUANT_KERNELS(NAME, D)                                                                     \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_dequant_##NAME(QUANT_W_PARAMS, void* out, int f32_out, int row0, int rows) {         \
        quant_dequant_body<D>(QUANT_W, out, f32_out, row0, rows);                                  \
    }                                                                                              \
    QUANT_GEMV_INSTANCE(NAME, D, 1)                                                                \
    QUANT_GEMV_INSTANCE(NAME, D, 2)                                                                \
    QUANT_GEMV_INSTANCE(NAME, D, 4)                                                                \
    QUANT_GEMV_INSTANCE(NAME, D, 8)                                                                \
    QUANT_GEMV_INSTANCE(NAME, D, 16)
