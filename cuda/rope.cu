// Rotary position embedding, NeoX rotate-half layout, applied in place to q and k.
// Only the first `rotary_dim` elements of each head rotate (partial RoPE); pairs are
// (i, i + rotary_dim/2). `inv_freq` holds rotary_dim/2 f32 frequencies computed on the host
// (so every scaling scheme is a host concern) and `attn_scale` multiplies cos and sin.
#include "common.cuh"

__device__ __forceinline__ void rotate_head(store_t* h, int half, float pos,
                                            const float* inv_freq, float attn_scale) {
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

// One block per token; heads are looped. q rows are `q_stride` apart, head_dim within.
extern "C" __global__ void rope_neox(store_t* __restrict__ q, store_t* __restrict__ k,
                                     const int* __restrict__ positions,
                                     const float* __restrict__ inv_freq, int n_q_heads,
                                     int n_kv_heads, int head_dim, int rotary_dim,
                                     long long q_stride, long long k_stride, float attn_scale) {
    const int t = blockIdx.x;
    const float pos = (float)positions[t];
    const int half = rotary_dim / 2;
    for (int h = 0; h < n_q_heads; ++h)
        rotate_head(q + t * q_stride + (long long)h * head_dim, half, pos, inv_freq, attn_scale);
    for (int h = 0; h < n_kv_heads; ++h)
        rotate_head(k + t * k_stride + (long long)h * head_dim, half, pos, inv_freq, attn_scale);
}
