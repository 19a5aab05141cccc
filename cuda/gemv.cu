// Decode GEMV: y[M, N] = x[M, K] * W[N, K]^T for small M (1..8 rows of activations).
// Decode is bound by reading the weights, so every weight byte is read exactly once, with
// 16-byte loads coalesced across the warp: one warp owns C output columns (rows of W),
// the block holds up to GEMV_WARPS such warps (the plan's `cc_warps`), and each lane
// keeps M f32 partial sums that a warp reduction combines. x is small and served from L1/L2.
// K must be a multiple of 8.
// The route of every M on sm_7x and of M = 1 on sm_80+; from M = 2 sm_80+ runs the tensor-core
// GEMV (gemv_tc.cu, `gemv_kernel` in ops/gemv.rs), which keeps every M of 1..8 bound by the
// weight stream.
#include "common.cuh"

#define GEMV_WARPS 8

// What a warp does with its column sums (gemv_body's OUT): store them in the storage type,
// store them as f32 (the lm_head's logits), apply SwiGLU to gate/up pairs (below), or rotate
// q/k pairs and write the KV cache (the qkv projection's RoPE epilogue, gemv_qkv_rope_m1).
// The f32 store takes `round_out` (gemv_f32out_m*'s last argument): nonzero rounds each logit to
// the storage type first (round_st), kept as f32: the model's logits_dtype "auto", the values
// transformers' and vLLM's lm_head return, with no extra kernel on the decode path.
#define GEMV_OUT_STORE 0
#define GEMV_OUT_F32 1
#define GEMV_OUT_SWIGLU 2
#define GEMV_OUT_QKV_ROPE 3

// The RoPE epilogue's operands (unused by the other epilogues): a decode step's one token, at
// positions[0] and flat cache slot slot_mapping[0] (negative: no cache write), q/k/v heads of
// 2 * half elements packed in the qkv row (q heads, then k heads, then v heads), full rotary
// (rotary_dim == head_dim) with inv_freq[half]; the caches are [slots, n_kv_heads, 2 * half].
struct gemv_qkv_rope {
    store_t* k_cache;
    store_t* v_cache;
    const int* positions;
    const long long* slot_mapping;
    const float* inv_freq;
    int n_q_heads;
    int n_kv_heads;
    int half;
    float attn_scale;
};

// The qkv row of the first element of RoPE pair p (pair i of head h is p = h * half + i: rows
// h * head_dim + i and that + half, which rotate together). v heads pair up the same way, so
// every warp of the epilogue owns two rows of one head.
__device__ __forceinline__ long long qkv_pair_row(int p, int half) {
    return (long long)(p / half) * (2 * half) + p % half;
}

// gemv_cols_per_warp, gemv_weight_row and gemv_store are the warp's column mapping and
// epilogue, apart from the k loop so that another GEMV body (e.g. one with a prologue) can offer
// the same epilogues.
// Output columns of y one warp of C weight rows stores under epilogue OUT.
template <int C, int OUT>
__device__ constexpr int gemv_cols_per_warp() {
    static_assert(OUT != GEMV_OUT_SWIGLU || C % 2 == 0, "SwiGLU pairs a gate row with an up row");
    static_assert(OUT != GEMV_OUT_QKV_ROPE || C == 2, "a RoPE warp owns one pair of rows");
    return OUT == GEMV_OUT_SWIGLU || OUT == GEMV_OUT_QKV_ROPE ? C / 2 : C;
}

// The weight row behind the warp's slot c (n0: the warp's first output column; for the RoPE
// epilogue its pair, `half` the pair's distance). Columns past n_out (the last warp of a
// ragged grid) read column n_out - 1 and store nothing.
template <int C, int OUT>
__device__ __forceinline__ long long gemv_weight_row(int c, int n0, int n_out, int half) {
    constexpr int P = gemv_cols_per_warp<C, OUT>();
    const int n = min(n0 + c % P, n_out - 1);
    if constexpr (OUT == GEMV_OUT_QKV_ROPE) return qkv_pair_row(n, half) + (c >= P ? half : 0);
    return n + (c >= P ? (long long)n_out : 0);
}

// The RoPE epilogue of pair p from its two row sums s0 (row r0) and s1 (row r0 + half): each
// rounded to storage as gemv_m1 stores it, q and k pairs rotated by common.cuh's rope_rotate
// (rope_kv_write's arithmetic on the same values), all stored back into the qkv row, and k and
// v pairs into their cache at the token's slot: bit for bit gemv_m1 then rope_kv_write_packed.
__device__ __forceinline__ void gemv_qkv_rope_store(float s0, float s1, int p, store_t* __restrict__ y,
                                                    const gemv_qkv_rope& qr) {
    const int head = p / qr.half;
    const int i = p % qr.half;
    const int n_qk = qr.n_q_heads + qr.n_kv_heads;
    store_t lo, hi;
    if (head < n_qk) {
        rope_rotate(round_st(s0), round_st(s1), i, (float)qr.positions[0], qr.inv_freq,
                    qr.attn_scale, &lo, &hi);
    } else {
        lo = from_f32(s0);
        hi = from_f32(s1);
    }
    const long long r0 = qkv_pair_row(p, qr.half);
    y[r0] = lo;
    y[r0 + qr.half] = hi;
    if (head < qr.n_q_heads) return;
    const long long slot = qr.slot_mapping[0];
    if (slot < 0) return;
    const int head_dim = 2 * qr.half;
    const int kvh = head < n_qk ? head - qr.n_q_heads : head - n_qk;
    store_t* cache = head < n_qk ? qr.k_cache : qr.v_cache;
    const long long off = slot * ((long long)qr.n_kv_heads * head_dim) + (long long)kvh * head_dim + i;
    cache[off] = lo;
    cache[off + qr.half] = hi;
}

// The warp's epilogue: reduces each lane's partial sums (slot c of gemv_weight_row) and lane 0
// stores the warp's output columns.
// With `reduced` the sums are already whole (gemv_body's K split combined them) and lane 0 has
// them.
template <int M, int C, int OUT>
__device__ __forceinline__ void gemv_store(const float (&acc)[C][M], void* __restrict__ y, int n0,
                                           int n_out, int lane, int round_out,
                                           const gemv_qkv_rope& qr, bool reduced = false) {
    static_assert(OUT != GEMV_OUT_QKV_ROPE || M == 1, "the RoPE epilogue is one token's");
    constexpr int P = gemv_cols_per_warp<C, OUT>();
#pragma unroll
    for (int c = 0; c < P; ++c) {
        const int n = n0 + c;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = reduced ? acc[c][m] : warp_sum(acc[c][m]);
            if constexpr (OUT == GEMV_OUT_SWIGLU) {
                const float u = reduced ? acc[P + c][m] : warp_sum(acc[P + c][m]);
                if (lane == 0 && n < n_out) {
                    reinterpret_cast<store_t*>(y)[(long long)m * n_out + n] =
                        swiglu_out(round_st(s), round_st(u));
                }
            } else if constexpr (OUT == GEMV_OUT_QKV_ROPE) {
                const float u = reduced ? acc[P + c][m] : warp_sum(acc[P + c][m]);
                if (lane == 0 && n < n_out) gemv_qkv_rope_store(s, u, n, reinterpret_cast<store_t*>(y), qr);
            } else if (lane == 0 && n < n_out) {
                if constexpr (OUT == GEMV_OUT_F32)
                    reinterpret_cast<float*>(y)[(long long)m * n_out + n] = round_out ? round_st(s) : s;
                else
                    reinterpret_cast<store_t*>(y)[(long long)m * n_out + n] = from_f32(s);
            }
        }
    }
}

// A warp computes C adjacent output columns (C = 1 for M = 1, 2 for M = 2..4, 4 for M = 5..8;
// the launcher's cols_per_warp in ops/gemv.rs mirrors this): each x vector it loads serves C
// weight vectors, so with several rows of x the x traffic from L1 per weight byte stays
// bounded. Every (column, row) sum is one f32 chain over the lane's k-slices in ascending
// order, eight elements each in order, then the same warp reduction, whatever M and C are:
// row r of an M-row launch equals the one-row launch of that row bit for bit.
//
// GEMV_OUT_SWIGLU (the decode MLP's gate_up projection, gemv_gateup_swiglu_m*): W is the fused
// gate_up weight, gate rows [0, n_out) then up rows [n_out, 2 n_out), and y = act[M, n_out] =
// silu(gate) * up. The warp's C weight rows are P = C / 2 pairs: gate rows n0 .. n0 + P - 1 and
// the up rows n_out later, so it ends with both sums of each of its P activations. Each sum is
// rounded to the storage type exactly as the GEMV stores it, then the activation is computed as
// the swiglu kernel computes it (common.cuh's swiglu_out on the same widened values): bit for
// bit gemv(gate_up) followed by swiglu. The chains are
// the ones above, so the weight stream and the row independence are those of the plain GEMV.
//
// GEMV_OUT_QKV_ROPE (gemv_qkv_rope_m1, M = 1): W is the packed qkv weight and n_out counts RoPE
// pairs; the warp owns pair n0, the two rows one rotation combines (qkv_pair_row), with the
// same chains as gemv_m1's one row each, and ends as gemv_qkv_rope_store says.
//
// K split (`ksplit`, the plan's `cc_ksplit`: 1, 2, 4 or 8, dividing the block's warps):
// ksplit adjacent warps of a block share one warp's columns, warp part s of them taking the
// lane's k-slices s, s + ksplit, ... (each load still 512 contiguous bytes a warp); each warp
// reduces its lanes, and the group's part 0 adds the parts in order 0, 1, .. and stores. A warp
// then streams 1 / ksplit of a row, so a kernel's last warps (its tail, where fewer and fewer
// warps keep the weight stream busy) end sooner. The sums are still one fixed chain per
// (column, row) for a given ksplit, whatever M and C are, so every contract above holds for
// kernels launched with the same ksplit; ksplit = 1 is the plain loop, bit for bit.
// A weight slice OFF bytes past p through the read-only path, the offset an immediate of the
// load: spelled out so that an unrolled loop's loads share one address register.
template <int OFF>
__device__ __forceinline__ vec8 gemv_load_w(const vec8* p) {
    unsigned r[4];
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4+%5];"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "l"(p), "n"(OFF));
    vec8 v;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v.v[2 * e] = (store_t)(r[e] & 0xffffu);
        v.v[2 * e + 1] = (store_t)(r[e] >> 16);
    }
    return v;
}

// Slice i of the lane's C weight rows (already loaded, wv) against the M rows of x into acc.
template <int M, int C>
__device__ __forceinline__ void gemv_slice(const store_t* __restrict__ x, int k, int i,
                                           const vec8 (&wv)[C], float (&acc)[C][M]) {
    float wf[C][8];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) wf[c][j] = to_f32(wv[c].v[j]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const vec8 xv = reinterpret_cast<const vec8*>(x + (long long)m * k)[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float xf = to_f32(xv.v[j]);
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c][m] = fmaf(wf[c][j], xf, acc[c][m]);
        }
    }
}

// The lane's slices first, first + STEP, ... (STEP = 32 x ksplit vectors) four a step, their
// weight loads at immediate offsets from one address, then the rest one at a time; slices in
// ascending order either way, so the sums are the plain loop's bit for bit. The loop with a
// runtime stride is not unrolled by the compiler since its loads became inline PTX (one slice
// in flight a lane; at batch 1 the Llama-3-8B decoded 0.8% slower than with the
// four-slice loop the compiler had made of the plain C++ loads), so the four are spelled out.
template <int M, int C, int STEP>
__device__ __forceinline__ void gemv_stream4(const store_t* __restrict__ x, int k, int k8, int first,
                                             const vec8* const (&wrow)[C], float (&acc)[C][M]) {
    constexpr int B = STEP * 16;  // bytes between a lane's slices
    int i = first;
    for (; i + 3 * STEP < k8; i += 4 * STEP) {
        vec8 w4[4][C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const vec8* p = wrow[c] + i;
            w4[0][c] = gemv_load_w<0>(p);
            w4[1][c] = gemv_load_w<B>(p);
            w4[2][c] = gemv_load_w<2 * B>(p);
            w4[3][c] = gemv_load_w<3 * B>(p);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) gemv_slice<M, C>(x, k, i + STEP * u, w4[u], acc);
    }
    for (; i < k8; i += STEP) {
        vec8 wv[C];
#pragma unroll
        for (int c = 0; c < C; ++c) wv[c] = gemv_load_w<0>(wrow[c] + i);
        gemv_slice<M, C>(x, k, i, wv, acc);
    }
}

template <int M, int C, int OUT>
__device__ __forceinline__ void gemv_body(const store_t* __restrict__ x,
                                          const store_t* __restrict__ w, void* __restrict__ y,
                                          int n_out, int k, int prefetch, int ksplit,
                                          int round_out = 0,
                                          const gemv_qkv_rope& qr = gemv_qkv_rope{}) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = warp % ksplit;
    // Warps a block: the plan's `cc_warps` (at most GEMV_WARPS), ksplit a column group.
    const int n0 = (blockIdx.x * ((blockDim.x >> 5) / ksplit) + warp / ksplit) * gemv_cols_per_warp<C, OUT>();
    const int k8 = k / 8;
    const vec8* wrow[C];
#pragma unroll
    for (int c = 0; c < C; ++c)
        wrow[c] = reinterpret_cast<const vec8*>(w + gemv_weight_row<C, OUT>(c, n0, n_out, qr.half) * k);
    // The weights never depend on an earlier kernel, so under PDL (launch_pdl) the lane's
    // first `prefetch` weight vectors (the plan's `cc_prefetch_vectors`) can be fetched into L2
    // before waiting for the kernel that wrote x.
    // Measured in the model, none decodes fastest (the default 0): the early lines slow the
    // kernels still running more than they save. The loop below is unchanged (a register
    // preload that split it measured ~3% slower). Copying the first vectors into shared memory
    // with cp.async before the wait did not help either: kept in flight through the whole row
    // it decodes as fast as this loop, as a
    // prologue before this loop ~14% slower.
#pragma unroll 4
    for (int p = 0; p < prefetch; ++p) {
        const int i = lane + 32 * (part + ksplit * p);
#pragma unroll
        for (int c = 0; c < C; ++c)
            if (i < k8) asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[c] + i));
    }
    pdl_enter();
    // A split group's warps meet at a barrier below, so only an unsplit warp may leave early
    // (past n_out the weight rows are clamped to the last one and nothing is stored).
    if (ksplit == 1 && n0 >= n_out) return;
    float acc[C][M];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;
    // Batch 1: four of the lane's slices a step (gemv_stream4) at every split the launcher
    // takes (1 for the Qwen3.5-27B shapes, 2 for the Llama-3-8B ones, 4 and 8 where a device
    // profile sets them). M > 1 keeps the one loop: the held weights of four slices would cost an M > 1
    // kernel its occupancy.
    const int first = lane + 32 * part;
    if (M == 1 && ksplit == 1) {
        gemv_stream4<M, C, 32>(x, k, k8, first, wrow, acc);
    } else if (M == 1 && ksplit == 2) {
        gemv_stream4<M, C, 64>(x, k, k8, first, wrow, acc);
    } else if (M == 1 && ksplit == 4) {
        gemv_stream4<M, C, 128>(x, k, k8, first, wrow, acc);
    } else if (M == 1 && ksplit == 8) {
        gemv_stream4<M, C, 256>(x, k, k8, first, wrow, acc);
    } else {
        for (int i = first; i < k8; i += 32 * ksplit) {
            vec8 wv[C];
#pragma unroll
            for (int c = 0; c < C; ++c) wv[c] = gemv_load_w<0>(wrow[c] + i);
            gemv_slice<M, C>(x, k, i, wv, acc);
        }
    }
    if (ksplit == 1) {
        gemv_store<M, C, OUT>(acc, y, n0, n_out, lane, round_out, qr);
        return;
    }
    __shared__ float parts[GEMV_WARPS][C * M];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float v = warp_sum(acc[c][m]);
            if (lane == 0) parts[warp][c * M + m] = v;
        }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = parts[warp][c * M + m];
            for (int q = 1; q < ksplit; ++q) v += parts[warp + q][c * M + m];
            acc[c][m] = v;
        }
    gemv_store<M, C, OUT>(acc, y, n0, n_out, lane, round_out, qr, true);
}

// SC: the weight rows per warp of the SwiGLU variant (twice the launcher's pairs_per_warp in
// ops/gemv.rs): C rounded up to a pair, so one gate/up pair per warp up to M = 4 and
// two at M = 5..8 (as many weight rows, and accumulator registers, as the plain GEMV's C).
#define GEMV_INSTANCE(M, C, SC)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_m##M(const store_t* x, const store_t* w, store_t* y, int n_out, int k,            \
                  int prefetch, int ksplit) {                                                  \
        gemv_body<M, C, GEMV_OUT_STORE>(x, w, y, n_out, k, prefetch, ksplit);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_f32out_m##M(const store_t* x, const store_t* w, float* y, int n_out, int k,       \
                         int prefetch, int ksplit, int round_out) {                            \
        gemv_body<M, C, GEMV_OUT_F32>(x, w, y, n_out, k, prefetch, ksplit, round_out);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_gateup_swiglu_m##M(     \
        const store_t* x, const store_t* w, store_t* act, int inter, int k, int prefetch,      \
        int ksplit) {                                                                          \
        gemv_body<M, SC, GEMV_OUT_SWIGLU>(x, w, act, inter, k, prefetch, ksplit);              \
    }

GEMV_INSTANCE(1, 1, 2)
GEMV_INSTANCE(2, 2, 2)
GEMV_INSTANCE(3, 2, 2)
GEMV_INSTANCE(4, 2, 2)
GEMV_INSTANCE(5, 4, 4)
GEMV_INSTANCE(6, 4, 4)
GEMV_INSTANCE(7, 4, 4)
GEMV_INSTANCE(8, 4, 4)

// The batch-1 qkv projection with the decode step's RoPE and KV cache write in its epilogue
// (ops/gemv_qkv_rope.rs): qkv[n_rows] = x[k] * W^T over n_pairs = n_rows / 2 pairs, a warp per
// pair, then q and k rotated in place and k and v cached at slot_mapping[0] (the operands are
// struct gemv_qkv_rope's): gemv_m1 followed by rope_kv_write_packed, bit for bit, one kernel.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_qkv_rope_m1(const store_t* x, const store_t* w, store_t* qkv, int n_pairs, int k,
                     int prefetch, int ksplit, store_t* k_cache, store_t* v_cache,
                     const int* positions, const long long* slot_mapping, const float* inv_freq,
                     int n_q_heads, int n_kv_heads, int half, float attn_scale) {
    gemv_body<1, 2, GEMV_OUT_QKV_ROPE>(
        x, w, qkv, n_pairs, k, prefetch, ksplit, 0,
        gemv_qkv_rope{k_cache, v_cache, positions, slot_mapping, inv_freq, n_q_heads, n_kv_heads,
                      half, attn_scale});
}

// y[i] = round_st(y[i]) for i < n: the cuBLAS route's logits (prefill, and decode batches of
// more than 8 rows) rounded to the storage type in place, kept as f32 (logits_dtype "auto"; the
// GEMV rounds in its epilogue instead, `round_out` above). Same rounding as there, so a row's
// logits are the same bits whichever route produced the unrounded sums. Grid-stride over a 64-bit
// count: a whole-prompt `Model.logits` of 8k rows at a 248k vocabulary passes 2^31 elements.
extern "C" __global__ void round_f32_to_storage(float* y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = round_st(y[i]);
}

// y[r, j] = from_f32(y32[r, j] + bias[j]) for the `rows` x `n` outputs of a projection with a
// bias (Qwen2's q/k/v, Llama's attention_bias and mlp_bias): the f32 sums of linear_f32_out plus
// the bias, rounded once to the storage type, as torch's addmm and cuBLASLt's bias epilogue
// round (rounding the sums first and adding the bias after would round twice). Grid-stride over
// a 64-bit count.
extern "C" __global__ void add_bias_to_storage(const float* y32, const store_t* bias, store_t* y, long long rows, long long n) {
    const long long total = rows * n;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride)
        y[i] = from_f32(y32[i] + to_f32(bias[i % n]));
}

// round_f32_to_storage four values a thread through 16-byte accesses, for a 16-byte aligned y
// (the launcher checks; the scalar loop took 32 us over the 64 x 128256 logits of a batch-64
// decode step); the last n % 4 values by the first threads.
extern "C" __global__ void round_f32_to_storage_v4(float* y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float4* y4 = reinterpret_cast<float4*>(y);
    for (long long i = first; i < n / 4; i += stride) {
        float4 v = y4[i];
        v.x = round_st(v.x);
        v.y = round_st(v.y);
        v.z = round_st(v.z);
        v.w = round_st(v.w);
        y4[i] = v;
    }
    if (first < n % 4) y[n / 4 * 4 + first] = round_st(y[n / 4 * 4 + first]);
}
