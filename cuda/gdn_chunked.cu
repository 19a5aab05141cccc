// Chunked gated delta rule for prefill (the WY / UT form of flash-linear-attention's
// chunk_gated_delta_rule), with the same inputs, state layout and results as gdn_recurrent.
//
// Recurrent rule per token t (q, k L2-normalised, q scaled by DK^-1/2, g_t = log decay):
//   S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),  o_t = S_t^T q_t.
// Within a chunk of C tokens starting from state S_0, with G_t = g_0 + ... + g_t and
// A = strictly lower [beta_t e^{G_t - G_i} k_t . k_i], the chunk's u solve (I + A) u = beta (v - e^G K S_0):
//   u = U - W S_0  with  U = (I + A)^-1 diag(beta) V,  W = (I + A)^-1 diag(beta e^G) K,
//   o = diag(e^G) Q S_0 + M u  with  M = lower [e^{G_t - G_i} q_t . k_i] (i <= t),
//   S_C = e^{G_last} S_0 + (diag(e^{G_last - G}) K)^T u.
// U, W and M do not depend on the incoming state, so two kernels split the work:
//  - gdn_chunk_prep: one block per (chunk, value head), all chunks of all sequences in
//    parallel: normalises q / k, builds A and M, solves for W and U by forward substitution
//    (one thread per right-hand-side column, the column in registers) and writes W, U, M and
//    the per-token scales to a workspace.
//  - gdn_chunk_scan: one block per (32 value columns, value head, sequence) walks the chunks
//    in order and only propagates the state: three dense products per chunk against the f32
//    state slice (register-tiled 4x4 per thread), no substitution and nothing recomputed.
// Padding rows of a sequence's last chunk are zero in every operand: they change nothing.
//
// Workspace (f32, rows = n_tokens * n_v_heads, indexed by token so ragged sequences need no
// table): W [rows][DK], U [rows][dv], M [rows][CH_C], scales [rows][4] = (q scale * e^G,
// k scale * e^{G_last - G}, e^{G_last}, 0). Shared memory: see gdn_chunked.rs smem_bytes.
#include "common.cuh"

#define CH_C 64
#define CH_THREADS 128
#define CH_WARPS (CH_THREADS / 32)
#define CH_COLS 32

// The sequence chunk of flat chunk index c (chunks numbered sequence by sequence): first
// token and length, or false past the last chunk (the grid is an upper bound).
__device__ __forceinline__ bool find_chunk(const int* __restrict__ cu_seqlens, int n_seqs, int c,
                                           int& s_out, int& t0, int& n) {
    for (int s = 0; s < n_seqs; ++s) {
        const int b = cu_seqlens[s];
        const int e = cu_seqlens[s + 1];
        const int nc = (e - b + CH_C - 1) / CH_C;
        if (c < nc) {
            s_out = s;
            t0 = b + c * CH_C;
            n = min(CH_C, e - t0);
            return true;
        }
        c -= nc;
    }
    return false;
}

template <int DK>
__device__ __forceinline__ void prep_body(const store_t* __restrict__ q, const store_t* __restrict__ k,
                                          long long qk_stride, const store_t* __restrict__ v,
                                          long long v_stride, const float* __restrict__ g,
                                          const float* __restrict__ beta,
                                          const int* __restrict__ cu_seqlens, int n_seqs,
                                          int n_k_heads, int n_v_heads, int dv, int n_tokens,
                                          float* __restrict__ work) {
    constexpr int LK = DK + 1;  // row stride of the q / k tiles (bank-conflict free columns)
    constexpr int EPL = DK / 32;
    // The q tile's space holds the substitution's solved columns after step 2.
    constexpr int QS = CH_C * (LK > CH_THREADS ? LK : CH_THREADS);
    extern __shared__ float ch_smem[];
    float* ks = ch_smem;          // [C][LK] normalised k
    float* qs = ks + CH_C * LK;   // [C][LK] normalised, scaled q; then xs [C][CH_THREADS]
    float* am = qs + QS;          // [C][C]  beta_t e^{G_t-G_i} k_t.k_i, i < t
    float* gc = am + CH_C * CH_C; // [C] cumulative log decay
    float* bc = gc + CH_C;        // [C] beta
    float* bw = bc + CH_C;        // [C] beta e^G
    float* qn = bw + CH_C;        // [C] q norm factor
    float* kn = qn + CH_C;        // [C] k norm factor

    int s, t0, n;
    if (!find_chunk(cu_seqlens, n_seqs, blockIdx.x, s, t0, n)) return;
    const int h = blockIdx.y;
    const int kh = h / (n_v_heads / n_k_heads);
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const long long rows = (long long)n_tokens * n_v_heads;
    float* w_out = work;
    float* u_out = w_out + rows * DK;
    float* m_out = u_out + rows * dv;
    float* sc_out = m_out + rows * CH_C;

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
        const float qf = rsqrtf(warp_sum(qss) + 1e-6f) * rsqrtf((float)DK);
        const float kf = rsqrtf(warp_sum(kss) + 1e-6f);
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qs[r * LK + e * 32 + lane] = qv[e] * qf;
            ks[r * LK + e * 32 + lane] = kv[e] * kf;
        }
        if (lane == 0) {
            qn[r] = qf;
            kn[r] = kf;
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
        const float b0 = lane < n ? beta[(long long)(t0 + lane) * n_v_heads + h] : 0.0f;
        const float b1 = lane + 32 < n ? beta[(long long)(t0 + lane + 32) * n_v_heads + h] : 0.0f;
        bc[lane] = b0;
        bc[lane + 32] = b1;
        bw[lane] = b0 * expf(g0);
        bw[lane + 32] = b1 * expf(g1);
    }
    __syncthreads();
    if (tid < n) {
        const float g_last = gc[CH_C - 1];
        float* sc = sc_out + ((long long)(t0 + tid) * n_v_heads + h) * 4;
        sc[0] = qn[tid] * expf(gc[tid]);
        sc[1] = kn[tid] * expf(g_last - gc[tid]);
        sc[2] = expf(g_last);
        sc[3] = 0.0f;
    }
    // 2. A (shared) and M (straight to the workspace). A warp shares t and spans 32 i.
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
        am[idx] = a;
        if (t < n) m_out[((long long)(t0 + t) * n_v_heads + h) * CH_C + i] = b;
    }
    __syncthreads();
    // 3. Forward substitution (I + A) X = R for the DK columns of W (R = beta e^G K) and the dv
    // columns of U (R = beta V), one thread per column, in blocks of 16 rows: a block's rows in
    // registers, the solved rows above it in this thread's column of xs (no barrier: a thread
    // reads only its own column). A's reads are block-wide broadcasts; rows past n stay zero
    // (their R and A rows are zero). Blocking keeps the unrolled code (and NVRTC time) small.
    float* xs = qs;
    for (int j = tid; j < DK + dv; j += CH_THREADS) {
        float* dst;
        long long stride;
        if (j < DK) {
            dst = w_out + (long long)h * DK + j;
            stride = (long long)n_v_heads * DK;
        } else {
            dst = u_out + (long long)h * dv + (j - DK);
            stride = (long long)n_v_heads * dv;
        }
#pragma unroll 1
        for (int b = 0; b < CH_C; b += 16) {
            float x[16];
            if (j < DK) {
#pragma unroll
                for (int r = 0; r < 16; ++r) x[r] = bw[b + r] * ks[(b + r) * LK + j];
            } else {
                const store_t* vj = v + (long long)h * dv + (j - DK);
#pragma unroll
                for (int r = 0; r < 16; ++r)
                    x[r] = b + r < n ? bc[b + r] * to_f32(vj[(long long)(t0 + b + r) * v_stride]) : 0.0f;
            }
            for (int i = 0; i < b; ++i) {
                const float xi = xs[i * CH_THREADS + tid];
#pragma unroll
                for (int r = 0; r < 16; ++r) x[r] = fmaf(-am[(b + r) * CH_C + i], xi, x[r]);
            }
#pragma unroll
            for (int r = 1; r < 16; ++r)
#pragma unroll
                for (int i = 0; i < r; ++i) x[r] = fmaf(-am[(b + r) * CH_C + b + i], x[i], x[r]);
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                xs[(b + r) * CH_THREADS + tid] = x[r];
                if (b + r < n) dst[(long long)(t0 + b + r) * stride] = x[r];
            }
        }
    }
}

// Tensor-core form of the scan's three products (sm_80+): mma.sync m16n8k8 with tf32 operands
// and f32 accumulators. The operands are f32 in shared memory already (the state slice, W, U,
// M, u), so tf32 takes them with one rounding each (10 explicit mantissa bits, against bf16's
// 7, at no packing cost); accumulation, and the state kept in registers, stay f32. Fragment
// layout (PTX ISA, m16n8k8 .tf32): g = lane / 4, q = lane % 4; A (16 x 8, row-major)
// a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4); B (8 x 8, column-major) b0 (q, g),
// b1 (q + 4, g); C (16 x 8) c0 (g, 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CH_TENSOR_CORES 1
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma1688(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// c[nt][4] += A (16 rows from a_row0, K columns, row stride la; A(r, k) = a[r * la + k]) times
// B (K x 32 columns at b, row stride lb): one warp, four n-tiles of 8.
template <int K>
__device__ __forceinline__ void warp_mma_rows(float (*c)[4], const float* a, int la, const float* b,
                                              int lb, int g, int q) {
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 8) {
        const unsigned af[4] = {to_tf32(a[g * la + k0 + q]), to_tf32(a[(g + 8) * la + k0 + q]),
                                to_tf32(a[g * la + k0 + q + 4]), to_tf32(a[(g + 8) * la + k0 + q + 4])};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
            mma1688(c[nt], af, to_tf32(b[(k0 + q) * lb + 8 * nt + g]),
                    to_tf32(b[(k0 + q + 4) * lb + 8 * nt + g]));
    }
}
#endif

// The scan's state slice, f32: its DK x 32 entries are spread over the block's threads, DK / 4
// each, in one of two layouts. SIMT (tiled 4 x 4): entry e of a thread is row ty + 16 (e / 4),
// column tx + 8 (e % 4). Tensor cores: warp w owns rows w DK/4 .. (w + 1) DK/4 - 1 as m-tiles
// of 16 in the mma C layout: e = (m-tile * 4 + n-tile) * 4 + i.
template <int DK, bool TC>
__device__ __forceinline__ void state_entry(int tid, int e, int& row, int& col) {
    if (TC) {
        const int w = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
        const int mt = e >> 4, nt = (e >> 2) & 3, i = e & 3;
        row = w * (DK / 4) + 16 * mt + g + 8 * (i >> 1);
        col = 8 * nt + 2 * q + (i & 1);
    } else {
        row = (tid >> 3) + 16 * (e >> 2);
        col = (tid & 7) + 8 * (e & 3);
    }
}

template <int DK, bool TC>
__device__ __forceinline__ void scan_body(const store_t* __restrict__ q, const store_t* __restrict__ k,
                                          long long qk_stride, const float* __restrict__ work,
                                          float* __restrict__ state,
                                          const int* __restrict__ cu_seqlens,
                                          const int* __restrict__ slots, int n_k_heads,
                                          int n_v_heads, int dv, int n_tokens,
                                          store_t* __restrict__ out) {
    constexpr int LK = DK + 1;       // row stride of the Q / W / K tiles
    constexpr int LS = CH_COLS + 1;  // row stride of the state slice and u
    constexpr int LM = CH_C + 1;     // row stride of M
    constexpr int NS = DK / 4;       // state entries per thread (state_entry)
    extern __shared__ float ch_smem[];
    float* ss = ch_smem;             // [DK][LS] state columns j0..j0+31 (f32)
    float* qg = ss + DK * LS;        // [C][LK]  e^G q (normalised, scaled)
    float* wk = qg + CH_C * LK;      // [C][LK]  W, then e^{G_last - G} k
    float* mm = wk + CH_C * LK;      // [C][LM]  M
    float* us = mm + CH_C * LM;      // [C][LS]  U, then u

    const int j0 = blockIdx.x * CH_COLS;
    const int h = blockIdx.y;
    const int s = blockIdx.z;
    const int kh = h / (n_v_heads / n_k_heads);
    const int tid = threadIdx.x;
    const int tx = tid & 7;   // SIMT: columns tx + 8c
    const int ty = tid >> 3;  // SIMT: rows ty + 16r
    const long long rows = (long long)n_tokens * n_v_heads;
    const float* w_in = work;
    const float* u_in = w_in + rows * DK;
    const float* m_in = u_in + rows * dv;
    const float* sc_in = m_in + rows * CH_C;

    float* st = state + ((long long)slots[s] * n_v_heads + h) * DK * dv + j0;
    float sr[NS];  // this thread's state entries (state_entry)
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        state_entry<DK, TC>(tid, e, row, col);
        sr[e] = st[(long long)row * dv + col];
        ss[row * LS + col] = sr[e];
    }

    const int t_begin = cu_seqlens[s];
    const int t_end = cu_seqlens[s + 1];
    for (int t0 = t_begin; t0 < t_end; t0 += CH_C) {
        const int n = min(CH_C, t_end - t0);
        __syncthreads();  // the previous chunk's readers of every tile are done
        // Tile loads: constant trip counts, unrolled, so each thread has many loads in flight.
#pragma unroll 16
        for (int it = 0; it < CH_C * DK / CH_THREADS; ++it) {
            const int idx = tid + it * CH_THREADS;
            const int t = idx / DK;
            const int d = idx - t * DK;
            float a = 0.0f, b = 0.0f;
            if (t < n) {
                const long long row = (long long)(t0 + t) * n_v_heads + h;
                a = to_f32(q[(long long)(t0 + t) * qk_stride + (long long)kh * DK + d]) * sc_in[row * 4];
                b = w_in[row * DK + d];
            }
            qg[t * LK + d] = a;
            wk[t * LK + d] = b;
        }
#pragma unroll 16
        for (int it = 0; it < CH_C * CH_C / CH_THREADS; ++it) {
            const int idx = tid + it * CH_THREADS;
            const int t = idx / CH_C;
            const int i = idx - t * CH_C;
            mm[t * LM + i] = t < n ? m_in[((long long)(t0 + t) * n_v_heads + h) * CH_C + i] : 0.0f;
        }
#pragma unroll
        for (int it = 0; it < CH_C * CH_COLS / CH_THREADS; ++it) {
            const int idx = tid + it * CH_THREADS;
            const int t = idx / CH_COLS;
            const int c = idx - t * CH_COLS;
            us[t * LS + c] = t < n ? u_in[((long long)(t0 + t) * n_v_heads + h) * dv + j0 + c] : 0.0f;
        }
        __syncthreads();
        // 1. u = U - W S and o = (e^G Q) S on 16 token rows x 32 columns per thread's 4 x 4
        // entries: SIMT rows ty + 16r, columns tx + 8c; TC the C fragments of warp w's rows
        // 16w.. (entry [nt][i] at row 16w + g + 8 (i / 2), column 8 nt + 2 q + i % 2).
        float ua[4][4], oa[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) ua[r][c] = oa[r][c] = 0.0f;
        int erow[4][4], ecol[4][4];  // the (token row, column) of entry [r][c] of ua / oa
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (TC) {
                    erow[r][c] = 16 * (tid >> 5) + ((tid & 31) >> 2) + 8 * (c >> 1);
                    ecol[r][c] = 8 * r + 2 * (tid & 3) + (c & 1);
                } else {
                    erow[r][c] = ty + 16 * r;
                    ecol[r][c] = tx + 8 * c;
                }
            }
        if (TC) {
#ifdef CH_TENSOR_CORES
            const int r0 = 16 * (tid >> 5), g = (tid & 31) >> 2, qq = tid & 3;
            warp_mma_rows<DK>(ua, wk + r0 * LK, LK, ss, LS, g, qq);
            warp_mma_rows<DK>(oa, qg + r0 * LK, LK, ss, LS, g, qq);
#endif
        } else {
#pragma unroll 4
            for (int d = 0; d < DK; ++d) {
                float sv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) sv[c] = ss[d * LS + tx + 8 * c];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float wv = wk[(ty + 16 * r) * LK + d];
                    const float qv = qg[(ty + 16 * r) * LK + d];
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        ua[r][c] = fmaf(wv, sv[c], ua[r][c]);
                        oa[r][c] = fmaf(qv, sv[c], oa[r][c]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) ua[r][c] = us[erow[r][c] * LS + ecol[r][c]] - ua[r][c];
        __syncthreads();  // W and U are consumed
        // 2. u replaces U; the decayed keys replace W.
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) us[erow[r][c] * LS + ecol[r][c]] = ua[r][c];
#pragma unroll 16
        for (int it = 0; it < CH_C * DK / CH_THREADS; ++it) {
            const int idx = tid + it * CH_THREADS;
            const int t = idx / DK;
            const int d = idx - t * DK;
            float b = 0.0f;
            if (t < n) {
                const long long row = (long long)(t0 + t) * n_v_heads + h;
                b = to_f32(k[(long long)(t0 + t) * qk_stride + (long long)kh * DK + d]) * sc_in[row * 4 + 1];
            }
            wk[t * LK + d] = b;
        }
        __syncthreads();
        // 3. o += M u; rows past n are padding (zero in M and u, so the tensor-core form
        // multiplies the whole 64-token chunk).
        if (TC) {
#ifdef CH_TENSOR_CORES
            warp_mma_rows<CH_C>(oa, mm + 16 * (tid >> 5) * LM, LM, us, LS, (tid & 31) >> 2, tid & 3);
#endif
        } else {
            for (int i = 0; i < n; ++i) {
                float uv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) uv[c] = us[i * LS + tx + 8 * c];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float mv = mm[(ty + 16 * r) * LM + i];
#pragma unroll
                    for (int c = 0; c < 4; ++c) oa[r][c] = fmaf(mv, uv[c], oa[r][c]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int t = erow[r][c];
                if (t < n) out[((long long)(t0 + t) * n_v_heads + h) * dv + j0 + ecol[r][c]] = from_f32(oa[r][c]);
            }
        // 4. S = e^{G_last} S + (e^{G_last - G} K)^T u, in registers, then the shared copy
        // (last read in step 1 of this chunk, next read after the loop's barrier).
        const float e_last = sc_in[((long long)t0 * n_v_heads + h) * 4 + 2];
#pragma unroll
        for (int e = 0; e < NS; ++e) sr[e] *= e_last;
        if (TC) {
#ifdef CH_TENSOR_CORES
            // Warp w's m-tiles of 16 state rows; A(d, i) = K^T is read transposed from wk.
            const int g = (tid & 31) >> 2, qq = tid & 3;
#pragma unroll
            for (int mt = 0; mt < DK / 64; ++mt) {
                const int d0 = (tid >> 5) * (DK / 4) + 16 * mt;
#pragma unroll 4
                for (int i0 = 0; i0 < CH_C; i0 += 8) {
                    const unsigned af[4] = {to_tf32(wk[(i0 + qq) * LK + d0 + g]),
                                            to_tf32(wk[(i0 + qq) * LK + d0 + g + 8]),
                                            to_tf32(wk[(i0 + qq + 4) * LK + d0 + g]),
                                            to_tf32(wk[(i0 + qq + 4) * LK + d0 + g + 8])};
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                        mma1688(sr + 16 * mt + 4 * nt, af, to_tf32(us[(i0 + qq) * LS + 8 * nt + g]),
                                to_tf32(us[(i0 + qq + 4) * LS + 8 * nt + g]));
                }
            }
#endif
        } else {
            for (int i = 0; i < n; ++i) {
                float uv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) uv[c] = us[i * LS + tx + 8 * c];
#pragma unroll
                for (int r = 0; r < DK / 16; ++r) {
                    const float kv = wk[i * LK + ty + 16 * r];
#pragma unroll
                    for (int c = 0; c < 4; ++c) sr[4 * r + c] = fmaf(kv, uv[c], sr[4 * r + c]);
                }
            }
        }
#pragma unroll
        for (int e = 0; e < NS; ++e) {
            int row, col;
            state_entry<DK, TC>(tid, e, row, col);
            ss[row * LS + col] = sr[e];
        }
    }
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        state_entry<DK, TC>(tid, e, row, col);
        st[(long long)row * dv + col] = sr[e];
    }
}

// gdn_chunk_scan_tc_dk* is the tensor-core scan where the architecture has tf32 mma (sm_80+)
// and the SIMT scan elsewhere (the launcher only picks it on sm_80+).
#ifdef CH_TENSOR_CORES
#define SCAN_TC true
#else
#define SCAN_TC false
#endif

#define CHUNKED_INSTANCE(DK)                                                                    \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_prep_dk##DK(             \
        const store_t* q, const store_t* k, long long qk_stride, const store_t* v,              \
        long long v_stride, const float* g, const float* beta, const int* cu_seqlens,           \
        int n_seqs, int n_k_heads, int n_v_heads, int dv, int n_tokens, float* work) {          \
        prep_body<DK>(q, k, qk_stride, v, v_stride, g, beta, cu_seqlens, n_seqs, n_k_heads,     \
                      n_v_heads, dv, n_tokens, work);                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_scan_dk##DK(             \
        const store_t* q, const store_t* k, long long qk_stride, const float* work,             \
        float* state, const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads,    \
        int dv, int n_tokens, store_t* out) {                                                   \
        scan_body<DK, false>(q, k, qk_stride, work, state, cu_seqlens, slots, n_k_heads,        \
                             n_v_heads, dv, n_tokens, out);                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_scan_tc_dk##DK(          \
        const store_t* q, const store_t* k, long long qk_stride, const float* work,             \
        float* state, const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads,    \
        int dv, int n_tokens, store_t* out) {                                                   \
        scan_body<DK, SCAN_TC>(q, k, qk_stride, work, state, cu_seqlens, slots, n_k_heads,      \
                               n_v_heads, dv, n_tokens, out);                                   \
    }

CHUNKED_INSTANCE(64)
CHUNKED_INSTANCE(128)
