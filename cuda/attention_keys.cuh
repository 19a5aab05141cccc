// The CUDA-core attention kernels' key walk (attention.cu's paged attention, decode_attention.cu's
// fixed-split decode form): a lane's K/V loads, the decode splits' partition of a context, and
// one warp's split folded into its GQA group's online softmax.

#define ATTN_KEYS 4

// Loads a lane's EPL contiguous storage elements as f32, with one vector load where the
// width allows (the row offset is a multiple of EPL elements, so the address is aligned).
template <int EPL>
__device__ __forceinline__ void load_lane(const store_t* __restrict__ p, float* out) {
    if constexpr (EPL == 8) {
        const uint4 r = *reinterpret_cast<const uint4*>(p);
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = to_f32((store_t)(w[i] & 0xffffu));
            out[2 * i + 1] = to_f32((store_t)(w[i] >> 16));
        }
    } else if constexpr (EPL == 4) {
        const uint2 r = *reinterpret_cast<const uint2*>(p);
        out[0] = to_f32((store_t)(r.x & 0xffffu));
        out[1] = to_f32((store_t)(r.x >> 16));
        out[2] = to_f32((store_t)(r.y & 0xffffu));
        out[3] = to_f32((store_t)(r.y >> 16));
    } else if constexpr (EPL == 2) {
        const unsigned r = *reinterpret_cast<const unsigned*>(p);
        out[0] = to_f32((store_t)(r & 0xffffu));
        out[1] = to_f32((store_t)(r >> 16));
    } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) out[e] = to_f32(p[e]);
    }
}

// G q heads that share one KV head (a GQA group, or 1 where the group size has no instance)
// are handled by one warp, so each K/V row is read once for the group. KB keys per iteration
// keep several rows in flight; fewer when G * D/32 registers per key are already many.
// Keys per split of a decode token that sees `limit` keys: DECODE_MIN_PARTITION up to a
// DECODE_MIN_PARTITION * DECODE_SPLITS (512) key context, then the context's power-of-two
// ceiling / DECODE_SPLITS, so that a token never needs more than DECODE_SPLITS splits (the
// launcher's grid height for decode). Short splits matter at batch 1, where a warp's keys are
// one dependent memory round trip per ATTN_KEYS of them: a 170-key context in splits of 64 ran
// on 3 warps per GQA group, each walking 64 keys one after another; in splits of 8 it runs on
// 22 warps of two round trips (H200, one_kernel_decode_attention_timing at batch 1 and a
// 256-key context: Llama-3-8B heads 12.1 -> 8.9 us, Qwen3.5-27B heads 8.2 -> 7.0 us going from
// splits of 16 to 8; 4096 keys unchanged at 32.6 us. Loading a warp's block-table entries once
// up front instead of per key was tried too and cost 12-17% at 4096 keys).
// DECODE_SPLITS must match ops/attention.rs.
#define DECODE_SPLITS 64
#define DECODE_MIN_PARTITION 8
__device__ __forceinline__ int decode_partition(int limit) {
    int p2 = 1;
    while (p2 < limit) p2 <<= 1;
    return max(DECODE_MIN_PARTITION, p2 / DECODE_SPLITS);
}

// The keys start..end of one warp's split, folded into its G rows' online softmax state (acc,
// m, l): KB keys per iteration so that their K/V rows are in flight together. `table` is the
// sequence's block-table row, `head_off` the lane's offset in a cache row (kv head and lane).
template <int D, int G>
__device__ __forceinline__ void attend_keys(const store_t* __restrict__ k_cache,
                                            const store_t* __restrict__ v_cache,
                                            const int* __restrict__ table, int n_kv_heads,
                                            int block_size, long long head_off, int start, int end,
                                            const float (&qv)[G][D / 32], float (&acc)[G][D / 32],
                                            float (&m)[G], float (&l)[G]) {
    constexpr int EPL = D / 32;
    constexpr int KB = (G * EPL > 16) ? 2 : ATTN_KEYS;
    for (int j = start; j < end; j += KB) {
        const int nk = min(KB, end - j);
        long long off[KB];
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            const int jj = j + (u < nk ? u : 0);
            off[u] = ((long long)table[jj / block_size] * block_size + (jj % block_size)) *
                         n_kv_heads * D + head_off;
        }
        float kf[KB][EPL], vf[KB][EPL], s[KB][G];
#pragma unroll
        for (int u = 0; u < KB; ++u) load_lane<EPL>(k_cache + off[u], kf[u]);
#pragma unroll
        for (int u = 0; u < KB; ++u) load_lane<EPL>(v_cache + off[u], vf[u]);
#pragma unroll
        for (int u = 0; u < KB; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) d = fmaf(qv[g][e], kf[u][e], d);
                s[u][g] = d;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < KB; ++u) {
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float smax = s[0][g];
#pragma unroll
            for (int u = 1; u < KB; ++u)
                if (u < nk) smax = fmaxf(smax, s[u][g]);
            const float m_new = fmaxf(m[g], smax);
            const float corr = expf(m[g] - m_new);
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                if (u < nk) {
                    const float p = expf(s[u][g] - m_new);
                    l[g] += p;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e]);
                }
            }
            m[g] = m_new;
        }
    }
}
