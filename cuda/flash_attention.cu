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
// paged_attention kernel), so the bodies compile to nothing below sm_80. The Hopper tilings are
// flash_attention_sm90.cu; the pieces both share, attention_mma.cuh.
#include "common.cuh"
#include "attention_mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
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

#define FA_BODY(D, BN, WARPS, PIPE)                                                             \
    flash_body<D, BN, WARPS, PIPE>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,     \
                                   cu_seqlens, token_pos, n_q_heads, n_kv_heads, block_size,    \
                                   scale_log2, out);
#else
#define FA_BODY(D, BN, WARPS, PIPE)
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
