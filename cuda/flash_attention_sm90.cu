// Causal flash attention for prefill on Hopper's warpgroup tensor cores (sm_90a code): the
// wgmma tilings and their warp-specialized form. The problem, the packing of query rows and the
// arithmetic are flash_attention.cu's (see its header); the pieces both share are
// attention_mma.cuh's.
#include "common.cuh"
#include "attention_mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
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
// Llama-3-8B prompt, H200.)
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
// Measured on the H200 (8k-token Llama-3-8B attention): 1.678 ms against 2.302 for the
// transposing form; the transposes alone were ~27% of that kernel (knocking out only them gave
// 1.694). ptxas of CUDA 12.9
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
// d 128 attention) counted
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
// (~2.97 us a 128-key tile at 8k against ~1.5 for its wgmma alone). Here, as in FlashAttention-3, a third warpgroup only copies: it fills three K/V
// buffers by cp.async and signals each through a "full" mbarrier (cp.async.mbarrier.arrive
// .noinc: the arrival lands when the thread's copies have), and waits on the buffer's "empty"
// mbarrier (one arrival a consumer warp, after its P V of that tile) before refilling it. The
// two consumer warpgroups (64 query rows each) never meet at a block barrier: each waits for
// its own tiles only, so they drift apart and one's softmax runs under the other's products.
// The producer gives registers back (setmaxnreg: 56 a lane) so the consumers keep
// flash_wgmma_body's 224 at 384 threads. Measured on the H200 (8k-token Llama-3-8B attention):
// 1.274 ms against 1.509 for flash_wgmma_body (432 against 364 TFLOP/s; 1.175 since the
// softmax's bare ex2). Making the
// consumers take turns at the tensor cores (FlashAttention-3's "ping-pong", two named barriers)
// measured the same (1.281 ms) and was dropped.
// Per tile the arithmetic is flash_wgmma_body's, in the same order: the outputs are equal bit
// for bit (the flash op tests require it of every case, rust_core/tests/cuda_ops.rs `flash_case`).
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
// (Nsight Compute, 8k d 128: 9% of the warp samples in those two phases, the Q
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
#endif

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

