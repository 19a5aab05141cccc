// Rotary position embedding, NeoX rotate-half layout, applied in place to q and k.
// Only the first `rotary_dim` elements of each head rotate (partial RoPE); pairs are
// (i, i + rotary_dim/2). `inv_freq` holds rotary_dim/2 f32 frequencies computed on the host
// (so every scaling scheme is a host concern) and `attn_scale` multiplies cos and sin.
#include "common.cuh"

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
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        c *= attn_scale;
        s *= attn_scale;
        const float a = to_f32(h[i]);
        const float b = to_f32(h[i + half]);
        h[i] = from_f32(a * c - b * s);
        h[i + half] = from_f32(b * c + a * s);
    }
}
