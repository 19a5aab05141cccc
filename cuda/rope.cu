// Rotary position embedding, NeoX rotate-half layout, applied in place to q and k.
// Only the first `rotary_dim` elements of each head rotate (partial RoPE); pairs are
// (i, i + rotary_dim/2). `inv_freq` holds rotary_dim/2 f32 frequencies computed on the host
// (so every scaling scheme is a host concern) and `attn_scale` multiplies cos and sin.
#include "common.cuh"

// Rotates pair i of the head at `h` (elements i and i + half) for position `pos`, returning the
// two rotated values: common.cuh's rope_rotate on the stored pair, which both kernels below
// (and the qkv GEMV's epilogue, gemv.cu) use, so that every route rounds each element alike.
__device__ __forceinline__ void rope_pair(const store_t* h, int i, int half, float pos,
                                          const float* __restrict__ inv_freq, float attn_scale,
                                          store_t* lo, store_t* hi) {
    rope_rotate(to_f32(h[i]), to_f32(h[i + half]), i, pos, inv_freq, attn_scale, lo, hi);
}

// One block per (token, head): grid x = token, grid y = head, q heads first then k heads. A
// decode step has a single token, so looping over its 40 heads inside one block made 40
// dependent round trips to memory; a block per head runs them all at once. Each element's
// arithmetic is the same whatever the grid, so results do not depend on the launch shape.
// q rows are `q_stride` apart, k rows `k_stride`, heads `head_dim` apart within a row.
extern "C" __global__ void rope_neox(store_t* __restrict__ q, store_t* __restrict__ k,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ inv_freq, int n_q_heads,
                                     int n_kv_heads, int head_dim, int rotary_dim,
                                     long long q_stride, long long k_stride, float attn_scale) {
    pdl_enter();
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    if (head >= n_q_heads + n_kv_heads) return;
    store_t* h = head < n_q_heads
                     ? q + t * q_stride + (long long)head * head_dim
                     : k + t * k_stride + (long long)(head - n_q_heads) * head_dim;
    const float pos = (float)positions[t];
    const int half = rotary_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        store_t lo, hi;
        rope_pair(h, i, half, pos, inv_freq, attn_scale, &lo, &hi);
        h[i] = lo;
        h[i + half] = hi;
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
    pdl_enter();
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    if (head >= n_q_heads + n_kv_heads) return;
    const float pos = (float)positions[t];
    const int half = rotary_dim / 2;
    if (head < n_q_heads) {
        store_t* h = q + t * q_stride + (long long)head * head_dim;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            store_t lo, hi;
            rope_pair(h, i, half, pos, inv_freq, attn_scale, &lo, &hi);
            h[i] = lo;
            h[i + half] = hi;
        }
        return;
    }
    const int kh = head - n_q_heads;
    store_t* h = k + t * k_stride + (long long)kh * head_dim;
    const long long slot = slot_mapping[t];
    const long long cache_off = slot * ((long long)n_kv_heads * head_dim) + (long long)kh * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        store_t lo, hi;
        rope_pair(h, i, half, pos, inv_freq, attn_scale, &lo, &hi);
        h[i] = lo;
        h[i + half] = hi;
        if (slot >= 0) {
            k_cache[cache_off + i] = lo;
            k_cache[cache_off + i + half] = hi;
        }
    }
    if (slot < 0) return;
    // The tail past the rotary part (partial RoPE) is cached as it is.
    for (int i = rotary_dim + threadIdx.x; i < head_dim; i += blockDim.x) k_cache[cache_off + i] = h[i];
    const store_t* vh = v + t * v_stride + (long long)kh * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) v_cache[cache_off + i] = vh[i];
}
