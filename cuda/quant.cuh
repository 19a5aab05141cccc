// Quantized weights on the GPU: the operands every format's kernels take, exact decoders of the
// small float words the formats store, and the two kernel bodies each format instantiates with
// its own decoder (quant_ninfer.cu, quant_gguf.cu, quant_hf.cu):
// - quant_gemv: decode GEMV y[m, N] = x[m, K] W[N, K]^T for m <= 16 rows with the weight
//   decoded in registers as it streams (each weight byte read once, every row of x reusing it),
//   into the storage type (projections) or f32 (quant_gemv_f32: a quantized LM head's logits);
// - quant_dequant: rows of the weight decoded into f32 (the tests' bit-exact check against the
//   CPU decoders of rust_core/src/quant) or into the storage type (the prefill route's
//   workspace, multiplied by cuBLAS; a quantized LM head a chunk of vocabulary rows at a time).
// 4-bit weights whose groups are runs of 64 (Q4G64_F16S; HF AWQ / GPTQ / pack-quantized
// without act-order) are repacked at upload into the tiled layout below, whose GEMV on sm_80+
// feeds the weight stream to mma.sync (q4t_gemv_tile, or q4t_ring_tile for long K) instead.
// The layouts are defined once, in rust_core/src/quant's module docs; each decoder here follows
// its format's CPU decoder expression for expression. Every product is written with __fmul_rn /
// __fsub_rn / __fdiv_rn so that NVRTC cannot contract it into an FMA: a decoded value is the
// same binary32 value the CPU computes, bit for bit.
#pragma once
#include "common.cuh"

// Threads per block of both bodies: one warp per output row in the GEMV.
#define QUANT_WARPS 8
// The output row of this warp in the row-per-warp GEMV launches.
#define QUANT_ROW (int)(blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5))

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
// One GEMV output: the f32 sum `s` of output row `row` plus its bias, stored at `at` once
// rounded to the storage type, or (F32) as f32: as is, or rounded to the storage type and kept
// as f32 under `round` (the logits' rounding).
template <bool F32>
__device__ __forceinline__ void quant_store(void* __restrict__ y, const store_t* __restrict__ bias, long long at, int row, float s, int round) {
    const float v = bias ? s + to_f32(bias[row]) : s;
    if constexpr (F32) {
        reinterpret_cast<float*>(y)[at] = round ? round_st(v) : v;
    } else {
        reinterpret_cast<store_t*>(y)[at] = from_f32(v);
    }
}

// `row` is the warp's output row (the grid's warp index for the row-per-warp launches). Begins
// with pdl_enter (the launcher queues it with launch_pdl).
template <class D, int MT, bool F32>
__device__ __forceinline__ void quant_gemv_body(const store_t* __restrict__ x, const qweight& w,
                                                void* __restrict__ y, const store_t* __restrict__ bias,
                                                int m, int round, int row) {
    const int lane = threadIdx.x & 31;
    pdl_enter();
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
            if (lane == 0) quant_store<F32>(y, bias, (long long)r * w.n_all + row, row, s, round);
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

// ---------------------------------------------------------------------------------------------
// The 4-bit tiled device layout (ops/quant_tiles.rs builds it at upload and documents it): a
// 4-bit weight (Q4G64_F16S; HF AWQ / GPTQ / pack-quantized whose groups are whole runs of 64)
// repacked so that the decode GEMV streams it in 16-byte loads straight into mma.sync A
// fragments. Rows come in tiles of 16, K in blocks of 128 values (two groups of 64); the codes
// of (tile t, block b) are 1024 bytes at (t * KB + b) * 1024 (KB = ceil(K / 128)): half h (rows
// 8h .. 8h + 7 of the tile) 512 bytes, then lane L = 4 * gid + t4 16 bytes (row 8h + gid), then
// word i (mma steps 2i, 2i + 1). Step j (0..7) covers group j / 4 of the block, values
// (j % 4) * 16 + 4 * t4 + e (e = 0..3) of it: nibbles 0, 4, 1, 5 of its word (j even) or 2, 6,
// 3, 7 (j odd), each a 4-bit q. Scales at p0, 16-bit words (p2: 1 binary16, 2 bfloat16), 64
// bytes a (tile, block), (row gid of half h, group g) at gid * 8 + h * 4 + g * 2; zeros at p1
// (0: none, every z is 8), bytes, 32 a (tile, block), at gid * 4 + h * 2 + g. Values are
// f32(s) * (q - z), the format's exactly.
__device__ __forceinline__ float q4t_scale(unsigned short word, long long kind) { return kind == 2 ? q_bf16(word) : q_f16(word); }

struct dec_q4_tiles {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const long long blk = (long long)(row >> 4) * ((w.k + 127) >> 7) + (k0 >> 7);
        const int h = (row >> 3) & 1, gid = row & 7;
        const int p = k0 & 127, gi = p >> 6, j = gi * 4 + ((p >> 4) & 3), t4 = (p & 15) >> 2;
        // Values k0 .. k0 + 3 are lane t4's, k0 + 4 .. k0 + 7 lane t4 + 1's (the next 16 bytes).
        const unsigned char* c = w.data + blk * 1024 + h * 512 + (gid * 4 + t4) * 16 + (j >> 1) * 4;
        const unsigned lo = q_u32a(c), hi = q_u32a(c + 16);
        const float s = q4t_scale(q_u16(w.data + w.p0 + blk * 64 + gid * 8 + h * 4 + gi * 2), w.p2);
        const int z = w.p1 ? (int)__ldg(w.data + w.p1 + blk * 32 + gid * 4 + h * 2 + gi) : 8;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int b = (e & 1) * 16 + (e >> 1) * 4 + (j & 1) * 8;
            v[e] = __fmul_rn(s, (float)((int)((lo >> b) & 15u) - z));
            v[4 + e] = __fmul_rn(s, (float)((int)((hi >> b) & 15u) - z));
        }
    }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// A nibble pair (n, n + 16 bits) becomes two storage-type halves exactly: OR-ed into the low
// mantissa bits of MAGIC (128 in bf16, 1024 in f16, whose ulp is 1), then one fma:
// v * 1 - (MAGIC + z). The high nibbles of a byte are shifted down first: bf16's 7-bit mantissa
// cannot hold a nibble at bit 4 (its top bit would land in the exponent). Every step is exact
// (small integers), so the A operand holds q - z itself. The bias for z = 8 (no zero plane):
// -(MAGIC + 8).
#if defined(NINFER_STORAGE_F16)
#define Q4T_MAGIC 0x64006400u
#define Q4T_MAGIC_F 1024.0f
#define Q4T_ONE 0x3c003c00u
#define Q4T_BIAS8 0xe408e408u
#else
#define Q4T_MAGIC 0x43004300u
#define Q4T_MAGIC_F 128.0f
#define Q4T_ONE 0x3f803f80u
#define Q4T_BIAS8 0xc308c308u
#endif

// x (a small integer, exact in the storage type) in both halves of a word.
__device__ __forceinline__ unsigned q4t_pair(float x) {
    const unsigned h = from_f32(x);
    return h | (h << 16);
}

__device__ __forceinline__ unsigned q4t_fma2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
#if defined(NINFER_STORAGE_F16)
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
}

// (w & 0x000f000f) | MAGIC: one LOP3 (written as C, the mask and the OR compile to two, and
// these are most of the GEMVs' integer-pipe work).
__device__ __forceinline__ unsigned q4t_nibbles(unsigned w) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(w), "n"(0x000f000fu), "n"(Q4T_MAGIC));
    return d;
}

// c += a * b, mma.sync m16n8k16 with storage-type operands and f32 accumulators.
__device__ __forceinline__ void q4t_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(NINFER_STORAGE_F16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 weight bytes read once: not kept in L1 (x is, for the whole block).
__device__ __forceinline__ uint4 q4t_ld_stream(const unsigned char* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned q4t_word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Where lane `lane`'s bytes of tile `tile` start (kbn K blocks a tile): its codes, its scales
// word and its zeros word (nullptr without a zero plane) of the tile's first K block.
__device__ __forceinline__ void q4t_lane_bytes(const qweight& w, int tile, int kbn, int lane, const unsigned char*& codes,
                                               const unsigned char*& scales, const unsigned char*& zeros) {
    const int gid = lane >> 2;
    codes = w.data + (long long)tile * kbn * 1024 + lane * 16;
    scales = w.data + w.p0 + (long long)tile * kbn * 64 + gid * 8;
    zeros = w.p1 ? w.data + w.p1 + (long long)tile * kbn * 32 + gid * 4 : nullptr;
}

// A lane's four scales of one K block from its 8-byte scales word: s[2h + g] of (row gid + 8h,
// group g of the block); BS: bf16 scales (p2 == 2), else f16.
template <bool BS>
__device__ __forceinline__ void q4t_scales(uint2 sc, float (&s)[4]) {
    const unsigned short h[4] = {(unsigned short)(sc.x & 0xffffu), (unsigned short)(sc.x >> 16),
                                 (unsigned short)(sc.y & 0xffffu), (unsigned short)(sc.y >> 16)};
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = BS ? q_bf16(h[i]) : q_f16(h[i]);
}

// The bias pair -(MAGIC + z) of group g for rows gid (h = 0) and gid + 8 (h = 1): z the byte
// 2h + g of the zeros word when the weight has a zero plane (Z), else 8.
template <bool Z>
__device__ __forceinline__ void q4t_bias(unsigned zq, int g, unsigned (&bias2)[2]) {
    bias2[0] = Q4T_BIAS8;
    bias2[1] = Q4T_BIAS8;
    if constexpr (Z) {
#pragma unroll
        for (int h = 0; h < 2; ++h) bias2[h] = q4t_pair(-(Q4T_MAGIC_F + (float)((zq >> (8 * (2 * h + g))) & 0xffu)));
    }
}

// The A fragment of mma step j of a K block: q - z of rows gid / gid + 8 (codes q0 / q1).
__device__ __forceinline__ void q4t_afrag(const uint4& q0, const uint4& q1, int j, const unsigned (&bias2)[2], unsigned (&af)[4]) {
    const int sh = (j & 1) * 8;
    const unsigned w0 = q4t_word(q0, j >> 1) >> sh;
    const unsigned w1 = q4t_word(q1, j >> 1) >> sh;
    af[0] = q4t_fma2(q4t_nibbles(w0), Q4T_ONE, bias2[0]);
    af[1] = q4t_fma2(q4t_nibbles(w1), Q4T_ONE, bias2[1]);
    af[2] = q4t_fma2(q4t_nibbles(w0 >> 4), Q4T_ONE, bias2[0]);
    af[3] = q4t_fma2(q4t_nibbles(w1 >> 4), Q4T_ONE, bias2[1]);
}

// Runs RUN<MT, F32, Z, BS>(...) for the weight's zero plane (Z: p1 != 0) and scale type (BS:
// bf16 scales, p2 == 2), in a function whose MT, F32 and `w` are in scope. A family whose only
// tiled weight is Q4G64_F16S (f16 scales, no zero plane) defines Q4T_PLAIN_ONLY and compiles
// that form alone.
#if defined(Q4T_PLAIN_ONLY)
#define Q4T_DISPATCH(RUN, ...) RUN<MT, F32, false, false>(__VA_ARGS__)
#else
#define Q4T_DISPATCH(RUN, ...)                                                                     \
    do {                                                                                           \
        if (w.p1) {                                                                                \
            if (w.p2 == 2) RUN<MT, F32, true, true>(__VA_ARGS__);                                  \
            else RUN<MT, F32, true, false>(__VA_ARGS__);                                           \
        } else {                                                                                   \
            if (w.p2 == 2) RUN<MT, F32, false, true>(__VA_ARGS__);                                 \
            else RUN<MT, F32, false, false>(__VA_ARGS__);                                          \
        }                                                                                          \
    } while (0)
#endif

// One K block of a lane: the 8 mma steps over its codes q0 / q1 (rows gid and gid + 8), each
// group's 4 steps summed in a fresh accumulator (the two groups as two independent mma chains)
// and added to the lane's sums times the group's scales. xb(j, nt) gives the B fragment of step
// j for batch rows nt. Z / BS are the weight's zero plane and scale type, fixed per launch and
// hoisted out of the K loop: per-block selects of them were a fifth of the loop's instructions,
// and the loop is bound by instruction issue.
template <int NT, bool Z, bool BS, class XB>
__device__ __forceinline__ void q4t_block(const uint4& q0, const uint4& q1, uint2 sc, unsigned zq, XB xb, float (&acc)[NT][4]) {
    float s[4];
    q4t_scales<BS>(sc, s);
    unsigned bias2[2][2];
#pragma unroll
    for (int g = 0; g < 2; ++g) q4t_bias<Z>(zq, g, bias2[g]);
    float d[2][NT][4];
#pragma unroll
    for (int g = 0; g < 2; ++g)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) d[g][nt][c] = 0.0f;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int j = g * 4 + a;
            unsigned af[4];
            q4t_afrag(q0, q1, j, bias2[g], af);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint2 b = xb(j, nt);
                q4t_mma(d[g][nt], af, b.x, b.y);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < 2; ++g)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            acc[nt][0] = fmaf(s[g], d[g][nt][0], acc[nt][0]);
            acc[nt][1] = fmaf(s[g], d[g][nt][1], acc[nt][1]);
            acc[nt][2] = fmaf(s[2 + g], d[g][nt][2], acc[nt][2]);
            acc[nt][3] = fmaf(s[2 + g], d[g][nt][3], acc[nt][3]);
        }
}

// The block's warps' sums of a tile through `red` (shared, [QUANT_WARPS][NT * 4][32]) in warp
// order, each stored by one thread (+ bias, rounded once, as quant_gemv_body does); rows past
// w.n (tile padding) and columns past m are not stored.
template <int NT, bool F32>
__device__ __forceinline__ void q4t_reduce_store(float (*red)[NT * 4][32], const float (&acc)[NT][4], const qweight& w, void* __restrict__ y,
                                                 const store_t* __restrict__ bias, int m, int round, int tile) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[warp][nt * 4 + c][lane] = acc[nt][c];
    __syncthreads();
    if (threadIdx.x < NT * 4 * 32) {
        const int c = threadIdx.x >> 5, ln = threadIdx.x & 31;
        float v = 0.0f;
#pragma unroll
        for (int wp = 0; wp < QUANT_WARPS; ++wp) v += red[wp][c][ln];
        // Accumulator c % 4 of lane ln: row (ln / 4) + 8 (c % 4 / 2), column 2 (ln % 4) + c % 2.
        const int row = tile * 16 + (ln >> 2) + ((c & 3) >> 1) * 8;
        const int col = (c >> 2) * 8 + (ln & 3) * 2 + (c & 1);
        if (col < m && row < w.n) quant_store<F32>(y, bias, (long long)col * w.n_all + row, row, v, round);
    }
}

// Blocks of 128 values a warp has in flight (U blocks: 2U 16-byte loads a lane).
#define Q4T_UNROLL 4
// K blocks one pass of a block's warps covers (warp w takes base + w + 8u), and its x values.
#define Q4T_PASS_BLOCKS (QUANT_WARPS * Q4T_UNROLL)
#define Q4T_PASS (Q4T_PASS_BLOCKS * 128)
// Padding of a staged x row, in values: rows 8 banks apart, so the B-fragment loads of lanes
// with different gid (different rows) never share a bank.
#define Q4T_XPAD 16

// The weight loads of one pass for one lane: codes of rows gid and gid + 8 (two 16-byte
// streaming loads a block), the four scales (one 8-byte load) and, with a zero plane (Z), the
// zeros (one 4-byte load).
template <bool Z>
struct q4t_pass {
    uint4 q[Q4T_UNROLL][2];
    uint2 sc[Q4T_UNROLL];
    unsigned zq[Q4T_UNROLL];

    // Slot u's loads of K block kb (none past kbn).
    __device__ __forceinline__ void load_one(int u, const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros, int kb, int kbn) {
        zq[u] = 0u;
        if (kb < kbn) {
            q[u][0] = q4t_ld_stream(codes + (long long)kb * 1024);
            q[u][1] = q4t_ld_stream(codes + (long long)kb * 1024 + 512);
            sc[u] = __ldg(reinterpret_cast<const uint2*>(scales + (long long)kb * 64));
            if constexpr (Z) zq[u] = __ldg(reinterpret_cast<const unsigned*>(zeros + (long long)kb * 32));
        }
    }

    __device__ __forceinline__ void load(const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros, int kb0, int kbn) {
#pragma unroll
        for (int u = 0; u < Q4T_UNROLL; ++u) load_one(u, codes, scales, zeros, kb0 + u * QUANT_WARPS, kbn);
    }
};

// mma column tiles of 8 batch rows a tile GEMV of up to MT rows of x runs (both forms).
template <int MT>
constexpr int q4t_nt = MT > 8 ? 2 : 1;

// The pass form's shared memory: the warps' partial sums and, for MT <= 4, the pass's x rows.
template <int MT>
struct q4t_pass_smem {
    static constexpr int NT = q4t_nt<MT>;
    static constexpr bool XS = MT <= 4;
    float red[QUANT_WARPS][NT * 4][32];
    __align__(16) store_t xs[XS ? MT : 1][XS ? Q4T_PASS + Q4T_XPAD : 8];
};

// One tile of 16 output rows for up to MT rows of x. The block's warps go through K in passes
// of Q4T_PASS_BLOCKS blocks of 128 values, warp w taking blocks base + w + 8u; each block's
// codes are two 16-byte loads a lane (rows gid and gid + 8 of the tile: the A fragments of 8
// mma steps, whose K order the layout chose; q - z formed in the storage type, exactly), x the
// B fragments (4 consecutive values of batch row gid [+ 8] a step), summed by q4t_block; the
// warps' sums meet in shared memory and one thread a (row, column) stores it (+ bias, rounded
// once, as quant_gemv_body does). Rows past w.n (tile padding) are not stored.
// Latency: the first pass's weight loads are issued before pdl_wait (weights are written by no
// kernel, so they may stream while the previous kernel finishes). For MT <= 4 each slot's block
// of the next pass is requested as soon as the slot is summed, and the pass's x
// is staged in shared memory by the whole block while those loads are in flight, so that the
// mma steps wait on shared-memory reads instead of one L2 round trip per step (MT 8 and 16 read
// x from global: a pass of 8 or 16 rows would not fit the static shared memory).
template <int MT, bool F32, bool Z, bool BS>
__device__ __forceinline__ void q4t_gemv_run(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                             const store_t* __restrict__ bias, int m, int round, int tile, q4t_pass_smem<MT>& sm) {
    constexpr int NT = q4t_pass_smem<MT>::NT;
    constexpr bool XS = q4t_pass_smem<MT>::XS;
    // Up to 4 rows of x, each slot requests its next-pass block early; 8 and 16 rows load a pass
    // at its start (the early requests' registers would spill there).
    constexpr bool REFILL = MT <= 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t4 = lane & 3;
    const int kbn = (w.k + 127) >> 7;
    const unsigned char *codes, *scales, *zeros;
    q4t_lane_bytes(w, tile, kbn, lane, codes, scales, zeros);
    q4t_pass<Z> ld;
    ld.load(codes, scales, zeros, warp, kbn);
    pdl_enter();
    // B fragments of batch rows past m (columns of the mma that are never stored) repeat a row
    // of x that exists, so that no load needs a predicate.
    const store_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xr[nt] = x + (long long)min(gid + 8 * nt, m - 1) * w.k + 4 * t4;
    const int xrow = gid < MT ? gid : 0;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    for (int base = 0; base < kbn; base += Q4T_PASS_BLOCKS) {
        if (!REFILL && base > 0) ld.load(codes, scales, zeros, base + warp, kbn);
        if constexpr (XS) {
            // The pass's x rows (zeros past m and past K), 16 bytes a thread at a time.
            if (base > 0) __syncthreads();  // every warp is done with the last pass's x
            for (int i = threadIdx.x; i < MT * (Q4T_PASS / 8); i += QUANT_WARPS * 32) {
                const int r = i / (Q4T_PASS / 8), c = (i % (Q4T_PASS / 8)) * 8;
                const int kk = base * 128 + c;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (r < m && kk < w.k) v = __ldg(reinterpret_cast<const uint4*>(x + (long long)r * w.k + kk));
                *reinterpret_cast<uint4*>(&sm.xs[r][c]) = v;
            }
            __syncthreads();
        }
#pragma unroll
        for (int u = 0; u < Q4T_UNROLL; ++u) {
            const int kb = base + warp + u * QUANT_WARPS;
            if (kb >= kbn) break;
            q4t_block<NT, Z, BS>(ld.q[u][0], ld.q[u][1], ld.sc[u], ld.zq[u], [&](int j, int nt) {
                uint2 b = make_uint2(0u, 0u);
                if constexpr (XS) {
                    b = *reinterpret_cast<const uint2*>(&sm.xs[xrow][(kb - base) * 128 + j * 16 + 4 * t4]);
                } else {
                    if (j * 16 < w.k - kb * 128 - 4 * t4) b = __ldg(reinterpret_cast<const uint2*>(xr[nt] + kb * 128 + j * 16));
                }
                return b;
            }, acc);
            // The slot's block of the next pass, in flight while this pass's other blocks are
            // summed (a K longer than one pass never waits with no loads in flight).
            if constexpr (REFILL) ld.load_one(u, codes, scales, zeros, kb + Q4T_PASS_BLOCKS, kbn);
        }
    }
    q4t_reduce_store<NT, F32>(sm.red, acc, w, y, bias, m, round, tile);
}

template <int MT, bool F32>
__device__ __forceinline__ void q4t_gemv_tile(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                              const store_t* __restrict__ bias, int m, int round, int tile) {
    __shared__ q4t_pass_smem<MT> sm;
    Q4T_DISPATCH(q4t_gemv_run, x, w, y, bias, m, round, tile, sm);
}

// K blocks of 128 values a warp has in flight: the stages of its cp.async ring.
#define Q4T_STAGES 4
// One stage holds lane L's bytes of one K block: its codes (rows gid and gid + 8 of the tile,
// 16 bytes each, half h at h * 512 + 16 L), its scales word (8 bytes at 1024 + 8 L) and its
// zeros word (4 bytes at 1280 + 4 L). Every lane copies and reads back only its own bytes, so
// a stage needs no barrier between lanes; 16-byte rows of 8 lanes never share a bank.
#define Q4T_STAGE_BYTES 1408

// `bytes` (16, 8 or 4) global bytes into shared memory by cp.async: the codes bypass L1 (read
// once), the small scale and zero words go through it (4 lanes share each).
__device__ __forceinline__ void q4t_cp_async(unsigned dst, const void* src, int bytes) {
    if (bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    } else if (bytes == 8) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
    }
}

// One tile of 16 output rows for up to MT rows of x. The block's warps split K: warp w takes
// the tile's K blocks w, w + 8, ..., streamed through a Q4T_STAGES-deep cp.async ring in shared
// memory, refilled as each stage is used, so loads in flight hold no registers (four blocks fit
// an H100 multiprocessor where register-held loads fitted two) and each warp's stream never
// waits for the others. Each block's codes are the A fragments of 8 mma steps (K order as the
// layout chose; q - z formed in the storage type, exactly), x the B fragments (4 consecutive
// values of batch row gid [+ 8] a step, read through L1: every block of a multiprocessor reads
// the same x), summed by q4t_block; the warps' sums meet in shared memory (the ring's bytes,
// once every warp is done) and one thread a (row, column) stores it (+ bias, rounded once, as
// quant_gemv_body does). Rows past w.n (tile padding) are not stored. The ring's first stages
// are requested before pdl_wait (weights are written by no kernel, so they stream while the
// previous kernel finishes). The loop is bound by instruction issue, so a request advances
// pointers instead of recomputing addresses, and only a block that ends past K (its warp's
// last, when K is not a multiple of 128) loads x under predicates.
// The sums are q4t_gemv_tile's, in the same order: the two forms give the same bits.
template <int MT, bool F32, bool Z, bool BS>
__device__ __forceinline__ void q4t_ring_run(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                             const store_t* __restrict__ bias, int m, int round, int tile,
                                             unsigned char (*rings)[Q4T_STAGES][Q4T_STAGE_BYTES]) {
    constexpr int NT = q4t_nt<MT>;
    constexpr int S = Q4T_STAGES;
    static_assert((S & (S - 1)) == 0, "a block's stage is i & (S - 1)");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t4 = lane & 3;
    const int kbn = (w.k + 127) >> 7;
    const unsigned char *codes, *scales, *zeros;
    q4t_lane_bytes(w, tile, kbn, lane, codes, scales, zeros);
    const int mine = warp < kbn ? (kbn - warp + QUANT_WARPS - 1) / QUANT_WARPS : 0;
    unsigned char(*ring)[Q4T_STAGE_BYTES] = rings[warp];
    // The bytes of the warp's next K block to request, QUANT_WARPS blocks further each request.
    codes += (long long)warp * 1024;
    scales += (long long)warp * 64;
    if constexpr (Z) zeros += (long long)warp * 32;
    const unsigned ring0 = smem_u32(&ring[0][0]);
    int asked = 0;
    // The warp's next block into `stage`; one commit group a call, empty past the warp's
    // blocks, so that the wait below always counts S groups.
    auto request = [&](int stage) {
        if (asked < mine) {
            const unsigned st = ring0 + stage * Q4T_STAGE_BYTES;
            q4t_cp_async(st + lane * 16, codes, 16);
            q4t_cp_async(st + 512 + lane * 16, codes + 512, 16);
            q4t_cp_async(st + 1024 + lane * 8, scales, 8);
            if constexpr (Z) q4t_cp_async(st + 1280 + lane * 4, zeros, 4);
        }
        cp_async_commit();
        ++asked;
        codes += QUANT_WARPS * 1024;
        scales += QUANT_WARPS * 64;
        if constexpr (Z) zeros += QUANT_WARPS * 32;
    };
#pragma unroll
    for (int i = 0; i < S; ++i) request(i);
    pdl_enter();
    // Rows past m repeat a row of x that exists (as in q4t_gemv_run). The lane's x pointers follow
    // the warp's K block, so that a step's load is one instruction at a constant offset.
    const store_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xr[nt] = x + (long long)min(gid + 8 * nt, m - 1) * w.k + warp * 128 + 4 * t4;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    // Block i of the warp from stage i & (S - 1), x under predicates (lim: the lane's values
    // left in its row) or not; then the stage refilled with the block S ahead.
    auto consume = [&](int i, bool whole, int lim) {
        cp_async_wait_group<S - 1>();  // S + i groups requested: the first i + 1 have landed
        const int stage = i & (S - 1);
        const unsigned char* st = &ring[stage][0];
        const uint4 q0 = *reinterpret_cast<const uint4*>(st + lane * 16);
        const uint4 q1 = *reinterpret_cast<const uint4*>(st + 512 + lane * 16);
        const uint2 sc = *reinterpret_cast<const uint2*>(st + 1024 + lane * 8);
        const unsigned zq = Z ? *reinterpret_cast<const unsigned*>(st + 1280 + lane * 4) : 0u;
        q4t_block<NT, Z, BS>(q0, q1, sc, zq, [&](int j, int nt) {
            uint2 b = make_uint2(0u, 0u);
            if (whole || j * 16 < lim) b = __ldg(reinterpret_cast<const uint2*>(xr[nt] + j * 16));
            return b;
        }, acc);
        request(stage);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) xr[nt] += QUANT_WARPS * 128;
    };
    // Only the tile's last K block can end past K; it is the last of warp (kbn - 1) % QUANT_WARPS.
    const int whole = (w.k & 127) && warp == (kbn - 1) % QUANT_WARPS ? mine - 1 : mine;
    int i = 0;
    for (; i < whole; ++i) consume(i, true, 0);
    if (i < mine) consume(i, false, w.k - (warp + i * QUANT_WARPS) * 128 - 4 * t4);
    cp_async_wait_all();
    __syncthreads();  // every warp is done with its ring: its bytes take the partial sums
    float(*red)[NT * 4][32] = reinterpret_cast<float(*)[NT * 4][32]>(&rings[0][0][0]);
    q4t_reduce_store<NT, F32>(red, acc, w, y, bias, m, round, tile);
}

template <int MT, bool F32>
__device__ __forceinline__ void q4t_ring_tile(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                              const store_t* __restrict__ bias, int m, int round, int tile) {
    constexpr int NT = q4t_nt<MT>;
    __shared__ __align__(16) unsigned char ring[QUANT_WARPS][Q4T_STAGES][Q4T_STAGE_BYTES];
    static_assert(sizeof(float) * QUANT_WARPS * NT * 4 * 32 <= sizeof(ring), "the partial sums reuse the ring");
    Q4T_DISPATCH(q4t_ring_run, x, w, y, bias, m, round, tile, ring);
}
#endif

// The GEMV of a tiled weight (decoder D reads the layout): on sm_80+ the first ceil(n / 16)
// blocks one tile each (RING: q4t_ring_tile, else q4t_gemv_tile), the rest QUANT_WARPS rows of
// the dense tail each; on older GPUs the row-per-warp body over D (grid ceil(n_all /
// QUANT_WARPS)). ops/quant.rs sizes the grid to match.
template <class D, int MT, bool F32, bool RING>
__device__ __forceinline__ void quant_tiled_gemv(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                                 const store_t* __restrict__ bias, int m, int round) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int tiles = (w.n + 15) >> 4;
    if ((int)blockIdx.x < tiles) {
        if constexpr (RING) {
            q4t_ring_tile<MT, F32>(x, w, y, bias, m, round, blockIdx.x);
        } else {
            q4t_gemv_tile<MT, F32>(x, w, y, bias, m, round, blockIdx.x);
        }
    } else {
        quant_gemv_body<D, MT, F32>(x, w, y, bias, m, round, w.n + ((int)blockIdx.x - tiles) * QUANT_WARPS + (int)(threadIdx.x >> 5));
    }
#else
    quant_gemv_body<D, MT, F32>(x, w, y, bias, m, round, QUANT_ROW);
#endif
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
        quant_gemv_body<D, MT, false>(x, QUANT_W, y, bias, m, 0, QUANT_ROW);                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_gemv_f32_##NAME##_m##MT(const store_t* x, QUANT_W_PARAMS, float* y, int m, int round) { \
        quant_gemv_body<D, MT, true>(x, QUANT_W, y, nullptr, m, round, QUANT_ROW);                 \
    }
// A format's dequantize kernel and its GEMVs at m = 1, 2, 4, 8, 16 (INSTANCE: the GEMV kernels'
// definition, QUANT_GEMV_INSTANCE or QUANT_TILED_GEMV_INSTANCE).
#define QUANT_KERNELS_OF(NAME, D, INSTANCE)                                                        \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_dequant_##NAME(QUANT_W_PARAMS, void* out, int f32_out, int row0, int rows) {         \
        quant_dequant_body<D>(QUANT_W, out, f32_out, row0, rows);                                  \
    }                                                                                              \
    INSTANCE(NAME, D, 1)                                                                           \
    INSTANCE(NAME, D, 2)                                                                           \
    INSTANCE(NAME, D, 4)                                                                           \
    INSTANCE(NAME, D, 8)                                                                           \
    INSTANCE(NAME, D, 16)
#define QUANT_KERNELS(NAME, D) QUANT_KERNELS_OF(NAME, D, QUANT_GEMV_INSTANCE)

// The kernels of a format held in the tiled layout: QUANT_KERNELS' names and parameters, the
// GEMVs through quant_tiled_gemv, in two forms on sm_80+ that give the same sums in the same
// order (one form a model: ops/quant_tiles.rs `q4t_ring`):
// - quant_gemv[_f32]_<NAME>_m<MT>: each warp's K blocks loaded into registers a pass at a time,
//   two blocks an SM (registers capped at 128): one block's pass is in flight while the other
//   computes. Older GPUs run the row-per-warp body here, whose m = 8 and 16 kernels would spill
//   under that cap.
// - quant_gemv[_f32]_<NAME>_ring_m<MT> (sm_80+ only): each warp's K blocks streamed through a
//   cp.async ring in shared memory, as many blocks an SM as its shared memory holds rings (45 KB
//   a block: 4 on sm_90, 3 on sm_80, 2 on sm_86 / sm_89 / sm_120), registers capped to match
//   (64 a thread at 4 blocks).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define Q4T_MIN_BLOCKS 2
#else
#define Q4T_MIN_BLOCKS 1
#endif
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900)
#define Q4T_RING_MIN_BLOCKS 4
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800)
#define Q4T_RING_MIN_BLOCKS 3
#else
#define Q4T_RING_MIN_BLOCKS 2
#endif
// The GEMVs of one form: quant_gemv[_f32]_<NAME><SUFFIX>_m<MT>, RING picking the tile body,
// BLOCKS the blocks an SM the registers are capped for.
#define QUANT_TILED_FORM(NAME, D, MT, SUFFIX, RING, BLOCKS)                                        \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32, BLOCKS)                         \
        quant_gemv_##NAME##SUFFIX##_m##MT(const store_t* x, QUANT_W_PARAMS, store_t* y, const store_t* bias, int m) { \
        quant_tiled_gemv<D, MT, false, RING>(x, QUANT_W, y, bias, m, 0);                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32, BLOCKS)                         \
        quant_gemv_f32_##NAME##SUFFIX##_m##MT(const store_t* x, QUANT_W_PARAMS, float* y, int m, int round) { \
        quant_tiled_gemv<D, MT, true, RING>(x, QUANT_W, y, nullptr, m, round);                     \
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define QUANT_TILED_RING_INSTANCE(NAME, D, MT) QUANT_TILED_FORM(NAME, D, MT, _ring, true, Q4T_RING_MIN_BLOCKS)
#else
#define QUANT_TILED_RING_INSTANCE(NAME, D, MT)
#endif
#define QUANT_TILED_GEMV_INSTANCE(NAME, D, MT)                                                     \
    QUANT_TILED_FORM(NAME, D, MT, , false, Q4T_MIN_BLOCKS)                                         \
    QUANT_TILED_RING_INSTANCE(NAME, D, MT)
#define QUANT_TILED_KERNELS(NAME, D) QUANT_KERNELS_OF(NAME, D, QUANT_TILED_GEMV_INSTANCE)
