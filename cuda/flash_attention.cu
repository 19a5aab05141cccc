// Causal flash attention for prefill over the paged KV cache, on tensor cores.
//
// The query rows of a step are packed by sequence: rows cu_seqlens[s]..cu_seqlens[s+1] belong
// to sequence s, row r sits at position token_pos[r] (consecutive within a sequence, possibly
// after a cached prefix) and sees keys 0..=token_pos[r], whose K/V are already in the cache
// [num_blocks, block_size, n_kv_heads, D] through the block table of s.
//
// One block of WARPS warps computes BM = 16 * WARPS query rows of one q head of one sequence
// (grid: row tiles, q heads, sequences). The Q tile is staged in shared memory once; key tiles
// of BN rows are gathered from the paged cache into shared memory, S = Q K^T and O += P V run as
// `mma.sync.m16n8k16` (16-bit inputs, f32 accumulators), and the softmax is online in f32
// (running max and sum per row; exp2 with the scale folded into log2(e)), so no score matrix
// leaves registers.
//
// Two tilings (the launcher picks; flash_attention.rs):
// - 4 warps (64 rows), one K/V buffer loaded synchronously between two barriers: every head
//   size, and d 256 where a block may not have 132 KiB of shared memory (sm_86/sm_89).
// - d 256 and d 128, 8 warps (128 rows), two K/V buffers filled by cp.async (at d 128 tiles of
//   64 keys, or 128 where a block may take 174 KiB of shared memory: sm_90): tile t+1 is in
//   flight while tile t is multiplied. At d 256 the f32 O accumulators take 128 registers a lane, so
//   an SM holds only 8 warps (238 registers a lane, no spills); with the synchronous form those
//   were two 4-warp blocks, each idle while its tile came from L2, and every K/V tile crossed
//   L2 once per 64 query rows (13 GB per layer of an 8k prompt at 24/4 heads). The 128-row
//   block halves that traffic and the copy overlaps the products.
//
// P V always runs with f16 operands, whatever the storage type: P lies in [0, 1], where f16
// keeps 10 mantissa bits against bf16's 7, and rounding P to bf16 made batched prefill drift
// from the same prompt run alone on trained models. With bf16 storage the V tile is converted
// to f16 in shared memory (as it is staged, or by the thread that copied it once its cp.async
// landed; exact for |v| in [6.1e-5, 65504]; smaller values become f16 subnormals, larger ones
// are clamped to +-65504 rather than turning into inf). A warp owns 16 query rows; in the mma
// fragment layout a lane holds rows lane/4 and lane/4 + 8, so row reductions are two quad
// shuffles.
//
// Tensor-core mma and cp.async need sm_80 (the launcher routes sm_70/sm_75 to the scalar
// paged_attention kernel), so the bodies compile to nothing below sm_80.
#include "common.cuh"

// Shared-memory rows are padded by 8 elements (16 bytes): 32-bit fragment loads of 8 rows x 4
// lanes then fall in distinct banks, and ldmatrix row addresses stay 16-byte aligned.
#define FA_PAD 8

// Warps a block of the batched tensor-core decode attention (flash_decode_d*, below): at d 256
// each warp's two K/V buffers take 33 KiB. Outside the sm_80 guard: the instances name it.
#define FD_WARPS(D) ((D) >= 256 ? 2 : 4)
// Warps a block of flash_decode_direct_d* (below).
#define FDD_WARPS 4

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// c += a (16x16, row) * b (16x8, col), storage-type operands, f32 accumulate (S = Q K^T).
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if defined(NINFER_STORAGE_F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += a * b as above with f16 operands whatever the storage type (O += P V).
__device__ __forceinline__ void mma16816_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 values rounded to nearest f16, `lo` in the low half (the lower column index).
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#if !defined(NINFER_STORAGE_F16)
// Clamp to the finite f16 range; comparisons are false for NaN, so NaN passes through.
__device__ __forceinline__ float clamp_f16_range(float x) {
    return x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x);
}

// Two packed bf16 values as two packed f16 values, element order kept.
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned v) {
    return pack_f16x2(clamp_f16_range(__uint_as_float(v << 16)),
                      clamp_f16_range(__uint_as_float(v & 0xffff0000u)));
}
#endif

// Four 8x8 tiles of 16-bit elements, lanes 8i..8i+7 giving the row addresses of tile i; lane l
// receives row l/4, columns 2(l%4) and 2(l%4)+1 of each: the A fragment of a row-major [m][k]
// tile, or the B fragments of a row-major [n][k] one (K as stored).
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four transposed 8x8 tiles of 16-bit elements: the B fragments of a row-major [k][n] matrix.
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_f32(lo) | ((unsigned)from_f32(hi) << 16);
}

__device__ __forceinline__ unsigned ld32(const store_t* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Element offset in the cache of key j's row for kv head kvh, column c.
__device__ __forceinline__ long long kv_offset(const int* table, int j, int block_size, int n_kv_heads,
                                               int kvh, int D, int c) {
    return ((long long)table[j / block_size] * block_size + (j % block_size)) * n_kv_heads * D +
           (long long)kvh * D + c;
}

// Stages keys kb..kb+BN into ks/vs through registers (V converted to f16), zeros past kv_len.
template <int D, int BN, int NT>
__device__ __forceinline__ void stage_kv_sync(store_t* ks, store_t* vs, const store_t* __restrict__ k_cache,
                                              const store_t* __restrict__ v_cache,
                                              const int* __restrict__ table, int kb,
                                              int kv_len, int kvh, int n_kv_heads, int block_size,
                                              int tid) {
    constexpr int LD = D + FA_PAD;
    constexpr int VPR = D / 8;
    for (int i = tid; i < BN * VPR; i += NT) {
        const int r = i / VPR;
        const int c = (i - r * VPR) * 8;
        const int j = kb + r;
        uint4 kv, vv;
        kv.x = kv.y = kv.z = kv.w = 0u;
        vv = kv;
        if (j < kv_len) {
            const long long off = kv_offset(table, j, block_size, n_kv_heads, kvh, D, c);
            kv = *reinterpret_cast<const uint4*>(k_cache + off);
            vv = *reinterpret_cast<const uint4*>(v_cache + off);
#if !defined(NINFER_STORAGE_F16)
            vv.x = bf16x2_to_f16x2(vv.x);
            vv.y = bf16x2_to_f16x2(vv.y);
            vv.z = bf16x2_to_f16x2(vv.z);
            vv.w = bf16x2_to_f16x2(vv.w);
#endif
        }
        *reinterpret_cast<uint4*>(ks + r * LD + c) = kv;
        *reinterpret_cast<uint4*>(vs + r * LD + c) = vv;
    }
}

// A key's block-table index and its row within the block (block_size keys a block): a shift
// and a mask where the size is a power of two (bs_shift = log2 of it, else -1), a division
// otherwise. One definition for every stager below.
__device__ __forceinline__ int kv_block_of(int j, int block_size, int bs_shift) {
    return bs_shift >= 0 ? j >> bs_shift : j / block_size;
}
__device__ __forceinline__ int kv_row_in_block(int j, int block_size, int bs_shift) {
    return bs_shift >= 0 ? j & (block_size - 1) : j % block_size;
}

// Starts the copy of keys kb..kb+BN into ks/vs as one cp.async group (V still in the storage
// type); rows past kv_len are zeroed with plain stores. Each thread owns the same 16-byte
// chunks in stage_kv_async and finish_v_async. bs_shift = log2(block_size) when block_size is a
// power of two (the engine's 16), else -1: the runtime integer division of the key index took
// a fifth of the loop's instructions.
template <int D, int BN, int NT>
__device__ __forceinline__ void stage_kv_async(store_t* ks, store_t* vs, const store_t* __restrict__ k_cache,
                                               const store_t* __restrict__ v_cache,
                                               const int* __restrict__ table, int kb,
                                               int kv_len, int kvh, int n_kv_heads, int block_size,
                                               int bs_shift, int tid) {
    constexpr int LD = D + FA_PAD;
    constexpr int VPR = D / 8;
    static_assert((BN * VPR) % NT == 0, "every thread copies the same number of chunks");
    constexpr int CHUNKS = BN * VPR / NT;
    // The block-table entries of this thread's rows first, so their loads are in flight
    // together instead of each stalling its own copy.
    int blk[CHUNKS];
#pragma unroll
    for (int it = 0; it < CHUNKS; ++it) {
        const int j = kb + (tid + it * NT) / VPR;
        blk[it] = j < kv_len ? table[kv_block_of(j, block_size, bs_shift)] : 0;
    }
#pragma unroll
    for (int it = 0; it < CHUNKS; ++it) {
        const int i = tid + it * NT;
        const int r = i / VPR;
        const int c = (i - r * VPR) * 8;
        const int j = kb + r;
        if (j < kv_len) {
            const int in_block = kv_row_in_block(j, block_size, bs_shift);
            const long long off = ((long long)blk[it] * block_size + in_block) * n_kv_heads * D +
                                  (long long)kvh * D + c;
            cp_async16(smem_u32(ks + r * LD + c), k_cache + off);
            cp_async16(smem_u32(vs + r * LD + c), v_cache + off);
        } else {
            uint4 z;
            z.x = z.y = z.z = z.w = 0u;
            *reinterpret_cast<uint4*>(ks + r * LD + c) = z;
            *reinterpret_cast<uint4*>(vs + r * LD + c) = z;
        }
    }
    cp_async_commit();
}

// Waits for this thread's copies and converts its own V chunks to f16 in place (bf16 storage);
// a barrier after it publishes the tile to the block.
template <int D, int BN, int NT>
__device__ __forceinline__ void finish_v_async(store_t* vs, int kb, int kv_len, int tid) {
    cp_async_wait_all();
#if !defined(NINFER_STORAGE_F16)
    constexpr int LD = D + FA_PAD;
    constexpr int VPR = D / 8;
#pragma unroll
    for (int it = 0; it < BN * VPR / NT; ++it) {
        const int i = tid + it * NT;
        const int r = i / VPR;
        const int c = (i - r * VPR) * 8;
        if (kb + r < kv_len) {
            uint4* p = reinterpret_cast<uint4*>(vs + r * LD + c);
            uint4 vv = *p;
            vv.x = bf16x2_to_f16x2(vv.x);
            vv.y = bf16x2_to_f16x2(vv.y);
            vv.z = bf16x2_to_f16x2(vv.z);
            vv.w = bf16x2_to_f16x2(vv.w);
            *p = vv;
        }
    }
#endif
}

// One K/V tile's online softmax for a warp's 16 query rows (a lane's rows a and b), in three
// steps so that the wgmma kernel can run the last two apart: fa_tile_max masks keys past each
// row's position in the raw scores sc (BN keys, mma accumulator layout; tiles ending by
// warp_min_pos, which every row of the warp sees whole, skip the mask), updates the running
// maxima m (in units of scale_log2 * score: the tile's raw maximum times scale_log2, which is
// the maximum of the scaled scores, the scale being positive), rescales the sums l and returns
// the exponent bases and output corrections; fa_rescale applies the corrections to the output
// accumulators o; fa_tile_exp leaves sc holding the unnormalized probabilities
// 2^(score * scale_log2 - base), the scale folded into one fma, and adds them to l.
struct FaTileScale {
    float base_a, base_b, corr_a, corr_b, scale;
};

// 2^x on the MUFU unit alone (ex2.approx.ftz). exp2f without fast math wraps the same
// instruction in a range check and two predicated multiplies so that results below 2^-126 come
// out denormal; here such a probability (or output correction) sits beside the row's largest
// term, which is 1, so it vanishes in every f32 sum either way, and the softmax saves three of
// its four instructions an element.
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int BN>
__device__ __forceinline__ FaTileScale fa_tile_max(float (&sc)[BN / 8][4], float& m_a, float& m_b, float& l_a,
                                                   float& l_b, int kb, int pos_a, int pos_b, int warp_min_pos,
                                                   float scale_log2) {
    const int tq = threadIdx.x & 3;  // this lane's key pair in each 8-key n-tile
    float rx_a = NEG_INF, rx_b = NEG_INF;
    if (kb + BN - 1 <= warp_min_pos) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                rx_a = fmaxf(rx_a, sc[n][e]);
                rx_b = fmaxf(rx_b, sc[n][2 + e]);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = kb + n * 8 + 2 * tq + e;
                if (j > pos_a) sc[n][e] = NEG_INF;
                if (j > pos_b) sc[n][2 + e] = NEG_INF;
                rx_a = fmaxf(rx_a, sc[n][e]);
                rx_b = fmaxf(rx_b, sc[n][2 + e]);
            }
        }
    }
    rx_a = fmaxf(rx_a, __shfl_xor_sync(0xffffffffu, rx_a, 1));
    rx_a = fmaxf(rx_a, __shfl_xor_sync(0xffffffffu, rx_a, 2));
    rx_b = fmaxf(rx_b, __shfl_xor_sync(0xffffffffu, rx_b, 1));
    rx_b = fmaxf(rx_b, __shfl_xor_sync(0xffffffffu, rx_b, 2));
    const float mx_a = fmaxf(m_a, rx_a * scale_log2);
    const float mx_b = fmaxf(m_b, rx_b * scale_log2);
    // A row with no visible key yet keeps max -inf; exponentiate against 0 so that it
    // stays all-zero instead of NaN.
    FaTileScale r;
    r.scale = scale_log2;
    r.base_a = mx_a == NEG_INF ? 0.0f : mx_a;
    r.base_b = mx_b == NEG_INF ? 0.0f : mx_b;
    r.corr_a = fa_exp2(m_a - r.base_a);
    r.corr_b = fa_exp2(m_b - r.base_b);
    m_a = mx_a;
    m_b = mx_b;
    l_a *= r.corr_a;
    l_b *= r.corr_b;
    return r;
}

// Once the running maxima settle, corr is fa_exp2(0) = 1 exactly for every row of the warp, and
// scaling O by it changes no bit: SKIP_UNIT_CORR (the 128-row kernels) skips those D/2
// multiplies a lane then (the 64-row kernel keeps its instruction stream unchanged).
template <int D, bool SKIP_UNIT_CORR>
__device__ __forceinline__ void fa_rescale(float (&o)[D / 8][4], const FaTileScale& r) {
    if (!SKIP_UNIT_CORR || !__all_sync(0xffffffffu, r.corr_a == 1.0f && r.corr_b == 1.0f)) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= r.corr_a;
            o[n][1] *= r.corr_a;
            o[n][2] *= r.corr_b;
            o[n][3] *= r.corr_b;
        }
    }
}

template <int BN>
__device__ __forceinline__ void fa_tile_exp(float (&sc)[BN / 8][4], const FaTileScale& r, float& l_a, float& l_b) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
        sc[n][0] = fa_exp2(fmaf(sc[n][0], r.scale, -r.base_a));
        sc[n][1] = fa_exp2(fmaf(sc[n][1], r.scale, -r.base_a));
        sc[n][2] = fa_exp2(fmaf(sc[n][2], r.scale, -r.base_b));
        sc[n][3] = fa_exp2(fmaf(sc[n][3], r.scale, -r.base_b));
        l_a += sc[n][0] + sc[n][1];
        l_b += sc[n][2] + sc[n][3];
    }
}

// Where a flash attention block works: sequence s, q head h and its kv head, the sequence's rows
// row0.. (n_rows), and this block's BM-row tile from tile0 (tile_rows of them); fa_block maps
// the block index to these. False for a tile past the sequence's rows (the grid covers the
// longest sequence).
struct FaBlock {
    int s, h, row0, n_rows, tile0, tile_rows, kvh;
};

// The grid is (row tiles, q heads, sequences), but a block's work is not its grid coordinates:
// blocks start roughly in linear index order (x fastest), and that order is mapped to work by
// sequence, then a span of kv heads, then row tile from the last (the longest key ranges
// first), then the span's q heads. Within a span the longest tiles start first and the
// shortest end it; the q heads that read the same K/V run together, so only the span's K/V is
// live in L2 (a 32k-key d 128 kv head is 16 MiB), as when each q head's tiles ran in turn. The
// span is one kv head where that head's blocks fill the SMs at least once (long prompts), else
// the fewest kv heads (a divisor of their count) that do. That older order (a q head's tiles
// longest first, then the next head's) started the last heads' longest tiles in the last
// waves, each then running alone for many tile steps.
__device__ __forceinline__ unsigned sm_id_count() {
    unsigned n;
    asm("mov.u32 %0, %%nsmid;" : "=r"(n));
    return n;
}
// Work item `lin` (a linear block index, x fastest, of a (tiles, q heads, sequences) grid) to
// its block; false when the tile lies past its sequence's rows (a shorter sequence of the launch).
template <int BM>
__device__ __forceinline__ bool fa_item(FaBlock& b, unsigned lin, unsigned tiles, const int* __restrict__ cu_seqlens,
                                        int n_q_heads, int n_kv_heads) {
    const unsigned group = n_q_heads / n_kv_heads;
    const unsigned kv_heads = n_kv_heads;
    const unsigned want = sm_id_count();
    unsigned span = 1;
    while (span < kv_heads && (kv_heads % span != 0 || span * group * tiles < want)) ++span;
    const unsigned in_span = lin % (span * group);
    lin /= span * group;
    const unsigned tile_rev = lin % tiles;
    lin /= tiles;
    b.kvh = lin % (kv_heads / span) * span + in_span / group;
    b.s = lin / (kv_heads / span);
    b.h = b.kvh * group + in_span % group;
    b.row0 = cu_seqlens[b.s];
    b.n_rows = cu_seqlens[b.s + 1] - b.row0;
    b.tile0 = (tiles - 1 - tile_rev) * BM;
    if (b.tile0 >= b.n_rows) return false;
    b.tile_rows = min(BM, b.n_rows - b.tile0);
    return true;
}
template <int BM>
__device__ __forceinline__ bool fa_block(FaBlock& b, const int* __restrict__ cu_seqlens, int n_q_heads,
                                         int n_kv_heads) {
    return fa_item<BM>(b, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x, cu_seqlens,
                       n_q_heads, n_kv_heads);
}

// Positions of a lane's two rows ra and rb = ra + 8 of its warp's 16 (-1: past the sequence's
// rows, fully masked), and warp_min_pos: every row of the warp sees keys 0..warp_min_pos (-1
// when a row lies past the sequence), so tiles ending there need no causal mask (the mask
// leaves their scores as they are).
struct FaRows {
    int ra, rb, pos_a, pos_b, warp_min_pos;
};

__device__ __forceinline__ FaRows fa_rows(const int* __restrict__ token_pos, const FaBlock& b, int warp, int gr) {
    FaRows r;
    r.ra = b.tile0 + warp * 16 + gr;
    r.rb = r.ra + 8;
    r.pos_a = r.ra < b.n_rows ? token_pos[b.row0 + r.ra] : -1;
    r.pos_b = r.rb < b.n_rows ? token_pos[b.row0 + r.rb] : -1;
    r.warp_min_pos = b.tile0 + warp * 16 + 15 < b.n_rows ? token_pos[b.row0 + b.tile0 + warp * 16] : -1;
    return r;
}

// The end of a flash block: each lane's two rows of O divided by their softmax sums (summed over
// the row's quad) and stored, rows past the sequence skipped.
template <int D>
__device__ __forceinline__ void fa_store_rows(store_t* __restrict__ out, const float (&o)[D / 8][4], float l_a,
                                              float l_b, const FaBlock& b, const FaRows& r, int n_q_heads, int tq) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
    const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    const long long out_stride = (long long)n_q_heads * D;
    store_t* oa = out + (long long)(b.row0 + r.ra) * out_stride + (long long)b.h * D + 2 * tq;
    store_t* ob = oa + 8 * out_stride;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        if (r.ra < b.n_rows)
            *reinterpret_cast<unsigned*>(oa + n * 8) = pack2(o[n][0] * inv_a, o[n][1] * inv_a);
        if (r.rb < b.n_rows)
            *reinterpret_cast<unsigned*>(ob + n * 8) = pack2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}

// WARPS warps, BN keys a tile; PIPE: two K/V buffers filled by cp.async (see the header).
template <int D, int BN, int WARPS, bool PIPE>
__device__ __forceinline__ void flash_body(
    const store_t* __restrict__ q, long long q_stride, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ cu_seqlens, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, int block_size, float scale_log2, store_t* __restrict__ out) {
    constexpr int LD = D + FA_PAD;
    constexpr int VPR = D / 8;  // 16-byte vectors per row
    constexpr int NT = WARPS * 32;
    constexpr int BM = 16 * WARPS;
    extern __shared__ uint4 fa_smem[];
    store_t* qs = reinterpret_cast<store_t*>(fa_smem);  // [BM][LD]
    store_t* kv0 = qs + BM * LD;  // per buffer: K [BN][LD], then V [BN][LD] (f16 bits)

    FaBlock fb;
    if (!fa_block<BM>(fb, cu_seqlens, n_q_heads, n_kv_heads)) return;
    const int s = fb.s, h = fb.h, row0 = fb.row0, n_rows = fb.n_rows, tile0 = fb.tile0, tile_rows = fb.tile_rows, kvh = fb.kvh;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int gr = lane >> 2;
    const int tq = lane & 3;

    for (int i = tid; i < BM * VPR; i += NT) {
        const int r = i / VPR;
        const int c = (i - r * VPR) * 8;
        uint4 val;
        val.x = val.y = val.z = val.w = 0u;
        if (r < tile_rows)
            val = *reinterpret_cast<const uint4*>(q + (long long)(row0 + tile0 + r) * q_stride +
                                                  (long long)h * D + c);
        *reinterpret_cast<uint4*>(qs + r * LD + c) = val;
    }
    const FaRows fr = fa_rows(token_pos, fb, warp, gr);
    const int pos_a = fr.pos_a, pos_b = fr.pos_b, warp_min_pos = fr.warp_min_pos;
    // The warp's last row's position: tiles past it are skipped.
    const int warp_last = min(tile0 + warp * 16 + 15, n_rows - 1);
    const int warp_max_pos = warp_last >= tile0 + warp * 16 ? token_pos[row0 + warp_last] : -1;
    const int kv_len = token_pos[row0 + tile0 + tile_rows - 1] + 1;
    const int* table = block_tables + (long long)s * max_blocks;

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    if constexpr (PIPE)
        stage_kv_async<D, BN, NT>(kv0, kv0 + BN * LD, k_cache, v_cache, table, 0, kv_len, kvh,
                                  n_kv_heads, block_size, bs_shift, tid);
    for (int kb = 0, t = 0; kb < kv_len; kb += BN, ++t) {
        store_t* ks = kv0 + (PIPE ? (t & 1) * 2 * BN * LD : 0);
        store_t* vs = ks + BN * LD;
        if constexpr (PIPE) {
            finish_v_async<D, BN, NT>(vs, kb, kv_len, tid);
            // Tile t is visible to the block (and the Q tile is stored); every warp is done
            // with tile t-1, whose buffer the next copy overwrites.
            __syncthreads();
            if (kb + BN < kv_len) {
                store_t* kn = kv0 + ((t + 1) & 1) * 2 * BN * LD;
                stage_kv_async<D, BN, NT>(kn, kn + BN * LD, k_cache, v_cache, table, kb + BN,
                                          kv_len, kvh, n_kv_heads, block_size, bs_shift, tid);
            }
        } else {
            __syncthreads();  // the previous tile is no longer read (and the Q tile is stored)
            stage_kv_sync<D, BN, NT>(ks, vs, k_cache, v_cache, table, kb, kv_len, kvh, n_kv_heads,
                                     block_size, tid);
            __syncthreads();
        }
        if (kb > warp_max_pos) continue;  // every key of the tile is in this warp's future

        float sc[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
        if constexpr (PIPE) {
            // The same fragments through ldmatrix: one x4 load gives the Q A-fragment of a k16
            // step (matrices: rows 0-7 / 8-15 by columns k0 / k0+8), one gives the K
            // B-fragments of two key n-tiles (keys n*8.. / n*8+8.. by columns k0 / k0+8): 3
            // loads per k16 step instead of 12 32-bit ones, the same values in the same mma
            // order.
            static_assert(BN % 16 == 0, "key n-tiles go in pairs");
            const unsigned qa = smem_u32(qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                         (lane >> 4) * 8);
            const unsigned ka = smem_u32(ks + ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int k0 = 0; k0 < D; k0 += 16) {
                unsigned a[4];
                ldsm_x4(a, qa + k0 * 2);
#pragma unroll
                for (int n = 0; n < BN / 8; n += 2) {
                    unsigned b[4];
                    ldsm_x4(b, ka + (n * 8 * LD + k0) * 2);
                    mma16816(sc[n], a, b[0], b[1]);
                    mma16816(sc[n + 1], a, b[2], b[3]);
                }
            }
        } else {
#pragma unroll
            for (int k0 = 0; k0 < D; k0 += 16) {
                const store_t* qp = qs + (warp * 16 + gr) * LD + k0 + 2 * tq;
                const unsigned a[4] = {ld32(qp), ld32(qp + 8 * LD), ld32(qp + 8), ld32(qp + 8 * LD + 8)};
#pragma unroll
                for (int n = 0; n < BN / 8; ++n) {
                    const store_t* kp = ks + (n * 8 + gr) * LD + k0 + 2 * tq;
                    mma16816(sc[n], a, ld32(kp), ld32(kp + 8));
                }
            }
        }
        const FaTileScale ts = fa_tile_max<BN>(sc, m_a, m_b, l_a, l_b, kb, pos_a, pos_b, warp_min_pos, scale_log2);
        fa_rescale<D, PIPE>(o, ts);
        fa_tile_exp<BN>(sc, ts, l_a, l_b);
        // O += P V: the accumulator fragments of two adjacent key n-tiles are exactly the A
        // fragment of one k16 step.
        const int mi = lane >> 3;
        const int ri = lane & 7;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned a[4] = {pack_f16x2(sc[2 * kk][0], sc[2 * kk][1]),
                                   pack_f16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                   pack_f16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                   pack_f16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
            const store_t* vrow = vs + (kk * 16 + (mi & 1) * 8 + ri) * LD + (mi >> 1) * 8;
#pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                unsigned b[4];
                ldsm_x4_trans(b, smem_u32(vrow + dn * 8));
                mma16816_f16(o[dn], a, b[0], b[1]);
                mma16816_f16(o[dn + 1], a, b[2], b[3]);
            }
        }
    }
    fa_store_rows<D>(out, o, l_a, l_b, fb, fr, n_q_heads, tq);
}

// ---------------------------------------------------------------------------------------------
// Prefill attention on Hopper's warpgroup tensor cores (flash_attention_d{128,256}_wgmma, sm_90a
// only). At d 256 the tiles are 32 keys (the 64 x 256 f32 output alone is 128 registers a lane)
// and V^T rows are padded to one 64-key slab (the swizzle's 128-byte row).
//
// The flash_body algorithm with its products as wgmma: a block is two warpgroups (8 warps) of
// 64 query rows each, sharing K/V tiles of BN keys filled by cp.async into two buffers. S = Q K^T
// is one wgmma.m64n128k16 chain a warpgroup with both operands read from shared memory (no
// ldmatrix, no fragment registers), and O += P V takes P from the registers the softmax left it
// in (the accumulator layout of S is the A-operand layout) and V^T from shared memory. mma.sync
// kernels must move every K/V fragment through registers, once per 16 query rows; at ~190
// TFLOP/s the 128-key mma.sync kernel ran at about half of sdpa's rate on the same GPU.
//
// Shared memory holds Q, K, V and V^T in wgmma's 128-byte swizzle K-major layout: columns in
// slabs of 64 (128 bytes a row), and in each 8-row group (1024 bytes, 1024-aligned) a row's eight
// 16-byte chunks permuted by XOR with the row's index in the group, so that the tensor cores read
// eight rows of one chunk column from eight different banks. A cp.async chunk's destination is
// that permutation of its row; 8 consecutive threads fill one 128-byte row (no two share a
// bank) from 128 consecutive bytes of global memory. (The no-swizzle layout, 8 x 8 core
// matrices of 128 contiguous bytes, gave the same values at 185 TFLOP/s, with or without the
// pipeline below, against 193 for the 128-key mma.sync kernel and 227 for this one; 8k-token
// Llama-3-8B prompt, H200, benches/results/cuda_ops_flash_wgmma_*.log.)
// V arrives as [keys][d]. Compiled by NVRTC 13 (FA_WGMMA_DIRECT_V below), P V reads it as it is,
// an N-major B operand, with P in the storage type; compiled by NVRTC 12, each warp transposes
// its share into V^T (ldmatrix.trans, then stmatrix) in f16 and P is f16 (as in flash_body).
// The loop is software-pipelined: P(t) V(t) and the scores of tile t+1 are issued together, and
// the warps (transpose V(t+1) and) exponentiate the new scores while the tensor cores run both
// (O is rescaled once P(t) V(t) has landed).
// Shared memory written by threads (cp.async, stores) is made visible to wgmma's async proxy by
// fence.proxy.async before the barrier that publishes it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The direct form (FA_WGMMA_DIRECT_V 1) takes V as it arrives, as the N-major B operand of P V,
// with P in the storage type (bf16 P, as FlashAttention and sdpa have it): no V^T, no transpose.
// Measured on the H200 (8k-token Llama-3-8B attention): 1.678 ms (6e312fe) against 2.302 for
// the transposing form (b99d499); the transposes alone were ~27% of that kernel (knocking out
// only them gave 1.694; benches/results/flash_wgmma_knockouts_b99d499.txt). ptxas of CUDA 12.9
// crashes (segfault) on the direct form, whatever sits in the loop, so NVRTC 12 compiles the
// transposing form (V^T in f16, P in f16) and NVRTC 13 the direct one; CI compiles both
// (.ci/compile-kernels).
#if __CUDACC_VER_MAJOR__ >= 13
#define FA_WGMMA_DIRECT_V 1
#else
#define FA_WGMMA_DIRECT_V 0
#endif

// Ties registers to the asm statements around them (asm volatile keeps its order): the
// accumulators of an in-flight wgmma are neither read before its wait nor written after its
// issue, and its A registers stay live until the wait.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_pin(unsigned (&a)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1]), "+r"(a[n][2]), "+r"(a[n][3])::"memory");
}

// The accumulator operands of a 64 x N f32 tile: 4 N / 8 registers, each size extending the last.
#define WG_ACC32 \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define WG_D32 "{" \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15" "}"

#define WG_ACC128 \
    WG_ACC32, "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
    "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), \
    "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), \
    "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), \
    "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), \
    "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), \
    "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), \
    "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), \
    "+f"(d[15][3])
#define WG_D128 "{" \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%2" \
    "2,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%4" \
    "2,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%6" \
    "2,%63" "}"

#define WG_ACC256 \
    WG_ACC128, "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), \
    "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), \
    "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), \
    "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), \
    "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), \
    "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), \
    "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), \
    "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), \
    "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), \
    "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), \
    "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
#define WG_D256 "{" \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%2" \
    "2,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%4" \
    "2,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%6" \
    "2,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%8" \
    "2,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101," \
    "%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117," \
    "%118,%119,%120,%121,%122,%123,%124,%125,%126,%127" "}"

#if defined(NINFER_STORAGE_F16)
#define WG_QK_TYPES "f16.f16"
#else
#define WG_QK_TYPES "bf16.bf16"
#endif

// d (64 x N, f32) = [d +] A B, A and B 16-bit storage-type operands in shared memory (the
// scores: N = keys a tile). One overload a tile width, the accumulator array's size picking it.

__device__ __forceinline__ void wgmma_ss(float (&d)[4][4], unsigned long long a, unsigned long long b,
                                         int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." WG_QK_TYPES " " WG_D32 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32
        : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], unsigned long long a, unsigned long long b,
                                         int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_QK_TYPES " " WG_D128 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC128
        : "l"(a), "l"(b), "r"(accumulate));
}


// d (64 x N, f32) += A B, A 16-bit fragments in registers (the mma.sync m16n8k16 A layout, each
// warp its 16 rows), B in shared memory (P V: N = the head size), one overload a head size.
// wgmma_rs_f16: f16 A and B, B K-major (V^T, the transposing form). wgmma_rs_v: storage-type A
// and B, B = V as it arrives, [keys][d]: N-major, so imm-trans-b is 1 (16-bit types only) and no
// V^T is built (the direct form).
#define WG_RS_PAIR(NAME, TYPES, TRANS_B)                                                                  \
    __device__ __forceinline__ void NAME(float (&d)[16][4], const unsigned (&a)[4], unsigned long long b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPES " " WG_D128                     \
                     ", {%64,%65,%66,%67}, %68, p, 1, 1, " TRANS_B ";\n}\n"                               \
                     : WG_ACC128                                                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                       \
    }                                                                                                     \
    __device__ __forceinline__ void NAME(float (&d)[32][4], const unsigned (&a)[4], unsigned long long b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                         \
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPES " " WG_D256                     \
                     ", {%128,%129,%130,%131}, %132, p, 1, 1, " TRANS_B ";\n}\n"                          \
                     : WG_ACC256                                                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                       \
    }
WG_RS_PAIR(wgmma_rs_f16, "f16.f16", "0")
WG_RS_PAIR(wgmma_rs_v, WG_QK_TYPES, "1")

// Descriptor of an N-major operand in the 128-byte swizzle layout (a swizzled [K rows][N] tile,
// as stage_kv_sw128 fills V): 64-column slabs `slab_bytes` apart (the leading byte offset),
// 8-row groups 1024 bytes apart (the stride byte offset). Checked on the H200: the two offsets
// the other way round give a relative error of ~1.
__device__ __forceinline__ unsigned long long wg_desc_sw128_n(unsigned addr, unsigned slab_bytes) {
    return (unsigned long long)((addr & 0x3ffff) >> 4) | ((unsigned long long)(slab_bytes >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// Two f32 values rounded to the storage type, `lo` in the low half.
__device__ __forceinline__ unsigned pack_store2(float lo, float hi) {
#if defined(NINFER_STORAGE_F16)
    return pack_f16x2(lo, hi);
#else
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

__device__ __forceinline__ void stsm_x4(unsigned addr, const unsigned* r) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Starts the copy of keys kb..kb+BN (K and V, storage type) into swizzled tiles ks / vs as one
// cp.async group; rows past kv_len are zeroed with plain stores. A thread takes rows
// tid / 8 + k NT / 8 and in each of them the 16-byte chunk tid % 8 of every 64-column slab, so
// it looks a row's block up once for all of its slabs, and 8 consecutive threads still fill one
// 128-byte row (no two share a bank) from 128 consecutive bytes of global memory.
template <int D, int BN, int NT>
__device__ __forceinline__ void stage_kv_sw128(store_t* ks, store_t* vs, const store_t* __restrict__ k_cache,
                                              const store_t* __restrict__ v_cache, const int* __restrict__ table,
                                              int kb, int kv_len, int kvh, int n_kv_heads, int block_size,
                                              int bs_shift, int tid) {
    constexpr int ROWS_STEP = NT / 8;
    static_assert(D % 64 == 0 && BN % ROWS_STEP == 0, "whole slabs, every thread the same rows");
    constexpr int ROWS = BN / ROWS_STEP;
    const int c = tid & 7;
    int blk[ROWS];
#pragma unroll
    for (int k = 0; k < ROWS; ++k) {
        const int j = kb + (tid >> 3) + k * ROWS_STEP;
        blk[k] = j < kv_len ? table[kv_block_of(j, block_size, bs_shift)] : 0;
    }
#pragma unroll
    for (int k = 0; k < ROWS; ++k) {
        const int r = (tid >> 3) + k * ROWS_STEP;
        const int j = kb + r;
        const int so = sw128_offset<BN>(r, c) / 2;  // elements, slab 0
        if (j < kv_len) {
            const int in_block = kv_row_in_block(j, block_size, bs_shift);
            const long long off = ((long long)blk[k] * block_size + in_block) * n_kv_heads * D + (long long)kvh * D + c * 8;
#pragma unroll
            for (int sl = 0; sl < D / 64; ++sl) {
                cp_async16(smem_u32(ks + so + sl * BN * 64), k_cache + off + sl * 64);
                cp_async16(smem_u32(vs + so + sl * BN * 64), v_cache + off + sl * 64);
            }
        } else {
            uint4 z;
            z.x = z.y = z.z = z.w = 0u;
#pragma unroll
            for (int sl = 0; sl < D / 64; ++sl) {
                *reinterpret_cast<uint4*>(ks + so + sl * BN * 64) = z;
                *reinterpret_cast<uint4*>(vs + so + sl * BN * 64) = z;
            }
        }
    }
    cp_async_commit();
}

// The warp-specialized form's producer staging (flash_wgmma_ws_body): the same tiles, chunks
// and thread-to-chunk map as stage_kv_sw128, with rows past kv_len zero-filled by cp.async (so
// an mbarrier arrival after it covers the whole tile; no group is committed) and the address
// arithmetic a row reduced to one wide multiply-add. Nsight Compute on the H200 (8k-token
// d 128 attention; benches/results/ncu_flash_attention_d128_wgmma_ws_28f274c.txt) counted
// half of the kernel's issued instructions in the producer when it ran stage_kv_sw128's ~75
// instructions a row (64-bit products of the row index, the kv-head offset and the pointers
// rebuilt for every row, each row's shared offset recomputed, an 8-byte spill): issue slots
// its four warps share with the consumers' softmax. Here what does not change from tile to
// tile is computed once: the chunk's pointers at the kv head (kp, vp), a row's and a block's
// strides, and the shared offset of the thread's first row, whose later rows lie 16 x 128
// bytes apart (the swizzle XORs with the row index mod 8, which a step of 16 rows keeps).
template <int D, int BN>
struct KvStager {
    static constexpr int ROWS = BN / 16;  // 128 threads, 8 to a row: 16 rows a step
    const char* kp;  // k_cache + kvh D + chunk (bytes)
    const char* vp;
    const int* table;
    unsigned row_bytes, blk_bytes;  // n_kv_heads D and block_size n_kv_heads D, in bytes
    int row0, bs_shift, block_size, kv_len;
    unsigned so0;  // bytes: the first row's chunk in slab 0

    __device__ __forceinline__ KvStager(const store_t* k_cache, const store_t* v_cache, const int* table_, int kvh,
                                        int n_kv_heads, int block_size_, int bs_shift_, int kv_len_, int ptid) {
        const int c = ptid & 7;
        row0 = ptid >> 3;
        kp = reinterpret_cast<const char*>(k_cache + (long long)kvh * D + c * 8);
        vp = reinterpret_cast<const char*>(v_cache + (long long)kvh * D + c * 8);
        table = table_;
        row_bytes = (unsigned)(n_kv_heads * D) * 2u;
        blk_bytes = (unsigned)block_size_ * row_bytes;
        bs_shift = bs_shift_;
        block_size = block_size_;
        kv_len = kv_len_;
        so0 = sw128_offset<BN>(row0, c);
    }

    // Keys kb..kb+BN into the swizzled tiles at shared addresses ks / vs. Block numbers and
    // in-block offsets are non-negative, so the offset is one unsigned wide multiply-add; a row
    // past kv_len looks up the last key's block (an in-bounds address; source size 0 reads
    // nothing and writes 16 zero bytes).
    __device__ __forceinline__ void stage(unsigned ks, unsigned vs, int kb) const {
        unsigned blk[ROWS];
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            const int j = min(kb + row0 + 16 * k, kv_len - 1);
            blk[k] = (unsigned)table[kv_block_of(j, block_size, bs_shift)];
        }
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            const int j = kb + row0 + 16 * k;
            const bool valid = j < kv_len;
            const int jc = min(j, kv_len - 1);
            const unsigned in_block = (unsigned)kv_row_in_block(jc, block_size, bs_shift);
            const unsigned long long off = (unsigned long long)blk[k] * blk_bytes + in_block * row_bytes;
            const char* kr = kp + off;
            const char* vr = vp + off;
            const unsigned so = so0 + k * 16 * 128;
#pragma unroll
            for (int sl = 0; sl < D / 64; ++sl) {
                cp_async16_zfill(ks + so + sl * BN * 128, kr + sl * 128, valid);
                cp_async16_zfill(vs + so + sl * BN * 128, vr + sl * 128, valid);
            }
        }
    }
};

// V tile [BN][D] -> V^T [D][BN] (both swizzled), as f16: four 8 x 8 blocks an ldmatrix.trans /
// stmatrix pair, the block's warps taking turns.
template <int D, int BN, int WARPS>
__device__ __forceinline__ void transpose_v_sw128(unsigned short* vt, const store_t* vs, int warp, int lane) {
    constexpr int OPS = (BN / 8) * (D / 8) / 4;
    const int mi = lane >> 3;
    const int rr = lane & 7;
#pragma unroll
    for (int op = warp; op < OPS; op += WARPS) {
        const int kg = op / (D / 32);
        const int dg = (op % (D / 32)) * 4 + mi;
        unsigned r[4];
        ldsm_x4_trans(r, smem_u32(vs + sw128_offset<BN>(kg * 8 + rr, dg) / 2));
#if !defined(NINFER_STORAGE_F16)
#pragma unroll
        for (int e = 0; e < 4; ++e) r[e] = bf16x2_to_f16x2(r[e]);
#endif
        stsm_x4(smem_u32(vt + sw128_offset<D>(dg * 8 + rr, kg) / 2), r);
    }
}

// P as the A operand of P V: the storage type in the direct form, f16 (V^T's type) otherwise.
__device__ __forceinline__ unsigned pack_p2(float lo, float hi) {
    return FA_WGMMA_DIRECT_V ? pack_store2(lo, hi) : pack_f16x2(lo, hi);
}

// The wgmma bodies' steps, one definition for both (flash_wgmma_body, flash_wgmma_ws_body).
// The scores of one K tile (swizzled, at shared address k_addr) against a warpgroup's 64 Q rows
// (at q_addr in the BM-row Q tile) into sc, as one wgmma group.
template <int D, int BN, int BM>
__device__ __forceinline__ void wg_issue_scores(float (&sc)[BN / 8][4], unsigned q_addr, unsigned k_addr) {
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16)
        wgmma_ss(sc, wg_desc_sw128(q_addr + (k0 >> 6) * BM * 128 + (k0 & 63) * 2),
                 wg_desc_sw128(k_addr + (k0 >> 6) * BN * 128 + (k0 & 63) * 2), k0 > 0);
    wg_commit();
}
// P (the probabilities in sc) as the A fragments of P V.
template <int BN>
__device__ __forceinline__ void wg_pack_p(unsigned (&pa)[BN / 16][4], const float (&sc)[BN / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack_p2(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = pack_p2(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = pack_p2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = pack_p2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}
#if FA_WGMMA_DIRECT_V
// O += P V with V as it arrived (a V tile at shared address v_addr: a k16 step is 16 key rows
// of 128 bytes on), as one wgmma group.
template <int D, int BN>
__device__ __forceinline__ void wg_issue_pv_direct(float (&o)[D / 8][4], unsigned (&pa)[BN / 16][4], unsigned v_addr) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_rs_v(o, pa[kk], wg_desc_sw128_n(v_addr + kk * 16 * 128, BN * 128));
    wg_commit();
}
#endif

template <int D, int BN>
__device__ __forceinline__ void flash_wgmma_body(
    const store_t* __restrict__ q, long long q_stride, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ cu_seqlens, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, int block_size, float scale_log2, store_t* __restrict__ out) {
    static_assert((D == 128 && BN == 128) || (D == 256 && BN == 32), "wgmma_ss / wgmma_rs_f16 widths");
    constexpr int WARPS = 8;
    constexpr int NT = WARPS * 32;
    constexpr int BM = 16 * WARPS;
    constexpr int TILE = BN * D;  // elements of one K or V tile
    // V^T rows are at least one 64-key slab wide (128 bytes, the swizzle's row), keys past BN unused.
    constexpr int VT_TILE = D * (BN < 64 ? 64 : BN);
    extern __shared__ uint4 fa_smem[];
    // Swizzle atoms are 1024-byte aligned (the launcher adds 1 KiB for this).
    const unsigned smem_pad = (1024u - (smem_u32(fa_smem) & 1023u)) & 1023u;
    store_t* qs = reinterpret_cast<store_t*>(reinterpret_cast<char*>(fa_smem) + smem_pad);  // [BM][D]
    store_t* kv0 = qs + BM * D;                                           // buffer b: K, then V
    unsigned short* vt = reinterpret_cast<unsigned short*>(kv0 + 4 * TILE);  // 2 x V^T, f16
    // K/V buffers. The direct form reads V(t) in place until P(t) V(t) lands at the end of
    // iteration t, so tile t+2 (staged at its start) cannot reuse tile t's buffer: three, the
    // third where the transposing form keeps its two V^T tiles (the same shared memory).
    constexpr int NBUF = FA_WGMMA_DIRECT_V ? 3 : 2;
    auto kv_buf = [&](int t) { return kv0 + (NBUF == 2 ? (t & 1) : t % NBUF) * 2 * TILE; };

    FaBlock fb;
    if (!fa_block<BM>(fb, cu_seqlens, n_q_heads, n_kv_heads)) return;
    const int s = fb.s, h = fb.h, row0 = fb.row0, tile0 = fb.tile0, tile_rows = fb.tile_rows, kvh = fb.kvh;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int gr = lane >> 2;
    const int wg = warp >> 2;

    for (int i = tid; i < BM * D / 8; i += NT) {
        const int r = sw128_chunk_row<BM>(i);
        const int c8 = sw128_chunk_c8<BM>(i);
        uint4 val;
        val.x = val.y = val.z = val.w = 0u;
        if (r < tile_rows)
            val = *reinterpret_cast<const uint4*>(q + (long long)(row0 + tile0 + r) * q_stride +
                                                  (long long)h * D + c8 * 8);
        *reinterpret_cast<uint4*>(qs + sw128_offset<BM>(r, c8) / 2) = val;
    }
    const FaRows fr = fa_rows(token_pos, fb, warp, gr);
    const int pos_a = fr.pos_a, pos_b = fr.pos_b, warp_min_pos = fr.warp_min_pos;
    // Both warpgroups compute every tile, including one wholly in a warpgroup's future (possible
    // only after a cached prefix; its scores are all masked): wgmma under a branch that ptxas
    // cannot prove uniform is serialized.
    const int kv_len = token_pos[row0 + tile0 + tile_rows - 1] + 1;
    const int* table = block_tables + (long long)s * max_blocks;

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    // Descriptor start of the k16 step at column k0 of a swizzled tile of `rows` rows: its
    // 64-column slab, then 2 bytes a column within the 128-byte rows.
    const unsigned q_addr = smem_u32(qs) + wg * 64 * 128;  // this warpgroup's 64 rows
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    const int n_tiles = (kv_len + BN - 1) / BN;
    // S (one tile's scores, then probabilities) and P (the previous tile's, f16 A fragments).
    float sc[BN / 8][4];
    unsigned pa[BN / 16][4];
    // The scores of tile t into sc, as one wgmma group.
    auto issue_scores = [&](int t) { wg_issue_scores<D, BN, BM>(sc, q_addr, smem_u32(kv_buf(t))); };
    auto pack_p = [&]() { wg_pack_p<BN>(pa, sc); };

    // Tile 0: its scores and probabilities before the loop.
    stage_kv_sw128<D, BN, NT>(kv_buf(0), kv_buf(0) + TILE, k_cache, v_cache, table, 0, kv_len, kvh, n_kv_heads,
                             block_size, bs_shift, tid);
    cp_async_wait_all();
    fence_proxy_async_smem();
    __syncthreads();
    if (n_tiles > 1)
        stage_kv_sw128<D, BN, NT>(kv_buf(1), kv_buf(1) + TILE, k_cache, v_cache, table, BN, kv_len, kvh,
                                 n_kv_heads, block_size, bs_shift, tid);
    wg_pin(sc);
    wg_fence();
    issue_scores(0);
    if (!FA_WGMMA_DIRECT_V) transpose_v_sw128<D, BN, WARPS>(vt, kv_buf(0) + TILE, warp, lane);
    fence_proxy_async_smem();
    wg_wait<0>();
    wg_pin(sc);
    {
        const FaTileScale ts = fa_tile_max<BN>(sc, m_a, m_b, l_a, l_b, 0, pos_a, pos_b, warp_min_pos, scale_log2);
        fa_tile_exp<BN>(sc, ts, l_a, l_b);  // o is still zero: no rescale
    }
    pack_p();

    // O += P(t) V(t) (from V^T buffer t & 1 in the transposing form), as one wgmma group.
    auto issue_pv = [&](int t) {
#if FA_WGMMA_DIRECT_V
        wg_issue_pv_direct<D, BN>(o, pa, smem_u32(kv_buf(t) + TILE));  // V(t) itself
#else
        const unsigned vt_addr = smem_u32(vt + (t & 1) * VT_TILE);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs_f16(o, pa[kk], wg_desc_sw128(vt_addr + (kk * 16 >> 6) * D * 128 + (kk * 16 & 63) * 2));
        wg_commit();
#endif
    };

    // Iteration t: O += P(t) V(t) runs on the tensor cores together with the scores of tile t+1,
    // while the warps transpose V(t+1) and then exponentiate those scores; O is rescaled once
    // P(t) V(t) has landed. The last tile's P V is peeled off below: a branch between
    // wgmma.fence and a wait (an `if (more)` around the scores) makes ptxas serialize every
    // wgmma of the kernel (C7515, each one waits for the one before); 226 TFLOP/s at 8k was
    // that serialized form.
    for (int t = 0; t + 1 < n_tiles; ++t) {
        cp_async_wait_all();
        fence_proxy_async_smem();
        // Tile t+1 is in shared memory and V^T(t) is published; every warpgroup is done with
        // the scores of tile t, V(t)'s transpose and P(t-1) V(t-1): tile t+2's buffer (tile
        // t's with two buffers, tile t-1's with three) is free.
        __syncthreads();
        wg_pin(sc);
        wg_pin(o);
        wg_pin(pa);
        wg_fence();
        issue_scores(t + 1);
        issue_pv(t);
        // Tile t+2's loads are issued with the tensor cores already busy.
        if (t + 2 < n_tiles) {
            store_t* kn = kv_buf(t + 2);
            stage_kv_sw128<D, BN, NT>(kn, kn + TILE, k_cache, v_cache, table, (t + 2) * BN, kv_len, kvh,
                                     n_kv_heads, block_size, bs_shift, tid);
        }
        if (!FA_WGMMA_DIRECT_V)
            transpose_v_sw128<D, BN, WARPS>(vt + ((t + 1) & 1) * VT_TILE, kv_buf(t + 1) + TILE, warp, lane);
        fence_proxy_async_smem();
        wg_wait<1>();  // the scores of tile t+1 (P(t) V(t) may still run)
        wg_pin(sc);
        const FaTileScale ts =
            fa_tile_max<BN>(sc, m_a, m_b, l_a, l_b, (t + 1) * BN, pos_a, pos_b, warp_min_pos, scale_log2);
        fa_tile_exp<BN>(sc, ts, l_a, l_b);
        wg_wait<0>();
        wg_pin(o);
        wg_pin(pa);
        fa_rescale<D, true>(o, ts);
        pack_p();
    }
    // The last tile: the barrier publishes V^T(n_tiles - 1) (the transposing form; in the direct
    // form V(n_tiles - 1) was published by the loop's or the prologue's), then its P V alone.
    fence_proxy_async_smem();
    __syncthreads();
    wg_pin(o);
    wg_pin(pa);
    wg_fence();
    issue_pv(n_tiles - 1);
    wg_wait<0>();
    wg_pin(o);
    fa_store_rows<D>(out, o, l_a, l_b, fb, fr, n_q_heads, lane & 3);
}

// ---------------------------------------------------------------------------------------------
// Warp-specialized wgmma prefill attention (flash_attention_d{128,256}_wgmma_ws, flash_wgmma_body's
// tilings, the direct form, so NVRTC 13 only). flash_wgmma_body's warps stage K/V themselves and pass one block
// barrier a tile, so both warpgroups exponentiate at the same time while the tensor cores idle
// (docs/kernels.md, session 20: ~2.97 us a 128-key tile at 8k against ~1.5 for its wgmma
// alone). Here, as in FlashAttention-3, a third warpgroup only copies: it fills three K/V
// buffers by cp.async and signals each through a "full" mbarrier (cp.async.mbarrier.arrive
// .noinc: the arrival lands when the thread's copies have), and waits on the buffer's "empty"
// mbarrier (one arrival a consumer warp, after its P V of that tile) before refilling it. The
// two consumer warpgroups (64 query rows each) never meet at a block barrier: each waits for
// its own tiles only, so they drift apart and one's softmax runs under the other's products.
// The producer gives registers back (setmaxnreg: 56 a lane) so the consumers keep
// flash_wgmma_body's 224 at 384 threads. Measured on the H200 (8k-token Llama-3-8B attention,
// cuda_ops_flash_ws_d0e9008.log): 1.274 ms against 1.509 for flash_wgmma_body (432 against 364
// TFLOP/s; 1.175 since the softmax's bare ex2, cuda_ops_flash_05fde09.log). Making the
// consumers take turns at the tensor cores (FlashAttention-3's "ping-pong", two named barriers)
// measured the same (1.281 ms) and was dropped.
// Per tile the arithmetic is flash_wgmma_body's, in the same order: the outputs are equal bit
// for bit (the flash op tests require it of every case, tests/cuda_ops.rs `flash_case`).
#if FA_WGMMA_DIRECT_V

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nMBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// An arrival on `bar` once every cp.async this thread issued before it has landed (counted in
// the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// A barrier of `threads` threads (a multiple of 32) under id `id` (0 is __syncthreads).
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// This warpgroup's 64 Q rows of block fb (rows wg * 64 ..) into the swizzled Q tile by
// cp.async, rows past the tile zero-filled; the caller commits, waits and publishes them.
template <int D, int BM>
__device__ __forceinline__ void fa_ws_load_q(unsigned qs, const store_t* __restrict__ q, long long q_stride,
                                             const FaBlock& fb, int wg, int ctid) {
#pragma unroll 4
    for (int i = ctid; i < 64 * D / 8; i += 128) {
        const int r = wg * 64 + sw128_chunk_row<64>(i);
        const int c8 = sw128_chunk_c8<64>(i);
        const bool valid = r < fb.tile_rows;
        const store_t* src = q + (long long)(fb.row0 + fb.tile0 + (valid ? r : 0)) * q_stride + (long long)fb.h * D + c8 * 8;
        cp_async16_zfill(qs + sw128_offset<BM>(r, c8), src, valid);
    }
}

// The keys block fb reads: through its tile's last row.
__device__ __forceinline__ int fa_kv_len(const int* __restrict__ token_pos, const FaBlock& fb) {
    return token_pos[fb.row0 + fb.tile0 + fb.tile_rows - 1] + 1;
}

// Persistent and dynamically scheduled: the launch has one block an SM (its shared memory allows
// no second), and each block takes work items (the (row tile, q head, sequence) blocks of the
// other tilings, in fa_item's order, longest tiles first) from a counter in global memory until
// none is left. Why: with a block a work item, every item began with its Q load and its first
// K/V tiles in flight and nothing else on the SM, and ended with its output stores alone
// (Nsight Compute, 8k d 128 at 85e27b4: 9% of the warp samples in those two phases, the Q
// load's long-scoreboard waits most of it). Here the producer stages the next item's tiles while
// the consumers finish the current one, and the consumers load their next Q rows by cp.async
// under the last tile's P V and the output stores. A static split of the items over the blocks
// would lose more than that to imbalance (causal tiles differ in length up to 64x at 8k), hence
// the counter: work[0] the next item, work[1] the blocks done; the last block done zeroes both
// for the next launch (every block has taken its last, empty, item before it counts itself
// done, so no block reads work[0] after the reset). The producer's first thread takes the
// items, skips those past their sequence and hands each to the consumers through a ring of four
// slots, each with an mbarrier of one arrival (the producer cannot run four items ahead: it
// stays within NBUF tiles of the consumers); -1 ends the block.
template <int D, int BN>
__device__ __forceinline__ void flash_wgmma_ws_body(
    const store_t* __restrict__ q, long long q_stride, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ cu_seqlens, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, int block_size, float scale_log2, store_t* __restrict__ out,
    unsigned* __restrict__ work, int row_tiles, int n_seqs) {
    static_assert((D == 128 && BN == 128) || (D == 256 && BN == 32), "flash_wgmma_body's tilings");
    constexpr int BM = 128;   // two consumer warpgroups of 64 rows
    constexpr int NBUF = 3;   // V(t) is read in place until P(t) V(t) lands
    constexpr int RING = 4;   // work items handed from the producer to the consumers
    constexpr int TILE = BN * D;
    extern __shared__ uint4 fa_smem[];
    __shared__ unsigned long long fa_bars[2 * NBUF + RING];  // full[b], empty[b], item[i]
    __shared__ int fa_items[RING];
    const unsigned smem_pad = (1024u - (smem_u32(fa_smem) & 1023u)) & 1023u;
    store_t* qs = reinterpret_cast<store_t*>(reinterpret_cast<char*>(fa_smem) + smem_pad);  // [BM][D]
    store_t* kv0 = qs + BM * D;
    // Tiles are numbered across the block's items (g), so the buffers' barrier phases carry on.
    auto kv_buf = [&](unsigned g) { return kv0 + (g % NBUF) * 2 * TILE; };
    const unsigned full0 = smem_u32(&fa_bars[0]);
    const unsigned empty0 = smem_u32(&fa_bars[NBUF]);
    const unsigned item0 = smem_u32(&fa_bars[2 * NBUF]);
    const unsigned total = (unsigned)row_tiles * (unsigned)n_q_heads * (unsigned)n_seqs;

    const int tid = threadIdx.x;
    // Broadcast so that ptxas sees a warp-uniform role (a branch it cannot prove uniform
    // serializes the wgmma under it).
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
#pragma unroll
        for (int b = 0; b < NBUF; ++b) {
            mbar_init(full0 + 8 * b, 128);  // the producer's threads
            mbar_init(empty0 + 8 * b, 8);   // the consumer warps
        }
#pragma unroll
        for (int i = 0; i < RING; ++i) mbar_init(item0 + 8 * i, 1);
    }
    __syncthreads();
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;

    if (wg == 2) {
        // Producer: tile g into buffer g % NBUF once the consumers have released its previous
        // tile (g - NBUF).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;" ::: "memory");
        const int ptid = tid - 256;
        unsigned g = 0;
        for (int k = 0;; ++k) {
            if (ptid == 0) {
                int item = -1;
                for (;;) {
                    const unsigned lin = atomicAdd(work, 1u);
                    if (lin >= total) break;
                    FaBlock tb;
                    if (fa_item<BM>(tb, lin, row_tiles, cu_seqlens, n_q_heads, n_kv_heads)) {
                        item = (int)lin;
                        break;
                    }
                }
                fa_items[k % RING] = item;
                mbar_arrive(item0 + 8 * (k % RING));  // releases the slot's write to the consumers
            }
            named_bar_sync(3, 128);  // the producer's threads read the slot after its write
            const int item = fa_items[k % RING];
            if (item < 0) break;
            FaBlock fb;
            fa_item<BM>(fb, (unsigned)item, row_tiles, cu_seqlens, n_q_heads, n_kv_heads);
            const int kv_len = fa_kv_len(token_pos, fb);
            const int n_tiles = (kv_len + BN - 1) / BN;
            const KvStager<D, BN> stager(k_cache, v_cache, block_tables + (long long)fb.s * max_blocks, fb.kvh,
                                         n_kv_heads, block_size, bs_shift, kv_len, ptid);
            for (int j = 0; j < n_tiles; ++j, ++g) {
                const unsigned b = g % NBUF;
                if (g >= NBUF) mbar_wait(empty0 + 8 * b, ((g / NBUF) - 1) & 1);
                const unsigned kb = smem_u32(kv_buf(g));
                stager.stage(kb, kb + TILE * 2, j * BN);
                cp_async_mbar_arrive(full0 + 8 * b);
            }
        }
        cp_async_wait_all();
        if (ptid == 0 && atomicAdd(work + 1, 1u) == gridDim.x - 1) {
            work[0] = 0u;
            work[1] = 0u;
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;" ::: "memory");
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int gr = lane >> 2;
    const int ctid = tid & 127;
    const unsigned q_smem = smem_u32(qs);
    const unsigned q_addr = q_smem + wg * 64 * 128;
    // Item k of this block from the producer's ring (-1: none left).
    auto next_item = [&](int k) {
        mbar_wait(item0 + 8 * (k % RING), (k / RING) & 1);
        return fa_items[k % RING];
    };
    int item = next_item(0);
    if (item < 0) return;
    FaBlock fb;
    fa_item<BM>(fb, (unsigned)item, row_tiles, cu_seqlens, n_q_heads, n_kv_heads);
    fa_ws_load_q<D, BM>(q_smem, q, q_stride, fb, wg, ctid);
    cp_async_commit();
    FaRows fr = fa_rows(token_pos, fb, warp, gr);
    int n_tiles = (fa_kv_len(token_pos, fb) + BN - 1) / BN;
    unsigned g0 = 0;

    for (int k = 0;; ++k) {
        // This item's Q rows (loaded under the previous item's last tile), published to this
        // warpgroup's wgmma by its own barrier.
        cp_async_wait_all();
        fence_proxy_async_smem();
        named_bar_sync(1 + wg, 128);
        const int pos_a = fr.pos_a, pos_b = fr.pos_b, warp_min_pos = fr.warp_min_pos;

        float o[D / 8][4];
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
        float sc[BN / 8][4];
        unsigned pa[BN / 16][4];
        auto wait_full = [&](int t) {
            const unsigned g = g0 + t;
            mbar_wait(full0 + 8 * (g % NBUF), (g / NBUF) & 1);
            fence_proxy_async_smem();
        };
        // Tile t's buffer is free once this warp's P(t) V(t) has landed.
        auto release = [&](int t) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((g0 + t) % NBUF));
        };
        auto issue_scores = [&](int t) { wg_issue_scores<D, BN, BM>(sc, q_addr, smem_u32(kv_buf(g0 + t))); };

        // flash_wgmma_body's loop, its block barriers replaced by the waits for tile t + 1 and
        // the release of tile t, and each tile's wait for P V moved to the start of the next
        // tile. Why: with the wait after the exponentials in the same basic block
        // (flash_wgmma_body's order), ptxas schedules the WARPGROUP.DEPBAR for P(t) V(t) above
        // them, right after the row maxima (SASS of NVRTC 13.0; Nsight Compute put 4.7% of the
        // warp samples on it), so a warpgroup exponentiated only once its own P V had landed.
        // Awaited at the top of the next step, it comes after them; P(t + 1) then needs
        // registers of its own while P(t) V(t) still reads P(t): two sets, `cur` and `prev`,
        // swapped by unrolling the loop twice. The arithmetic and its order are unchanged (O is
        // rescaled by tile t + 1's correction once P(t) V(t) has landed, as before): the
        // outputs stay equal bit for bit.
        wait_full(0);
        wg_pin(sc);
        wg_fence();
        issue_scores(0);
        wg_wait<0>();
        wg_pin(sc);
        FaTileScale pend = fa_tile_max<BN>(sc, m_a, m_b, l_a, l_b, 0, pos_a, pos_b, warp_min_pos, scale_log2);
        fa_tile_exp<BN>(sc, pend, l_a, l_b);
        unsigned pb[BN / 16][4];
        wg_pack_p<BN>(pa, sc);
        // P(t - 1) V(t - 1) awaited (`prev`, its A registers, free again), tile t - 1 released
        // and O rescaled for tile t (pend: the correction tile t's maxima made).
        auto land_pv = [&](int t, unsigned (&prev)[BN / 16][4]) {
            wg_wait<0>();
            wg_pin(o);
            wg_pin(prev);
            release(t - 1);
            fa_rescale<D, true>(o, pend);
        };
        // Tile t (its P in `cur`): S(t + 1) and P(t) V(t) issued together, tile t + 1's
        // probabilities packed into `prev` while P(t) V(t) runs.
        auto step = [&](int t, unsigned (&cur)[BN / 16][4], unsigned (&prev)[BN / 16][4]) {
            if (t > 0) land_pv(t, prev);
            wait_full(t + 1);
            wg_pin(sc);
            wg_pin(o);
            wg_pin(cur);
            wg_fence();
            issue_scores(t + 1);
            wg_issue_pv_direct<D, BN>(o, cur, smem_u32(kv_buf(g0 + t) + TILE));
            wg_wait<1>();
            wg_pin(sc);
            pend = fa_tile_max<BN>(sc, m_a, m_b, l_a, l_b, (t + 1) * BN, pos_a, pos_b, warp_min_pos, scale_log2);
            fa_tile_exp<BN>(sc, pend, l_a, l_b);
            wg_pack_p<BN>(prev, sc);
        };
        // The last tile t: no wgmma reads Q any more (every score product has landed), so the
        // next item's Q rows are requested first; then P(t) V(t) alone, its release, and this
        // item's output.
        FaBlock nfb;
        auto last = [&](int t, unsigned (&cur)[BN / 16][4], unsigned (&prev)[BN / 16][4]) {
            if (t > 0) land_pv(t, prev);
            item = next_item(k + 1);
            if (item >= 0) {
                fa_item<BM>(nfb, (unsigned)item, row_tiles, cu_seqlens, n_q_heads, n_kv_heads);
                fa_ws_load_q<D, BM>(q_smem, q, q_stride, nfb, wg, ctid);
                cp_async_commit();
            }
            wg_pin(o);
            wg_pin(cur);
            wg_fence();
            wg_issue_pv_direct<D, BN>(o, cur, smem_u32(kv_buf(g0 + t) + TILE));
            wg_wait<0>();
            wg_pin(o);
            release(t);
        };
        for (int t = 0;; t += 2) {
            if (t + 1 >= n_tiles) {
                last(t, pa, pb);
                break;
            }
            step(t, pa, pb);
            if (t + 2 >= n_tiles) {
                last(t + 1, pb, pa);
                break;
            }
            step(t + 1, pb, pa);
        }
        fa_store_rows<D>(out, o, l_a, l_b, fb, fr, n_q_heads, lane & 3);
        if (item < 0) break;
        g0 += n_tiles;
        fb = nfb;
        fr = fa_rows(token_pos, fb, warp, gr);
        n_tiles = (fa_kv_len(token_pos, fb) + BN - 1) / BN;
    }
}
#endif  // FA_WGMMA_DIRECT_V
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---------------------------------------------------------------------------------------------
// Batched decode attention on tensor cores (flash_decode_d*): one query token per sequence, the
// route of decode launches of 16+ tokens (ops/decode_attention.rs, form TensorCore).
//
// Why: the CUDA-core decode kernels score each key against the G q heads of its group with
// per-lane dot products, shuffle reductions and one exp per (key, head) on every lane of a key
// slot, ~290 instructions a warp for each 2 KB of K/V at d 128. At batch 64 and ~1.2k keys that
// bound the fixed form at 1.4 TB/s, 59% of the 8B's decode step (benches/results/decode_profile_8b_b64_0ea12b0.txt,
// session 11). Here the G heads of a token's group are the N columns of m16n8k16 (columns
// G..7 zero) and 16 keys (for S^T = K Q^T) or 16 head dims (for O^T += V^T P^T) its M rows:
// D / 16 + D / 16 mmas for 16 keys, every one of them useful, each O^T mma on its own
// accumulators, and every K/V byte read once for the whole group. P^T goes from the S^T
// accumulator layout to O^T's B fragments by movmatrix (a register transpose), not shared
// memory. (Session 11's first form put the heads in the M rows, as the prefill kernel does its
// queries: half of every tile zero rows, 2 D / 16 + D / 8 mmas, and the P V chain serialised
// through shared throwaway accumulators; a ~35-40 us floor a call at d 256.)
//
// Layout: a block of FD_WARPS(D) warps owns (token, kv head, split); a split is
// fd_split_keys(limit) consecutive keys (a function of the token's own context, as the scaled
// form's splits: batch == alone holds), at most FD_MAX_SPLITS of them. Warp w takes the 16-key
// tiles w, w + WARPS, ... of the split, each staged by the warp alone into its own two shared
// buffers by cp.async (the next tile in flight while this one is multiplied; V converted to f16
// as the prefill kernel does, P V in f16), with its own online softmax (exp2, the scale folded
// into log2 e). The warps merge through shared memory in warp order; the splits through the
// scratch partials, merged in split order by the last block to arrive (arrives_last), which is
// the layout decode_attention.cu's kernels use (the same AttnScratch).
#define FD_MAX_SPLITS 32  // = ops/decode_attention.rs DECODE_MAX_SPLITS
#define FD_BN 16
// Fewest 16-key tiles a warp takes in a split (fewer splits and partials at short contexts) is
// the launch's `min_warp_tiles` (ops/decode_attention.rs TC_MIN_WARP_TILES, 8, unless
// NINFER_TC_DECODE_MIN_TILES sets it; why 8 there).
// The last block's split merge: output elements a thread sums at once, and splits of each
// whose partials it requests before using any (FD_MERGE_ROWS x FD_MERGE_CHUNK loads in flight).
#define FD_MERGE_ROWS 4
#define FD_MERGE_CHUNK 8

// Keys a split of a token seeing `limit` keys takes (a multiple of the block's tile row):
// `min_tiles` tiles a warp, or more where that would pass FD_MAX_SPLITS splits.
// = ops/decode_attention.rs `tc_split_keys_with`.
__host__ __device__ __forceinline__ int fd_split_keys(int limit, int warps, int min_tiles) {
    const int unit = warps * FD_BN;
    const int need = (limit + FD_MAX_SPLITS - 1) / FD_MAX_SPLITS;
    return max(unit * min_tiles, (need + unit - 1) / unit * unit);
}

// The 8x8 16-bit matrix held one row pair a lane (lane l: row l/4, columns 2(l%4), +1, the mma
// fragment layout) transposed, in the same layout: what turns the keys-by-heads probabilities
// of S^T into the heads-by-keys B fragment of O^T += V^T P^T without shared memory (sm_75+).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// The end of both tensor-core decode forms: the SLOTS partials of a block of WARPS warps (a
// slot is a warp, or a pair of warps that split the head dims; each slot's O^T accumulators
// already in sm_o, [SLOTS][8 heads][D] f32, by head dim) merged in slot order through shared
// memory, the block's partial published, and the last block to arrive merging the splits in
// split order. `m` / `l`: the lane's running max and (warp-reduced) sum of heads 2tq, 2tq + 1,
// written for the slot by the warps with `writes_ml` (one a slot).
template <int D, int SLOTS, int WARPS>
__device__ __forceinline__ void fd_merge(float* sm_o, const float* m, const float* l, int slot, bool writes_ml, int t,
                                         int kvh, int G, int n_q_heads, int b, int nb, store_t* __restrict__ out,
                                         float* part_acc, float* part_ml, unsigned* arrivals) {
    const int lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const int tk = t * (n_q_heads / G) + kvh;
    float* sm_m = sm_o + SLOTS * 8 * D;  // [SLOTS][8]
    float* sm_l = sm_m + SLOTS * 8;
    if (writes_ml && gr == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sm_m[slot * 8 + 2 * tq + h] = m[h];  // -inf (and l 0) for a slot without keys
            sm_l[slot * 8 + 2 * tq + h] = l[h];
        }
    }
    __syncthreads();
    const long long tok_row = (long long)t * n_q_heads + (long long)kvh * G;  // row of head 0
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
        const int g = i / D, d = i - g * D;
        float mb = NEG_INF;
#pragma unroll
        for (int w = 0; w < SLOTS; ++w) mb = fmaxf(mb, sm_m[w * 8 + g]);
        float lb = 0.0f, ob = 0.0f;
#pragma unroll
        for (int w = 0; w < SLOTS; ++w) {
            const float mw = sm_m[w * 8 + g];
            const float f = mw == NEG_INF ? 0.0f : exp2f(mw - mb);
            lb += sm_l[w * 8 + g] * f;
            ob += sm_o[(w * 8 + g) * D + d] * f;
        }
        store_block_result<D>(ob, mb, lb, d, tok_row + g, b, nb, FD_MAX_SPLITS, out, part_acc, part_ml);
    }
    if (nb == 1 || !arrives_last(arrivals + tk, (unsigned)nb)) return;
    // Last block: the nb split partials in split order, read through L2 (ld.global.cg: L1 is
    // not coherent with the other blocks' writes). Each head's max over the splits, the splits'
    // weights and their total once, in shared memory (free again: every thread is past the
    // warp merge); then each thread sums FD_MERGE_ROWS elements at a time with FD_MERGE_CHUNK
    // splits' loads of each in flight before any is used. Why: the first form re-read the
    // (max, sum) pairs for every element and waited on every load in turn, ~24 elements x nb
    // round trips a thread at d 256, most of the d 256 kernel's ~37 us floor at short contexts.
    float* sm_pm = sm_o;  // [8][FD_MAX_SPLITS] split max, then weight
    float* sm_pl = sm_pm + 8 * FD_MAX_SPLITS;         // [8][FD_MAX_SPLITS] split sum
    float* sm_tot = sm_pl + 8 * FD_MAX_SPLITS;        // [8] weighted total
    for (int i = threadIdx.x; i < G * nb; i += WARPS * 32) {
        const int g = i / nb, sp = i - g * nb;
        const float* ml = part_ml + ((tok_row + g) * FD_MAX_SPLITS + sp) * 2;
        sm_pm[g * FD_MAX_SPLITS + sp] = __ldcg(ml);
        sm_pl[g * FD_MAX_SPLITS + sp] = __ldcg(ml + 1);
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float* pm = sm_pm + threadIdx.x * FD_MAX_SPLITS;
        const float* pl = sm_pl + threadIdx.x * FD_MAX_SPLITS;
        float mx = NEG_INF;
        for (int sp = 0; sp < nb; ++sp) mx = fmaxf(mx, pm[sp]);
        float tot = 0.0f;
        for (int sp = 0; sp < nb; ++sp) {
            const float f = exp2f(pm[sp] - mx);
            pm[sp] = f;
            tot += pl[sp] * f;
        }
        sm_tot[threadIdx.x] = tot;
    }
    __syncthreads();
    for (int i0 = threadIdx.x; i0 < G * D; i0 += FD_MERGE_ROWS * WARPS * 32) {
        float acc[FD_MERGE_ROWS];
#pragma unroll
        for (int r = 0; r < FD_MERGE_ROWS; ++r) acc[r] = 0.0f;
        for (int s0 = 0; s0 < nb; s0 += FD_MERGE_CHUNK) {
            float v[FD_MERGE_ROWS][FD_MERGE_CHUNK];
#pragma unroll
            for (int r = 0; r < FD_MERGE_ROWS; ++r) {
                const int i = i0 + r * WARPS * 32;
                const int g = i / D, d = i - g * D;
                const float* pa = part_acc + (tok_row + g) * FD_MAX_SPLITS * D + d;
#pragma unroll
                for (int u = 0; u < FD_MERGE_CHUNK; ++u)
                    v[r][u] = i < G * D && s0 + u < nb ? __ldcg(pa + (long long)(s0 + u) * D) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < FD_MERGE_ROWS; ++r) {
                const int g = (i0 + r * WARPS * 32) / D;
#pragma unroll
                for (int u = 0; u < FD_MERGE_CHUNK; ++u)
                    if (s0 + u < nb) acc[r] += v[r][u] * sm_pm[min(g, 7) * FD_MAX_SPLITS + s0 + u];
            }
        }
#pragma unroll
        for (int r = 0; r < FD_MERGE_ROWS; ++r) {
            const int i = i0 + r * WARPS * 32;
            if (i < G * D) {
                const int g = i / D;
                out[(tok_row + g) * D + (i - g * D)] = from_f32(acc[r] / sm_tot[g]);
            }
        }
    }
}

// The online softmax of one 16-key tile of a tensor-core decode form, in place: `sc` the lane's
// S^T accumulators (keys kb + gr and kb + gr + 8, heads 2tq and 2tq + 1) become its
// probabilities (keys at or past `s_end` 0), the running max `m` and sum `l` of the two heads and
// the NT O^T accumulators are rescaled to the new max. ROUND: each probability rounded to the
// storage type before it is summed (the form whose P V runs in the storage type).
template <int NT, bool ROUND>
__device__ __forceinline__ void fd_tile_softmax(float* sc, float* m, float* l, float (*acc)[4], int kb, int gr,
                                                int s_end, float scale_log2) {
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sc[h] = kb + gr < s_end ? sc[h] * scale_log2 : NEG_INF;
        sc[h + 2] = kb + gr + 8 < s_end ? sc[h + 2] * scale_log2 : NEG_INF;
        mx[h] = fmaxf(m[h], fmaxf(sc[h], sc[h + 2]));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
    }
    // Every tile has a key (kb < s_end), so mx is finite from the first tile on.
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        corr[h] = exp2f(m[h] - mx[h]);
        m[h] = mx[h];
        sc[h] = ROUND ? round_st(exp2f(sc[h] - mx[h])) : exp2f(sc[h] - mx[h]);
        sc[h + 2] = ROUND ? round_st(exp2f(sc[h + 2] - mx[h])) : exp2f(sc[h + 2] - mx[h]);
        l[h] = l[h] * corr[h] + sc[h] + sc[h + 2];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] *= corr[0];
        acc[n][1] *= corr[1];
        acc[n][2] *= corr[0];
        acc[n][3] *= corr[1];
    }
}

template <int D>
__device__ __forceinline__ void flash_decode_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals, int min_tiles) {
    constexpr int WARPS = FD_WARPS(D);
    constexpr int LD = D + FA_PAD;
    constexpr int TILE = FD_BN * LD;  // elements of one K or V tile
    extern __shared__ uint4 fa_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gr = lane >> 2, tq = lane & 3;
    const int tk = blockIdx.x;  // token * n_kv_heads + kv head
    const int t = tk / n_kv_heads;
    const int kvh = tk - t * n_kv_heads;
    const int G = n_q_heads / n_kv_heads;
    pdl_enter();
    const int limit = token_pos[t] + 1;
    const int split = fd_split_keys(limit, WARPS, min_tiles);
    const int nb = (limit + split - 1) / split;
    const int b = blockIdx.y;
    if (b >= nb) return;  // beyond this token's splits (uniform over the block)
    const int s0 = b * split;
    const int s_end = min(limit, s0 + split);
    const int* table = block_tables + (long long)token_seq[t] * max_blocks;
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    store_t* kv0 = reinterpret_cast<store_t*>(fa_smem) + warp * 4 * TILE;  // [buf][K, V][TILE]

    // Q^T as B fragments (k = head dims, n = the group's heads): column gr is head gr, rows
    // k0 + 2tq (+1) and +8; heads past the group are zero columns.
    const float scale_log2 = scale * 1.4426950408889634f;
    unsigned qb[D / 16][2];
    {
        const bool live = gr < G;
        const store_t* qr = q + (long long)t * q_stride + (long long)(kvh * G + (live ? gr : 0)) * D + 2 * tq;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
            qb[k][0] = live ? ld32(qr + 16 * k) : 0u;
            qb[k][1] = live ? ld32(qr + 16 * k + 8) : 0u;
        }
    }
    // O^T accumulators: acc[n] holds dims 16n + gr (0, 1) and 16n + gr + 8 (2, 3) of heads
    // 2tq (0, 2) and 2tq + 1 (1, 3). The running max m and sum l are those two heads' (h = 0, 1).
    float acc[D / 16][4];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    // ldmatrix row addresses: K tiles as the A operand of S^T (rows = keys, non-transposed),
    // V tiles as the A operand of O^T (rows = head dims, transposed from the key rows).
    const int ka_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
    const int va_off = ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
    int kb = s0 + warp * FD_BN;
    if (kb < s_end)
        stage_kv_async<D, FD_BN, 32>(kv0, kv0 + TILE, k_cache, v_cache, table, kb, s_end, kvh,
                                     n_kv_heads, block_size, bs_shift, lane);
    for (int it = 0; kb < s_end; kb += WARPS * FD_BN, ++it) {
        store_t* ks = kv0 + (it & 1) * 2 * TILE;
        store_t* vs = ks + TILE;
        finish_v_async<D, FD_BN, 32>(vs, kb, s_end, lane);
        __syncwarp();  // tile `it` visible to the warp; the other buffer no longer read
        const int kn = kb + WARPS * FD_BN;
        if (kn < s_end) {
            store_t* nk = kv0 + ((it + 1) & 1) * 2 * TILE;
            stage_kv_async<D, FD_BN, 32>(nk, nk + TILE, k_cache, v_cache, table, kn, s_end, kvh,
                                         n_kv_heads, block_size, bs_shift, lane);
        }
        // S^T = K Q^T: rows gr, gr + 8 = keys kb + gr (+8), columns 2tq, 2tq + 1 = heads.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const unsigned ka = smem_u32(ks + ka_off);
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
            unsigned a[4];
            ldsm_x4(a, ka + k * 32);
            mma16816(sc, a, qb[k][0], qb[k][1]);
        }
        fd_tile_softmax<D / 16, false>(sc, m, l, acc, kb, gr, s_end, scale_log2);
        // P^T (keys x heads) in f16, transposed into the B fragments of O^T += V^T P^T.
        const unsigned pb0 = movmatrix_trans(pack_f16x2(sc[0], sc[1]));
        const unsigned pb1 = movmatrix_trans(pack_f16x2(sc[2], sc[3]));
        const unsigned va = smem_u32(vs + va_off);
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
            unsigned a[4];
            ldsm_x4_trans(a, va + n * 32);
            mma16816_f16(acc[n], a, pb0, pb1);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the warp's sums over its keys (rows gr of every lane)
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }

    // Merge the warps in warp order (shared memory reused: every warp is past its tiles).
    __syncthreads();
    float* ow = reinterpret_cast<float*>(fa_smem) + (warp * 8 + 2 * tq) * D + gr;  // head 2tq, dim gr
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        ow[16 * n] = acc[n][0];
        ow[D + 16 * n] = acc[n][1];
        ow[16 * n + 8] = acc[n][2];
        ow[D + 16 * n + 8] = acc[n][3];
    }
    fd_merge<D, WARPS, WARPS>(reinterpret_cast<float*>(fa_smem), m, l, warp, true, t, kvh, G, n_q_heads, b, nb, out,
                              part_acc, part_ml, arrivals);
}

// ---------------------------------------------------------------------------------------------
// Decode attention on tensor cores with K/V loaded straight into mma fragments
// (flash_decode_direct_d*): the form of decode launches below TC_DECODE_MIN_TOKENS tokens where
// it fits (ops/decode_attention.rs, form TensorCoreDirect).
//
// Why: flash_decode_* stages its tiles through 68-70 KiB of shared memory a block; the SMs then
// take a large shared carveout, and the decode GEMVs around it run with a small L1 (below 16
// tokens that cost more in the model than the kernel saved, docs/kernels.md). The CUDA-core
// forms that run there instead spend ~300 instructions a warp on every 2 KB of K/V (dot
// products, shuffle reductions, an exp per key and head), which bounds batch-1 decode at long
// contexts (~1.9 TB/s at 16k keys on Llama-3-8B). Here every lane loads 16-byte slices of K and
// V rows into registers and they are the fragments: the head dims of S^T = K Q^T are summed in
// an order of our choosing, so a lane's four A-fragment elements of two k-steps are 8
// consecutive dims of one key row (one 16-byte load; Q^T's B fragments are loaded in the same
// order), and for O^T += V^T P^T the head dims (the M rows) are permuted so that a lane's rows
// of every m-tile are 8 consecutive dims of each of its 4 keys (two key rows' halves paired by
// byte permutes), un-permuted when the warp's accumulators go to shared memory. P V runs in the
// storage type (bf16 P, as flash attention's bf16 path; the softmax sums the rounded P). No
// staging: the only shared memory is the warps' merge (16 KiB at d 128).
//
// Layout: a block of FDD_WARPS warps owns (token, kv head, split of fdd_split_keys(limit,
// splits) keys), warp w the 16-key tiles w, w + WARPS, ... of the split; the next tile's rows
// are requested before this one's are used. `splits` (at most FD_MAX_SPLITS) is the launch's:
// the launcher aims at two blocks an SM over the launch's tokens and kv heads
// (ops/decode_attention.rs tc_direct_splits), so a token's layout depends on its context and
// on the launch's token count (as the form does), not on the other tokens' contexts. Before the PDL
// wait a warp requests its first tile (every key but a token's newest was written by earlier
// steps; the step's metadata was uploaded before it) and loads that tile again after the wait
// if it holds the newest key. d 64 and 128 (a tile and the next take 32-64 registers each).
// Keys a split takes for a token seeing `limit` keys: `splits` splits at most, whole blocks'
// worth of tiles (FDD_WARPS x FD_BN keys) each. = ops/decode_attention.rs tc_direct_split_keys.
__device__ __forceinline__ int fdd_split_keys(int limit, int splits) {
    const int unit = FDD_WARPS * FD_BN;
    const int need = (limit + splits - 1) / splits;
    return max(unit, (need + unit - 1) / unit * unit);
}

__device__ __forceinline__ unsigned u4_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// One 16-key tile of a lane: K rows gr and gr + 8 at dims 32p + 8tq .. +7 (k[h][p]); V rows
// 2tq, 2tq + 1, 2tq + 8, 2tq + 9 at dims 64c + 8gr .. +7 (v[i][c]). Keys past `s_end` read the
// split's last key (a valid row; masked out of the softmax).
template <int D>
struct FddTile {
    static constexpr int KC = D / 32, VC = D / 64;
    uint4 k[2][KC];
    uint4 v[4][VC];
    __device__ __forceinline__ void load(const store_t* __restrict__ k_cache, const store_t* __restrict__ v_cache,
                                         const int* __restrict__ table, int kb, int s_end, int block_size,
                                         long long row_elems, long long head_off, int gr, int tq) {
        const int last = s_end - 1 - kb;  // the tile's last live row
        const int kr[2] = {min(gr, last), min(gr + 8, last)};
        const int vr[4] = {min(2 * tq, last), min(2 * tq + 1, last), min(2 * tq + 8, last), min(2 * tq + 9, last)};
        long long ko[2], vo[4];
        if ((block_size & 15) == 0) {  // the tile is inside one cache block (kb is a multiple of 16)
            const long long base = ((long long)table[kb / block_size] * block_size + kb % block_size) * row_elems + head_off;
#pragma unroll
            for (int h = 0; h < 2; ++h) ko[h] = base + kr[h] * row_elems;
#pragma unroll
            for (int i = 0; i < 4; ++i) vo[i] = base + vr[i] * row_elems;
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = kb + kr[h];
                ko[h] = ((long long)table[j / block_size] * block_size + j % block_size) * row_elems + head_off;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = kb + vr[i];
                vo[i] = ((long long)table[j / block_size] * block_size + j % block_size) * row_elems + head_off;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int p = 0; p < KC; ++p)
                k[h][p] = *reinterpret_cast<const uint4*>(k_cache + ko[h] + 32 * p + 8 * tq);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < VC; ++c)
                v[i][c] = *reinterpret_cast<const uint4*>(v_cache + vo[i] + 64 * c + 8 * gr);
    }
};

template <int D>
__device__ __forceinline__ void flash_decode_direct_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals, int splits) {
    static_assert(D == 64 || D == 128 || D == 256, "a lane's two tiles of K/V must fit its registers");
    // At d 256 a pair of warps shares each tile, one half of the head dims a warp (DH each).
    constexpr int DH = D > 128 ? 128 : D, HALVES = D / DH;
    constexpr int WARPS = FDD_WARPS, SLOTS = WARPS / HALVES;
    extern __shared__ uint4 fa_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gr = lane >> 2, tq = lane & 3;
    const int half = warp % HALVES, slot = warp / HALVES;
    const int tk = blockIdx.x;  // token * n_kv_heads + kv head
    const int t = tk / n_kv_heads;
    const int kvh = tk - t * n_kv_heads;
    const int G = n_q_heads / n_kv_heads;
    const int limit = token_pos[t] + 1;
    const int split = fdd_split_keys(limit, splits);
    const int nb = (limit + split - 1) / split;
    const int b = blockIdx.y;
    if (b >= nb) {  // beyond this token's splits (uniform over the block)
        pdl_enter();
        return;
    }
    const int s0 = b * split;
    const int s_end = min(limit, s0 + split);
    const int* table = block_tables + (long long)token_seq[t] * max_blocks;
    const long long row_elems = (long long)n_kv_heads * D;
    const long long head_off = (long long)kvh * D + half * DH;
    int kb = s0 + slot * FD_BN;
    FddTile<DH> cur;
    if (kb < s_end) cur.load(k_cache, v_cache, table, kb, s_end, block_size, row_elems, head_off, gr, tq);
    pdl_enter();
    // The newest key's row is written by the kernel just waited for: a first tile holding it
    // is loaded again.
    if (kb < s_end && s_end == limit && kb + FD_BN > limit - 1)
        cur.load(k_cache, v_cache, table, kb, s_end, block_size, row_elems, head_off, gr, tq);

    // Q^T as B fragments in the K tile's dim order: k-step k's rows 2tq, 2tq + 1 (b0) and
    // 2tq + 8, 2tq + 9 (b1) are dims 32(k / 2) + 8tq + 4(k % 2) + 0, 1 and + 2, 3; column gr is
    // head gr, heads past the group zero columns.
    const float scale_log2 = scale * 1.4426950408889634f;
    unsigned qb[DH / 16][2];
    {
        const bool live = gr < G;
        const store_t* qr = q + (long long)t * q_stride + (long long)(kvh * G + (live ? gr : 0)) * D + half * DH + 8 * tq;
#pragma unroll
        for (int k = 0; k < DH / 16; ++k) {
            qb[k][0] = live ? ld32(qr + 32 * (k >> 1) + 4 * (k & 1)) : 0u;
            qb[k][1] = live ? ld32(qr + 32 * (k >> 1) + 4 * (k & 1) + 2) : 0u;
        }
    }
    // O^T accumulators: acc[n] rows gr / gr + 8 of m-tile n are dims 64(n / 4) + 8gr + 2(n % 4)
    // + 0 / 1; columns heads 2tq (0, 2) and 2tq + 1 (1, 3).
    float acc[DH / 16][4];
#pragma unroll
    for (int n = 0; n < DH / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int it = 0; kb < s_end; kb += SLOTS * FD_BN, ++it) {
        const int kn = kb + SLOTS * FD_BN;
        FddTile<DH> nxt;
        if (kn < s_end) nxt.load(k_cache, v_cache, table, kn, s_end, block_size, row_elems, head_off, gr, tq);
        // S^T = K Q^T: rows gr, gr + 8 = keys kb + gr (+8), columns 2tq, 2tq + 1 = heads.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < DH / 16; ++k) {
            const int p = k >> 1, w = 2 * (k & 1);
            const unsigned a[4] = {u4_word(cur.k[0][p], w), u4_word(cur.k[1][p], w), u4_word(cur.k[0][p], w + 1),
                                   u4_word(cur.k[1][p], w + 1)};
            mma16816(sc, a, qb[k][0], qb[k][1]);
        }
        if constexpr (HALVES == 2) {
            // The pair's two halves of each dot product summed (a + b == b + a: both warps hold
            // the same scores and so the same softmax), through a buffer a tile parity so that
            // one barrier a tile orders a write after the partner's read of two tiles before.
            __shared__ float4 fdd_x[2][FDD_WARPS][32];
            fdd_x[it & 1][warp][lane] = make_float4(sc[0], sc[1], sc[2], sc[3]);
            if (slot == 0)  // immediate barrier ids (a register id reserves all 16)
                asm volatile("bar.sync 1, 64;" ::: "memory");
            else
                asm volatile("bar.sync 2, 64;" ::: "memory");
            const float4 o = fdd_x[it & 1][warp ^ 1][lane];
            sc[0] += o.x;
            sc[1] += o.y;
            sc[2] += o.z;
            sc[3] += o.w;
        }
        // The probabilities rounded to the storage type before they are summed into l, so the
        // weights P V multiplies are the ones it is normalised by.
        fd_tile_softmax<DH / 16, true>(sc, m, l, acc, kb, gr, s_end, scale_log2);
        // P^T (keys x heads) in the storage type, transposed into O^T's B fragments.
        const unsigned pb0 = movmatrix_trans(pack2(sc[0], sc[1]));
        const unsigned pb1 = movmatrix_trans(pack2(sc[2], sc[3]));
        // V^T's A fragment of m-tile n: row gr (gr + 8) is the low (high) half of word n % 4 of
        // each key's slice c = n / 4; columns keys 2tq, 2tq + 1 (a0, a1) and 2tq + 8, 2tq + 9.
#pragma unroll
        for (int n = 0; n < DH / 16; ++n) {
            const int c = n >> 2, w = n & 3;
            const unsigned v0 = u4_word(cur.v[0][c], w), v1 = u4_word(cur.v[1][c], w);
            const unsigned v2 = u4_word(cur.v[2][c], w), v3 = u4_word(cur.v[3][c], w);
            const unsigned a[4] = {__byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632),
                                   __byte_perm(v2, v3, 0x5410), __byte_perm(v2, v3, 0x7632)};
            mma16816(acc[n], a, pb0, pb1);
        }
        cur = nxt;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the warp's sums over its keys (rows gr of every lane)
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }
    // The accumulators to shared memory by head dim (the permutation undone), then the merge
    // of the slots (both warps of a pair hold the same max and sum).
    float* ow = reinterpret_cast<float*>(fa_smem) + (slot * 8 + 2 * tq) * D + half * DH + 8 * gr;  // head 2tq
#pragma unroll
    for (int n = 0; n < DH / 16; ++n) {
        float* o = ow + 64 * (n >> 2) + 2 * (n & 3);
        *reinterpret_cast<float2*>(o) = make_float2(acc[n][0], acc[n][2]);
        *reinterpret_cast<float2*>(o + D) = make_float2(acc[n][1], acc[n][3]);
    }
    fd_merge<D, SLOTS, WARPS>(reinterpret_cast<float*>(fa_smem), m, l, slot, half == 0, t, kvh, G, n_q_heads, b, nb,
                              out, part_acc, part_ml, arrivals);
}

#define FD_BODY(D)                                                                              \
    flash_decode_body<D>(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_pos,   \
                         n_q_heads, n_kv_heads, q_stride, block_size, scale, out, part_acc,     \
                         part_ml, arrivals, min_warp_tiles);

#define FDD_BODY(D)                                                                             \
    flash_decode_direct_body<D>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,       \
                                token_pos, n_q_heads, n_kv_heads, q_stride, block_size, scale,  \
                                out, part_acc, part_ml, arrivals, splits);

#define FA_BODY(D, BN, WARPS, PIPE)                                                             \
    flash_body<D, BN, WARPS, PIPE>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,     \
                                   cu_seqlens, token_pos, n_q_heads, n_kv_heads, block_size,    \
                                   scale_log2, out);
#else
#define FA_BODY(D, BN, WARPS, PIPE)
#define FD_BODY(D)
#define FDD_BODY(D)
#endif

// (head size, keys per tile, warps, cp.async double buffer); the launcher's table in
// flash_attention.rs repeats these. Key tiles of 64 up to d 128; 32 at d 256, where the f32
// output accumulators already take 128 registers a lane.
#define FA_INSTANCE(NAME, D, BN, WARPS, PIPE)                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                              \
        const store_t* q, long long q_stride, const store_t* k_cache, const store_t* v_cache,   \
        const int* block_tables, int max_blocks, const int* cu_seqlens, const int* token_pos,   \
        int n_q_heads, int n_kv_heads, int block_size, float scale_log2, store_t* out) {        \
        FA_BODY(D, BN, WARPS, PIPE)                                                             \
    }

FA_INSTANCE(flash_attention_d64, 64, 64, 4, false)
FA_INSTANCE(flash_attention_d96, 96, 64, 4, false)
FA_INSTANCE(flash_attention_d128, 128, 64, 4, false)
FA_INSTANCE(flash_attention_d256, 256, 32, 4, false)
FA_INSTANCE(flash_attention_d256_r128, 256, 32, 8, true)
FA_INSTANCE(flash_attention_d128_r128, 128, 64, 8, true)
FA_INSTANCE(flash_attention_d128_r128_k128, 128, 128, 8, true)

// The wgmma form (flash_wgmma_body): the same arguments, 8 warps, dynamic shared memory Q + two
// buffers of K, V and V^T, aligned to 1 KiB (225 KiB at d 128, 193 at d 256). Only sm_90a code has wgmma;
// elsewhere the kernel exists (every arch compiles the same names) and traps, and the launcher
// never routes to it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA_WGMMA_BODY(D, BN)                                                                    \
    flash_wgmma_body<D, BN>(q, q_stride, k_cache, v_cache, block_tables, max_blocks, cu_seqlens,\
                            token_pos, n_q_heads, n_kv_heads, block_size, scale_log2, out);
#else
#define FA_WGMMA_BODY(D, BN) __trap();
#endif
// A wgmma-form kernel: the arguments above, __launch_bounds__ of the trailing arguments.
#define FA_WGMMA_KERNEL(NAME, BODY, ...)                                                        \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) NAME(                             \
        const store_t* q, long long q_stride, const store_t* k_cache, const store_t* v_cache,   \
        const int* block_tables, int max_blocks, const int* cu_seqlens, const int* token_pos,   \
        int n_q_heads, int n_kv_heads, int block_size, float scale_log2, store_t* out) {        \
        BODY                                                                                    \
    }
#define FA_WGMMA_INSTANCE(NAME, D, BN) FA_WGMMA_KERNEL(NAME, FA_WGMMA_BODY(D, BN), 256)

FA_WGMMA_INSTANCE(flash_attention_d128_wgmma, 128, 128)
FA_WGMMA_INSTANCE(flash_attention_d256_wgmma, 256, 32)

// The warp-specialized form (flash_wgmma_ws_body): the arguments above and three more (the
// scheduler's two counters, zero before the launch and left zero; the row tiles and the
// sequences of the work), 12 warps (a producer warpgroup and two consumer warpgroups), the wgmma
// form's shared memory, a block an SM (persistent); the direct form only, so sm_90a code built by
// NVRTC 13 (the launcher checks the NVRTC that built it).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && FA_WGMMA_DIRECT_V
#define FA_WGMMA_WS_BODY(D, BN)                                                                 \
    flash_wgmma_ws_body<D, BN>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,         \
                               cu_seqlens, token_pos, n_q_heads, n_kv_heads, block_size,        \
                               scale_log2, out, work, row_tiles, n_seqs);
#else
#define FA_WGMMA_WS_BODY(D, BN) __trap();
#endif
#define FA_WGMMA_WS_INSTANCE(NAME, D, BN)                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                  \
        const store_t* q, long long q_stride, const store_t* k_cache, const store_t* v_cache,   \
        const int* block_tables, int max_blocks, const int* cu_seqlens, const int* token_pos,   \
        int n_q_heads, int n_kv_heads, int block_size, float scale_log2, store_t* out,          \
        unsigned* work, int row_tiles, int n_seqs) {                                            \
        FA_WGMMA_WS_BODY(D, BN)                                                                 \
    }

FA_WGMMA_WS_INSTANCE(flash_attention_d128_wgmma_ws, 128, 128)
FA_WGMMA_WS_INSTANCE(flash_attention_d256_wgmma_ws, 256, 32)

// The batched tensor-core decode attention (flash_decode_body); the arguments of
// decode_attention.cu's kernels, the last the fewest tiles a warp takes in a split (theirs: the
// fewest keys a warp), dynamic shared memory ops/decode_attention.rs `tc_smem_bytes`. Heads
// per group at most 8.
#define FD_INSTANCE(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(FD_WARPS(D) * 32) flash_decode_d##D(          \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, int min_warp_tiles) { \
        FD_BODY(D)                                                                              \
    }

FD_INSTANCE(64)
FD_INSTANCE(128)
FD_INSTANCE(256)

// The tensor-core decode attention with K/V straight into fragments (flash_decode_direct_body):
// the arguments of flash_decode_d*, the last the most splits a token takes (theirs: the fewest
// tiles a warp); dynamic shared memory ops/decode_attention.rs `tc_direct_smem_bytes` (the
// warps' merge). Two blocks an SM at most 255 registers a thread.
#define FDD_INSTANCE(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(FDD_WARPS * 32, 2) flash_decode_direct_d##D(  \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, int splits) {        \
        FDD_BODY(D)                                                                             \
    }

FDD_INSTANCE(64)
FDD_INSTANCE(128)
FDD_INSTANCE(256)
