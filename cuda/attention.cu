// Paged attention for decode and prefill, one kernel for both.
//
// The KV cache is paged: k_cache / v_cache are [num_blocks, block_size, n_kv_heads, D] and a
// sequence's i-th block is block_tables[seq * max_blocks + i]. Every query token t belongs to
// sequence token_seq[t] and sees keys 0..=token_pos[t] (causal; the new tokens' K/V are already
// in the cache). Decode is the case of one token per sequence at position context_len - 1.
//
// One warp computes one token's G q heads of one GQA group (G = the group size when it is 2, 4
// or 8, else 1): each lane holds D/32 contiguous elements of q and of the output accumulators,
// scores are warp reductions, and the softmax is online (running max and sum), so no score
// matrix is stored: flash-attention style. Each K/V row is read once per group, and several
// keys are taken per iteration so that their rows are in flight together. Grid dimension y splits the
// key range into partitions of `partition` keys (split-K flash decoding): with one split the
// kernel writes the normalised output, with several it writes unnormalised partials and their
// (max, sum) for attention_combine; `partition` <= 0 lets each token size its splits from its
// own context (decode_partition). GQA: q head h reads kv head h / (n_q_heads / n_kv_heads).
#include "common.cuh"

#define ATTN_WARPS 4
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

template <int D, int G>
__device__ __forceinline__ void attention_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_tokens,
    int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale, int partition,
    store_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    constexpr int EPL = D / 32;
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int warps_per_token = n_q_heads / G;
    const int w = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (w >= n_tokens * warps_per_token) return;
    const int t = w / warps_per_token;
    const int h0 = (w - t * warps_per_token) * G;
    const int kvh = h0 / (n_q_heads / n_kv_heads);
    const int seq = token_seq[t];
    const int limit = token_pos[t] + 1;
    const int split = blockIdx.y;
    const int n_splits = gridDim.y;
    // partition <= 0: each token picks its own split size from its own context length (decode
    // steps, see decode_partition), so its result does not depend on the other rows of the step
    // and the launch arguments do not depend on the context (a CUDA graph replays them).
    const int part = partition > 0 ? partition : decode_partition(limit);
    const int start = split * part;
    const int end = min(limit, start + part);
    if (n_splits > 1 && start >= limit) {
        // Idle split: mark it empty (l = 0) so that the combine skips it without reading acc.
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const long long p_idx = ((long long)t * n_q_heads + h0 + g) * n_splits + split;
                part_ml[p_idx * 2] = NEG_INF;
                part_ml[p_idx * 2 + 1] = 0.0f;
            }
        }
        return;
    }

    float qv[G][EPL], acc[G][EPL], m[G], l[G];
    softmax_state_init<G, EPL, D>(q + t * q_stride + (long long)h0 * D + lane * EPL, scale, qv, acc, m, l);
    attend_keys<D, G>(k_cache, v_cache, block_tables + (long long)seq * max_blocks, n_kv_heads,
                      block_size, (long long)kvh * D + lane * EPL, start, end, qv, acc, m, l);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const long long row = (long long)t * n_q_heads + h0 + g;
        if (n_splits == 1) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            store_t* orow = out + row * D + lane * EPL;
#pragma unroll
            for (int e = 0; e < EPL; ++e) orow[e] = from_f32(acc[g][e] * inv);
        } else {
            const long long p_idx = row * n_splits + split;
            float* prow = part_acc + p_idx * D + lane * EPL;
#pragma unroll
            for (int e = 0; e < EPL; ++e) prow[e] = acc[g][e];
            if (lane == 0) {
                part_ml[p_idx * 2] = m[g];
                part_ml[p_idx * 2 + 1] = l[g];
            }
        }
    }
}

// Merges the split partials of attention_body (rows are (token, q head)): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// Lane i reads the (max, sum) of splits i, i + 32, ..., so the maximum and the weights come
// from warp reductions and shuffles instead of a serial walk with a load per split; the
// accumulators of CB splits are then loaded together before they are added (in split order).
// Decode's short splits give up to DECODE_SPLITS live splits per row, so this walk matters.
#define COMBINE_BATCH 4
template <int D>
__device__ __forceinline__ void combine_body(const float* __restrict__ part_acc,
                                             const float* __restrict__ part_ml, int n_rows,
                                             int n_splits, store_t* __restrict__ out) {
    constexpr int EPL = D / 32;
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int w = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (w >= n_rows) return;
    const long long row0 = (long long)w * n_splits;
    float mx = NEG_INF;
    for (int s = lane; s < n_splits; s += 32) mx = fmaxf(mx, part_ml[(row0 + s) * 2]);
    mx = warp_max(mx);
    float acc[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[e] = 0.0f;
    float total = 0.0f;
    if (mx != NEG_INF) {
        float lane_total = 0.0f;
        for (int s0 = 0; s0 < n_splits; s0 += 32) {
            // This lane's split s0 + lane: its weight e^(m_s - M), 0 for an empty split (no
            // keys: l = 0), whose accumulators idle splits do not even write.
            float f = 0.0f;
            if (s0 + lane < n_splits) {
                const float ls = part_ml[(row0 + s0 + lane) * 2 + 1];
                if (ls != 0.0f) {
                    f = expf(part_ml[(row0 + s0 + lane) * 2] - mx);
                    lane_total += ls * f;
                }
            }
            const int n = min(32, n_splits - s0);
            for (int j0 = 0; j0 < n; j0 += COMBINE_BATCH) {
                float fj[COMBINE_BATCH], v[COMBINE_BATCH][EPL];
#pragma unroll
                for (int u = 0; u < COMBINE_BATCH; ++u) {
                    fj[u] = __shfl_sync(0xffffffffu, f, (j0 + u) & 31);
                    if (j0 + u >= n) fj[u] = 0.0f;
                }
#pragma unroll
                for (int u = 0; u < COMBINE_BATCH; ++u) {
                    const float* prow = part_acc + (row0 + s0 + j0 + u) * D + lane * EPL;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) v[u][e] = fj[u] != 0.0f ? prow[e] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < COMBINE_BATCH; ++u) {
                    if (fj[u] != 0.0f) {
#pragma unroll
                        for (int e = 0; e < EPL; ++e) acc[e] = fmaf(v[u][e], fj[u], acc[e]);
                    }
                }
            }
        }
        total = warp_sum(lane_total);
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    store_t* orow = out + (long long)w * D + lane * EPL;
#pragma unroll
    for (int e = 0; e < EPL; ++e) orow[e] = from_f32(acc[e] * inv);
}

// Decode attention in one kernel with a fixed DA_SPLITS block splits per (token, group), kept as
// the baseline that decode steps' kernel (decode_attention_* in decode_attention.cu, whose splits
// grow with the context) is timed against (`paged_attention_decode_fixed`, tests only).
// Without attention_combine. A block owns one (token, GQA
// group) and one "block split" of DA_WARPS consecutive warp splits; warp split
// blockIdx.y * DA_WARPS + warp walks decode_partition(limit) keys exactly as attention_body's
// split of that index does, so a token still never needs more than DECODE_SPLITS warp splits,
// i.e. DA_SPLITS blocks, and the grid (tokens x groups, DA_SPLITS) does not depend on the
// contexts (a CUDA graph replays it). The warps of a block merge their partials through
// shared memory in warp order. A token whose keys fit one block split (limit <=
// DA_WARPS * partition: up to 128 keys) is done there: block 0 writes the normalised output.
// Otherwise each live block writes its merged partial (acc, max, sum) to the scratch,
// `__threadfence()`s, and one thread counts the block in with atomicInc on the (token, group)
// arrival counter; the block that arrives last merges the block partials in split order
// 0..nb-1, so the result is the same whichever block is last (deterministic: graph == eager,
// batch == alone, since nb and every split's keys depend on the token's own context only).
// nb, the live block splits, is known on device from the context; idle block splits exit
// without arriving. The election (and the counter's reset for the next layer / step / replay) is
// common.cuh's arrives_last.
#define DA_WARPS 8
#define DA_SPLITS (DECODE_SPLITS / DA_WARPS)
template <int D, int G>
__device__ __forceinline__ void decode_attention_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals) {
    constexpr int EPL = D / 32;
    __shared__ float sm_acc[DA_WARPS][D];
    __shared__ float sm_m[DA_WARPS][G], sm_l[DA_WARPS][G];
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int wi = threadIdx.x >> 5;
    const int groups = n_q_heads / G;
    const int tg = blockIdx.x;
    const int t = tg / groups;
    const int h0 = (tg - t * groups) * G;
    const int kvh = h0 / (n_q_heads / n_kv_heads);
    const int limit = token_pos[t] + 1;
    const int part = decode_partition(limit);
    const int block_keys = part * DA_WARPS;
    const int nb = (limit + block_keys - 1) / block_keys;
    const int b = blockIdx.y;
    if (b >= nb) return;  // idle block split (uniform over the block)
    const int start = b * block_keys + wi * part;
    const int end = min(limit, start + part);

    float qv[G][EPL], acc[G][EPL], m[G], l[G];
    softmax_state_init<G, EPL, D>(q + t * q_stride + (long long)h0 * D + lane * EPL, scale, qv, acc, m, l);
    // A warp past the context (start >= limit) keeps m = -inf, l = 0: an empty partial.
    attend_keys<D, G>(k_cache, v_cache, block_tables + (long long)token_seq[t] * max_blocks,
                      n_kv_heads, block_size, (long long)kvh * D + lane * EPL, start, end, qv,
                      acc, m, l);
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[wi][g] = m[g];
            sm_l[wi][g] = l[g];
        }
    }
    // Merge the warps' partials one q head at a time (thread i: element i of the head). Warp 0
    // of a live block always has keys, so the block's max is finite and its sum positive.
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) sm_acc[wi][lane * EPL + e] = acc[g][e];
        __syncthreads();
        if (threadIdx.x < D)
            merge_warp_partials<DA_WARPS, G, D>(g, threadIdx.x, sm_acc, sm_m, sm_l,
                                                (long long)t * n_q_heads + h0 + g, b, nb, DA_SPLITS,
                                                out, part_acc, part_ml);
        __syncthreads();
    }
    // Publish this block's partial, then count it in (common.cuh's arrives_last).
    if (nb == 1 || !arrives_last(arrivals + tg, (unsigned)nb)) return;
    // Last block: merge the nb block partials in split order. Volatile loads bypass L1, which
    // is not coherent with the other blocks' writes; a thread loads all its splits' values
    // before it uses any (one L2 round trip, not one per split).
    const volatile float* vacc = part_acc;
    const volatile float* vml = part_ml;
    for (int i = threadIdx.x; i < G * D; i += DA_WARPS * 32) {
        const int g = i / D;
        const int e = i - g * D;
        const long long row = (long long)t * n_q_heads + h0 + g;
        const long long p0 = row * DA_SPLITS;
        float ms[DA_SPLITS], ls[DA_SPLITS], av[DA_SPLITS];
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s) {
            if (s < nb) {
                ms[s] = vml[(p0 + s) * 2];
                ls[s] = vml[(p0 + s) * 2 + 1];
                av[s] = vacc[(p0 + s) * D + e];
            }
        }
        float mx = NEG_INF;
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s)
            if (s < nb) mx = fmaxf(mx, ms[s]);
        float a = 0.0f, sum = 0.0f;
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s) {
            if (s < nb) {
                const float f = expf(ms[s] - mx);
                sum = fmaf(ls[s], f, sum);
                a = fmaf(av[s], f, a);
            }
        }
        out[row * D + e] = from_f32(a * (1.0f / sum));
    }
}

#define ATTN_GROUP_INSTANCE(D, G)                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_d##D##_g##G(  \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_tokens, int n_q_heads, int n_kv_heads, long long q_stride, int block_size,        \
        float scale, int partition, store_t* out, float* part_acc, float* part_ml) {            \
        attention_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,          \
                             token_pos, n_tokens, n_q_heads, n_kv_heads, q_stride, block_size,  \
                             scale, partition, out, part_acc, part_ml);                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(DA_WARPS * 32) decode_attention_fixed_d##D##_g##G(\
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals) {                    \
        decode_attention_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,   \
                                    token_pos, n_q_heads, n_kv_heads, q_stride, block_size,     \
                                    scale, out, part_acc, part_ml, arrivals);                   \
    }

#define ATTN_INSTANCE(D)                                                                        \
    ATTN_GROUP_INSTANCE(D, 1)                                                                   \
    ATTN_GROUP_INSTANCE(D, 2)                                                                   \
    ATTN_GROUP_INSTANCE(D, 4)                                                                   \
    ATTN_GROUP_INSTANCE(D, 8)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_combine_d##D(       \
        const float* part_acc, const float* part_ml, int n_rows, int n_splits, store_t* out) {  \
        combine_body<D>(part_acc, part_ml, n_rows, n_splits, out);                              \
    }

ATTN_INSTANCE(64)
ATTN_INSTANCE(96)
ATTN_INSTANCE(128)
ATTN_INSTANCE(256)

// Writes the new tokens' K and V rows into the paged cache: token t goes to flat slot
// slot_mapping[t] = block * block_size + offset. A negative slot skips the token (padding).
// Rows of k / v are `k_stride` / `v_stride` elements apart (a fused QKV projection).
extern "C" __global__ void kv_cache_write(const store_t* __restrict__ k,
                                          const store_t* __restrict__ v,
                                          store_t* __restrict__ k_cache,
                                          store_t* __restrict__ v_cache,
                                          const long long* __restrict__ slot_mapping, int row_elems,
                                          long long k_stride, long long v_stride) {
    pdl_enter();
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        k_cache[slot * row_elems + i] = k[t * k_stride + i];
        v_cache[slot * row_elems + i] = v[t * v_stride + i];
    }
}
