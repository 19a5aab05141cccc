// The NInfer family's quantized formats (rust_core/src/quant/{grouped,fp8_row,nvfp4}.rs define
// the layouts): decode GEMV and dequantize kernels of W8G32_F16S, Q4G64_F16S, Q5G64_F16S,
// Q6G64_F16S (`row-split-k128-v1`), FP8_E4M3FN_ROW_BF16S (`row-scale-v1`) and NVFP4
// (`blockscale-k16-m128x4-v1`). quant.cuh holds the bodies; each decoder below gives values
// k0 .. k0 + 7 of a row (k0 a multiple of 8) exactly as the CPU decoder does. Q4G64_F16S is
// repacked at upload into quant.cuh's tiled layout (dec_q4_tiles, the mma.sync GEMV).
#include "quant.cuh"

// Grouped signed codes of BITS bits, G values a group (8 of them always in one group: G is 32
// or 64), one binary16 scale a group. p0: the high-bit plane's byte offset, p1: the scale
// plane's (grouped.rs `Planes`).
template <int BITS, int G>
struct dec_grouped {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const long long gpr = (long long)((w.k + 127) / 128) * 128 / G;
        const long long idx = (long long)row * gpr + k0 / G;
        const int i0 = k0 % G;
        const float s = q_f16(q_u16(w.data + w.p1 + 2 * idx));
        if constexpr (BITS == 8) {
            const unsigned char* b = w.data + idx * 32 + i0;
            const uint2 q = __ldg(reinterpret_cast<const uint2*>(b));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned word = j < 4 ? q.x : q.y;
                const int c = (int)(signed char)((word >> (8 * (j % 4))) & 0xffu);
                v[j] = __fmul_rn(s, (float)c);
            }
        } else {
            // Low nibbles: 4 bytes, lane i0 + 2t in byte t's low nibble.
            const unsigned lo = q_u32a(w.data + idx * 32 + i0 / 2);
            unsigned hi = 0;
            if constexpr (BITS == 5) hi = __ldg(w.data + w.p0 + idx * 8 + i0 / 8);
            if constexpr (BITS == 6) hi = q_u16(w.data + w.p0 + idx * 16 + i0 / 4);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                unsigned u = (lo >> (4 * j)) & 15u;
                if constexpr (BITS > 4) u |= ((hi >> ((BITS - 4) * j)) & ((1u << (BITS - 4)) - 1u)) << 4;
                const int c = u >= (1u << (BITS - 1)) ? (int)u - (1 << BITS) : (int)u;
                v[j] = __fmul_rn(s, (float)c);
            }
        }
    }
};

// FP8_E4M3FN_ROW_BF16S: E4M3FN codes row-major, one bfloat16 multiplier a row at p0 (the scale
// plane's offset): w = e4m3(c) * s.
struct dec_fp8_row {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const float s = q_bf16(q_u16(w.data + w.p0 + 2 * (long long)row));
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(w.data + (long long)row * w.k + k0));
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(q_e4m3((j < 4 ? q.x : q.y) >> (8 * (j % 4))), s);
    }
};

// NVFP4: row-stacked parts (one for a single weight; a fused projection keeps each part's
// tensor divisor), each a whole payload of rows that are a multiple of 128: E2M1 codes
// row-major (lower K in the low nibble), E4M3FN scales per 16 values in 128-row x 4-group
// swizzled tiles, the binary32 divisor last: w = e2m1(c) * e4m3(s) / d_w, left to right. The
// first rows of parts 1 .. 4 are p0's and p1's 32-bit halves (n where absent); part j begins
// at byte r0 * k / 2 + r0 * k / 16 + 4 * j (no plane is padded at these shapes).
struct dec_nvfp4 {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const long long starts[4] = {w.p0 & 0xffffffffll, w.p0 >> 32, w.p1 & 0xffffffffll, w.p1 >> 32};
        int j = 0;
        long long r0 = 0, r1 = w.n;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (row >= starts[i]) {
                j = i + 1;
                r0 = starts[i];
            }
        }
#pragma unroll
        for (int i = 3; i >= 0; --i) {
            if (starts[i] > row) r1 = starts[i];
        }
        const long long k = w.k;
        const unsigned char* part = w.data + r0 * k / 2 + r0 * k / 16 + 4 * j;
        const long long rows = r1 - r0, r = row - r0;
        const int g = k0 / 16;
        const int inner = (int)(r % 128);
        const long long si = ((r / 128) * (k / 64) + g / 4) * 512 + (inner % 32) * 16 + (inner / 32) * 4 + g % 4;
        const float s = q_e4m3(__ldg(part + rows * k / 2 + si));
        const float d = __uint_as_float(q_u32a(part + rows * k / 2 + rows * k / 16));
        const unsigned c = q_u32a(part + (r * k + k0) / 2);
#pragma unroll
        for (int j8 = 0; j8 < 8; ++j8) v[j8] = __fdiv_rn(__fmul_rn(q_e2m1(c >> (4 * j8)), s), d);
    }
};

typedef dec_grouped<8, 32> dec_w8g32;
typedef dec_grouped<5, 64> dec_q5g64;
typedef dec_grouped<6, 64> dec_q6g64;

QUANT_KERNELS(w8g32, dec_w8g32)
QUANT_TILED_KERNELS(q4_tiles, dec_q4_tiles)
QUANT_KERNELS(q5g64, dec_q5g64)
QUANT_KERNELS(q6g64, dec_q6g64)
QUANT_KERNELS(fp8_row, dec_fp8_row)
QUANT_KERNELS(nvfp4, dec_nvfp4)
