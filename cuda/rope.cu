// Rotary position embedding, NeoX rotate-half layout, applied in place to q and k.
// Only the first `rotary_dim` elements of each head rotate (partial RoPE); pairs are
// (i, i + rotary_dim/2). `inv_freq` holds rotary_dim/2 f32 frequencies computed on the host
// (so every scaling scheme is a host concern) and `attn_scale` multiplies cos and sin.
#include "common.cuh"

// cos and sin of the calling thread's first pair of a head (i = threadIdx.x, where i < half) at
// `pos`: rope_cos_sin's values. The decode kernels form them before pdl_wait (positions are
// uploaded with the step, inv_freq at load), sincosf's argument reduction included, so that
// after the wait only the head's loads and the products remain.
struct rope_first {
    float c, s;
};
__device__ __forceinline__ rope_first rope_first_pair(int half, float pos, const float* __restrict__ inv_freq,
                                                      float attn_scale) {
    rope_first f{1.0f, 0.0f};
    if ((int)threadIdx.x < half) rope_cos_sin(threadIdx.x, pos, inv_freq, attn_scale, &f.c, &f.s);
    return f;
}

// Rotates the head at h (pairs i, i + half of its first rotary_dim elements: common.cuh's
// rope_rotate on the stored pair, the thread's first pair with the cos and sin of `first`) into
// out, which may be h itself, and into the cache head unless `cache` is null; the tail past
// rotary_dim (partial RoPE) goes to the cache as it is, and to out where `tail_out`. The block's
// threads share the pairs and the tail.
__device__ __forceinline__ void rope_head(const store_t* h, store_t* out, store_t* cache,
                                          int head_dim, int rotary_dim, float pos,
                                          const float* __restrict__ inv_freq, float attn_scale,
                                          bool tail_out, rope_first first) {
    const int half = rotary_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c = first.c, s = first.s;
        if (i != (int)threadIdx.x) rope_cos_sin(i, pos, inv_freq, attn_scale, &c, &s);
        store_t lo, hi;
        rope_apply(to_f32(h[i]), to_f32(h[i + half]), c, s, &lo, &hi);
        out[i] = lo;
        out[i + half] = hi;
        if (cache) {
            cache[i] = lo;
            cache[i + half] = hi;
        }
    }
    if (!cache && !tail_out) return;
    for (int i = rotary_dim + threadIdx.x; i < head_dim; i += blockDim.x) {
        if (tail_out) out[i] = h[i];
        if (cache) cache[i] = h[i];
    }
}

// A thread per (token, pair): cos and sin once, then that pair of each head in a group of
// heads (grid y; q heads first, then k heads). A block per (token, head) made a prefill of 2k
// tokens launch 80k blocks of 64 threads, bound by block scheduling (~100 us a layer of the
// Llama-3-8B shape where the bytes take ~10 us), and evaluated the same sincosf once per head.
// Each element's arithmetic is rope_rotate's whatever the grid or the grouping, so results do
// not depend on the launch shape (rope_kv_write, a block per head, gives the same bits).
// q rows are `q_stride` apart, k rows `k_stride`, heads `head_dim` apart within a row.
extern "C" __global__ void rope_neox(store_t* __restrict__ q, store_t* __restrict__ k,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ inv_freq, int n_tokens,
                                     int n_q_heads, int n_kv_heads, int head_dim, int rotary_dim,
                                     long long q_stride, long long k_stride, float attn_scale,
                                     int heads_per_group) {
    pdl_enter();
    const int half = rotary_dim / 2;
    const long long pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= (long long)n_tokens * half) return;
    const int t = (int)(pair / half);
    const int i = (int)(pair - (long long)t * half);
    const int h0 = blockIdx.y * heads_per_group;
    const int h1 = min(h0 + heads_per_group, n_q_heads + n_kv_heads);
    float c, s;
    rope_cos_sin(i, (float)positions[t], inv_freq, attn_scale, &c, &s);
    store_t* qt = q + t * q_stride + i;
    store_t* kt = k + t * k_stride + i;
#pragma unroll 4
    for (int head = h0; head < h1; ++head) {
        store_t* h = head < n_q_heads ? qt + (long long)head * head_dim
                                      : kt + (long long)(head - n_q_heads) * head_dim;
        store_t lo, hi;
        rope_apply(to_f32(h[0]), to_f32(h[half]), c, s, &lo, &hi);
        h[0] = lo;
        h[half] = hi;
    }
}

// rope_neox and kv_cache_write (attention.cu) of a decode step in one kernel: q and k heads
// rotate in place as rope_neox rotates them, and each k head block also stores its rotated
// head (and the unrotated tail of a partial rotary) into the paged cache at flat slot
// slot_mapping[t] = block * block_size + offset, with the token's v head; a negative slot
// skips the cache writes (padding rows), as kv_cache_write does. The cached k is the value the
// block just rotated, stored from registers: bit for bit what the two kernels give, one kernel
// boundary less per attention layer. The caches are [slots, n_kv_heads, head_dim]; v rows are
// `v_stride` apart.
extern "C" __global__ void rope_kv_write(store_t* __restrict__ q, store_t* __restrict__ k,
                                         const store_t* __restrict__ v,
                                         store_t* __restrict__ k_cache,
                                         store_t* __restrict__ v_cache,
                                         const int* __restrict__ positions,
                                         const long long* __restrict__ slot_mapping,
                                         const float* __restrict__ inv_freq, int n_q_heads,
                                         int n_kv_heads, int head_dim, int rotary_dim,
                                         long long q_stride, long long k_stride,
                                         long long v_stride, float attn_scale) {
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    const float pos = (float)positions[t];
    const long long slot = slot_mapping[t];
    const rope_first first = rope_first_pair(rotary_dim / 2, pos, inv_freq, attn_scale);
    pdl_enter();
    if (head >= n_q_heads + n_kv_heads) return;
    if (head < n_q_heads) {
        store_t* h = q + t * q_stride + (long long)head * head_dim;
        rope_head(h, h, nullptr, head_dim, rotary_dim, pos, inv_freq, attn_scale, false, first);
        return;
    }
    const int kh = head - n_q_heads;
    store_t* h = k + t * k_stride + (long long)kh * head_dim;
    const long long cache_off = slot * ((long long)n_kv_heads * head_dim) + (long long)kh * head_dim;
    rope_head(h, h, slot >= 0 ? k_cache + cache_off : nullptr, head_dim, rotary_dim, pos, inv_freq, attn_scale, false, first);
    if (slot < 0) return;
    const store_t* vh = v + t * v_stride + (long long)kh * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) v_cache[cache_off + i] = vh[i];
}

// rmsnorm (norm.cu, per head: rmsnorm_heads) of a decode step's q and k heads, then
// rope_kv_write on the normed heads, in one kernel: one where three ran per attention layer of a
// model with per-head q/k norm (Qwen3, Qwen3.5) at batch-1 decode, ~2-3 us a kernel boundary.
// A block per (token, head), q heads then k heads (grid y), of the rmsnorm launch's block size
// (ops/norm.rs chunked_norm_threads of head_dim): each thread sums the squares of the same
// chunks in the same order and block_sum adds the same lanes, so the normed head is rmsnorm's
// bits. It is kept, rounded to storage, in shared memory (dynamic: (head_dim + 7) / 8 chunks of
// 16 bytes) and rotated from there with rope_head as rope_kv_write rotates the normed head it
// reads back: the rotated q head goes to q_out ([T, n_q_heads * head_dim]), the rotated k head
// to k_out ([T, n_kv_heads * head_dim]) and to the paged cache at slot_mapping[t] with the
// token's v head (unnormed), skipped where the slot is negative; the tail past rotary_dim is
// the normed values. Token t's q heads are read at t * q_stride of q, its k heads at
// t * k_stride of k, its v heads at t * v_stride of v (column ranges of the qkv projection).
extern "C" __global__ void rope_kv_write_normed(
    const store_t* __restrict__ q, const store_t* __restrict__ k, const store_t* __restrict__ v,
    const store_t* __restrict__ q_w, const store_t* __restrict__ k_w, store_t* __restrict__ q_out,
    store_t* __restrict__ k_out, store_t* __restrict__ k_cache, store_t* __restrict__ v_cache,
    const int* __restrict__ positions, const long long* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, int n_q_heads, int n_kv_heads, int head_dim,
    int rotary_dim, long long q_stride, long long k_stride, long long v_stride, float eps,
    int plus_one, float attn_scale) {
    extern __shared__ uint4 normed[];
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    const float pos = (float)positions[t];
    const long long t_slot = slot_mapping[t];
    const rope_first first = rope_first_pair(rotary_dim / 2, pos, inv_freq, attn_scale);
    const bool is_q = head < n_q_heads;
    const int kh = head - n_q_heads;
    const store_t* x = is_q ? q + t * q_stride + (long long)head * head_dim
                            : k + t * k_stride + (long long)kh * head_dim;
    const store_t* w = is_q ? q_w : k_w;
    store_t* out = is_q ? q_out + ((long long)t * n_q_heads + head) * head_dim
                        : k_out + ((long long)t * n_kv_heads + kh) * head_dim;
    // rmsnorm's chunks, sum of squares and scaling (its NORM_CACHE register copies are an
    // order-preserving detail: the raw chunks wait in shared memory here).
    const bool vec = (head_dim & 7) == 0 && aligned16(x) && aligned16(w);
    const int n_chunks = (head_dim + 7) >> 3;
    // The weight's chunk of the thread's first pass, read before the wait (as rmsnorm does).
    const bool w0_live = (int)threadIdx.x < n_chunks && head < n_q_heads + n_kv_heads;
    const uint4 w0 = w0_live ? load_chunk(w, threadIdx.x * 8, head_dim, vec) : make_uint4(0u, 0u, 0u, 0u);
    pdl_enter();
    if (head >= n_q_heads + n_kv_heads) return;
    float ss = 0.0f;
    for (int ch = threadIdx.x; ch < n_chunks; ch += blockDim.x) {
        const uint4 r = load_chunk(x, ch * 8, head_dim, vec);
        ss = chunk_sum_squares(r, ss);
        normed[ch] = r;
    }
    const float rstd = norm_rstd(block_sum(ss, scratch), head_dim, eps);
    for (int ch = threadIdx.x; ch < n_chunks; ch += blockDim.x)
        normed[ch] = ch == (int)threadIdx.x ? norm_chunk_w(normed[ch], w0, rstd, plus_one)
                                            : norm_chunk(normed[ch], w, ch * 8, head_dim, vec, rstd, plus_one);
    __syncthreads();
    const store_t* h = reinterpret_cast<const store_t*>(normed);
    const long long slot = is_q ? -1 : t_slot;
    const long long cache_off = slot * ((long long)n_kv_heads * head_dim) + (long long)kh * head_dim;
    rope_head(h, out, slot >= 0 ? k_cache + cache_off : nullptr, head_dim, rotary_dim, pos, inv_freq, attn_scale, true, first);
    if (slot < 0) return;
    const store_t* vh = v + t * v_stride + (long long)kh * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) v_cache[cache_off + i] = vh[i];
}
