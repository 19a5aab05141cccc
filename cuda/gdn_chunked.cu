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
//    the per-token scales to a workspace. Two forms: f32 on CUDA cores (gdn_chunk_prep_dk*) and,
//    sm_80+, A and M on tensor cores from the raw storage-type rows (gdn_chunk_prep_tc_dk*,
//    the default there; see prep_tc_body).
//  - gdn_chunk_scan: one block per (32 value columns, value head, sequence) walks the chunks
//    in order and only propagates the state: three dense products per chunk against the f32
//    state slice (register-tiled 4x4 per thread), no substitution and nothing recomputed.
//    Four forms: SIMT (gdn_chunk_scan_dk*), tensor cores (gdn_chunk_scan_tc_dk*, sm_80+),
//    tensor cores with each warp's operands staged by cp.async a chunk ahead
//    (gdn_chunk_scan_pipe_dk*, sm_80+; see scan_pipe_body) and the same products over 8 warps
//    a block (gdn_chunk_scan_wide_dk*, sm_80+, the default there; see scan_wide_body).
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

// The workspace's four arrays for n_tokens tokens (layout above): W, U, M and the scales, one
// place for the preps that write them and the scans that read them (F = float / const float).
template <int DK, typename F>
struct ChunkWork {
    F *w, *u, *m, *sc;
    __device__ __forceinline__ ChunkWork(F* work, int n_tokens, int n_v_heads, int dv) {
        const long long rows = (long long)n_tokens * n_v_heads;
        w = work;
        u = w + rows * DK;
        m = u + rows * dv;
        sc = m + rows * CH_C;
    }
};

// A scan block's place in the launch grid (gdn_chunked.rs: dv / 32 x n_v_heads x n_seqs
// blocks) and what it reads and writes there, one place for the three scan bodies: its state
// columns j0..j0+31, value head h and the key head kh it shares, sequence s and that sequence's
// tokens [t_begin, t_end), the workspace arrays, and its state slice (row stride dv).
template <int DK>
struct ScanBlock {
    int j0, h, s, kh, t_begin, t_end;
    ChunkWork<DK, const float> ws;
    float* st;
    __device__ __forceinline__ ScanBlock(const float* work, float* state, const int* __restrict__ cu_seqlens,
                                         const int* __restrict__ slots, int n_k_heads, int n_v_heads, int dv,
                                         int n_tokens)
        : j0(blockIdx.x * CH_COLS),
          h(blockIdx.y),
          s(blockIdx.z),
          kh(h / (n_v_heads / n_k_heads)),
          t_begin(cu_seqlens[s]),
          t_end(cu_seqlens[s + 1]),
          ws(work, n_tokens, n_v_heads, dv),
          st(state + ((long long)slots[s] * n_v_heads + h) * DK * dv + j0) {}
};

// The chunk's gates, by one warp: inclusive prefix sum gc of the log decays g (lanes hold rows
// lane and lane + 32), beta (bc) and beta e^G (bw); rows past n are zero in g and beta.
__device__ __forceinline__ void chunk_gates(const float* __restrict__ g, const float* __restrict__ beta, int t0,
                                            int n, int h, int n_v_heads, int lane, float* gc, float* bc,
                                            float* bw) {
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

// Row r's per-token scales in the workspace (layout in the header): q norm e^G, k norm
// e^{G_last - G}, e^{G_last}.
__device__ __forceinline__ void write_scales(float* __restrict__ sc_out, int t0, int r, int h, int n_v_heads,
                                             const float* qn, const float* kn, const float* gc) {
    const float g_last = gc[CH_C - 1];
    float* sc = sc_out + ((long long)(t0 + r) * n_v_heads + h) * 4;
    sc[0] = qn[r] * expf(gc[r]);
    sc[1] = kn[r] * expf(g_last - gc[r]);
    sc[2] = expf(g_last);
    sc[3] = 0.0f;
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
    const ChunkWork<DK, float> wk(work, n_tokens, n_v_heads, dv);
    float *w_out = wk.w, *u_out = wk.u, *m_out = wk.m, *sc_out = wk.sc;

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
    if (warp == 0) chunk_gates(g, beta, t0, n, h, n_v_heads, lane, gc, bc, bw);
    __syncthreads();
    if (tid < n) write_scales(sc_out, t0, tid, h, n_v_heads, qn, kn, gc);
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
// f32 to tf32 operand bits, rounded to nearest. sm_90 converts in one instruction (cvt.rn,
// F2FP.TF32), ties to even; cvt.rna (ties away from zero, the only form before sm_90) is four
// there (an inf / NaN test, an add, a mask, a select), and a scan chunk step converts ~150
// values a warp: ~40% of the pipelined scan's instructions were these. The two differ only
// on exact ties.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
#if __CUDA_ARCH__ >= 900
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#else
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#endif
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

    const ScanBlock<DK> blk(work, state, cu_seqlens, slots, n_k_heads, n_v_heads, dv, n_tokens);
    const int j0 = blk.j0, h = blk.h, kh = blk.kh, t_begin = blk.t_begin, t_end = blk.t_end;
    const float *w_in = blk.ws.w, *u_in = blk.ws.u, *m_in = blk.ws.m, *sc_in = blk.ws.sc;
    float* st = blk.st;
    const int tid = threadIdx.x;
    const int tx = tid & 7;   // SIMT: columns tx + 8c
    const int ty = tid >> 3;  // SIMT: rows ty + 16r

    float sr[NS];  // this thread's state entries (state_entry)
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        state_entry<DK, TC>(tid, e, row, col);
        sr[e] = st[(long long)row * dv + col];
        ss[row * LS + col] = sr[e];
    }

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

// Pipelined tensor-core scan (sm_80+), `gdn_chunk_scan_pipe_dk*`. The scan above spends its
// ~72 us per chunk step (27B shape, H200) waiting, not computing: every chunk's operands are
// loaded by the whole block with scalar global loads, written to shared memory and fenced by
// __syncthreads before the products start, and the decayed keys are loaded again the same way
// between the products; with one or two 4-warp blocks per SM nothing else hides that latency.
// None of these operands depends on the state, and in the tensor-core partition each warp reads
// only its own slice of them: W, e^G Q, M and U rows 16w..16w+15 (the rows of u and o it
// computes) and K columns w DK/4.. (the state rows it owns). So each warp stages its own slices
// with 16-byte cp.async into warp-private shared memory (no block barrier: cp.async.wait_group
// and __syncwarp), one buffer per operand, each reloaded for chunk c + 1 as soon as chunk c's
// products have consumed it: W and Q after step 1, M after step 3, K after step 4, so every
// load has the rest of a chunk step to land. U and the per-token scales go to registers the
// same way. Q and K are staged raw (storage type, exact in tf32) and scaled in f32 instead:
// e^G q-norm on o's rows after Q S, e^{G_last - G} k-norm on the K fragment. The state slice
// and u, which every warp reads, keep the two block barriers per chunk.
// With two blocks an SM (4 warps each) a chunk step is bound by instruction issue, so the
// instruction count is what this form keeps down (1.48 -> 0.90 ms for the 27B shape's 8k scan
// against its first version, the same bits):
//  - fragments by ldmatrix (ldsm_x4): W, M and the B operands (state, u) one instruction per
//    four values; the state and u live transposed ([32][DK + 4], [32][C + 4]) as tf32 bits,
//    rounded once when written instead of at every read;
//  - step 1's two products (W S, Q S) share one pass over the state's fragments;
//  - copy and load addresses stepped by a uniform stride (PipeStreams), not recomputed from
//    (token, head) per copy (~20 integer instructions a copy, ~40 copies a chunk).
// Row strides of 4 mod 32 words keep every fragment read conflict-free. 112 KiB at DK 128: two
// blocks per SM on sm_90, so the 27B shape's 192 blocks stay one wave. Requires CH_COLS == 32.
#ifdef CH_TENSOR_CORES
#define CHP_ROWS (CH_C / CH_WARPS)  // token rows of u and o per warp

// Waits until at most N of this thread's committed groups are pending, then makes the whole
// warp's copies visible to the warp.
template <int N>
__device__ __forceinline__ void cp_async_wait_warp() {
    cp_async_wait_group<N>();
    __syncwarp();
}
// tf32 operand bits: f32 rounded once; storage values (bf16 / f16) are exact in tf32.
__device__ __forceinline__ unsigned tf32_of(float x) { return to_tf32(x); }
__device__ __forceinline__ unsigned tf32_of(store_t x) { return __float_as_uint(to_f32(x)); }
// Fragments by ldmatrix. ldmatrix.x4 hands thread t word t % 4 of
// row t / 4 of four 8 x (16 bytes) matrices, which on 32-bit data is exactly the tf32 m16n8k8
// A fragment (a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4)) of a 16 x 8 f32 tile,
// or the B fragments (b0 (k q, n g), b1 (k q + 4, n g)) of two n-tiles of a tile stored
// transposed ([n][k]): one instruction where the scalar form issues four shared loads. Row
// strides of 4 mod 32 words keep the 8 rows of each matrix on distinct banks.
// Addresses are 32-bit shared-window byte addresses (smem_u32 once, then integer offsets that
// unrolled loops fold into the instruction's immediate).
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// This lane's row address offset (elements) for an A fragment of an f32 tile with row stride
// la (matrices: rows 0-7 / 8-15 x columns 0-3 / 4-7), and for the B fragments of n-tiles 0 and 1
// of a transposed tile with row stride lb (matrices: n 0-7 k 0-3, n 0-7 k 4-7, n 8-15 k 0-3,
// n 8-15 k 4-7).
__device__ __forceinline__ int ldsm_a_off(int lane, int la) { return ((lane & 7) + 8 * ((lane >> 3) & 1)) * la + 4 * (lane >> 4); }
__device__ __forceinline__ int ldsm_b_off(int lane, int lb) { return ((lane & 7) + 8 * (lane >> 4)) * lb + 4 * ((lane >> 3) & 1); }
// tf32 A fragment of f32 values by ldmatrix (rounded here, as tf32_of does).
__device__ __forceinline__ void ldsm_a_tf32(unsigned (&af)[4], unsigned addr) {
    ldsm_x4(af, addr);
#pragma unroll
    for (int i = 0; i < 4; ++i) af[i] = to_tf32(__uint_as_float(af[i]));
}
// The B fragments of n-tiles 0-3 at column k0 of a transposed tf32 tile (shared address b,
// ldsm_b_off applied, row stride LB words): b01 n-tiles 0 and 1, b23 n-tiles 2 and 3.
template <int LB>
__device__ __forceinline__ void ldsm_b4(unsigned (&b01)[4], unsigned (&b23)[4], unsigned b, int k0) {
    ldsm_x4(b01, b + 4 * k0);
    ldsm_x4(b23, b + 4 * (16 * LB + k0));
}
// c[0..1][4] += the A fragment af times the two n-tiles of one ldsm_x4 B load (b01 of ldsm_b4).
__device__ __forceinline__ void mma_b2(float (*c)[4], const unsigned (&af)[4], const unsigned (&b)[4]) {
    mma1688(c[0], af, b[0], b[1]);
    mma1688(c[1], af, b[2], b[3]);
}
// c[nt][4] += the A fragment af times n-tiles 0-3 of ldsm_b4's fragments.
__device__ __forceinline__ void mma_b4(float (*c)[4], const unsigned (&af)[4], const unsigned (&b01)[4],
                                       const unsigned (&b23)[4]) {
    mma_b2(c, af, b01);
    mma_b2(c + 2, af, b23);
}
// c[nt][4] += A (16 f32 rows at shared address a, this lane's ldsm_a_off applied, K columns)
// times B (K x 32, tf32 bits stored transposed at b, ldsm_b_off applied, row stride LB
// words).
template <int K, int LB>
__device__ __forceinline__ void warp_mma_ldsm(float (*c)[4], unsigned a, unsigned b) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned af[4], b01[4], b23[4];
        ldsm_a_tf32(af, a + 4 * k0);
        ldsm_b4<LB>(b01, b23, b, k0);
        mma_b4(c, af, b01, b23);
    }
}
// Step 1's two products over one pass of the state's B fragments: ua += W S (W f32 by
// ldmatrix at w) and oa += Q S (raw q rows at qr, stride lq, scalar loads: a 16-bit tile's
// ldmatrix layout is not tf32's).
template <int K, int LQ, int LB>
__device__ __forceinline__ void warp_mma_wq_ldsm(float (*ua)[4], float (*oa)[4], unsigned w, const store_t* qr,
                                                 unsigned b, int g, int q) {
    const store_t* q0 = qr + g * LQ + q;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned wf[4], b01[4], b23[4];
        ldsm_a_tf32(wf, w + 4 * k0);
        const unsigned qf[4] = {tf32_of(q0[k0]), tf32_of(q0[8 * LQ + k0]), tf32_of(q0[k0 + 4]),
                                tf32_of(q0[8 * LQ + k0 + 4])};
        ldsm_b4<LB>(b01, b23, b, k0);
        mma_b4(ua, wf, b01, b23);
        mma_b4(oa, qf, b01, b23);
    }
}

// Per-warp tile strides (elements) and the shared-memory layout; gdn_chunked.rs
// pipe_smem_bytes mirrors it.
template <int DK>
struct PipeLayout {
    static constexpr int LW = DK + 4;          // W rows, f32
    static constexpr int LM = CH_C + 4;        // M rows, f32
    static constexpr int LQ = DK + 8;          // raw q rows, storage type
    static constexpr int KC = DK / CH_WARPS;   // state rows (K columns) per warp
    static constexpr int LK = KC + 8;          // raw k rows (this warp's columns), storage type
    static constexpr int LST = DK + 4;         // transposed state rows (one per value column)
    static constexpr int LUT = CH_C + 4;       // transposed u rows
    static constexpr int SS = CH_COLS * LST;   // state tile floats
    static constexpr int US = CH_COLS * LUT;   // u tile floats
    static constexpr int F32 = SS + US + CH_WARPS * CHP_ROWS * (LW + LM);
};

// N 16-byte cp.async copies of consecutive rows, RSTEP rows apart: copy `it` goes from src plus
// it times step to shared address dst plus it times DSTEP, and one for row `row + it * RSTEP`
// at or past n (padding) has source size 0: it writes 16 zero bytes and reads nothing, so its
// address needs no substitute.
template <int N, int RSTEP, int DSTEP>
__device__ __forceinline__ void copy_rows16(unsigned dst, const char* src, long long step, int row, int n) {
#pragma unroll
    for (int it = 0; it < N; ++it) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + it * DSTEP), "l"(src),
                     "r"(row + it * RSTEP < n ? 16 : 0)
                     : "memory");
        src += step;
    }
}

// The operands a tensor-core scan thread loads to registers a chunk ahead (plain loads: they
// land while a chunk step runs), addresses stepped per chunk by a uniform stride: U at its NT
// n-tiles' entries of u (entry [nt][i]: row r0 + g + 8 (i / 2), column col0 + 8 nt + i % 2,
// col0 already holding the value column of the lane's 2 q) with the q scale of its two rows,
// and the k scales of the tokens of its K fragments (8 j + q and 8 j + q + 4) with e^{G_last}.
template <int NT>
struct ScanRegLoads {
    const float *u_src, *sc_q, *sc_k, *sc_last;  // at token 0 (the chunk's first token added per chunk)
    long long u_tok, sc_tok;
    __device__ __forceinline__ ScanRegLoads(const float* u_in, const float* sc_in, int h, int n_v_heads, int dv,
                                            int col0, int r0, int g, int q) {
        u_tok = (long long)n_v_heads * dv;
        sc_tok = (long long)n_v_heads * 4;
        u_src = u_in + ((long long)(r0 + g) * n_v_heads + h) * dv + col0;
        sc_q = sc_in + ((long long)(r0 + g) * n_v_heads + h) * 4;
        sc_k = sc_in + ((long long)q * n_v_heads + h) * 4 + 1;
        sc_last = sc_in + (long long)h * 4 + 2;
    }
    // (U's two adjacent columns in one 8-byte load: the workspace is 16-byte aligned, col0 even)
    __device__ __forceinline__ void u(float (&un)[NT][4], int t0, int n, int r0, int g) const {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const bool ok = r0 + g + 8 * half < n;
            const float* up = u_src + (t0 + 8 * half) * u_tok;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 x = ok ? *(const float2*)(up + 8 * nt) : make_float2(0.0f, 0.0f);
                un[nt][2 * half] = x.x;
                un[nt][2 * half + 1] = x.y;
            }
        }
    }
    __device__ __forceinline__ void sq(float (&sq)[2], int t0, int n, int r0, int g) const {
#pragma unroll
        for (int half = 0; half < 2; ++half) sq[half] = r0 + g + 8 * half < n ? sc_q[(t0 + 8 * half) * sc_tok] : 0.0f;
    }
    __device__ __forceinline__ void sk_last(float (&sk)[CH_C / 8][2], float& e_last, int t0, int n, int q) const {
        const float* p = sc_k + t0 * sc_tok;
#pragma unroll
        for (int j = 0; j < CH_C / 8; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                sk[j][half] = 8 * j + q + 4 * half < n ? *p : 0.0f;
                p += 4 * sc_tok;
            }
        e_last = n > 0 ? sc_last[t0 * sc_tok] : 0.0f;
    }
};

// A warp's copies of one chunk's operands. Copy `it` of an operand is the first copy's address
// plus it times a uniform step, and a chunk's first address one multiply-add from its first
// token. Row r of the warp's W / Q / M tile is token r0 + r; row i of its K tile is token i.
template <int DK>
struct PipeStreams : ScanRegLoads<4> {
    using L = PipeLayout<DK>;
    static constexpr int RW = 128 / DK;  // W rows a warp-wide round of copies advances
    static constexpr int RQ = 256 / DK;  // Q rows likewise (M: 2)
    // This thread's first rows within the chunk (W: r0 + lane / (DK / 4), Q: r0 + lane /
    // (DK / 8), M: r0 + lane / 16, K: lane / (KC / 8)) and shared addresses of its first copies.
    int rw, rq, rm, rk;
    unsigned dw, dq, dm, dk;
    const char *w_src, *q_src, *m_src, *k_src;  // at token 0 (the chunk's first token added per chunk)
    long long w_tok, qk_tok, m_tok;             // bytes a token advances each
    __device__ __forceinline__ PipeStreams(float* wsm, store_t* qsm, float* msm, store_t* ksm, const float* w_in,
                                           const store_t* qh, const store_t* kw, const float* m_in,
                                           const float* u_in, const float* sc_in, long long qk_stride, int h,
                                           int n_v_heads, int dv, int j0, int r0, int lane, int g, int q)
        : ScanRegLoads<4>(u_in, sc_in, h, n_v_heads, dv, j0 + 2 * q, r0, g, q) {
        const int cw = lane % (DK / 4), cq = lane % (DK / 8), cm = lane % 16, ck = lane % (L::KC / 8);
        rw = r0 + lane / (DK / 4);
        rq = r0 + lane / (DK / 8);
        rm = r0 + lane / 16;
        rk = lane / (L::KC / 8);
        dw = smem_u32(wsm + (rw - r0) * L::LW + 4 * cw);
        dq = smem_u32(qsm + (rq - r0) * L::LQ + 8 * cq);
        dm = smem_u32(msm + (rm - r0) * L::LM + 4 * cm);
        dk = smem_u32(ksm + rk * L::LK + 8 * ck);
        w_tok = (long long)n_v_heads * DK * 4;
        qk_tok = qk_stride * 2;
        m_tok = (long long)n_v_heads * CH_C * 4;
        w_src = (const char*)(w_in + (long long)h * DK + 4 * cw);
        q_src = (const char*)(qh + 8 * cq);
        m_src = (const char*)(m_in + (long long)h * CH_C + 4 * cm);
        k_src = (const char*)(kw + 8 * ck);
    }
    // The chunk at token t0 with n rows: W and Q (one group), M, K.
    __device__ __forceinline__ void wq(int t0, int n) const {
        copy_rows16<CHP_ROWS * (DK / 4) / 32, RW, RW * L::LW * 4>(dw, w_src + (t0 + rw) * w_tok, RW * w_tok, rw, n);
        copy_rows16<CHP_ROWS * (DK / 8) / 32, RQ, RQ * L::LQ * 2>(dq, q_src + (t0 + rq) * qk_tok, RQ * qk_tok, rq, n);
    }
    __device__ __forceinline__ void m(int t0, int n) const {
        copy_rows16<CHP_ROWS * (CH_C / 4) / 32, 2, 2 * L::LM * 4>(dm, m_src + (t0 + rm) * m_tok, 2 * m_tok, rm, n);
    }
    __device__ __forceinline__ void k(int t0, int n) const {
        constexpr int R = 32 / (L::KC / 8);
        copy_rows16<CH_C * (L::KC / 8) / 32, R, R * L::LK * 2>(dk, k_src + (t0 + rk) * qk_tok, R * qk_tok, rk, n);
    }
};

template <int DK>
__device__ __forceinline__ void scan_pipe_body(const store_t* __restrict__ q, const store_t* __restrict__ k,
                                               long long qk_stride, const float* __restrict__ work,
                                               float* __restrict__ state,
                                               const int* __restrict__ cu_seqlens,
                                               const int* __restrict__ slots, int n_k_heads,
                                               int n_v_heads, int dv, int n_tokens,
                                               store_t* __restrict__ out) {
    using L = PipeLayout<DK>;
    constexpr int NS = DK / 4;  // state entries per thread (state_entry, tensor-core layout)
    extern __shared__ float ch_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, qq = lane & 3;
    const int r0 = CHP_ROWS * warp;  // this warp's token rows of u and o
    // The state columns j0.. and u, transposed ([32][LST], [32][LUT]) as tf32 bits.
    float* ss = ch_smem;
    float* us = ss + L::SS;
    float* wsm = us + L::US + warp * CHP_ROWS * L::LW;                             // [16][LW] this warp's W rows
    float* msm = us + L::US + CH_WARPS * CHP_ROWS * L::LW + warp * CHP_ROWS * L::LM;  // [16][LM]
    const unsigned sst = smem_u32(ss) + 4 * ldsm_b_off(lane, L::LST);
    const unsigned ust = smem_u32(us) + 4 * ldsm_b_off(lane, L::LUT);
    const unsigned wsa = smem_u32(wsm) + 4 * ldsm_a_off(lane, L::LW);
    const unsigned msa = smem_u32(msm) + 4 * ldsm_a_off(lane, L::LM);
    // State entry (row, col) and u entry (token, col) as the tf32 operand bits.
    auto put_ss = [&](int row, int col, float x) { ss[col * L::LST + row] = __uint_as_float(to_tf32(x)); };
    auto put_us = [&](int t, int col, float x) { us[col * L::LUT + t] = __uint_as_float(to_tf32(x)); };
    store_t* qsm = (store_t*)(ch_smem + L::F32) + warp * CHP_ROWS * L::LQ;                     // [16][LQ]
    store_t* ksm = (store_t*)(ch_smem + L::F32) + CH_WARPS * CHP_ROWS * L::LQ + warp * CH_C * L::LK;  // [C][LK]

    const ScanBlock<DK> blk(work, state, cu_seqlens, slots, n_k_heads, n_v_heads, dv, n_tokens);
    const int j0 = blk.j0, h = blk.h, kh = blk.kh, t_begin = blk.t_begin, t_end = blk.t_end;
    const float *w_in = blk.ws.w, *u_in = blk.ws.u, *m_in = blk.ws.m, *sc_in = blk.ws.sc;
    float* st = blk.st;
    const store_t* qh = q + (long long)kh * DK;
    const store_t* kw = k + (long long)kh * DK + warp * L::KC;  // this warp's K columns

    const PipeStreams<DK> io(wsm, qsm, msm, ksm, w_in, qh, kw, m_in, u_in, sc_in, qk_stride, h, n_v_heads, dv, j0, r0,
                             lane, g, qq);
    // Chunk 0's operands, in the order the loop waits for them (three groups per chunk).
    io.wq(t_begin, t_end - t_begin);
    cp_async_commit();
    io.m(t_begin, t_end - t_begin);
    cp_async_commit();
    io.k(t_begin, t_end - t_begin);
    cp_async_commit();

    float sr[NS];  // this thread's state entries (state_entry<DK, true>)
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        state_entry<DK, true>(tid, e, row, col);
        sr[e] = st[(long long)row * dv + col];
        put_ss(row, col, sr[e]);
    }
    // Loaded a chunk ahead (ScanRegLoads).
    float un[4][4], sq[2], sk[CH_C / 8][2], e_last;
    io.u(un, t_begin, t_end - t_begin, r0, g);
    io.sq(sq, t_begin, t_end - t_begin, r0, g);
    io.sk_last(sk, e_last, t_begin, t_end - t_begin, qq);

    for (int t0 = t_begin; t0 < t_end; t0 += CH_C) {
        const int n = min(CH_C, t_end - t0);
        const int t1 = t0 + CH_C;
        const int n1 = t_end - t1;  // the next chunk's tokens (<= 0: none, its loads zero-fill)
        __syncthreads();  // ss holds this chunk's state; every reader of the last chunk's u is done
        // 1. u = U - W S and o = e^G (Q S) on this warp's 16 rows (C fragments).
        cp_async_wait_warp<2>();  // W, Q
        float ua[4][4], oa[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) ua[nt][i] = oa[nt][i] = 0.0f;
        warp_mma_wq_ldsm<DK, L::LQ, L::LST>(ua, oa, wsa, qsm, sst, g, qq);
        __syncwarp();  // every lane's fragment reads of W and Q are done
        io.wq(t1, n1);
        cp_async_commit();
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ua[nt][i] = un[nt][i] - ua[nt][i];
                oa[nt][i] *= sq[i >> 1];
            }
        io.u(un, t1, n1, r0, g);
        io.sq(sq, t1, n1, r0, g);
        // 2. u to shared memory for every warp (rows past n are zero: W, U rows are).
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) put_us(r0 + g + 8 * (i >> 1), 8 * nt + 2 * qq + (i & 1), ua[nt][i]);
        __syncthreads();
        // 3. o += M u (the whole 64-token chunk: padding rows of M and u are zero).
        cp_async_wait_warp<2>();  // M
        warp_mma_ldsm<CH_C, L::LUT>(oa, msa, ust);
        __syncwarp();
        io.m(t1, n1);
        cp_async_commit();
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int t = r0 + g + 8 * (i >> 1);
                if (t < n) out[((long long)(t0 + t) * n_v_heads + h) * dv + j0 + 8 * nt + 2 * qq + (i & 1)] = from_f32(oa[nt][i]);
            }
        // 4. S = e^{G_last} S + (diag(e^{G_last - G}) K)^T u on this warp's state rows: A(d, i)
        // = sk_i k_i[d], read transposed from the warp's K columns.
        cp_async_wait_warp<2>();  // K
#pragma unroll
        for (int e = 0; e < NS; ++e) sr[e] *= e_last;
#pragma unroll
        for (int mt = 0; mt < DK / 64; ++mt) {
            const int d = 16 * mt + g;
#pragma unroll
            for (int j = 0; j < CH_C / 8; ++j) {
                const int i = 8 * j + qq;
                const unsigned af[4] = {to_tf32(sk[j][0] * to_f32(ksm[i * L::LK + d])),
                                        to_tf32(sk[j][0] * to_f32(ksm[i * L::LK + d + 8])),
                                        to_tf32(sk[j][1] * to_f32(ksm[(i + 4) * L::LK + d])),
                                        to_tf32(sk[j][1] * to_f32(ksm[(i + 4) * L::LK + d + 8]))};
                unsigned b01[4], b23[4];
                ldsm_x4(b01, ust + 4 * 8 * j);
                ldsm_x4(b23, ust + 4 * (16 * L::LUT + 8 * j));
                mma1688(sr + 16 * mt, af, b01[0], b01[1]);
                mma1688(sr + 16 * mt + 4, af, b01[2], b01[3]);
                mma1688(sr + 16 * mt + 8, af, b23[0], b23[1]);
                mma1688(sr + 16 * mt + 12, af, b23[2], b23[3]);
            }
        }
        __syncwarp();
        io.k(t1, n1);
        cp_async_commit();
        io.sk_last(sk, e_last, t1, n1, qq);
        // The new state for the next chunk's step 1 (its readers finished before step 3's barrier).
#pragma unroll
        for (int e = 0; e < NS; ++e) {
            int row, col;
            state_entry<DK, true>(tid, e, row, col);
            put_ss(row, col, sr[e]);
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        state_entry<DK, true>(tid, e, row, col);
        st[(long long)row * dv + col] = sr[e];
    }
}

// Eight-warp scan (sm_80+), `gdn_chunk_scan_wide_dk*`: the pipelined scan's products and
// operand tiles, over twice the warps. The pipelined scan runs 4 warps a block, two blocks an
// SM (the 27B shape's 192 blocks), and there a chunk step is one warp's serial chain: Nsight
// Compute finds each warp issuing on 19% of its cycles and
// waiting on fixed-latency results, shared and global loads the rest, with two warps a
// scheduler to cover each other. Here 8 warps split every product of a chunk step in half:
//  - steps 1 and 3 (u = U - W S, o = e^G Q S + M u: 64 token rows x 32 value columns): warp w
//    takes token rows 16 (w % 4).. and value columns 16 (w / 4)..: two n-tiles, not four;
//  - step 4 (the DK x 32 state): warp w takes state m-tile w % (DK / 16) and DK / 32 n-tiles
//    (4 at DK 128: rows 16 w.., every column; 2 at DK 64).
// Each mma is the pipelined scan's, with the same operands in the same k order, so both forms
// give the same bits (GPU test). The tiles are now shared by the warps that read them (the W,
// Q and M rows by two warps, every K column's rows by all), so the block copies them together
// into one tile each (16-byte cp.async, no per-warp slices), and block barriers publish them:
// a chunk step's two barriers (B1 before step 1, B2 before step 3) also order the copies. M,
// K and the per-token scales are requested after B1 (every reader of the last chunk's passed
// it) and land during step 1; W and Q of the next chunk after B2, landing during steps 3 and
// 4 (the scales as a tile too: every warp reads all 64 tokens' k scales, which as register
// loads were 17 global loads a thread a chunk). Registers: 16 state entries a thread at DK 128
// instead of 32, and half the accumulators, so two 8-warp blocks fit an SM (launch bounds
// 256, 2: at most 128 registers); shared memory 110 KiB at DK 128 (one K tile instead of four
// per-warp column slices with their padding). 27B shape, 8k tokens: 0.758 ms against the
// pipelined scan's 0.890.
#define CHW_THREADS 256
#define CHW_WARPS (CHW_THREADS / 32)

// Tile strides (elements) and the shared-memory layout (state, u, W, M, scales in f32, then raw
// q and k); gdn_chunked.rs wide_smem_bytes mirrors it. Row strides of 4 mod 32 words keep the
// fragment reads conflict-free (the raw q / k rows: DK + 8 storage elements, (DK + 8) / 2 words).
template <int DK>
struct WideLayout {
    static constexpr int LST = DK + 4;   // transposed state rows (tf32 bits), one per value column
    static constexpr int LUT = CH_C + 4; // transposed u rows
    static constexpr int LW = DK + 4;    // W rows, f32
    static constexpr int LM = CH_C + 4;  // M rows, f32
    static constexpr int LQK = DK + 8;   // raw q and k rows, storage type
    static constexpr int SS = CH_COLS * LST;
    static constexpr int US = CH_COLS * LUT;
    static constexpr int F32 = SS + US + CH_C * (LW + LM + 4);  // ... and the per-token scales [C][4]
    static constexpr int MT = DK / 16;                // state m-tiles
    static constexpr int NTW = 4 * MT / CHW_WARPS;    // state n-tiles per warp
};

// State entry e of a thread of warp w (mma C layout): m-tile w % MT, n-tile
// NTW (w / MT) + e / 4, element e % 4.
template <int DK>
__device__ __forceinline__ void wide_state_entry(int warp, int lane, int e, int& row, int& col) {
    using L = WideLayout<DK>;
    row = 16 * (warp % L::MT) + (lane >> 2) + 8 * ((e >> 1) & 1);
    col = 8 * (L::NTW * (warp / L::MT) + (e >> 2)) + 2 * (lane & 3) + (e & 1);
}

// The block's copies of one chunk's tiles: thread tid copies row tid / (16-byte copies a row)
// + it * (rows a round of 256 copies covers), column tid % (copies a row).
template <int DK>
struct WideStreams {
    using L = WideLayout<DK>;
    static constexpr int RW = CHW_THREADS / (DK / 4);    // W rows a round advances
    static constexpr int RQ = CHW_THREADS / (DK / 8);    // Q and K rows
    static constexpr int RM = CHW_THREADS / (CH_C / 4);  // M rows
    int rw, rq, rm, tid;
    unsigned dw, dq, dk, dm, ds;
    const char *w_src, *q_src, *k_src, *m_src, *s_src;  // at token 0
    long long w_tok, qk_tok, m_tok, s_tok;              // bytes a token advances each
    __device__ __forceinline__ WideStreams(float* wsm, store_t* qsm, store_t* ksm, float* msm, float* scs,
                                           const float* w_in, const store_t* qh, const store_t* kh,
                                           const float* m_in, const float* sc_in, long long qk_stride, int h,
                                           int n_v_heads, int tid_)
        : tid(tid_) {
        const int cw = tid % (DK / 4), cq = tid % (DK / 8), cm = tid % (CH_C / 4);
        rw = tid / (DK / 4);
        rq = tid / (DK / 8);
        rm = tid / (CH_C / 4);
        dw = smem_u32(wsm + rw * L::LW + 4 * cw);
        dq = smem_u32(qsm + rq * L::LQK + 8 * cq);
        dk = smem_u32(ksm + rq * L::LQK + 8 * cq);
        dm = smem_u32(msm + rm * L::LM + 4 * cm);
        ds = smem_u32(scs + 4 * tid);
        w_tok = (long long)n_v_heads * DK * 4;
        qk_tok = qk_stride * 2;
        m_tok = (long long)n_v_heads * CH_C * 4;
        s_tok = (long long)n_v_heads * 4 * 4;
        w_src = (const char*)(w_in + (long long)h * DK + 4 * cw);
        q_src = (const char*)(qh + 8 * cq);
        k_src = (const char*)(kh + 8 * cq);
        m_src = (const char*)(m_in + (long long)h * CH_C + 4 * cm);
        s_src = (const char*)(sc_in + (long long)h * 4);
    }
    // The chunk at token t0 with n rows: W and Q (one group), then M, K and the scales (one
    // group; thread t < 64 copies token t's four scales).
    __device__ __forceinline__ void wq(int t0, int n) const {
        copy_rows16<CH_C / RW, RW, RW * L::LW * 4>(dw, w_src + (t0 + rw) * w_tok, RW * w_tok, rw, n);
        copy_rows16<CH_C / RQ, RQ, RQ * L::LQK * 2>(dq, q_src + (t0 + rq) * qk_tok, RQ * qk_tok, rq, n);
    }
    __device__ __forceinline__ void mk(int t0, int n) const {
        copy_rows16<CH_C / RM, RM, RM * L::LM * 4>(dm, m_src + (t0 + rm) * m_tok, RM * m_tok, rm, n);
        copy_rows16<CH_C / RQ, RQ, RQ * L::LQK * 2>(dk, k_src + (t0 + rq) * qk_tok, RQ * qk_tok, rq, n);
        if (tid < CH_C) copy_rows16<1, 0, 0>(ds, s_src + (t0 + tid) * s_tok, 0, tid, n);
    }
};

template <int DK>
__device__ __forceinline__ void scan_wide_body(const store_t* __restrict__ q, const store_t* __restrict__ k,
                                               long long qk_stride, const float* __restrict__ work,
                                               float* __restrict__ state,
                                               const int* __restrict__ cu_seqlens,
                                               const int* __restrict__ slots, int n_k_heads,
                                               int n_v_heads, int dv, int n_tokens,
                                               store_t* __restrict__ out) {
    using L = WideLayout<DK>;
    constexpr int NS = 4 * L::NTW;  // state entries per thread (wide_state_entry)
    extern __shared__ float ch_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, qq = lane & 3;
    const int r0 = 16 * (warp & 3);   // this warp's token rows of u and o
    const int c0 = 16 * (warp >> 2);  // and value columns (of the block's 32)
    const int sn0 = 8 * L::NTW * (warp / L::MT);  // its first state column (step 4)
    // The state columns j0.. and u, transposed ([32][LST], [32][LUT]) as tf32 bits; the W, M,
    // raw q and raw k tiles of the chunk.
    float* ss = ch_smem;
    float* us = ss + L::SS;
    float* wsm = us + L::US;
    float* msm = wsm + CH_C * L::LW;
    float* scs = msm + CH_C * L::LM;  // [C][4] per-token scales (q e^G, k e^{G_last - G}, e^{G_last}, 0)
    store_t* qsm = (store_t*)(ch_smem + L::F32);
    store_t* ksm = qsm + CH_C * L::LQK;
    const unsigned sst = smem_u32(ss) + 4 * (ldsm_b_off(lane, L::LST) + c0 * L::LST);
    const unsigned ust = smem_u32(us) + 4 * (ldsm_b_off(lane, L::LUT) + c0 * L::LUT);
    const unsigned ust4 = smem_u32(us) + 4 * (ldsm_b_off(lane, L::LUT) + sn0 * L::LUT);
    const unsigned wsa = smem_u32(wsm) + 4 * (ldsm_a_off(lane, L::LW) + r0 * L::LW);
    const unsigned msa = smem_u32(msm) + 4 * (ldsm_a_off(lane, L::LM) + r0 * L::LM);
    const store_t* q0 = qsm + (r0 + g) * L::LQK + qq;              // step 1's raw q rows
    const store_t* k0 = ksm + qq * L::LQK + 16 * (warp % L::MT) + g;  // step 4's raw k entries
    auto put_ss = [&](int row, int col, float x) { ss[col * L::LST + row] = __uint_as_float(to_tf32(x)); };
    auto put_us = [&](int t, int col, float x) { us[col * L::LUT + t] = __uint_as_float(to_tf32(x)); };

    const ScanBlock<DK> blk(work, state, cu_seqlens, slots, n_k_heads, n_v_heads, dv, n_tokens);
    const int j0 = blk.j0, h = blk.h, kh = blk.kh, t_begin = blk.t_begin, t_end = blk.t_end;
    const float *w_in = blk.ws.w, *u_in = blk.ws.u, *m_in = blk.ws.m, *sc_in = blk.ws.sc;
    float* st = blk.st;

    const WideStreams<DK> io(wsm, qsm, ksm, msm, scs, w_in, q + (long long)kh * DK, k + (long long)kh * DK, m_in,
                             sc_in, qk_stride, h, n_v_heads, tid);
    const ScanRegLoads<2> regs(u_in, sc_in, h, n_v_heads, dv, j0 + c0 + 2 * qq, r0, g, qq);
    io.wq(t_begin, t_end - t_begin);
    cp_async_commit();

    float sr[NS];  // this thread's state entries (wide_state_entry)
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        wide_state_entry<DK>(warp, lane, e, row, col);
        sr[e] = st[(long long)row * dv + col];
        put_ss(row, col, sr[e]);
    }
    // U loaded a chunk ahead (ScanRegLoads); the scales come with M and K.
    float un[2][4];
    regs.u(un, t_begin, t_end - t_begin, r0, g);

    for (int t0 = t_begin; t0 < t_end; t0 += CH_C) {
        const int n = min(CH_C, t_end - t0);
        const int t1 = t0 + CH_C;
        const int n1 = t_end - t1;  // the next chunk's tokens (<= 0: none, its copies zero-fill)
        cp_async_wait_group<0>();   // W, Q
        __syncthreads();  // B1: ss, W and Q hold this chunk's; every reader of u, M and K is done
        io.mk(t0, n);
        cp_async_commit();
        // 1. u = U - W S and o = e^G (Q S) on this warp's 16 rows and 16 columns.
        float ua[2][4], oa[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) ua[nt][i] = oa[nt][i] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DK; kk += 8) {
            unsigned wf[4], b[4];
            ldsm_a_tf32(wf, wsa + 4 * kk);
            const unsigned qf[4] = {tf32_of(q0[kk]), tf32_of(q0[8 * L::LQK + kk]), tf32_of(q0[kk + 4]),
                                    tf32_of(q0[8 * L::LQK + kk + 4])};
            ldsm_x4(b, sst + 4 * kk);
            mma_b2(ua, wf, b);
            mma_b2(oa, qf, b);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) ua[nt][i] = un[nt][i] - ua[nt][i];
        regs.u(un, t1, n1, r0, g);
        // 2. u to shared memory for every warp (rows past n are zero: W, U rows are).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) put_us(r0 + g + 8 * (i >> 1), c0 + 8 * nt + 2 * qq + (i & 1), ua[nt][i]);
        cp_async_wait_group<0>();  // M, K, scales
        __syncthreads();  // B2: u, M, K and the scales published; every reader of ss, W and Q is done
        io.wq(t1, n1);
        cp_async_commit();
        // 3. o = e^G-scaled Q S (the q scale of each row, zero past n) + M u (the whole 64-token
        // chunk: padding rows of M and u are zero).
        const float sq[2] = {scs[4 * (r0 + g)], scs[4 * (r0 + g + 8)]};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) oa[nt][i] *= sq[i >> 1];
#pragma unroll
        for (int kk = 0; kk < CH_C; kk += 8) {
            unsigned af[4], b[4];
            ldsm_a_tf32(af, msa + 4 * kk);
            ldsm_x4(b, ust + 4 * kk);
            mma_b2(oa, af, b);
        }
        // Two adjacent columns a 4-byte store (the launcher requires out 4-byte aligned; dv even).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = r0 + g + 8 * half;
                if (t < n)
                    *(unsigned*)(out + ((long long)(t0 + t) * n_v_heads + h) * dv + j0 + c0 + 8 * nt + 2 * qq) =
                        (unsigned)from_f32(oa[nt][2 * half]) | ((unsigned)from_f32(oa[nt][2 * half + 1]) << 16);
            }
        // 4. S = e^{G_last} S + (diag(e^{G_last - G}) K)^T u on this warp's state tiles: A(d, i)
        // = sk_i k_i[d], read transposed from the K tile (sk zero past n).
        const float e_last = scs[2];
#pragma unroll
        for (int e = 0; e < NS; ++e) sr[e] *= e_last;
#pragma unroll
        for (int j = 0; j < CH_C / 8; ++j) {
            const store_t* kr = k0 + 8 * j * L::LQK;
            const float sk0 = scs[4 * (8 * j + qq) + 1], sk1 = scs[4 * (8 * j + qq + 4) + 1];
            const unsigned af[4] = {to_tf32(sk0 * to_f32(kr[0])), to_tf32(sk0 * to_f32(kr[8])),
                                    to_tf32(sk1 * to_f32(kr[4 * L::LQK])), to_tf32(sk1 * to_f32(kr[4 * L::LQK + 8]))};
#pragma unroll
            for (int p = 0; p < L::NTW / 2; ++p) {
                unsigned b[4];
                ldsm_x4(b, ust4 + 4 * (16 * p * L::LUT + 8 * j));
                mma1688(sr + 8 * p, af, b[0], b[1]);
                mma1688(sr + 8 * p + 4, af, b[2], b[3]);
            }
        }
        // The new state for the next chunk's step 1 (its readers finished before B2).
#pragma unroll
        for (int e = 0; e < NS; ++e) {
            int row, col;
            wide_state_entry<DK>(warp, lane, e, row, col);
            put_ss(row, col, sr[e]);
        }
    }
    cp_async_wait_all();
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int row, col;
        wide_state_entry<DK>(warp, lane, e, row, col);
        st[(long long)row * dv + col] = sr[e];
    }
}
#endif

// Tensor-core prep (gdn_chunk_prep_tc_dk*, sm_80+; PrepForm::TensorCores in gdn_chunked.rs).
// Where the SIMT prep's time goes, per block (chunk, v head) at dk 128: A and M are 2080
// lower-triangle dot products of 128, each thread loading kt[d], qt[d] and ki[d] from shared
// memory per FMA pair (~37k warp-wide shared loads a block), and the substitution loads one
// broadcast A entry per FMA (~18k): shared-memory issue, not arithmetic, bounds it, with
// 8 warps an SM (84 KB a block) to hide the latency. This form:
//  - A and M as mma.sync m16n8k16 on the raw q / k rows in their storage type (bf16 or f16:
//    products exact, f32 accumulation), the L2 norms applied to the f32 results as row and
//    column scales; warp w owns rows 16w..16w+15 and skips the n-tiles above the diagonal.
//  - the substitution as the SIMT prep's (one thread per right-hand column, blocks of 16
//    rows, the same FMA order), with A read as float4 along a row (4 entries per broadcast
//    load) and the W right-hand sides from the raw k rows times beta e^G and the k norm.
//  - 67 KB of shared memory at dk 128 (the raw q tile's space then holds the solved columns),
//    three blocks per sm_90 SM.
// Fragment layout (PTX ISA, m16n8k16 with 16-bit operands; g = lane / 4, q = lane % 4; each
// register two consecutive k): A a0 (g, 2q), a1 (g + 8, 2q), a2 (g, 2q + 8), a3 (g + 8, 2q + 8);
// B (column-major) b0 (k 2q, n g), b1 (k 2q + 8, n g); C as m16n8k8's.
#ifdef CH_TENSOR_CORES
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if defined(NINFER_STORAGE_F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory layout of the tensor-core prep (floats unless said); gdn_chunked.rs
// prep_tc_smem_bytes mirrors it.
template <int DK>
struct PrepTcLayout {
    static constexpr int LA = CH_C + 4;  // A rows: float4-aligned, 4 mod 32 words (C-fragment stores)
    static constexpr int LR = DK + 8;    // raw q / k rows, storage elements: (DK + 8) / 2 words, 4 mod 32
    // Raw q tile [C][LR] (storage type), then the solved columns xs [C][CH_THREADS].
    static constexpr int QX = (CH_C * LR / 2 > CH_C * CH_THREADS) ? CH_C * LR / 2 : CH_C * CH_THREADS;
    static constexpr int F32 = CH_C * LA + 5 * CH_C + QX;  // then the raw k tile [C][LR]
};

template <int DK>
__device__ __forceinline__ void prep_tc_body(const store_t* __restrict__ q, const store_t* __restrict__ k,
                                             long long qk_stride, const store_t* __restrict__ v,
                                             long long v_stride, const float* __restrict__ g,
                                             const float* __restrict__ beta,
                                             const int* __restrict__ cu_seqlens, int n_seqs,
                                             int n_k_heads, int n_v_heads, int dv, int n_tokens,
                                             float* __restrict__ work) {
    using L = PrepTcLayout<DK>;
    constexpr int EPL = DK / 32;
    extern __shared__ float ch_smem[];
    float* am = ch_smem;                    // [C][LA] beta_t e^{G_t-G_i} k_t.k_i, i < t (normalised k)
    float* gc = am + CH_C * L::LA;          // [C] cumulative log decay
    float* bc = gc + CH_C;                  // [C] beta
    float* bw = bc + CH_C;                  // [C] beta e^G
    float* qn = bw + CH_C;                  // [C] q norm factor (with dk^-1/2)
    float* kn = qn + CH_C;                  // [C] k norm factor
    float* xs = kn + CH_C;                  // [C][CH_THREADS] solved columns (step 3)
    store_t* qr = (store_t*)xs;             // [C][LR] raw q (steps 1-2)
    store_t* kr = (store_t*)(ch_smem + L::F32);  // [C][LR] raw k

    int s, t0, n;
    if (!find_chunk(cu_seqlens, n_seqs, blockIdx.x, s, t0, n)) return;
    const int h = blockIdx.y;
    const int kh = h / (n_v_heads / n_k_heads);
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const ChunkWork<DK, float> wk(work, n_tokens, n_v_heads, dv);
    float *w_out = wk.w, *u_out = wk.u, *m_out = wk.m, *sc_out = wk.sc;

    // 1. Raw q and k rows (zero past n) and their norm factors (one warp per row), gates. A
    // warp's rows go RB at a time with every load issued before the first reduction: one row at
    // a time left each row's load latency exposed (16 rows a warp, in sequence).
    constexpr int RB = 4;
    for (int r_0 = warp; r_0 < CH_C; r_0 += RB * CH_WARPS) {
        store_t qv[RB][EPL], kv[RB][EPL];
#pragma unroll
        for (int b = 0; b < RB; ++b) {
            const int r = r_0 + b * CH_WARPS;
            const store_t* qrow = q + (long long)(t0 + r) * qk_stride + (long long)kh * DK + lane;
            const store_t* krow = k + (long long)(t0 + r) * qk_stride + (long long)kh * DK + lane;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                qv[b][e] = r < n ? qrow[e * 32] : store_t(0);
                kv[b][e] = r < n ? krow[e * 32] : store_t(0);
            }
        }
#pragma unroll
        for (int b = 0; b < RB; ++b) {
            const int r = r_0 + b * CH_WARPS;
            float qss = 0.0f, kss = 0.0f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const float a = to_f32(qv[b][e]), c = to_f32(kv[b][e]);
                qss += a * a;
                kss += c * c;
                qr[r * L::LR + e * 32 + lane] = qv[b][e];
                kr[r * L::LR + e * 32 + lane] = kv[b][e];
            }
            const float qf = rsqrtf(warp_sum(qss) + 1e-6f) * rsqrtf((float)DK);
            const float kf = rsqrtf(warp_sum(kss) + 1e-6f);
            if (lane == 0) {
                qn[r] = qf;
                kn[r] = kf;
            }
        }
    }
    if (warp == 0) chunk_gates(g, beta, t0, n, h, n_v_heads, lane, gc, bc, bw);
    __syncthreads();
    if (tid < n) write_scales(sc_out, t0, tid, h, n_v_heads, qn, kn, gc);
    // 2. Raw K K^T and Q K^T on this warp's 16 rows (n-tiles 0..2w+1: the rest is above the
    // diagonal), then scaled: A to shared memory, M straight to the workspace.
    {
        const int gq = lane >> 2, qq = lane & 3;
        const int m0 = 16 * warp;
        float ck[CH_C / 8][4], cq[CH_C / 8][4];
#pragma unroll
        for (int nt = 0; nt < CH_C / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) ck[nt][i] = cq[nt][i] = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < DK; k0 += 16) {
            const int c0 = k0 + 2 * qq;
            const unsigned* k_lo = (const unsigned*)(kr + (m0 + gq) * L::LR + c0);
            const unsigned* k_hi = (const unsigned*)(kr + (m0 + gq + 8) * L::LR + c0);
            const unsigned* q_lo = (const unsigned*)(qr + (m0 + gq) * L::LR + c0);
            const unsigned* q_hi = (const unsigned*)(qr + (m0 + gq + 8) * L::LR + c0);
            const unsigned ak[4] = {k_lo[0], k_hi[0], k_lo[4], k_hi[4]};
            const unsigned aq[4] = {q_lo[0], q_hi[0], q_lo[4], q_hi[4]};
#pragma unroll
            for (int nt = 0; nt < CH_C / 8; ++nt) {
                if (nt > 2 * warp + 1) continue;  // warp-uniform
                const unsigned* bk = (const unsigned*)(kr + (8 * nt + gq) * L::LR + c0);
                mma16816(ck[nt], ak, bk[0], bk[4]);
                mma16816(cq[nt], aq, bk[0], bk[4]);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int t = m0 + gq + 8 * half;
            const float kt = kn[t], qt = qn[t], bt = bc[t], gt = gc[t];
            float* mrow = m_out + ((long long)(t0 + t) * n_v_heads + h) * CH_C;
#pragma unroll
            for (int nt = 0; nt < CH_C / 8; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int i = 8 * nt + 2 * qq + c;
                    float a = 0.0f, b = 0.0f;
                    if (i <= t && t < n) {
                        const float decay = expf(gt - gc[i]);
                        const float ki = kn[i];
                        a = i < t ? bt * decay * ((ck[nt][2 * half + c] * kt) * ki) : 0.0f;
                        b = decay * ((cq[nt][2 * half + c] * qt) * ki);
                    }
                    am[t * L::LA + i] = a;
                    if (t < n) mrow[i] = b;
                }
        }
    }
    __syncthreads();  // A complete; every read of the raw q tile (xs's space) done
    // 3. Forward substitution (I + A) X = R, as prep_body's step 3; A rows read as float4.
    // A value column's right-hand side comes from global memory, 16 rows a block: each block's
    // rows are requested one block ahead (the first block of the thread's first value column
    // before its key column), so their latency hides under the substitution's FMAs. Loaded at
    // the point of use, they were the kernel's largest stall: 14% of Nsight Compute's warp
    // samples on the four conversions right after the loads.
    store_t vn[16];
    auto load_v = [&](int jv, int b) {
        const store_t* vj = v + (long long)h * dv + (jv - DK);
#pragma unroll
        for (int r = 0; r < 16; ++r) vn[r] = b + r < n ? vj[(long long)(t0 + b + r) * v_stride] : store_t(0);
    };
    {
        int jv = tid;
        while (jv < DK) jv += CH_THREADS;
        if (jv < DK + dv) load_v(jv, 0);
    }
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
                for (int r4 = 0; r4 < 4; ++r4) {
                    const float4 bw4 = *(const float4*)(bw + b + 4 * r4);
                    const float4 kn4 = *(const float4*)(kn + b + 4 * r4);
                    const float bs[4] = {bw4.x * kn4.x, bw4.y * kn4.y, bw4.z * kn4.z, bw4.w * kn4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) x[4 * r4 + e] = bs[e] * to_f32(kr[(b + 4 * r4 + e) * L::LR + j]);
                }
            } else {
#pragma unroll
                for (int r = 0; r < 16; ++r) x[r] = b + r < n ? bc[b + r] * to_f32(vn[r]) : 0.0f;
                if (b + 16 < CH_C)
                    load_v(j, b + 16);
                else if (j + CH_THREADS < DK + dv)
                    load_v(j + CH_THREADS, 0);
            }
#pragma unroll 1
            for (int i = 0; i < b; i += 4) {
                const float x0 = xs[i * CH_THREADS + tid];
                const float x1 = xs[(i + 1) * CH_THREADS + tid];
                const float x2 = xs[(i + 2) * CH_THREADS + tid];
                const float x3 = xs[(i + 3) * CH_THREADS + tid];
#pragma unroll
                for (int r = 0; r < 16; ++r) {
                    const float4 a4 = *(const float4*)(am + (b + r) * L::LA + i);
                    x[r] = fmaf(-a4.x, x0, x[r]);
                    x[r] = fmaf(-a4.y, x1, x[r]);
                    x[r] = fmaf(-a4.z, x2, x[r]);
                    x[r] = fmaf(-a4.w, x3, x[r]);
                }
            }
#pragma unroll
            for (int r = 1; r < 16; ++r)
#pragma unroll
                for (int i4 = 0; i4 < r; i4 += 4) {
                    const float4 a4 = *(const float4*)(am + (b + r) * L::LA + b + i4);
                    const float a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (i4 + e < r) x[r] = fmaf(-a[e], x[i4 + e], x[r]);
                }
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                xs[(b + r) * CH_THREADS + tid] = x[r];
                if (b + r < n) dst[(long long)(t0 + b + r) * stride] = x[r];
            }
        }
    }
}
#define PREP_TC_BODY(DK) prep_tc_body<DK>
#else
#define PREP_TC_BODY(DK) prep_body<DK>
#endif

// gdn_chunk_scan_tc_dk* is the tensor-core scan where the architecture has tf32 mma (sm_80+)
// and the SIMT scan elsewhere (the launcher only picks it on sm_80+).
// gdn_chunk_scan_pipe_dk* likewise: the pipelined scan on sm_80+, the SIMT scan elsewhere.
#ifdef CH_TENSOR_CORES
#define SCAN_TC true
#define SCAN_PIPE_BODY(DK) scan_pipe_body<DK>
// gdn_chunk_scan_wide_dk* exists on sm_80+ only (256 threads: no SIMT form; the launcher runs
// the SIMT scan below sm_80).
#define SCAN_WIDE_INSTANCE(DK)                                                                  \
    extern "C" __global__ void __launch_bounds__(CHW_THREADS, 2) gdn_chunk_scan_wide_dk##DK(    \
        const store_t* q, const store_t* k, long long qk_stride, const float* work,             \
        float* state, const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads,    \
        int dv, int n_tokens, store_t* out) {                                                   \
        scan_wide_body<DK>(q, k, qk_stride, work, state, cu_seqlens, slots, n_k_heads,          \
                           n_v_heads, dv, n_tokens, out);                                       \
    }
#else
#define SCAN_TC false
#define SCAN_PIPE_BODY(DK) scan_body<DK, false>
#define SCAN_WIDE_INSTANCE(DK)
#endif

#define CHUNKED_INSTANCE(DK)                                                                    \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_prep_dk##DK(             \
        const store_t* q, const store_t* k, long long qk_stride, const store_t* v,              \
        long long v_stride, const float* g, const float* beta, const int* cu_seqlens,           \
        int n_seqs, int n_k_heads, int n_v_heads, int dv, int n_tokens, float* work) {          \
        prep_body<DK>(q, k, qk_stride, v, v_stride, g, beta, cu_seqlens, n_seqs, n_k_heads,     \
                      n_v_heads, dv, n_tokens, work);                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_prep_tc_dk##DK(          \
        const store_t* q, const store_t* k, long long qk_stride, const store_t* v,              \
        long long v_stride, const float* g, const float* beta, const int* cu_seqlens,           \
        int n_seqs, int n_k_heads, int n_v_heads, int dv, int n_tokens, float* work) {          \
        PREP_TC_BODY(DK)(q, k, qk_stride, v, v_stride, g, beta, cu_seqlens, n_seqs, n_k_heads, \
                         n_v_heads, dv, n_tokens, work);                                        \
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
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdn_chunk_scan_pipe_dk##DK(        \
        const store_t* q, const store_t* k, long long qk_stride, const float* work,             \
        float* state, const int* cu_seqlens, const int* slots, int n_k_heads, int n_v_heads,    \
        int dv, int n_tokens, store_t* out) {                                                   \
        SCAN_PIPE_BODY(DK)(q, k, qk_stride, work, state, cu_seqlens, slots, n_k_heads,          \
                           n_v_heads, dv, n_tokens, out);                                       \
    }                                                                                           \
    SCAN_WIDE_INSTANCE(DK)

CHUNKED_INSTANCE(64)
CHUNKED_INSTANCE(128)
