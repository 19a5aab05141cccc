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
#include "attention_keys.cuh"

#define ATTN_WARPS 4


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

#define ATTN_GROUP_INSTANCE(D, G)                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_d##D##_g##G(  \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_tokens, int n_q_heads, int n_kv_heads, long long q_stride, int block_size,        \
        float scale, int partition, store_t* out, float* part_acc, float* part_ml) {            \
        attention_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,          \
                             token_pos, n_tokens, n_q_heads, n_kv_heads, q_stride, block_size,  \
                             scale, partition, out, part_acc, part_ml);                         \
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
