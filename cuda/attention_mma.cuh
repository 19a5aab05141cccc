// The tensor-core attention kernels' shared pieces (mma.sync fragments, K/V staging from the
// paged cache, the online softmax of a tile, the prefill work items and row stores), included by
// the mma.sync prefill (flash_attention.cu), the Hopper prefill (flash_attention_sm90.cu) and the
// direct tensor-core decode (decode_attention.cu). Tensor-core mma and cp.async need sm_80: below
// it these compile to nothing (the launchers route sm_70/sm_75 elsewhere).

// Shared-memory rows are padded by 8 elements (16 bytes): 32-bit fragment loads of 8 rows x 4
// lanes then fall in distinct banks, and ldmatrix row addresses stay 16-byte aligned.
#define FA_PAD 8

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
#endif
