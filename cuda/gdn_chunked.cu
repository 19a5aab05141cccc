// Chunked gated delta rule for prefill (the WY / UT form of flash-linear-attention's
// chunk_gated_delta_rule), with the same inputs, state layout and results as gdn_recurrent.
//
// Recurrent rule per token t (q, k L2-normalised, q scaled by DK^-1/2, g_t = log decay):
//   S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),  o_t = S_t^T q_t.
// Within a chunk of C tokens starting from state S_0, with G_t = g_0 + ... + g_t:
//   S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} k_i u_i^T, so
//   u_t + sum_{i<t} beta_t e^{G_t - G_i} (k_t . k_i) u_i = beta_t (v_t - e^{G_t} S_0^T k_t),
// a unit lower-triangular system (I + A) U = R solved by forward substitution, then
//   o_t = e^{G_t} S_0^T q_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) u_i,
//   S_C = e^{G_{C-1}} S_0 + sum_i e^{G_{C-1} - G_i} k_i u_i^T.
// The sequential work per chunk is the C-step substitution instead of C dependent state
// updates of DK x DV, and everything else is dense products over the chunk.
//
// Grid (DV / 32, n_v_heads, n_seqs), CH_THREADS threads: a block owns 32 value columns of one
// head of one sequence (columns are independent given A, which each block recomputes) and
// keeps its [DK, 32] state slice in shared memory (f32) from the first chunk to the last.
// Padding rows of the last chunk have k = q = 0, beta = 0 and g = 0: they change nothing.
// Shared memory (dynamic, opted in by the launcher): see gdn_chunked_smem_floats.
#include "common.cuh"

#define CH_C 64
#define CH_THREADS 128
#define CH_WARPS (CH_THREADS / 32)
#define CH_COLS 32

template <int DK>
__device__ __forceinline__ void chunked_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k, long long qk_stride,
    const store_t* __restrict__ v, long long v_stride, const float* __restrict__ g,
    const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ cu_seqlens,
    const int* __restrict__ slots, int n_k_heads, int n_v_heads, int dv,
    store_t* __restrict__ out) {
    constexpr int LK = DK + 1;       // row stride of the q / k tiles (bank-conflict free columns)
    constexpr int LC = CH_C + 1;     // row stride of A and QK
    constexpr int LS = CH_COLS + 1;  // row stride of the state slice and U
    constexpr int EPL = DK / 32;
    extern __shared__ float ch_smem[];
    float* ks = ch_smem;             // [C][LK]
    float* qs = ks + CH_C * LK;      // [C][LK]
    float* am = qs + CH_C * LK;      // [C][LC]  beta_t e^{G_t-G_i} k_t.k_i, i < t
    float* qk = am + CH_C * LC;      // [C][LC]  e^{G_t-G_i} q_t.k_i, i <= t
    float* ss = qk + CH_C * LC;      // [DK][LS] state columns j0..j0+31
    float* us = ss + DK * LS;        // [C][LS]  R, then U
    float* gc = us + CH_C * LS;      // [C] cumulative log decay
    float* bc = gc + CH_C;           // [C] beta
    float* dc = bc + CH_C;           // [C] e^{G_last - G_t}

    const int j0 = blockIdx.x * CH_COLS;
    const int h = blockIdx.y;
    const int s = blockIdx.z;
    const int kh = h / (n_v_heads / n_k_heads);
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const float q_scale = rsqrtf((float)DK);
    float* st = state + ((long long)slots[s] * n_v_heads + h) * DK * dv + j0;
    for (int d = warp; d < DK; d += CH_WARPS) ss[d * LS + lane] = st[(long long)d * dv + lane];

    const int t_begin = cu_seqlens[s];
    const int t_end = cu_seqlens[s + 1];
    for (int t0 = t_begin; t0 < t_end; t0 += CH_C) {
        const int n = min(CH_C, t_end - t0);
        __syncthreads();  // the previous chunk's readers of ks / us / dc are done
        // 1. Normalised q and k rows (one warp per row), gates.
        for (int r = warp; r < CH_C; r += CH_WARPS) {
            float qv[EPL], kv[EPL], qss = 0.0f, kss = 0.0f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                qv[e] = kv[e] = 0.0f;
                if (r < n) {
                    const long long base = (long long)(t0 + r) * qk_stride + (long long)kh * DK + e * 32 + lane;
                    qv[e] = to_f32(q[base]);
                    kv[e] = to_f32(k[base]);
                }
                qss += qv[e] * qv[e];
                kss += kv[e] * kv[e];
            }
            const float qn = rsqrtf(warp_sum(qss) + 1e-6f) * q_scale;
            const float kn = rsqrtf(warp_sum(kss) + 1e-6f);
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                qs[r * LK + e * 32 + lane] = qv[e] * qn;
                ks[r * LK + e * 32 + lane] = kv[e] * kn;
            }
        }
        if (warp == 0) {
            // Inclusive prefix sum of g over the chunk: lanes hold rows lane and lane + 32.
            float g0 = lane < n ? g[(long long)(t0 + lane) * n_v_heads + h] : 0.0f;
            float g1 = lane + 32 < n ? g[(long long)(t0 + lane + 32) * n_v_heads + h] : 0.0f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float a0 = __shfl_up_sync(0xffffffffu, g0, o);
                const float a1 = __shfl_up_sync(0xffffffffu, g1, o);
                if (lane >= o) {
                    g0 += a0;
                    g1 += a1;
                }
            }
            g1 += __shfl_sync(0xffffffffu, g0, 31);
            gc[lane] = g0;
            gc[lane + 32] = g1;
            const float g_last = __shfl_sync(0xffffffffu, g1, 31);
            dc[lane] = expf(g_last - g0);
            dc[lane + 32] = expf(g_last - g1);
            bc[lane] = lane < n ? beta[(long long)(t0 + lane) * n_v_heads + h] : 0.0f;
            bc[lane + 32] = lane + 32 < n ? beta[(long long)(t0 + lane + 32) * n_v_heads + h] : 0.0f;
        }
        __syncthreads();
        // 2. A and QK (lower triangles). A warp shares t and spans 32 consecutive i.
        for (int idx = tid; idx < CH_C * CH_C; idx += CH_THREADS) {
            const int t = idx / CH_C;
            const int i = idx - t * CH_C;
            float a = 0.0f, b = 0.0f;
            if (i <= t && t < n) {
                const float* kt = ks + t * LK;
                const float* qt = qs + t * LK;
                const float* ki = ks + i * LK;
                float kk = 0.0f, qq = 0.0f;
#pragma unroll 8
                for (int d = 0; d < DK; ++d) {
                    kk = fmaf(kt[d], ki[d], kk);
                    qq = fmaf(qt[d], ki[d], qq);
                }
                const float decay = expf(gc[t] - gc[i]);
                a = i < t ? bc[t] * decay * kk : 0.0f;
                b = decay * qq;
            }
            am[t * LC + i] = a;
            qk[t * LC + i] = b;
        }
        // 3. R = beta (V - e^G K S_0) and the inter-chunk output e^G Q S_0; column j0 + lane,
        // rows warp, warp + 4, ...
        float o_inter[CH_C / CH_WARPS];
#pragma unroll
        for (int rr = 0; rr < CH_C / CH_WARPS; ++rr) {
            const int t = warp + rr * CH_WARPS;
            const float* kt = ks + t * LK;
            const float* qt = qs + t * LK;
            float w = 0.0f, oq = 0.0f;
#pragma unroll 8
            for (int d = 0; d < DK; ++d) {
                const float sv = ss[d * LS + lane];
                w = fmaf(kt[d], sv, w);
                oq = fmaf(qt[d], sv, oq);
            }
            const float eg = expf(gc[t]);
            const float vv = t < n ? to_f32(v[(long long)(t0 + t) * v_stride + (long long)h * dv + j0 + lane]) : 0.0f;
            us[t * LS + lane] = bc[t] * (vv - eg * w);
            o_inter[rr] = eg * oq;
        }
        __syncthreads();
        // 4. Forward substitution U = (I + A)^-1 R. Warp w owns columns 8w..8w+7; the 4 lanes of
        // a column split the sum over i (i = part, part + 4, ...) and reduce by shuffles.
        {
            const int col = warp * 8 + (lane >> 2);
            const int part = lane & 3;
            for (int t = 1; t < n; ++t) {
                float acc = 0.0f;
                for (int i = part; i < t; i += 4) acc = fmaf(am[t * LC + i], us[i * LS + col], acc);
                acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                if (part == 0) us[t * LS + col] -= acc;
                __syncwarp();
            }
        }
        __syncthreads();
        // 5. Output rows: o = e^G Q S_0 + QK U.
#pragma unroll
        for (int rr = 0; rr < CH_C / CH_WARPS; ++rr) {
            const int t = warp + rr * CH_WARPS;
            if (t >= n) continue;
            float o = o_inter[rr];
            const float* qkt = qk + t * LC;
            for (int i = 0; i <= t; ++i) o = fmaf(qkt[i], us[i * LS + lane], o);
            out[((long long)(t0 + t) * n_v_heads + h) * dv + j0 + lane] = from_f32(o);
        }
        // 6. State: S = e^{G_last} S_0 + sum_t e^{G_last - G_t} k_t u_t^T (rows d of this warp).
        const float e_last = expf(gc[CH_C - 1]);
        for (int d = warp; d < DK; d += CH_WARPS) {
            float acc = ss[d * LS + lane] * e_last;
            for (int t = 0; t < n; ++t) acc = fmaf(dc[t] * ks[t * LK + d], us[t * LS + lane], acc);
            ss[d * LS + lane] = acc;
        }
    }
    __syncthreads();
    for (int d = warp; d < DK; d += CH_WARPS) st[(long long)d * dv + lane] = ss[d * LS + lane];
}

#define CHUNKED_INSTANCE(DK)                                                                    \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunked_dk##DK(                \
        const store_t* q, const store_t* k, long long qk_stride, const store_t* v,              \
        long long v_stride, const float* g, const float* beta, float* state,                    \
        const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads, int dv,          \
        store_t* out) {                                                                         \
        chunked_body<DK>(q, k, qk_stride, v, v_stride, g, beta, state, cu_seqlens, slots,       \
                         n_k_heads, n_v_heads, dv, out);                                        \
    }

CHUNKED_INSTANCE(64)
CHUNKED_INSTANCE(128)
