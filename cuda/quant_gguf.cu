// The GGUF block formats NInfer reads (rust_core/src/quant/gguf.rs defines them): decode GEMV
// and dequantize kernels of Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS and IQ3_S. A row is K / QK blocks of
// BB bytes, rows one after another; each decoder gives values k0 .. k0 + 7 of a row (k0 a
// multiple of 8, so inside one block and one sub-block) exactly as the CPU decoder does. Q4_K
// and IQ4_XS run the chunk GEMV of quant_chunk.cuh (chunk_q4_k, chunk_iq4_xs).
#include "quant_chunk.cuh"

// The block of row `row` holding value k0, and k0's place in it.
template <int QK, int BB>
__device__ __forceinline__ const unsigned char* gguf_block(const qweight& w, int row, int k0) {
    return w.data + (long long)row * (w.k / QK) * BB + (long long)(k0 / QK) * BB;
}

// Q8_0 (32 values, 34 bytes): d: f16, q: [i8; 32]; w = q * d.
struct dec_q8_0 {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const unsigned char* b = gguf_block<32, 34>(w, row, k0);
        const float d = q_f16(q_u16(b));
        const int e0 = k0 % 32;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn((float)(signed char)__ldg(b + 2 + e0 + j), d);
    }
};

// The 6-bit (scale, min) of sub-block j from a Q4_K / Q5_K block's 12 scale bytes.
__device__ __forceinline__ void gguf_scale_min_k4(const unsigned char* s, int j, unsigned& sc, unsigned& m) {
    if (j < 4) {
        sc = __ldg(s + j) & 63u;
        m = __ldg(s + j + 4) & 63u;
    } else {
        sc = (__ldg(s + j + 4) & 15u) | ((__ldg(s + j - 4) >> 6) << 4);
        m = (__ldg(s + j + 4) >> 4) | ((__ldg(s + j) >> 6) << 4);
    }
}

// Q4_K (144 bytes) and Q5_K (176 bytes), 256 values: d, dmin, 12 scale bytes, [Q5: qh 32],
// qs 128; w = f32(d * sc) * q - f32(dmin * m).
template <bool Q5>
struct dec_qk45 {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        constexpr int BB = Q5 ? 176 : 144;
        const unsigned char* b = gguf_block<256, BB>(w, row, k0);
        const float d = q_f16(q_u16(b));
        const float dmin = q_f16(q_u16(b + 2));
        const int e0 = k0 % 256, j = e0 / 32, i0 = e0 % 32;
        unsigned sc, m;
        gguf_scale_min_k4(b + 4, j, sc, m);
        const float d1 = __fmul_rn(d, (float)sc);
        const float m1 = __fmul_rn(dmin, (float)m);
        const unsigned char* qs = b + (Q5 ? 48 : 16) + (j / 2) * 32 + i0;
        const int shift = (j % 2) * 4;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            unsigned q = (__ldg(qs + t) >> shift) & 15u;
            if constexpr (Q5) q |= ((__ldg(b + 16 + i0 + t) >> j) & 1u) << 4;
            v[t] = __fsub_rn(__fmul_rn(d1, (float)q), m1);
        }
    }
};

// Q6_K (256 values, 210 bytes): ql 128, qh 64, scales [i8; 16], d: f16;
// w = f32(d * scale) * (code - 32).
struct dec_q6_k {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const unsigned char* b = gguf_block<256, 210>(w, row, k0);
        const float d = q_f16(q_u16(b + 208));
        const int e0 = k0 % 256;
        const float ds = __fmul_rn(d, (float)(signed char)__ldg(b + 192 + e0 / 16));
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int e = e0 + t, h = e / 128, r = e % 128;
            const unsigned low = (__ldg(b + h * 64 + r % 64) >> ((r / 64) * 4)) & 15u;
            const unsigned high = (__ldg(b + 128 + h * 32 + r % 32) >> ((r / 32) * 2)) & 3u;
            v[t] = __fmul_rn(ds, (float)((int)(low | (high << 4)) - 32));
        }
    }
};

// The IQ4_NL / IQ4_XS non-linear code table (gguf.rs KVALUES_IQ4NL).
__device__ const signed char iq4nl_kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS (256 values, 136 bytes): d, scales_h: u16, scales_l [u8; 4], qs 128; each code an
// index into the IQ4_NL table; w = f32(d * (ls - 32)) * kvalue.
struct dec_iq4_xs {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const unsigned char* b = gguf_block<256, 136>(w, row, k0);
        const float d = q_f16(q_u16(b));
        const unsigned scales_h = q_u16(b + 2);
        const int e0 = k0 % 256, j = e0 / 32, i0 = e0 % 32;
        const unsigned ls = ((__ldg(b + 4 + j / 2) >> ((j % 2) * 4)) & 15u) | (((scales_h >> (2 * j)) & 3u) << 4);
        const float dl = __fmul_rn(d, (float)((int)ls - 32));
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int i = i0 + t;
            const unsigned q = (__ldg(b + 8 + 16 * j + i % 16) >> ((i / 16) * 4)) & 15u;
            v[t] = __fmul_rn(dl, (float)iq4nl_kvalues[q]);
        }
    }
};

// The IQ3_S codebook (rust_core/src/quant/iq3s_grid.rs, entry i's four magnitudes as the bytes
// of a little-endian word; a CPU test checks this copy against that table).
__device__ const unsigned iq3s_grid[512] = {
    0x01010101, 0x01010103, 0x01010105, 0x0101010b, 0x0101010f, 0x01010301, 0x01010303, 0x01010305,
    0x01010309, 0x0101030d, 0x01010501, 0x01010503, 0x0101050b, 0x01010707, 0x01010901, 0x01010905,
    0x0101090b, 0x0101090f, 0x01010b03, 0x01010b07, 0x01010d01, 0x01010d05, 0x01010f03, 0x01010f09,
    0x01010f0f, 0x01030101, 0x01030103, 0x01030105, 0x01030109, 0x01030301, 0x01030303, 0x0103030b,
    0x01030501, 0x01030507, 0x0103050f, 0x01030703, 0x0103070b, 0x01030909, 0x01030d03, 0x01030d0b,
    0x01030f05, 0x01050101, 0x01050103, 0x0105010b, 0x0105010f, 0x01050301, 0x01050307, 0x0105030d,
    0x01050503, 0x0105050b, 0x01050701, 0x01050709, 0x01050905, 0x0105090b, 0x0105090f, 0x01050b03,
    0x01050b07, 0x01050f01, 0x01050f07, 0x01070107, 0x01070303, 0x0107030b, 0x01070501, 0x01070505,
    0x01070703, 0x01070707, 0x0107070d, 0x01070909, 0x01070b01, 0x01070b05, 0x01070d0f, 0x01070f03,
    0x01070f0b, 0x01090101, 0x01090307, 0x0109030f, 0x01090503, 0x01090509, 0x01090705, 0x01090901,
    0x01090907, 0x01090b03, 0x01090f01, 0x010b0105, 0x010b0109, 0x010b0501, 0x010b0505, 0x010b050d,
    0x010b0707, 0x010b0903, 0x010b090b, 0x010b090f, 0x010b0d0d, 0x010b0f07, 0x010d010d, 0x010d0303,
    0x010d0307, 0x010d0703, 0x010d0b05, 0x010d0f03, 0x010f0101, 0x010f0105, 0x010f0109, 0x010f0501,
    0x010f0505, 0x010f050d, 0x010f0707, 0x010f0b01, 0x010f0b09, 0x03010101, 0x03010103, 0x03010105,
    0x03010109, 0x03010301, 0x03010303, 0x03010307, 0x0301030b, 0x0301030f, 0x03010501, 0x03010505,
    0x03010703, 0x03010709, 0x0301070d, 0x03010b09, 0x03010b0d, 0x03010d03, 0x03010f05, 0x03030101,
    0x03030103, 0x03030107, 0x0303010d, 0x03030301, 0x03030309, 0x03030503, 0x03030701, 0x03030707,
    0x03030903, 0x03030b01, 0x03030b05, 0x03030f01, 0x03030f0d, 0x03050101, 0x03050305, 0x0305030b,
    0x0305030f, 0x03050501, 0x03050509, 0x03050705, 0x03050901, 0x03050907, 0x03050b0b, 0x03050d01,
    0x03050f05, 0x03070103, 0x03070109, 0x0307010f, 0x03070301, 0x03070307, 0x03070503, 0x0307050f,
    0x03070701, 0x03070709, 0x03070903, 0x03070d05, 0x03070f01, 0x03090107, 0x0309010b, 0x03090305,
    0x03090309, 0x03090703, 0x03090707, 0x03090905, 0x0309090d, 0x03090b01, 0x03090b09, 0x030b0103,
    0x030b0301, 0x030b0307, 0x030b0503, 0x030b0701, 0x030b0705, 0x030b0b03, 0x030d0501, 0x030d0509,
    0x030d050f, 0x030d0909, 0x030d090d, 0x030f0103, 0x030f0107, 0x030f0301, 0x030f0305, 0x030f0503,
    0x030f070b, 0x030f0903, 0x030f0d05, 0x030f0f01, 0x05010101, 0x05010103, 0x05010107, 0x0501010b,
    0x0501010f, 0x05010301, 0x05010305, 0x05010309, 0x0501030d, 0x05010503, 0x05010507, 0x0501050f,
    0x05010701, 0x05010705, 0x05010903, 0x05010907, 0x0501090b, 0x05010b01, 0x05010b05, 0x05010d0f,
    0x05010f01, 0x05010f07, 0x05010f0b, 0x05030101, 0x05030105, 0x05030301, 0x05030307, 0x0503030f,
    0x05030505, 0x0503050b, 0x05030703, 0x05030709, 0x05030905, 0x05030b03, 0x05050103, 0x05050109,
    0x0505010f, 0x05050503, 0x05050507, 0x05050701, 0x0505070f, 0x05050903, 0x05050b07, 0x05050b0f,
    0x05050f03, 0x05050f09, 0x05070101, 0x05070105, 0x0507010b, 0x05070303, 0x05070505, 0x05070509,
    0x05070703, 0x05070707, 0x05070905, 0x05070b01, 0x05070d0d, 0x05090103, 0x0509010f, 0x05090501,
    0x05090507, 0x05090705, 0x0509070b, 0x05090903, 0x05090f05, 0x05090f0b, 0x050b0109, 0x050b0303,
    0x050b0505, 0x050b070f, 0x050b0901, 0x050b0b07, 0x050b0f01, 0x050d0101, 0x050d0105, 0x050d010f,
    0x050d0503, 0x050d0b0b, 0x050d0d03, 0x050f010b, 0x050f0303, 0x050f050d, 0x050f0701, 0x050f0907,
    0x050f0b01, 0x07010105, 0x07010303, 0x07010307, 0x0701030b, 0x0701030f, 0x07010505, 0x07010703,
    0x07010707, 0x0701070b, 0x07010905, 0x07010909, 0x0701090f, 0x07010b03, 0x07010d07, 0x07010f03,
    0x07030103, 0x07030107, 0x0703010b, 0x07030309, 0x07030503, 0x07030507, 0x07030901, 0x07030d01,
    0x07030f05, 0x07030f0d, 0x07050101, 0x07050305, 0x07050501, 0x07050705, 0x07050709, 0x07050b01,
    0x07070103, 0x07070301, 0x07070309, 0x07070503, 0x07070507, 0x0707050f, 0x07070701, 0x07070903,
    0x07070907, 0x0707090f, 0x07070b0b, 0x07070f07, 0x07090107, 0x07090303, 0x0709030d, 0x07090505,
    0x07090703, 0x07090b05, 0x07090d01, 0x07090d09, 0x070b0103, 0x070b0301, 0x070b0305, 0x070b050b,
    0x070b0705, 0x070b0909, 0x070b0b0d, 0x070b0f07, 0x070d030d, 0x070d0903, 0x070f0103, 0x070f0107,
    0x070f0501, 0x070f0505, 0x070f070b, 0x09010101, 0x09010109, 0x09010305, 0x09010501, 0x09010509,
    0x0901050f, 0x09010705, 0x09010903, 0x09010b01, 0x09010f01, 0x09030105, 0x0903010f, 0x09030303,
    0x09030307, 0x09030505, 0x09030701, 0x0903070b, 0x09030907, 0x09030b03, 0x09030b0b, 0x09050103,
    0x09050107, 0x09050301, 0x0905030b, 0x09050503, 0x09050707, 0x09050901, 0x09050b0f, 0x09050d05,
    0x09050f01, 0x09070109, 0x09070303, 0x09070307, 0x09070501, 0x09070505, 0x09070703, 0x0907070b,
    0x09090101, 0x09090105, 0x09090509, 0x0909070f, 0x09090901, 0x09090f03, 0x090b010b, 0x090b010f,
    0x090b0503, 0x090b0d05, 0x090d0307, 0x090d0709, 0x090d0d01, 0x090f0301, 0x090f030b, 0x090f0701,
    0x090f0907, 0x090f0b03, 0x0b010105, 0x0b010301, 0x0b010309, 0x0b010505, 0x0b010901, 0x0b010909,
    0x0b01090f, 0x0b010b05, 0x0b010d0d, 0x0b010f09, 0x0b030103, 0x0b030107, 0x0b03010b, 0x0b030305,
    0x0b030503, 0x0b030705, 0x0b030f05, 0x0b050101, 0x0b050303, 0x0b050507, 0x0b050701, 0x0b05070d,
    0x0b050b07, 0x0b070105, 0x0b07010f, 0x0b070301, 0x0b07050f, 0x0b070909, 0x0b070b03, 0x0b070d0b,
    0x0b070f07, 0x0b090103, 0x0b090109, 0x0b090501, 0x0b090705, 0x0b09090d, 0x0b0b0305, 0x0b0b050d,
    0x0b0b0b03, 0x0b0b0b07, 0x0b0d0905, 0x0b0f0105, 0x0b0f0109, 0x0b0f0505, 0x0d010303, 0x0d010307,
    0x0d01030b, 0x0d010703, 0x0d010707, 0x0d010d01, 0x0d030101, 0x0d030501, 0x0d03050f, 0x0d030d09,
    0x0d050305, 0x0d050709, 0x0d050905, 0x0d050b0b, 0x0d050d05, 0x0d050f01, 0x0d070101, 0x0d070309,
    0x0d070503, 0x0d070901, 0x0d09050b, 0x0d090907, 0x0d090d05, 0x0d0b0101, 0x0d0b0107, 0x0d0b0709,
    0x0d0b0d01, 0x0d0d010b, 0x0d0d0901, 0x0d0f0303, 0x0d0f0307, 0x0f010101, 0x0f010109, 0x0f01010f,
    0x0f010501, 0x0f010505, 0x0f01070d, 0x0f010901, 0x0f010b09, 0x0f010d05, 0x0f030105, 0x0f030303,
    0x0f030509, 0x0f030907, 0x0f03090b, 0x0f050103, 0x0f050109, 0x0f050301, 0x0f05030d, 0x0f050503,
    0x0f050701, 0x0f050b03, 0x0f070105, 0x0f070705, 0x0f07070b, 0x0f070b07, 0x0f090103, 0x0f09010b,
    0x0f090307, 0x0f090501, 0x0f090b01, 0x0f0b0505, 0x0f0b0905, 0x0f0d0105, 0x0f0d0703, 0x0f0f0101,
};

// IQ3_S (256 values, 110 bytes): d, qs 64, qh 8, signs 32, scales 4; index i (four values) is
// qs[i] | bit (i % 8) of qh[i / 8] << 8; w = +-f32(d * (1 + 2 * scale nibble)) * grid byte.
struct dec_iq3_s {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const unsigned char* b = gguf_block<256, 110>(w, row, k0);
        const float d = q_f16(q_u16(b));
        const int e0 = k0 % 256, j = e0 / 32;
        const float db = __fmul_rn(d, (float)(1u + 2u * ((__ldg(b + 106 + j / 2) >> ((j % 2) * 4)) & 15u)));
        const unsigned signs = __ldg(b + 74 + e0 / 8);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = e0 / 4 + h;
            const unsigned idx = __ldg(b + 2 + i) | (((__ldg(b + 66 + i / 8) >> (i % 8)) & 1u) << 8);
            const unsigned g = __ldg(iq3s_grid + idx);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float val = __fmul_rn(db, (float)((g >> (8 * t)) & 0xffu));
                v[4 * h + t] = (signs >> (4 * h + t)) & 1u ? -val : val;
            }
        }
    }
};

typedef dec_qk45<false> dec_q4_k;
typedef dec_qk45<true> dec_q5_k;

// Q4_K for the chunk GEMV: chunk ch is the 16 qs bytes 16 (ch % 8) .. of super-block ch / 8
// (a 144-byte block: every chunk and header 16-byte aligned), byte i of it holding value
// 16 (ch % 2) + i of sub-blocks 2 jp (low nibble) and 2 jp + 1 (high), jp = ch % 8 / 2. With
// the block's 16-byte header (d, dmin, 12 scale bytes: one load the chunk's 8 lanes share),
// the chunk's sum is d1a * sum(q x) - m1a * sum(x) over sub-block 2 jp (run 0) plus the same
// over 2 jp + 1 (run 1; d1 = f32(d * sc), m1 = f32(dmin * m): the CPU decoder's factors) for
// one batch row, sum((d1 q - m1) x) for several (fold).
struct chunk_q4_k {
    static constexpr bool XSUM = true;
    struct Row {
        const unsigned char* p;
    };
    struct Chunk {
        uint4 q, h;
    };
    struct Scales {
        float da, ma, db, mb;
    };
    __device__ __forceinline__ static Row row(const qweight& w, int row) { return {w.data + (long long)row * (w.k >> 8) * 144}; }
    __device__ __forceinline__ static Chunk load(const Row& r, int ch) {
        const unsigned char* b = r.p + (long long)(ch >> 3) * 144;
        return {qc_ld16(b + 16 + (ch & 7) * 16), qc_ld16(b)};
    }
    __device__ __forceinline__ static void x_runs(int ch, int& x0, int& x1) {
        x0 = (ch >> 3) * 256 + ((ch & 7) >> 1) * 64 + (ch & 1) * 16;
        x1 = x0 + 32;
    }
    // The 6-bit (scale, min) of sub-blocks 0..3 (bytes of words y, z) or 4..7 (w's nibbles and
    // the top two bits of y's and z's bytes), one a byte: gguf_scale_min_k4 four at a time.
    __device__ __forceinline__ static Scales scales(const Chunk& c, int ch) {
        const int jp = (ch & 7) >> 1;
        const float d = q_f16((unsigned short)(c.h.x & 0xffffu)), dmin = q_f16((unsigned short)(c.h.x >> 16));
        const unsigned sc = jp < 2 ? (c.h.y & 0x3f3f3f3fu) : ((c.h.w & 0x0f0f0f0fu) | ((c.h.y >> 2) & 0x30303030u));
        const unsigned mn = jp < 2 ? (c.h.z & 0x3f3f3f3fu) : (((c.h.w >> 4) & 0x0f0f0f0fu) | ((c.h.z >> 2) & 0x30303030u));
        const int sh = (jp & 1) * 16;
        Scales s;
        s.da = __fmul_rn(d, qc_field<0xffu, 0x4b000000u>(sc >> sh));
        s.ma = __fmul_rn(dmin, qc_field<0xffu, 0x4b000000u>(mn >> sh));
        s.db = __fmul_rn(d, qc_field<0xffu, 0x4b000000u>(sc >> (sh + 8)));
        s.mb = __fmul_rn(dmin, qc_field<0xffu, 0x4b000000u>(mn >> (sh + 8)));
        return s;
    }
    // Word t: values 4t .. 4t + 3 of run 0 (the low nibbles of its bytes) and of run 1 (the
    // high ones), bytes 2 and 3's from the word's upper half (bit 23 is the exponent's).
    __device__ __forceinline__ static void decode(const Chunk& c, float (&v)[32]) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const unsigned w = qc_word(c.q, t), wh = w >> 16;
            v[4 * t] = qc_field<0x0000000fu, 0x4b000000u>(w);
            v[16 + 4 * t] = qc_field<0x000000f0u, 0x49000000u>(w);
            v[4 * t + 1] = qc_field<0x00000f00u, 0x47000000u>(w);
            v[16 + 4 * t + 1] = qc_field<0x0000f000u, 0x45000000u>(w);
            v[4 * t + 2] = qc_field<0x000f0000u, 0x43000000u>(w);
            v[16 + 4 * t + 2] = qc_field<0x000000f0u, 0x49000000u>(wh);
            v[4 * t + 3] = qc_field<0x00000f00u, 0x47000000u>(wh);
            v[16 + 4 * t + 3] = qc_field<0x0000f000u, 0x45000000u>(wh);
        }
    }
    // Several batch rows: d1 * q - m1 as one fma (one rounding where the CPU decoder rounds
    // the product and the difference).
    __device__ __forceinline__ static void fold(const Scales& s, float (&v)[32]) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            v[i] = fmaf(s.da, v[i], -s.ma);
            v[16 + i] = fmaf(s.db, v[16 + i], -s.mb);
        }
    }
    __device__ __forceinline__ static void apply(const Scales& s, float h0, float h1, const float (&xs)[2], float& acc) {
        acc = fmaf(s.da, h0, acc);
        acc = fmaf(-s.ma, xs[0], acc);
        acc = fmaf(s.db, h1, acc);
        acc = fmaf(-s.mb, xs[1], acc);
    }
    __device__ __forceinline__ static float finish(const Row&, float s) { return s; }
};

// The IQ4_NL table as bytes kvalue + 128, qc_lut16's four words (a CPU test checks them against
// gguf.rs KVALUES_IQ4NL).
#define IQ4NL_BIASED_WORDS 0x3f2d1801u, 0x766a5d4fu, 0xa6998d81u, 0xf1d9c5b5u

// IQ4_XS for the chunk GEMV: chunk ch is sub-block ch % 8 of super-block ch / 8 (136-byte
// blocks: 8-byte aligned, so two 8-byte loads of its 16 qs bytes and one of the block's
// header), byte i holding values i (low nibble, run 0) and 16 + i (high, run 1); the chunk's
// sum is f32(d * (ls - 32)) * sum(kvalue x).
struct chunk_iq4_xs {
    static constexpr bool XSUM = false;
    struct Row {
        const unsigned char* p;
    };
    struct Chunk {
        uint2 a, b, h;
    };
    struct Scales {
        float dl;
    };
    __device__ __forceinline__ static Row row(const qweight& w, int row) { return {w.data + (long long)row * (w.k >> 8) * 136}; }
    __device__ __forceinline__ static Chunk load(const Row& r, int ch) {
        const unsigned char* b = r.p + (long long)(ch >> 3) * 136;
        const unsigned char* q = b + 8 + (ch & 7) * 16;
        return {qc_ld8(q), qc_ld8(q + 8), qc_ld8(b)};
    }
    __device__ __forceinline__ static void x_runs(int ch, int& x0, int& x1) {
        x0 = ch * 32;
        x1 = x0 + 16;
    }
    // Header words: d | scales_h << 16, then scales_l (sub-block j's low scale bits: nibble j).
    __device__ __forceinline__ static Scales scales(const Chunk& c, int ch) {
        const int j = ch & 7;
        const float d = q_f16((unsigned short)(c.h.x & 0xffffu));
        const unsigned ls = ((c.h.y >> (4 * j)) & 15u) | (((c.h.x >> (16 + 2 * j)) & 3u) << 4);
        return {__fmul_rn(d, (float)((int)ls - 32))};
    }
    // Word t (bytes 4t .. 4t + 3): nibbles 2e and 2e + 1 are values 4t + e of run 0 and run 1.
    __device__ __forceinline__ static void decode(const Chunk& c, float (&v)[32]) {
        const unsigned words[4] = {c.a.x, c.a.y, c.b.x, c.b.y};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            unsigned r0, r1;
            qc_lut16(words[t], IQ4NL_BIASED_WORDS, r0, r1);
            qc_bytes_less128(r0, v[4 * t], v[16 + 4 * t], v[4 * t + 1], v[16 + 4 * t + 1]);
            qc_bytes_less128(r1, v[4 * t + 2], v[16 + 4 * t + 2], v[4 * t + 3], v[16 + 4 * t + 3]);
        }
    }
    __device__ __forceinline__ static void apply(const Scales& s, float h0, float h1, const float (&)[2], float& acc) {
        acc = fmaf(s.dl, h0, acc);
        acc = fmaf(s.dl, h1, acc);
    }
    __device__ __forceinline__ static float finish(const Row&, float s) { return s; }
};

QUANT_KERNELS(q8_0, dec_q8_0)
QUANT_CHUNK_KERNELS(q4_k, dec_q4_k)
QUANT_KERNELS(q5_k, dec_q5_k)
QUANT_KERNELS(q6_k, dec_q6_k)
QUANT_CHUNK_KERNELS(iq4_xs, dec_iq4_xs)
QUANT_KERNELS(iq3_s, dec_iq3_s)
