// The chunk GEMV of the 4-bit block formats read in their stored layout (GGUF Q4_K and IQ4_XS,
// NVFP4): the decode GEMV's weight stream in whole 16-byte loads, each scale decoded once per
// 16 or 32 values and factored out of their sum, where the row-per-warp body (quant.cuh
// quant_gemv_body) decodes 8 values at a time from byte loads. Values are produced exactly (an
// integer code or table entry as a binary32 through a magic-exponent word, one subtraction);
// the format's scale multiplies each group's f32 sum instead of each value (Q4_K's scale and
// min, with several batch rows, one fma a value): within f32 accumulation of the CPU's
// per-value products.
//
// Each warp owns QC_ROWS consecutive rows; a row is K / 32 chunks of 32 values, lane l taking
// chunks l, l + 32, ... (the warp's loads of one step are adjacent chunks of the row), several
// chunks of each row in flight before any is multiplied. A chunk's values are two runs of 16
// consecutive values of K (the format's C::x_runs); the 32 x values of each batch row are read
// as four 16-byte loads (with one batch row, converted once for the warp's rows; with several,
// each row's chunk is decoded once for all of them). Per (row, batch row) one f32
// sum a lane, then the warp reduction; `bias` and the output rounding as quant_gemv_body.
// A pair of rows reaching past the quantized rows (a dense tail, the grid's last rows) runs
// quant_gemv_body with the format's 8-value decoder D instead, row by row.
#pragma once
#include "quant.cuh"

// Output rows a warp of the chunk GEMV owns (ops/quant_chunks.rs QC_ROWS sizes the grid).
#define QC_ROWS 2

__device__ __forceinline__ unsigned qc_prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Weight bytes are read once: not kept in L1 (x is, for every warp of the SM).
__device__ __forceinline__ uint4 qc_ld16(const unsigned char* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 qc_ld8(const unsigned char* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned qc_word(const uint4& q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// The field of `w` under `mask` (bits s .. s + b - 1 inside the 23-bit mantissa: s + b <= 23)
// as a binary32, exactly: OR-ed into the mantissa of 2^e with e = 23 - s (so its lowest bit
// weighs 1), 2^e subtracted.
template <unsigned MASK, unsigned MAGIC>
__device__ __forceinline__ float qc_field(unsigned w) {
    return __fsub_rn(__uint_as_float((w & MASK) | MAGIC), __uint_as_float(MAGIC));
}

// The four bytes of `r` as binary32 values less 128, exactly: bytes 0 and 1 OR-ed into a
// mantissa whose lowest bit under them weighs 1, bytes 2 and 3 (bit 23 is the exponent's) moved
// to the bottom of 2^23 by one prmt each.
__device__ __forceinline__ void qc_bytes_less128(unsigned r, float& v0, float& v1, float& v2, float& v3) {
    v0 = __fsub_rn(__uint_as_float((r & 0xffu) | 0x4b000000u), 8388736.0f);  // 2^23 + 128
    v1 = __fsub_rn(__uint_as_float((r & 0xff00u) | 0x47000000u), 32896.0f);  // 2^15 + 128
    v2 = __fsub_rn(__uint_as_float(qc_prmt(r, 0x4b000000u, 0x7442u)), 8388736.0f);
    v3 = __fsub_rn(__uint_as_float(qc_prmt(r, 0x4b000000u, 0x7443u)), 8388736.0f);
}

// A 16-entry byte table in four words (entry i: byte i % 4 of word i / 4), looked up for the
// eight nibbles of `w` (nibble i: bits 4i .. 4i + 3): r0 bytes = entries of nibbles 0..3, r1 of
// nibbles 4..7. prmt picks one of 8 bytes a selector nibble (bit 3 masked: it would select the
// sign-replicating mode): entries i & 7 from words 0-1 and 2-3, then bit 3 chooses between them.
__device__ __forceinline__ void qc_lut16(unsigned w, unsigned t0, unsigned t1, unsigned t2, unsigned t3, unsigned& r0, unsigned& r1) {
    const unsigned s = w & 0x77777777u;
    const unsigned h = ((w >> 1) & 0x44444444u) | 0x32103210u;
    r0 = qc_prmt(qc_prmt(t0, t1, s), qc_prmt(t2, t3, s), h);
    const unsigned s1 = s >> 16, h1 = h >> 16;
    r1 = qc_prmt(qc_prmt(t0, t1, s1), qc_prmt(t2, t3, s1), h1);
}

// Storage-type words (two values each) as f32, exactly.
__device__ __forceinline__ void qc_x8(const uint4& q, float* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned u = qc_word(q, i);
#if defined(NINFER_STORAGE_F16)
        out[2 * i] = to_f32((store_t)(u & 0xffffu));
        out[2 * i + 1] = to_f32((store_t)(u >> 16));
#else
        out[2 * i] = __uint_as_float(u << 16);
        out[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
#endif
    }
}

// Values x0 .. x0 + 15 and x1 .. x1 + 15 of one batch row (16-byte aligned runs) into xv.
__device__ __forceinline__ void qc_x32(const store_t* xr, int x0, int x1, float (&xv)[32]) {
    const uint4* a = reinterpret_cast<const uint4*>(xr + x0);
    const uint4* b = reinterpret_cast<const uint4*>(xr + x1);
    const uint4 q0 = __ldg(a), q1 = __ldg(a + 1), q2 = __ldg(b), q3 = __ldg(b + 1);
    qc_x8(q0, xv);
    qc_x8(q1, xv + 8);
    qc_x8(q2, xv + 16);
    qc_x8(q3, xv + 24);
}

// qc_x32 and, where SUMS, the sums of its two runs into xs.
template <bool SUMS>
__device__ __forceinline__ void qc_x32_sums(const store_t* xr, int x0, int x1, float (&xv)[32], float (&xs)[2]) {
    qc_x32(xr, x0, x1, xv);
    xs[0] = 0.0f;
    xs[1] = 0.0f;
    if constexpr (SUMS) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            xs[0] += xv[i];
            xs[1] += xv[16 + i];
        }
    }
}

// The chunk GEMV of format C (C::row: a row's addresses; C::load: chunk ch's bytes;
// C::x_runs: the two runs of K its values are; C::scales: its scales; C::decode: its 32 values
// without their scales, run 0 then run 1; C::apply: the runs' sums of value times x (and of x
// alone, xs, where C::XSUM: a format with mins) times the scales, added into acc; C::fold (a
// format with mins): the values with their scales and mins, one fma each; C::finish: a row's
// sum of chunk sums into its output value) for up to MT rows of x.
template <class D, class C, int MT, bool F32>
__device__ __forceinline__ void quant_chunk_gemv(const store_t* __restrict__ x, const qweight& w, void* __restrict__ y,
                                                 const store_t* __restrict__ bias, int m, int round) {
    const int lane = threadIdx.x & 31;
    const int row0 = (int)(blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5)) * QC_ROWS;
    if (row0 + QC_ROWS > w.n) {
#pragma unroll 1
        for (int r = 0; r < QC_ROWS; ++r) quant_gemv_body<D, MT, F32>(x, w, y, bias, m, round, row0 + r);
        return;
    }
    pdl_enter();
    // Chunks a lane has in flight a row (fewer where many batch rows need the registers).
    constexpr int U = MT <= 4 ? 2 : 1;
    typename C::Row rw[QC_ROWS];
#pragma unroll
    for (int r = 0; r < QC_ROWS; ++r) rw[r] = C::row(w, row0 + r);
    const int nch = w.k >> 5;
    float acc[QC_ROWS][MT];
#pragma unroll
    for (int r = 0; r < QC_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;
#pragma unroll 1
    for (int c0 = lane; c0 < nch; c0 += 32 * U) {
        typename C::Chunk ck[U][QC_ROWS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c0 + 32 * u < nch) {
#pragma unroll
                for (int r = 0; r < QC_ROWS; ++r) ck[u][r] = C::load(rw[r], c0 + 32 * u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ch = c0 + 32 * u;
            if (ch >= nch) break;
            int x0, x1;
            C::x_runs(ch, x0, x1);
            // One batch row: its x converted once for both rows. Several: each row's chunk
            // decoded once for all of them (x read again a row, as the row-per-warp body does),
            // a format's mins folded into its values (C::fold) rather than summing x a row.
            constexpr bool FOLD = C::XSUM && MT > 1;
            float xv[32], xs[2];
            if constexpr (MT == 1) qc_x32_sums<C::XSUM>(x, x0, x1, xv, xs);
#pragma unroll
            for (int r = 0; r < QC_ROWS; ++r) {
                const typename C::Scales sc = C::scales(ck[u][r], ch);
                float wv[32];
                C::decode(ck[u][r], wv);
                if constexpr (FOLD) C::fold(sc, wv);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    if (t < m) {
                        if constexpr (MT > 1) qc_x32_sums<false>(x + (long long)t * w.k, x0, x1, xv, xs);
                        float h0 = 0.0f, h1 = 0.0f;
#pragma unroll
                        for (int i = 0; i < 16; ++i) {
                            h0 = fmaf(wv[i], xv[i], h0);
                            h1 = fmaf(wv[16 + i], xv[16 + i], h1);
                        }
                        if constexpr (FOLD) {
                            acc[r][t] += h0 + h1;
                        } else {
                            C::apply(sc, h0, h1, xs, acc[r][t]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QC_ROWS; ++r) {
        const int row = row0 + r;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            if (t < m) {
                const float s = C::finish(rw[r], warp_sum(acc[r][t]));
                if (lane == 0) quant_store<F32>(y, bias, (long long)t * w.n_all + row, row, s, round);
            }
        }
    }
}

// The kernels of a format whose GEMV is the chunk GEMV of its chunk decoder `chunk_<NAME>`:
// QUANT_KERNELS' names and parameters; the dequantize kernel decodes through D (grid:
// ops/quant.rs sizes it for QC_ROWS rows a warp).
#define QUANT_CHUNK_GEMV_INSTANCE(NAME, D, MT)                                                     \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_gemv_##NAME##_m##MT(const store_t* x, QUANT_W_PARAMS, store_t* y, const store_t* bias, int m) { \
        quant_chunk_gemv<D, chunk_##NAME, MT, false>(x, QUANT_W, y, bias, m, 0);                   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32)                                 \
        quant_gemv_f32_##NAME##_m##MT(const store_t* x, QUANT_W_PARAMS, float* y, int m, int round) { \
        quant_chunk_gemv<D, chunk_##NAME, MT, true>(x, QUANT_W, y, nullptr, m, round);             \
    }
#define QUANT_CHUNK_KERNELS(NAME, D) QUANT_KERNELS_OF(NAME, D, QUANT_CHUNK_GEMV_INSTANCE)
