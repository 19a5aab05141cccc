// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) with per-sequence recurrent state.
//
// Sequences are packed: tokens cu_seqlens[s]..cu_seqlens[s+1] belong to sequence s, whose state
// lives in slot slots[s]. Decode is one token per sequence; prefill carries the state through
// the chunk and leaves it updated, so a prompt can be processed in several chunks.
#include "common.cuh"

// Depthwise causal conv1d over time with carried state, then SiLU.
// conv_state is [n_slots, channels, K-1] (per channel the last K-1 inputs, oldest first: the
// CPU backend's layout, so state snapshots are the same bytes on both); weight is
// [channels, K]; bias may be null.
//
// Two forms compute every output element with the same f32 operations in the same order
// (bias, then one fmaf per tap from the oldest input to the newest, the sum rounded to storage
// as transformers' bf16 F.conv1d returns it, then SiLU, rounded again), so they agree
// bit for bit and a prompt may be split between them:
// - causal_conv1d_k*: one thread per (sequence, channel) walks the sequence's tokens in order.
//   Decode (one token per sequence) uses it; for a long prompt it is serial over time.
// - causal_conv1d_tiled_k* + causal_conv1d_state_k*: prefill, parallel over time.

// The conv of one token from its window win[0..K-2] (oldest first) and its own input xv.
template <int K>
__device__ __forceinline__ float conv_tap(const float* win, const float* wt, float b, float xv) {
    float y = b;
#pragma unroll
    for (int i = 0; i < K - 1; ++i) y = fmaf(wt[i], win[i], y);
    return fmaf(wt[K - 1], xv, y);
}

template <int K>
__device__ __forceinline__ void conv_body(const store_t* __restrict__ x, long long x_stride,
                                          store_t* __restrict__ conv_state,
                                          const store_t* __restrict__ weight,
                                          const store_t* __restrict__ bias,
                                          const int* __restrict__ cu_seqlens,
                                          const int* __restrict__ slots, int channels,
                                          store_t* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    pdl_enter();
    const int s = blockIdx.y;
    if (c >= channels) return;
    store_t* st = conv_state + ((long long)slots[s] * channels + c) * (K - 1);
    float win[K - 1], wt[K];
#pragma unroll
    for (int i = 0; i < K - 1; ++i) win[i] = to_f32(st[i]);
#pragma unroll
    for (int i = 0; i < K; ++i) wt[i] = to_f32(weight[(long long)c * K + i]);
    const float b = bias ? to_f32(bias[c]) : 0.0f;
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        const float xv = to_f32(x[t * x_stride + c]);
        out[(long long)t * channels + c] = from_f32(silu_f(round_st(conv_tap<K>(win, wt, b, xv))));
#pragma unroll
        for (int i = 0; i < K - 2; ++i) win[i] = win[i + 1];
        win[K - 2] = xv;
    }
#pragma unroll
    for (int i = 0; i < K - 1; ++i) st[i] = from_f32(win[i]);
}

#define CONV_INSTANCE(K)                                                                       \
    extern "C" __global__ void causal_conv1d_k##K(                                             \
        const store_t* x, long long x_stride, store_t* conv_state, const store_t* weight,      \
        const store_t* bias, const int* cu_seqlens, const int* slots, int channels,            \
        store_t* out) {                                                                        \
        conv_body<K>(x, x_stride, conv_state, weight, bias, cu_seqlens, slots, channels, out); \
    }

CONV_INSTANCE(2)
CONV_INSTANCE(3)
CONV_INSTANCE(4)

// Tokens per block of the tiled prefill conv (the launcher's grid uses the same number:
// ops/gdn.rs CONV_TOKEN_TILE). Each thread re-reads K-1 inputs before its tile, so a longer
// tile reads less twice; 32 keeps a 4k-token prompt at 128 token tiles, enough blocks to fill
// the GPU at any channel count.
#define CONV_TOKEN_TILE 32

// Prefill conv, parallel over time. Grid (channel tiles of blockDim.x, token tiles of
// CONV_TOKEN_TILE over the packed tokens); a thread owns one channel of one token tile. A
// token's window comes from the input rows where it lies inside the token's sequence and from
// the sequence's conv_state slot (as it was before this call) where it reaches before the
// sequence's first token. Only reads conv_state: causal_conv1d_state_k* writes the new state in
// a later launch, because the block holding a sequence's last tokens is in general not the one
// reading its old state, and no order between blocks of one grid is guaranteed.
template <int K>
__device__ __forceinline__ void conv_tiled_body(const store_t* __restrict__ x, long long x_stride,
                                                const store_t* __restrict__ conv_state,
                                                const store_t* __restrict__ weight,
                                                const store_t* __restrict__ bias,
                                                const int* __restrict__ cu_seqlens,
                                                const int* __restrict__ slots, int n_seqs,
                                                int channels, store_t* __restrict__ out) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int n_tokens = cu_seqlens[n_seqs];
    const int t0 = blockIdx.y * CONV_TOKEN_TILE;
    const int t1 = min(t0 + CONV_TOKEN_TILE, n_tokens);
    if (c >= channels || t0 >= t1) return;
    // The sequence holding t0: the last s with cu_seqlens[s] <= t0 (cu_seqlens[n_seqs] > t0,
    // so that sequence is not empty).
    int s = 0, hi = n_seqs;
    while (hi - s > 1) {
        const int mid = (s + hi) >> 1;
        if (cu_seqlens[mid] <= t0) s = mid;
        else hi = mid;
    }
    float win[K - 1], wt[K];
#pragma unroll
    for (int i = 0; i < K; ++i) wt[i] = to_f32(weight[(long long)c * K + i]);
    const float b = bias ? to_f32(bias[c]) : 0.0f;
    int start = cu_seqlens[s], end = cu_seqlens[s + 1];
    const store_t* st = conv_state + ((long long)slots[s] * channels + c) * (K - 1);
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        const int j = t0 - (K - 1) + i;
        win[i] = to_f32(j >= start ? x[j * x_stride + c] : st[K - 1 + j - start]);
    }
    if (t1 - t0 == CONV_TOKEN_TILE && t1 <= end) {
        // A whole tile inside one sequence (nearly every tile of a long prompt): all its inputs
        // are loaded before the first output, so the 32 loads are in flight together instead
        // of one round trip a token (the loop below); the same operations in the same order.
        float xs[CONV_TOKEN_TILE];
#pragma unroll
        for (int i = 0; i < CONV_TOKEN_TILE; ++i) xs[i] = to_f32(x[(long long)(t0 + i) * x_stride + c]);
#pragma unroll
        for (int i = 0; i < CONV_TOKEN_TILE; ++i) {
            out[(long long)(t0 + i) * channels + c] = from_f32(silu_f(round_st(conv_tap<K>(win, wt, b, xs[i]))));
#pragma unroll
            for (int j = 0; j < K - 2; ++j) win[j] = win[j + 1];
            win[K - 2] = xs[i];
        }
        return;
    }
    for (int t = t0; t < t1; ++t) {
        if (t >= end) {
            // The next non-empty sequence starts at t: its window is all carried state.
            do {
                ++s;
            } while (cu_seqlens[s + 1] <= t);
            start = t;
            end = cu_seqlens[s + 1];
            st = conv_state + ((long long)slots[s] * channels + c) * (K - 1);
#pragma unroll
            for (int i = 0; i < K - 1; ++i) win[i] = to_f32(st[i]);
        }
        const float xv = to_f32(x[t * x_stride + c]);
        out[(long long)t * channels + c] = from_f32(silu_f(round_st(conv_tap<K>(win, wt, b, xv))));
#pragma unroll
        for (int i = 0; i < K - 2; ++i) win[i] = win[i + 1];
        win[K - 2] = xv;
    }
}

// The conv state after a tiled prefill conv: per (sequence, channel) the last K-1 inputs of the
// window that ends at the sequence's last token, the older ones still from the old state when
// the sequence is shorter than K-1. Grid (channel tiles, sequences). Each thread reads its
// whole old state before writing it, and sequences own distinct slots, so nothing else reads
// what it writes. Values pass through f32 as in causal_conv1d_k* (same bytes, NaNs included).
template <int K>
__device__ __forceinline__ void conv_state_body(const store_t* __restrict__ x, long long x_stride,
                                                store_t* __restrict__ conv_state,
                                                const int* __restrict__ cu_seqlens,
                                                const int* __restrict__ slots, int channels) {
    pdl_enter();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= channels) return;
    store_t* st = conv_state + ((long long)slots[s] * channels + c) * (K - 1);
    const int start = cu_seqlens[s], end = cu_seqlens[s + 1];
    float win[K - 1];
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        const int j = end - (K - 1) + i;
        win[i] = to_f32(j >= start ? x[j * x_stride + c] : st[K - 1 + j - start]);
    }
#pragma unroll
    for (int i = 0; i < K - 1; ++i) st[i] = from_f32(win[i]);
}

#define CONV_TILED_INSTANCE(K)                                                                 \
    extern "C" __global__ void causal_conv1d_tiled_k##K(                                       \
        const store_t* x, long long x_stride, const store_t* conv_state,                       \
        const store_t* weight, const store_t* bias, const int* cu_seqlens, const int* slots,   \
        int n_seqs, int channels, store_t* out) {                                              \
        conv_tiled_body<K>(x, x_stride, conv_state, weight, bias, cu_seqlens, slots, n_seqs,   \
                           channels, out);                                                     \
    }                                                                                          \
    extern "C" __global__ void causal_conv1d_state_k##K(const store_t* x, long long x_stride,  \
                                                        store_t* conv_state,                   \
                                                        const int* cu_seqlens,                 \
                                                        const int* slots, int channels) {      \
        conv_state_body<K>(x, x_stride, conv_state, cu_seqlens, slots, channels);              \
    }

CONV_TILED_INSTANCE(2)
CONV_TILED_INSTANCE(3)
CONV_TILED_INSTANCE(4)

// Gates of one token and value head h from its projection values a and b: g = -exp(A_log) *
// softplus(a + dt_bias) (log of the decay) and beta = sigmoid(b). gdn_gates and the fused
// decode kernel both call this, so their gates are the same bits.
__device__ __forceinline__ void gdn_gate(float a, float b, float a_log, float dt_bias, float* g,
                                         float* beta) {
    const float x = a + dt_bias;
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    *g = -expf(a_log) * sp;
    // Rounded to storage: transformers computes b.sigmoid() on the bf16 projection (a bf16
    // tensor) and widens it to f32 inside the delta rule; g stays f32 there too (a.float()).
    *beta = round_st(sigmoid_f(b));
}

// Gates per token and value head (gdn_gate). Token t's a and b are n_heads elements at
// t * ab_stride (they are columns of the fused input projection's output, whose rows are
// ab_stride wide); A_log and dt_bias are f32 [n_heads]; g and beta are [T, n_heads].
extern "C" __global__ void gdn_gates(const store_t* __restrict__ a, const store_t* __restrict__ b,
                                     long long ab_stride, const float* __restrict__ a_log,
                                     const float* __restrict__ dt_bias, int n_tokens, int n_heads,
                                     float* __restrict__ g, float* __restrict__ beta) {
    pdl_enter();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_tokens * n_heads) return;
    const int h = e % n_heads;
    const long long src = (long long)(e / n_heads) * ab_stride + h;
    gdn_gate(to_f32(a[src]), to_f32(b[src]), a_log[h], dt_bias[h], &g[e], &beta[e]);
}

// Recurrent gated delta rule, token by token, fp32 state [n_slots, n_v_heads, DK, DV].
// q and k are L2-normalised here (eps 1e-6) and q is scaled by DK^-1/2. Per token:
// S *= exp(g); delta = (v - S^T k) * beta; S += k delta^T; o = S^T q.
// Value head h reads key head h / (n_v_heads / n_k_heads). One thread owns column j of one
// head's S (DK floats in registers); the two kernels below share these steps, so a column's
// arithmetic is the same chain in both.

// One warp writes token t's normalised q (scaled by DK^-1/2) and k of key head kh into sq / sk.
template <int DK>
__device__ __forceinline__ void load_qk_normed(const store_t* __restrict__ q,
                                               const store_t* __restrict__ k, long long qk_stride,
                                               int t, int kh, int lane, float* sq, float* sk) {
    constexpr int EPL = DK / 32;
    const float q_scale = rsqrtf((float)DK);
    float qv[EPL], kv[EPL], qss = 0.0f, kss = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        qv[e] = to_f32(q[t * qk_stride + (long long)kh * DK + lane * EPL + e]);
        kv[e] = to_f32(k[t * qk_stride + (long long)kh * DK + lane * EPL + e]);
        qss += qv[e] * qv[e];
        kss += kv[e] * kv[e];
    }
    const float qn = rsqrtf(warp_sum(qss) + 1e-6f) * q_scale;
    const float kn = rsqrtf(warp_sum(kss) + 1e-6f);
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        sq[lane * EPL + e] = qv[e] * qn;
        sk[lane * EPL + e] = kv[e] * kn;
    }
}

// Four floats of sq / sk in one shared load that ptxas keeps in program order: a volatile
// load is not moved across another, so the loops below load one group of four ahead of the
// arithmetic. Plain loads were all issued first (ptxas hoists every load of an unrolled loop),
// which kept up to 256 loaded values live beside the 128 state floats at DK 128: 255
// registers and spills, two 4-warp blocks an SM, ~3 TB/s of state at batch 64.
__device__ __forceinline__ float4 lds_in_order(const float* p) {
    float4 v;
    asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
    return v;
}

// One token's update of a state column and its output: col *= decay; delta = (v - col.k) *
// beta; col += k delta; returns col.q.
template <int DK>
__device__ __forceinline__ float delta_column_step(float* col, const float* sq, const float* sk,
                                                   float decay, float bt, float v) {
    constexpr int G = DK / 4;
    float mem = 0.0f;
    float4 kn = lds_in_order(sk);
#pragma unroll
    for (int c = 0; c < G; ++c) {
        const float4 kc = kn;
        if (c + 1 < G) kn = lds_in_order(sk + 4 * (c + 1));
        const float kk[4] = {kc.x, kc.y, kc.z, kc.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            col[4 * c + e] *= decay;
            mem = fmaf(col[4 * c + e], kk[e], mem);
        }
    }
    const float delta = (v - mem) * bt;
    float o = 0.0f;
    kn = lds_in_order(sk);
    float4 qn = lds_in_order(sq);
#pragma unroll
    for (int c = 0; c < G; ++c) {
        const float4 kc = kn, qc = qn;
        if (c + 1 < G) {
            kn = lds_in_order(sk + 4 * (c + 1));
            qn = lds_in_order(sq + 4 * (c + 1));
        }
        const float kk[4] = {kc.x, kc.y, kc.z, kc.w};
        const float qq[4] = {qc.x, qc.y, qc.z, qc.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            col[4 * c + e] = fmaf(kk[e], delta, col[4 * c + e]);
            o = fmaf(col[4 * c + e], qq[e], o);
        }
    }
    return o;
}

// Writes a state column back. The address goes through an opaque move so that ptxas computes
// the DK addresses again here instead of keeping the load loop's 64-bit addresses live across
// the token loop: that took ~1 KB of spills per thread in both kernels at DK 128 (sm_70..sm_90,
// NVRTC 12.9), about as much local-memory traffic as the state itself.
template <int DK>
__device__ __forceinline__ void store_state_column(float* st, int dv, const float* col) {
    float* p;
    asm("mov.b64 %0, %1;" : "=l"(p) : "l"(st));
#pragma unroll
    for (int i = 0; i < DK; ++i) p[(long long)i * dv] = col[i];
}

// Grid (DV / 32, n_v_heads, n_seqs), one warp per block; lane j owns column j of S. Gates come
// precomputed (gdn_gates); out is the raw attention output [T, n_v_heads, dv].
template <int DK>
__device__ __forceinline__ void recurrent_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k, long long qk_stride,
    const store_t* __restrict__ v, long long v_stride, const float* __restrict__ g,
    const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ cu_seqlens,
    const int* __restrict__ slots, int n_k_heads, int n_v_heads, int dv,
    store_t* __restrict__ out) {
    __shared__ __align__(16) float sq[DK], sk[DK];
    const int lane = threadIdx.x;
    const int j = blockIdx.x * 32 + lane;
    const int h = blockIdx.y;
    const int s = blockIdx.z;
    const int kh = h / (n_v_heads / n_k_heads);
    float* st = state + ((long long)slots[s] * n_v_heads + h) * DK * dv + j;
    float col[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) col[i] = st[(long long)i * dv];
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        __syncwarp();
        load_qk_normed<DK>(q, k, qk_stride, t, kh, lane, sq, sk);
        __syncwarp();
        const float decay = expf(g[(long long)t * n_v_heads + h]);
        const float bt = beta[(long long)t * n_v_heads + h];
        const float o = delta_column_step<DK>(col, sq, sk, decay, bt,
                                              to_f32(v[t * v_stride + (long long)h * dv + j]));
        out[((long long)t * n_v_heads + h) * dv + j] = from_f32(o);
    }
    store_state_column<DK>(st, dv, col);
}

// One token's conv output of channel c (window in sw, K - 1 floats, oldest first, for a
// runtime K of 2..4; its K taps and bias in wb, widened), as causal_conv1d_k* stores it
// (conv_tap<K>'s fmaf chain, rounded, SiLU, rounded) and widened again; the window then
// shifts in the token's input.
__device__ __forceinline__ float fused_conv_step(float* sw, const float* wb, const store_t* __restrict__ x, int c, int K) {
    const float xv = to_f32(x[c]);
    float y = wb[4];
#pragma unroll
    for (int i = 0; i < 3; ++i)
        if (i < K - 1) y = fmaf(wb[i], sw[i], y);
    y = fmaf(wb[K - 1], xv, y);
#pragma unroll
    for (int i = 0; i < 2; ++i)
        if (i < K - 2) sw[i] = sw[i + 1];
    sw[K - 2] = xv;
    return to_f32(from_f32(silu_f(round_st(y))));
}

// Conv channel of a fused block's local channel e: e < DK the key head's q channels, e < 2 DK
// its k channels, then value head h's v channels.
template <int DK>
__device__ __forceinline__ int fused_conv_channel(int e, int kh, int kd, int h, int dv) {
    return e < DK ? kh * DK + e : e < 2 * DK ? kd + kh * DK + e - DK : 2 * kd + h * dv + e - 2 * DK;
}

// A GDN layer's whole core in one kernel, for decode and short chunks: per token, the causal
// conv of the q, k and v channels (as causal_conv1d_k*: same chain, same roundings), the gates
// from the projection's a / b columns (gdn_gate), the delta rule, and the gated RMSNorm
// rmsnorm(o) * w * silu(z) (gated_norm_rstd / gated_norm_out, as rmsnorm_gated): one launch
// where conv + gdn_gates + gdn_recurrent + rmsnorm_gated ran four, with the same bits.
// Grid (n_v_heads, n_seqs), dv / 32 warps a block: the block owns a whole head, which the norm
// needs. Thread j owns column j with recurrent_body's chain; o is rounded to storage before the
// norm, as the unfused path stores it, so for dv <= 256 the result is the unfused path's bits
// (the block sum adds the same warp sums in the same order as rmsnorm_gated's 256-thread block,
// whose extra warps add zeros). DVF is dv as a compile-time constant (0: the dv argument): the
// state's row addresses are then immediate offsets of one base instead of a register pair each.
// x rows (x_stride apart) hold the conv channels q | k | v from column 0. Conv windows live in
// shared memory, with their channels' taps and biases: the key head's 2 DK q / k channels,
// which every block of the head's group computes alike, and the block's own dv v channels.
// Everything but x, a, b and z is read before pdl_wait (the state and conv windows are written
// only by this layer's launches of earlier steps, the rest are weights and uploaded slots), so
// that the DRAM reads of the state overlap the input projection before it and only L2 reads
// of its output remain after the wait. The v channels' new conv state is the
// block's to write; the q / k channels' is written by the group's last block to have read the
// old one (the ticket taken after the reads, as arrives_last elects, in `tickets`, one counter
// a (sequence, key head), zero between launches).
template <int DK, int DVF, int THREADS>
__device__ __forceinline__ void conv_recurrent_gated_body(
    const store_t* __restrict__ x, long long x_stride, store_t* __restrict__ conv_state,
    const store_t* __restrict__ conv_w, const store_t* __restrict__ conv_b, int K,
    unsigned* __restrict__ tickets, const store_t* __restrict__ a, const store_t* __restrict__ b,
    long long ab_stride, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    float* __restrict__ state, const int* __restrict__ cu_seqlens,
    const int* __restrict__ slots, const store_t* __restrict__ z, long long z_stride,
    const store_t* __restrict__ norm_w, float eps, int n_k_heads, int n_v_heads, int dv_arg,
    store_t* __restrict__ out) {
    __shared__ __align__(16) float sq[DK], sk[DK];
    __shared__ float scratch[32];
    __shared__ float swin[(2 * DK + THREADS) * 3];
    __shared__ float swb[(2 * DK + THREADS) * 5];
    __shared__ store_t sx[2 * DK];
    __shared__ int elected;
    const int dv = DVF ? DVF : dv_arg;
    const int j = threadIdx.x;
    const int h = blockIdx.x;
    const int s = blockIdx.y;
    const int group = n_v_heads / n_k_heads;
    const int kh = h / group;
    const int kd = n_k_heads * DK;
    const int channels = 2 * kd + n_v_heads * dv;
    const int km1 = K - 1;
    store_t* cst = conv_state + (long long)slots[s] * channels * km1;
    for (int e = j; e < 2 * DK + dv; e += blockDim.x) {
        const long long c = fused_conv_channel<DK>(e, kh, kd, h, dv);
        for (int i = 0; i < km1; ++i) swin[e * 3 + i] = to_f32(cst[c * km1 + i]);
        for (int i = 0; i < K; ++i) swb[e * 5 + i] = to_f32(conv_w[c * K + i]);
        swb[e * 5 + 4] = conv_b ? to_f32(conv_b[c]) : 0.0f;
    }
    float* st = state + ((long long)slots[s] * n_v_heads + h) * DK * dv + j;
    float col[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) col[i] = st[(long long)i * dv];
    // Every thread's reads of the old q / k windows come before the block's ticket (the fence
    // waits for this thread's loads above, while the kernel before still runs).
    __threadfence();
    pdl_enter();
    const float w = to_f32(norm_w[j]);
    const float al = a_log[h], dtb = dt_bias[h];
    __syncthreads();
    unsigned ticket = 0;
    if (j == 0) ticket = atomicInc(tickets + (long long)s * n_k_heads + kh, group - 1);
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        // This token's own inputs, loaded before the barriers (which the compiler does not move
        // loads across) so that their latency overlaps the conv.
        const float av = to_f32(a[t * ab_stride + h]), bv = to_f32(b[t * ab_stride + h]);
        const float zv = to_f32(z[t * z_stride + (long long)h * dv + j]);
        const store_t* xt = x + t * x_stride;
        // Warp 0 rewrites sq / sk, and every thread sx, only after this barrier (or the
        // previous token's block_sum barriers), past every read of the previous values.
        __syncthreads();
        const float vv = fused_conv_step(swin + (2 * DK + j) * 3, swb + (2 * DK + j) * 5, xt, 2 * kd + h * dv + j, K);
        for (int e = j; e < 2 * DK; e += blockDim.x)
            sx[e] = from_f32(fused_conv_step(swin + e * 3, swb + e * 5, xt, fused_conv_channel<DK>(e, kh, kd, h, dv), K));
        __syncthreads();
        if (j < 32) load_qk_normed<DK>(sx, sx + DK, 0, 0, 0, j, sq, sk);
        __syncthreads();
        float g, bt;
        gdn_gate(av, bv, al, dtb, &g, &bt);
        const float o = delta_column_step<DK>(col, sq, sk, expf(g), bt, vv);
        const float xo = to_f32(from_f32(o));
        const float rstd = gated_norm_rstd(block_sum(xo * xo, scratch), dv, eps);
        out[((long long)t * n_v_heads + h) * dv + j] = gated_norm_out(xo, rstd, w, zv);
    }
    store_state_column<DK>(st, dv, col);
    if (j == 0) elected = ticket == (unsigned)(group - 1);
    __syncthreads();
    for (int e = elected ? j : 2 * DK + j; e < 2 * DK + dv; e += blockDim.x) {
        const long long c = fused_conv_channel<DK>(e, kh, kd, h, dv);
        for (int i = 0; i < km1; ++i) cst[c * km1 + i] = from_f32(swin[e * 3 + i]);
    }
}

#define RECURRENT_INSTANCE(DK)                                                                  \
    extern "C" __global__ void __launch_bounds__(32) gdn_recurrent_dk##DK(                      \
        const store_t* q, const store_t* k, long long qk_stride, const store_t* v,              \
        long long v_stride, const float* g, const float* beta, float* state,                    \
        const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads, int dv,          \
        store_t* out) {                                                                         \
        recurrent_body<DK>(q, k, qk_stride, v, v_stride, g, beta, state, cu_seqlens, slots,     \
                           n_k_heads, n_v_heads, dv, out);                                      \
    }

RECURRENT_INSTANCE(64)
RECURRENT_INSTANCE(128)

// THREADS / MIN_BLOCKS are the launch bounds: any dv up to 256, or dv fixed at 128 (the
// Qwen3.5 / Qwen3-Next head) with three blocks an SM, which caps ptxas at 168 registers. On
// the H200 at batch 64 that streams the state at 3.73 TB/s against 3.21 for the dv-argument
// form (an instance sweep).
#define CONV_RECURRENT_GATED_INSTANCE(NAME, DK, DVF, THREADS, MIN_BLOCKS)                       \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) NAME(                     \
        const store_t* x, long long x_stride, store_t* conv_state, const store_t* conv_w,       \
        const store_t* conv_b, int K, unsigned* tickets, const store_t* a, const store_t* b,    \
        long long ab_stride, const float* a_log, const float* dt_bias, float* state,            \
        const int* cu_seqlens, const int* slots, const store_t* z, long long z_stride,          \
        const store_t* norm_w, float eps, int n_k_heads, int n_v_heads, int dv, store_t* out) { \
        conv_recurrent_gated_body<DK, DVF, THREADS>(                                            \
            x, x_stride, conv_state, conv_w, conv_b, K, tickets, a, b, ab_stride, a_log,        \
            dt_bias, state, cu_seqlens, slots, z, z_stride, norm_w, eps, n_k_heads, n_v_heads,  \
            dv, out);                                                                           \
    }

CONV_RECURRENT_GATED_INSTANCE(gdn_conv_recurrent_gated_dk64, 64, 0, 256, 1)
CONV_RECURRENT_GATED_INSTANCE(gdn_conv_recurrent_gated_dk128, 128, 0, 256, 1)
CONV_RECURRENT_GATED_INSTANCE(gdn_conv_recurrent_gated_dk128_dv128, 128, 128, 128, 3)

// Rollback of speculative drafts by replay (engine/speculation.rs): a verify step keeps each
// verify chunk's rows of the fused input projection that the recurrence reads (the conv
// channels, then b and a), and a rollback rebuilds a state from the state kept before the
// chunk by running only the conv and the delta rule over the accepted tokens.

// Kept row r takes step row rows[r] (none where rows[r] < 0): its conv channels x[0..channels)
// and the 2 * n_v_heads values at x[ab_offset..) (b, then a), into kept[r] of
// channels + 2 * n_v_heads. Grid (column tiles of blockDim.x, kept rows).
extern "C" __global__ void gdn_keep_rows(const store_t* __restrict__ x, long long x_stride,
                                         const int* __restrict__ rows, int channels,
                                         int ab_offset, int n_v_heads,
                                         store_t* __restrict__ kept) {
    pdl_enter();
    const int r = blockIdx.y;
    const int src = rows[r];
    const int width = channels + 2 * n_v_heads;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (src < 0 || c >= width) return;
    const long long from = (long long)src * x_stride + (c < channels ? c : ab_offset + c - channels);
    kept[(long long)r * width + c] = x[from];
}

// The conv output of channel c at token t (0-based in the replayed range) from the kept rows
// row0.. and, for the window before the range, the source slot's conv state: the forward's
// conv_tap, rounded to storage and through SiLU as the conv kernels store it.
template <int K>
__device__ __forceinline__ float replay_conv(const store_t* __restrict__ kept, int width, int row0,
                                             const store_t* __restrict__ st, const float* wt,
                                             float b, int c, int t) {
    float win[K - 1];
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        const int p = t - (K - 1) + i;
        win[i] = to_f32(p >= 0 ? kept[(long long)(row0 + p) * width + c] : st[K - 1 + p]);
    }
    const float xv = to_f32(kept[(long long)(row0 + t) * width + c]);
    return to_f32(from_f32(silu_f(round_st(conv_tap<K>(win, wt, b, xv)))));
}

// Channel c's conv state after n replayed tokens: the last K - 1 inputs, older ones from the
// source state cs where n is shorter, into cd.
template <int K>
__device__ __forceinline__ void replay_conv_state(const store_t* __restrict__ kept, int width,
                                                  int row0, int n, const store_t* __restrict__ cs,
                                                  store_t* __restrict__ cd, int c) {
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
        const int q = n - (K - 1) + i;
        cd[(long long)c * (K - 1) + i] = q >= 0 ? kept[(long long)(row0 + q) * width + c] : cs[(long long)c * (K - 1) + K - 1 + q];
    }
}

// Grid (n_v_heads, replays), dv threads; replay s is params[4 s ..]: first kept row, tokens,
// source slot, destination slot (never the source of any replay of the launch). Thread j owns
// column j of head h's delta state, read once from the source slot, carried through the
// tokens in registers with the forward's per-token chain (gdn_gate, load_qk_normed,
// delta_column_step) and written once to the destination; the block also writes its v
// channels' conv state, and the first value head of each key head the q and k channels'.
template <int DK, int K>
__device__ __forceinline__ void replay_body(
    const store_t* __restrict__ kept, int width, int kd, const int* __restrict__ params,
    store_t* __restrict__ conv_state, const store_t* __restrict__ conv_w,
    const store_t* __restrict__ conv_b, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ state, int n_k_heads, int n_v_heads,
    int dv) {
    __shared__ __align__(16) float sq[DK], sk[DK];
    __shared__ store_t sx[2 * DK];
    pdl_enter();
    const int j = threadIdx.x;
    const int h = blockIdx.x;
    const int* p = params + 4 * blockIdx.y;
    const int row0 = p[0], n = p[1], src = p[2], dst = p[3];
    const int group = n_v_heads / n_k_heads;
    const int kh = h / group;
    const int channels = 2 * kd + n_v_heads * dv;
    const int cv = 2 * kd + h * dv + j;
    const store_t* cs = conv_state + (long long)src * channels * (K - 1);
    store_t* cd = conv_state + (long long)dst * channels * (K - 1);
    const float* st = state + ((long long)src * n_v_heads + h) * DK * dv + j;
    float col[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) col[i] = st[(long long)i * dv];
    float wv[K];
#pragma unroll
    for (int i = 0; i < K; ++i) wv[i] = to_f32(conv_w[(long long)cv * K + i]);
    const float bv = conv_b ? to_f32(conv_b[cv]) : 0.0f;
    const float al = a_log[h], dtb = dt_bias[h];
    for (int t = 0; t < n; ++t) {
        const long long row = (long long)(row0 + t) * width;
        const float vv = replay_conv<K>(kept, width, row0, cs + (long long)cv * (K - 1), wv, bv, cv, t);
        const float bb = to_f32(kept[row + channels + h]);
        const float aa = to_f32(kept[row + channels + n_v_heads + h]);
        __syncthreads();
        for (int e = j; e < 2 * DK; e += blockDim.x) {
            const int c = e < DK ? kh * DK + e : kd + kh * DK + e - DK;
            float wt[K];
#pragma unroll
            for (int i = 0; i < K; ++i) wt[i] = to_f32(conv_w[(long long)c * K + i]);
            const float b = conv_b ? to_f32(conv_b[c]) : 0.0f;
            sx[e] = from_f32(replay_conv<K>(kept, width, row0, cs + (long long)c * (K - 1), wt, b, c, t));
        }
        __syncthreads();
        if (j < 32) load_qk_normed<DK>(sx, sx + DK, 0, 0, 0, j, sq, sk);
        __syncthreads();
        float g, bt;
        gdn_gate(aa, bb, al, dtb, &g, &bt);
        delta_column_step<DK>(col, sq, sk, expf(g), bt, vv);
    }
    store_state_column<DK>(state + ((long long)dst * n_v_heads + h) * DK * dv + j, dv, col);
    replay_conv_state<K>(kept, width, row0, n, cs, cd, cv);
    if (h % group == 0) {
        for (int e = j; e < 2 * DK; e += blockDim.x) {
            replay_conv_state<K>(kept, width, row0, n, cs, cd, e < DK ? kh * DK + e : kd + kh * DK + e - DK);
        }
    }
}

#define REPLAY_INSTANCE(DK, K)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gdn_replay_dk##DK##_k##K(                 \
        const store_t* kept, int width, int kd, const int* params, store_t* conv_state,         \
        const store_t* conv_w, const store_t* conv_b, const float* a_log,                       \
        const float* dt_bias, float* state, int n_k_heads, int n_v_heads, int dv) {             \
        replay_body<DK, K>(kept, width, kd, params, conv_state, conv_w, conv_b, a_log, dt_bias, \
                           state, n_k_heads, n_v_heads, dv);                                    \
    }

REPLAY_INSTANCE(64, 2)
REPLAY_INSTANCE(64, 3)
REPLAY_INSTANCE(64, 4)
REPLAY_INSTANCE(128, 2)
REPLAY_INSTANCE(128, 3)
REPLAY_INSTANCE(128, 4)
