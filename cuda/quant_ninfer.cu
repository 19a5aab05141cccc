// The NInfer family's quantized formats (rust_core/src/quant/{grouped,fp8_row,nvfp4}.rs define
// the layouts): decode GEMV and dequantize kernels of W8G32_F16S, Q4G64_F16S, Q5G64_F16S,
// Q6G64_F16S (`row-split-k128-v1`), FP8_E4M3FN_ROW_BF16S (`row-scale-v1`) and NVFP4
// (`blockscale-k16-m128x4-v1`). quant.cuh holds the bodies (quant_chunk.cuh NVFP4's GEMV);
// each decoder below gives values k0 .. k0 + 7 of a row (k0 a multiple of 8) exactly as the CPU
// decoder does. Q4G64_F16S is
// repacked at upload into quant.cuh's tiled layout (dec_q4_tiles, the mma.sync GEMV); it is
// this family's only tiled weight, so only the tiled GEMVs' f16-scale, no-zero-plane form is
// compiled here (Q4T_PLAIN_ONLY).
#define Q4T_PLAIN_ONLY
#include "quant_chunk.cuh"

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
// first rows of parts 1 .. 4 are p0's and p1's 32-bit halves (n where absent); each payload is
// padded to 256 bytes (NVFP4_PART_ALIGN), so part j begins at byte r0 * k / 2 + r0 * k / 16 +
// 256 * j (no plane is padded within a payload at these shapes). Its GEMV is
// the chunk GEMV (chunk_nvfp4). nvfp4_part: the part of row `row` (its payload, first row r0
// and rows).
__device__ __forceinline__ const unsigned char* nvfp4_part(const qweight& w, int row, long long& r0, long long& rows) {
    const long long starts[4] = {w.p0 & 0xffffffffll, w.p0 >> 32, w.p1 & 0xffffffffll, w.p1 >> 32};
    int j = 0;
    long long r1 = w.n;
    r0 = 0;
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
    rows = r1 - r0;
    const long long k = w.k;
    return w.data + r0 * k / 2 + r0 * k / 16 + 256 * j;
}

struct dec_nvfp4 {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        long long r0, rows;
        const unsigned char* part = nvfp4_part(w, row, r0, rows);
        const long long k = w.k;
        const long long r = row - r0;
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

// E2M1 codes as bytes 128 + 2 e2m1(c), qc_lut16's four words (a CPU test checks them against
// scalars.rs e2m1_to_f32).
#define E2M1_BIASED_WORDS 0x83828180u, 0x8c888684u, 0x7d7e7f80u, 0x74787a7cu

// NVFP4 for the chunk GEMV: chunk ch is the row's 16 code bytes 16 ch .. (values 32 ch ..
// 32 ch + 31 in order, two a byte, low nibble first: 16-byte aligned in every part), groups 2 ch
// and 2 ch + 1, whose two E4M3 scales are adjacent bytes of the swizzled plane. The chunk's sum
// is s0 * sum(2 e2m1 x) over its first 16 values plus s1 * the same over the rest; the row's
// sum is halved and divided by the part's divisor once.
struct chunk_nvfp4 {
    static constexpr bool XSUM = false;
    struct Row {
        const unsigned char* codes;
        const unsigned char* scales;
        float d;
    };
    struct Chunk {
        uint4 q;
        unsigned s;
    };
    struct Scales {
        float s0, s1;
    };
    __device__ __forceinline__ static Row row(const qweight& w, int row) {
        long long r0, rows;
        const unsigned char* part = nvfp4_part(w, row, r0, rows);
        const long long k = w.k, r = row - r0;
        const int inner = (int)(r % 128);
        Row out;
        out.codes = part + r * k / 2;
        out.scales = part + rows * k / 2 + (r / 128) * (k / 64) * 512 + (inner % 32) * 16 + (inner / 32) * 4;
        out.d = __uint_as_float(q_u32a(part + rows * k / 2 + rows * k / 16));
        return out;
    }
    __device__ __forceinline__ static Chunk load(const Row& r, int ch) {
        const unsigned char* p = r.codes + (long long)ch * 16;
        Chunk c;
        c.q = qc_ld16(p);
        c.s = q_u16(r.scales + (long long)(ch >> 1) * 512 + (ch & 1) * 2);
        return c;
    }
    __device__ __forceinline__ static void x_runs(int ch, int& x0, int& x1) {
        x0 = ch * 32;
        x1 = x0 + 16;
    }
    __device__ __forceinline__ static Scales scales(const Chunk& c, int) { return {q_e4m3(c.s), q_e4m3(c.s >> 8)}; }
    // Word t: values 8t .. 8t + 7 (nibble e: value 8t + e) as 2 e2m1.
    __device__ __forceinline__ static void decode(const Chunk& c, float (&v)[32]) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            unsigned r0, r1;
            qc_lut16(qc_word(c.q, t), E2M1_BIASED_WORDS, r0, r1);
            qc_bytes_less128(r0, v[8 * t], v[8 * t + 1], v[8 * t + 2], v[8 * t + 3]);
            qc_bytes_less128(r1, v[8 * t + 4], v[8 * t + 5], v[8 * t + 6], v[8 * t + 7]);
        }
    }
    __device__ __forceinline__ static void apply(const Scales& s, float h0, float h1, const float (&)[2], float& acc) {
        acc = fmaf(s.s0, h0, acc);
        acc = fmaf(s.s1, h1, acc);
    }
    __device__ __forceinline__ static float finish(const Row& r, float s) { return __fdiv_rn(__fmul_rn(s, 0.5f), r.d); }
};

typedef dec_grouped<8, 32> dec_w8g32;
typedef dec_grouped<5, 64> dec_q5g64;
typedef dec_grouped<6, 64> dec_q6g64;

QUANT_KERNELS(w8g32, dec_w8g32)
QUANT_TILED_KERNELS(q4_tiles, dec_q4_tiles)
QUANT_KERNELS(q5g64, dec_q5g64)
QUANT_KERNELS(q6g64, dec_q6g64)
QUANT_KERNELS(fp8_row, dec_fp8_row)
QUANT_CHUNK_KERNELS(nvfp4, dec_nvfp4)
