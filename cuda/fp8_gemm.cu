// The kernels around cuBLASLt's FP8 tensor-core GEMMs (rust_core/src/backend/cuda/ops/
// fp8_linear.rs and fp8_block.rs). Row-scaled weights: activations quantized to E4M3FN a row at
// a time, then the GEMM's raw sums (unit scales) scaled by the row's and the weight row's
// multipliers, the bias added, in place. HF block-scaled weights: activations quantized per
// 128-value group into the scale layout cuBLASLt's block scaling reads, the weight's multipliers
// widened to that layout where the checkpoint's differ, the bias added after. Plain loads and
// integer arithmetic: they compile for every architecture, though only sm_89 and newer run the
// GEMMs between them.
#include "common.cuh"
#include "narrow_float.cuh"

// Row t of x [rows, k] (storage type, 16-byte aligned rows: k a multiple of 8) into E4M3FN
// codes [rows, k] and its multiplier scale[t] = amax / 448 (f32, 0 for a row of zeros):
// code = e4m3(x / scale), so x ~= e4m3(code) * scale. A block a row.
extern "C" __global__ void fp8_quantize_rows(const store_t* __restrict__ x, unsigned char* __restrict__ codes,
                                             float* __restrict__ scale, int rows, int k) {
    __shared__ float red[32];
    for (int t = blockIdx.x; t < rows; t += gridDim.x) {
        const vec8* xr = reinterpret_cast<const vec8*>(x + (long long)t * k);
        uint2* cr = reinterpret_cast<uint2*>(codes + (long long)t * k);
        const float amax = block_row_amax(xr, k / 8, red);
        const float s = __fdiv_rn(amax, 448.0f);
        if (threadIdx.x == 0) scale[t] = s;
        for (int c = threadIdx.x; c < k / 8; c += blockDim.x) {
            const vec8 v = xr[c];
            unsigned w[2] = {0u, 0u};
            if (s != 0.0f) {
#pragma unroll
                for (int j = 0; j < 8; ++j) w[j / 4] |= fp8_e4m3_code(__fdiv_rn(to_f32(v.v[j]), s)) << (8 * (j % 4));
            }
            cr[c] = make_uint2(w[0], w[1]);
        }
    }
}

// y [rows, n] (storage type, in place) = y * xs[t] * ws[n] (+ bias[n]), rounded once: the
// GEMM's sums of codes (held in the storage type) times the row's activation multiplier and
// the weight row's bfloat16 multiplier. n a multiple of 8 and y 16-byte aligned; bias may be
// null. Grid: x over a row's 8-value chunks, y over the rows (strided past 65535).
extern "C" __global__ void fp8_scale_rows(store_t* __restrict__ y, const float* __restrict__ xs,
                                          const unsigned short* __restrict__ ws, const store_t* __restrict__ bias,
                                          int rows, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n / 8) return;
    float wsc[8], b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        wsc[j] = __uint_as_float(((unsigned)ws[c * 8 + j]) << 16);
        b[j] = bias ? to_f32(bias[c * 8 + j]) : 0.0f;
    }
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        vec8* yr = reinterpret_cast<vec8*>(y + (long long)t * n) + c;
        const float s = xs[t];
        vec8 v = *yr;
#pragma unroll
        for (int j = 0; j < 8; ++j) v.v[j] = from_f32(__fadd_rn(__fmul_rn(__fmul_rn(to_f32(v.v[j]), s), wsc[j]), b[j]));
        *yr = v;
    }
}

// Row t < rows of x [rows, k] (storage type, k a multiple of 8, 16-byte aligned rows) into
// E4M3FN codes [rows_ld, k] and one multiplier per 128-value group g (the last group may be
// partial): scale[g * rows_ld + t] = amax / 448 (0 for a group of zeros), code =
// e4m3(x / scale), as `quant::fp8_groups::quantize_groups`. The multipliers are cuBLASLt's
// VEC128_32F tensor for B: [L, rows_ld], the rows contiguous. Rows rows .. rows_ld (padding
// to cuBLASLt's multiple of 4) get zero codes and multipliers. A block a row; 16 threads a
// group (8 values each), reduced by shuffles within the aligned half-warp.
extern "C" __global__ void fp8_quantize_groups(const store_t* __restrict__ x, unsigned char* __restrict__ codes,
                                               float* __restrict__ scale, int rows, int rows_ld, int k) {
    const int chunks = k / 8;
    const int span = (chunks + blockDim.x - 1) / blockDim.x * blockDim.x;
    for (int t = blockIdx.x; t < rows_ld; t += gridDim.x) {
        uint2* cr = reinterpret_cast<uint2*>(codes + (long long)t * k);
        for (int c0 = 0; c0 < span; c0 += blockDim.x) {
            const int c = c0 + threadIdx.x;
            const bool live = c < chunks && t < rows;
            vec8 v;
            float amax = 0.0f;
            if (live) {
                v = reinterpret_cast<const vec8*>(x + (long long)t * k)[c];
#pragma unroll
                for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(v.v[j])));
            }
            // All threads of a warp shuffle: the loop bound is uniform across the block.
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float s = __fdiv_rn(amax, 448.0f);
            if (c < chunks) {
                if ((c & 15) == 0) scale[(long long)(c >> 4) * rows_ld + t] = s;
                unsigned w[2] = {0u, 0u};
                if (live && s != 0.0f) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) w[j / 4] |= fp8_e4m3_code(__fdiv_rn(to_f32(v.v[j]), s)) << (8 * (j % 4));
                }
                cr[c] = make_uint2(w[0], w[1]);
            }
        }
    }
}

// The weight's multipliers [nb, l] (F32 when kind is 0, F16 when 1, BF16 when 2) as cuBLASLt's
// BLK128x128_32F tensor for A: f32 [nb, l4], the K blocks contiguous, l4 = l rounded up to 4,
// blocks l .. l4 zero.
extern "C" __global__ void fp8_block_scales(const void* __restrict__ src, int kind, float* __restrict__ out, int nb, int l, int l4) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)nb * l4) return;
    const int p = (int)(i / l4), b = (int)(i % l4);
    float v = 0.0f;
    if (b < l) {
        const long long j = (long long)p * l + b;
        if (kind == 0) {
            v = reinterpret_cast<const float*>(src)[j];
        } else if (kind == 1) {
            const unsigned short h = reinterpret_cast<const unsigned short*>(src)[j];
            asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
        } else {
            v = __uint_as_float(((unsigned)reinterpret_cast<const unsigned short*>(src)[j]) << 16);
        }
    }
    out[i] = v;
}

// y [rows, n] (storage type, in place) += bias[n], rounded once: the block route's bias, after
// the GEMM's scaled output. n a multiple of 8, y 16-byte aligned. Grid as fp8_scale_rows.
extern "C" __global__ void fp8_bias_rows(store_t* __restrict__ y, const store_t* __restrict__ bias, int rows, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n / 8) return;
    float b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = to_f32(bias[c * 8 + j]);
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        vec8* yr = reinterpret_cast<vec8*>(y + (long long)t * n) + c;
        vec8 v = *yr;
#pragma unroll
        for (int j = 0; j < 8; ++j) v.v[j] = from_f32(__fadd_rn(to_f32(v.v[j]), b[j]));
        *yr = v;
    }
}
