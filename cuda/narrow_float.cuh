// Encoders of the narrow float formats the low-precision GEMM routes quantize activations to
// (fp8_gemm.cu: E4M3FN; fp4_gemm.cu: E2M1 values under E4M3FN scales), each the step-for-step
// twin of its rust_core/src/quant/scalars.rs function, so that the codes equal the CPU
// encoder's bit for bit, and the row amax both routes' per-row quantizers start from. Included
// after common.cuh.
#pragma once

// The largest magnitude of the row at `xr` (`chunks` 8-value chunks), reduced over the block
// (every thread gets it); `red` a 32-float shared array, reused row after row (the previous
// row's reads finish before it is written).
__device__ __forceinline__ float block_row_amax(const vec8* xr, int chunks, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float amax = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const vec8 v = xr[c];
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(v.v[j])));
    }
    amax = warp_max(amax);
    __syncthreads();
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    return warp_max(lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f);
}

// Finite binary32 -> E4M3FN word, round to nearest even, saturating at +-448 (never a NaN
// word): `quant::scalars::f32_to_e4m3`. A NaN input saturates (fminf keeps the other operand).
__device__ __forceinline__ unsigned fp8_e4m3_code(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), 448.0f);
    unsigned bits;
    if (a < 0.015625f) {
        // Subnormal step 2^-9 (exact scaling); a code of 8 is the smallest normal word 0x08.
        bits = __float2uint_rn(a * 512.0f);
    } else {
        const int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
        // a * 2^(3-e) lies in [8, 16) exactly; a 16 carries into exponent e + 1.
        const float scaled = a * __uint_as_float((unsigned)(127 + 3 - e) << 23);
        bits = (unsigned)(e + 7) * 8u + __float2uint_rn(scaled) - 8u;
    }
    return sign | min(bits, 0x7eu);
}

// A sign-zero finite E4M3FN word's value (exact in binary32): `quant::scalars::e4m3_to_f32`.
__device__ __forceinline__ float e4m3_value(unsigned w) {
    const unsigned e = (w >> 3) & 15u, m = w & 7u;
    return e == 0 ? (float)m * 0.001953125f : __uint_as_float((e + 120u) << 23) * (float)(8u + m) * 0.125f;
}

// Finite binary32 -> E2M1 nibble, round to nearest with ties to the even word, saturating at 6:
// `quant::scalars::f32_to_e2m1` (the sign bit kept, so -0.1 gives the negative zero word).
__device__ __forceinline__ unsigned e2m1_code(float x) {
    const unsigned sign = (__float_as_uint(x) >> 28) & 8u;
    const float a = fabsf(x);
    unsigned c;
    if (a <= 0.25f) c = 0;
    else if (a < 0.75f) c = 1;
    else if (a <= 1.25f) c = 2;
    else if (a < 1.75f) c = 3;
    else if (a <= 2.5f) c = 4;
    else if (a < 3.5f) c = 5;
    else if (a <= 5.0f) c = 6;
    else c = 7;
    return sign | c;
}
