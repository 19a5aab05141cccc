// The kernels around cuBLASLt's block-scaled FP4 GEMM (rust_core/src/backend/cuda/ops/
// fp4_linear.rs), NVFP4 weights' prefill route on FP4 tensor cores (sm_100 and newer):
// activations quantized to NVFP4 a row at a time (the row its own matrix: divisor 2688 / amax,
// an E4M3FN scale per 16 values in the swizzled 128-row x 4-group tiles cuBLASLt's VEC16_UE4M3
// mode reads, E2M1 codes), then the GEMM's output divided by each row's divisor, the bias
// added, in place. Plain loads and integer arithmetic: they compile for every architecture,
// though only sm_100 and newer run the GEMM between them.
#include "common.cuh"
#include "narrow_float.cuh"

// The scale word of row t, 16-value group g of a K-wide plane (rust_core/src/quant/nvfp4.rs
// `scale_index`).
__device__ __forceinline__ long long nvfp4_scale_at(long long t, int g, int k) {
    const int inner = (int)(t % 128);
    return ((t / 128) * (k / 64) + g / 4) * 512 + (inner % 32) * 16 + (inner / 32) * 4 + g % 4;
}

// Row t < rows of x [rows, k] (storage type, k a multiple of 64, 16-byte aligned rows) into
// E2M1 codes [rows_ld, k / 2] (lower K in the low nibble), E4M3FN scale words in the swizzled
// plane of rows_ld rows, and its divisor d[t]: `quant::nvfp4::quantize_rows`, bit for bit.
// Rows rows .. rows_ld (padding to the plane's 128-row tiles) get zero codes and scales and
// divisor 1. A block a row; a thread a 16-value group at a time.
extern "C" __global__ void nvfp4_quantize_rows(const store_t* __restrict__ x, unsigned char* __restrict__ codes,
                                               unsigned char* __restrict__ scales, float* __restrict__ divisors,
                                               int rows, int rows_ld, int k) {
    __shared__ float red[32];
    const int groups = k / 16;
    for (int t = blockIdx.x; t < rows_ld; t += gridDim.x) {
        uint2* cr = reinterpret_cast<uint2*>(codes + (long long)t * (k / 2));
        if (t >= rows) {
            for (int g = threadIdx.x; g < groups; g += blockDim.x) {
                cr[g] = make_uint2(0u, 0u);
                scales[nvfp4_scale_at(t, g, k)] = 0;
            }
            if (threadIdx.x == 0) divisors[t] = 1.0f;
            continue;
        }
        const vec8* xr = reinterpret_cast<const vec8*>(x + (long long)t * k);
        const float amax = block_row_amax(xr, k / 8, red);
        float d = amax == 0.0f ? 1.0f : __fdiv_rn(2688.0f, amax);
        if (d > 3.40282347e38f) d = 3.40282347e38f;  // the quotient overflowed: the largest finite value
        if (threadIdx.x == 0) divisors[t] = d;
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            float v[16];
            float amax_g = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const vec8 w = xr[2 * g + h];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    v[8 * h + j] = to_f32(w.v[j]);
                    amax_g = fmaxf(amax_g, fabsf(v[8 * h + j]));
                }
            }
            unsigned s = fp8_e4m3_code(__fmul_rn(__fdiv_rn(amax_g, 6.0f), d));
            if (s == 0 && amax_g != 0.0f) s = 1;
            unsigned q[2] = {0u, 0u};
            if (s != 0) {
                const float inv = __fdiv_rn(d, e4m3_value(s));
#pragma unroll
                for (int j = 0; j < 16; ++j) q[j / 8] |= e2m1_code(__fmul_rn(v[j], inv)) << (4 * (j % 8));
            }
            cr[g] = make_uint2(q[0], q[1]);
            scales[nvfp4_scale_at(t, g, k)] = (unsigned char)s;
        }
    }
}

// y [rows, n] (storage type, in place) = y / d[t] (+ bias[n]), each step rounded once in f32
// and the result once to the storage type: the GEMM's output (its alpha the weight's 1 / d_w)
// divided by the row's activation divisor. n a multiple of 8 and y 16-byte aligned; bias may be
// null. Grid: x over a row's 8-value chunks, y over the rows (strided past 65535).
extern "C" __global__ void nvfp4_scale_rows(store_t* __restrict__ y, const float* __restrict__ divisors,
                                            const store_t* __restrict__ bias, int rows, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n / 8) return;
    float b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = bias ? to_f32(bias[c * 8 + j]) : 0.0f;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        vec8* yr = reinterpret_cast<vec8*>(y + (long long)t * n) + c;
        const float d = divisors[t];
        vec8 v = *yr;
#pragma unroll
        for (int j = 0; j < 8; ++j) v.v[j] = from_f32(__fadd_rn(__fdiv_rn(to_f32(v.v[j]), d), b[j]));
        *yr = v;
    }
}
