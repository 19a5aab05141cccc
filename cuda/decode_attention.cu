// Decode attention in one kernel whose split-K layout grows with each token's context.
//
// A decode token t (one query row per sequence; any tokens work) sees keys 0..limit-1 of its
// sequence in the paged cache (k_cache / v_cache [num_blocks, block_size, n_kv_heads, D], the
// sequence's i-th block at block_tables[seq * max_blocks + i]). A block of DA_WARPS warps owns one
// (token, GQA group of G q heads) and one "block split" of DA_WARPS * da_warp_keys(limit)
// consecutive keys; each warp walks da_warp_keys(limit) of them with an online softmax, the warps
// merge through shared memory, and the block splits merge in-kernel: the last block to arrive on
// the (token, group) counter merges all of them in split order (no combine kernel).
//
// Why the layout scales: the fixed form (decode_attention_fixed_* in attention.cu, 8 block splits
// whatever the context) gives Llama-3-8B at batch 1 only 8 groups x 8 blocks = 64 blocks on 132
// SMs, each warp walking 64 keys one dependent round trip after another at a 4096-key context:
// 32.6 us for 16.8 MB of K/V (~0.5 TB/s; H200, one_kernel_decode_attention_timing at 7f5b63e).
// Here a warp takes at least DA_SHORT_WARP_KEYS keys up to DA_SHORT_CONTEXT keys and
// DA_MIN_WARP_KEYS above, and the block splits grow with the context up to DA_MAX_SPLITS
// (ceil(limit / 32) up to 512 keys, ceil(limit / 64) up to 2048, then 32 with ceil(limit / 256)
// keys a warp), so 4096 keys are 32 block splits of 16 keys a warp (256 blocks, two per SM), and
// a short context keeps few splits (256 keys: 8) and so few partials to merge.
//
// Everything that decides a token's arithmetic (its splits, each warp's keys, the merge order)
// is a function of its own context, never of the batch or the grid: a token's output is the same
// bits alone or in any batch, eager or replayed from a CUDA graph, with PDL or without. The grid
// is (tokens x groups, splits for the longest context the block tables can hold), fixed per graph;
// block splits beyond a token's own count exit at once.
//
// Inside a warp: lanes take 16-byte slices of a K/V row (EPL = 8 elements; 4 for groups of 8,
// D 96 takes 3; DaLayout), so LPK = D / EPL lanes cover a row and a warp load covers
// KPW = 32 / LPK keys (D 128: two keys, one per half warp); every q head of the group is scored
// against each loaded row (GQA: one K/V read per group). Each iteration takes U loads of K and V per lane (KI = KPW x U keys), and the
// loop is software-pipelined: the next iteration's K/V rows and the block-table entries of the one
// after are requested before the current keys are scored, so a warp has its next loads in flight
// while it computes and the table lookup is off the K/V loads' critical path. Each slot (the LPK
// lanes of one key position) keeps its own online softmax; the slots merge by shuffles at the end.
#include "common.cuh"

#define DA_WARPS 8
// Most block splits a token takes; the scratch holds this many partials per (token, q head).
// Must match ops/decode_attention.rs.
#define DA_MAX_SPLITS 32
// Fewest keys a warp walks by default: DA_SHORT_WARP_KEYS for a token of up to DA_SHORT_CONTEXT
// keys (256 keys: 8 block splits), DA_MIN_WARP_KEYS above (1024 keys: 16). Per call on an H200
// (TIMING of cuda_ops decode_attention, dakeys_093c1a4.log), batch 1: 4 keys a warp against 8
// took 7.22 / 8.13 us at 256 keys on Llama-3-8B (6.32 / 7.11 on Qwen3.5-27B) but 9.36 / 8.83 at
// 1024 (12.80 / 9.07: 32 partials to merge). The kernels take the launch's `min_warp_keys`: 0
// for this default, else that many at every context (NINFER_DA_MIN_WARP_KEYS, a tuning tool,
// ops/decode_attention.rs).
#define DA_MIN_WARP_KEYS 8
#define DA_SHORT_WARP_KEYS 4
#define DA_SHORT_CONTEXT 512

// Keys per warp for a token that sees `limit` keys: the fewest (`min_keys`, or the default above
// when 0) up to the context where that many would pass DA_MAX_SPLITS block splits, then as many
// as keep the token within them. Must match ops/decode_attention.rs (decode_warp_keys_with).
__device__ __forceinline__ int da_warp_keys(int limit, int min_keys) {
    const int fewest = min_keys > 0 ? min_keys : (limit <= DA_SHORT_CONTEXT ? DA_SHORT_WARP_KEYS : DA_MIN_WARP_KEYS);
    return max(fewest, (limit + DA_MAX_SPLITS * DA_WARPS - 1) / (DA_MAX_SPLITS * DA_WARPS));
}

// Lane layout of a head of D elements for G q heads a warp: EPL elements per lane, LPK lanes per
// key, KPW keys per warp load. 16-byte slices (8 elements) where D / 8 lanes divide a warp, unless
// the group's q and accumulators (2 x G x EPL registers) would then pass 64: G = 8 takes 8-byte
// slices (4 elements), or D / 32 where that is more (D 256). D 96 takes 3 elements a lane.
template <int D, int G>
struct DaLayout {
    static constexpr int WIDE = (D == 64 || D == 128 || D == 256) ? 8 : D / 32;
    static constexpr int EPL = (G * WIDE <= 32 || D == 96) ? WIDE : (D / 32 > 32 / G ? D / 32 : 32 / G);
    static constexpr int LPK = D / EPL;
    static constexpr int KPW = 32 / LPK;
    static_assert(LPK * EPL == D && KPW * LPK == 32, "a head must tile a warp");
};

// A lane's EPL storage elements of one K or V row, held raw until they are used (half the
// registers of f32) so that a second set can be in flight.
template <int EPL>
struct KvSlice {
    store_t v[EPL];
    __device__ __forceinline__ void load(const store_t* __restrict__ p) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) v[e] = p[e];
    }
    __device__ __forceinline__ void unpack(float* f) const {
#pragma unroll
        for (int e = 0; e < EPL; ++e) f[e] = to_f32(v[e]);
    }
};

template <>
struct KvSlice<4> {
    uint2 r;
    // The row offset is a multiple of 4 elements, so the address is 8-byte aligned.
    __device__ __forceinline__ void load(const store_t* __restrict__ p) {
        r = *reinterpret_cast<const uint2*>(p);
    }
    __device__ __forceinline__ void unpack(float* f) const {
        f[0] = to_f32((store_t)(r.x & 0xffffu));
        f[1] = to_f32((store_t)(r.x >> 16));
        f[2] = to_f32((store_t)(r.y & 0xffffu));
        f[3] = to_f32((store_t)(r.y >> 16));
    }
};

template <>
struct KvSlice<8> {
    uint4 r;
    // The row offset is a multiple of 8 elements, so the address is 16-byte aligned.
    __device__ __forceinline__ void load(const store_t* __restrict__ p) {
        r = *reinterpret_cast<const uint4*>(p);
    }
    __device__ __forceinline__ void unpack(float* f) const { unpack_chunk(r, f); }
};

template <int D, int G>
__device__ __forceinline__ void scaled_decode_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals, int min_warp_keys) {
    using L = DaLayout<D, G>;
    constexpr int EPL = L::EPL, LPK = L::LPK, KPW = L::KPW;
    // Loads per lane per iteration: 4, or 2 where the group's q and accumulators already take
    // more than 32 registers (so that groups up to 4 fit DA_MIN_BLOCKS' 128 registers without
    // spilling), and at most 8 keys an iteration (a warp's default run at the longer contexts is
    // DA_MIN_WARP_KEYS). Llama-3-8B (D 128, G 4): 2 loads of 2 keys; Qwen3.5-27B (D 256, G 2): 4
    // loads of 1 key.
    constexpr int U0 = G * EPL <= 16 ? 4 : 2;
    constexpr int U = KPW * U0 > 8 ? 8 / KPW : U0;
    constexpr int KI = KPW * U;
    static_assert(DA_MAX_SPLITS <= 32 && D % 32 == 0, "the final merge gives a lane per split, a warp one q head");
    __shared__ float sm_acc[DA_WARPS][D];
    __shared__ float sm_m[DA_WARPS][G], sm_l[DA_WARPS][G];
    // Before the PDL wait: everything that does not depend on the kernel before this one (the
    // decode step's rope_kv_write, which writes q and the newest key's K/V row). The step's
    // metadata (token_seq, token_pos, block tables) was uploaded before the step began, and every
    // key before the newest was written by earlier steps, so the block-table entries and the K/V
    // rows of the warp's first iteration are requested here, while that kernel still runs; a
    // load of the newest key's row (position limit - 1) is issued again after the wait.
    const int lane = threadIdx.x & 31;
    const int wi = threadIdx.x >> 5;
    const int slot = lane / LPK;
    const int sl = lane - slot * LPK;
    const int groups = n_q_heads / G;
    const int tg = blockIdx.x;
    const int t = tg / groups;
    const int h0 = (tg - t * groups) * G;
    const int kvh = h0 / (n_q_heads / n_kv_heads);
    const int limit = token_pos[t] + 1;
    const int part = da_warp_keys(limit, min_warp_keys);
    const int block_keys = part * DA_WARPS;
    const int nb = (limit + block_keys - 1) / block_keys;
    const int b = blockIdx.y;
    if (b >= nb) {  // beyond this token's splits (uniform over the block)
        pdl_enter();
        return;
    }
    const int start = b * block_keys + wi * part;
    const int end = min(limit, start + part);
    const int* __restrict__ table = block_tables + (long long)token_seq[t] * max_blocks;
    const long long row_elems = (long long)n_kv_heads * D;
    const long long head_off = (long long)kvh * D + sl * EPL;
    // Load u of the iteration at key j reads key j + u * KPW + slot; keys past the warp's range
    // read its last key instead (a valid address) and are masked out of the softmax.
    int tb[U];
    KvSlice<EPL> kc[U], vc[U];
    // A warp past the context (start >= limit) keeps m = -inf, l = 0: an empty partial.
    if (start < end) {
#pragma unroll
        for (int u = 0; u < U; ++u) tb[u] = table[min(start + u * KPW + slot, end - 1) / block_size];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int jj = min(start + u * KPW + slot, end - 1);
            const long long off = ((long long)tb[u] * block_size + jj % block_size) * row_elems + head_off;
            kc[u].load(k_cache + off);
            vc[u].load(v_cache + off);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            tb[u] = table[min(start + KI + u * KPW + slot, end - 1) / block_size];
    }
    pdl_enter();
    // The newest key's row, written by the kernel just waited for: loads above that read it read
    // it again (later iterations load after the wait).
    if (start < end && end == limit && start + KI > limit - 1) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (min(start + u * KPW + slot, end - 1) == limit - 1) {
                const long long off =
                    ((long long)table[(limit - 1) / block_size] * block_size + (limit - 1) % block_size) *
                        row_elems + head_off;
                kc[u].load(k_cache + off);
                vc[u].load(v_cache + off);
            }
        }
    }

    float qv[G][EPL], acc[G][EPL], m[G], l[G];
    softmax_state_init<G, EPL, D>(q + t * q_stride + (long long)h0 * D + sl * EPL, scale, qv, acc, m, l);
    if (start < end) {
        for (int j = start; j < end; j += KI) {
            // Next iteration's K/V rows (their table entries came one iteration ahead), then the
            // table entries of the iteration after it, before this iteration's keys are used.
            // Past the warp's range these re-read its last key (clamped): no branch, and the
            // last iteration's spare loads hit rows already on their way.
            const int jn = j + KI;
            KvSlice<EPL> kn[U], vn[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int jj = min(jn + u * KPW + slot, end - 1);
                const long long off =
                    ((long long)tb[u] * block_size + jj % block_size) * row_elems + head_off;
                kn[u].load(k_cache + off);
                vn[u].load(v_cache + off);
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                tb[u] = table[min(jn + KI + u * KPW + slot, end - 1) / block_size];
            float s[U][G];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float kf[EPL];
                kc[u].unpack(kf);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    float d = 0.0f;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) d = fmaf(qv[g][e], kf[e], d);
                    s[u][g] = d;
                }
            }
            // Each slot's LPK lanes sum their partial dot products (xor offsets below LPK stay
            // inside the slot).
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
#pragma unroll
                    for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
                }
            }
            float vf[U][EPL];
#pragma unroll
            for (int u = 0; u < U; ++u) vc[u].unpack(vf[u]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float smax = NEG_INF;
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (j + u * KPW + slot < end) smax = fmaxf(smax, s[u][g]);
                // A slot without a key in this iteration (the warp's last one) changes nothing.
                if (smax != NEG_INF) {
                    const float m_new = fmaxf(m[g], smax);
                    const float corr = expf(m[g] - m_new);
                    l[g] *= corr;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        if (j + u * KPW + slot < end) {
                            const float p = expf(s[u][g] - m_new);
                            l[g] += p;
#pragma unroll
                            for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e]);
                        }
                    }
                    m[g] = m_new;
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                kc[u] = kn[u];
                vc[u] = vn[u];
            }
        }
    }
    // Merge the slots' softmax states (butterfly over the lane bits above the slot's); slot 0
    // (lanes 0..LPK-1) then holds the warp's partial. A slot that saw no key has m = -inf.
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            float ao[EPL];
#pragma unroll
            for (int e = 0; e < EPL; ++e) ao[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
            const float mn = fmaxf(m[g], mo);
            if (mn != NEG_INF) {
                const float fa = expf(m[g] - mn);
                const float fb = expf(mo - mn);
                l[g] = l[g] * fa + lo * fb;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * fa + ao[e] * fb;
                m[g] = mn;
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[wi][g] = m[g];
            sm_l[wi][g] = l[g];
        }
    }
    // Merge the warps' partials one q head at a time (thread i: element i of the head), in warp
    // order. Warp 0 of a live block always has keys, so the block's max is finite, its sum > 0.
    const long long row0 = (long long)t * n_q_heads + h0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane < LPK) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) sm_acc[wi][sl * EPL + e] = acc[g][e];
        }
        __syncthreads();
        if (threadIdx.x < D)
            merge_warp_partials<DA_WARPS, G, D>(g, threadIdx.x, sm_acc, sm_m, sm_l, row0 + g, b, nb,
                                                DA_MAX_SPLITS, out, part_acc, part_ml);
        __syncthreads();
    }
    // Publish this block's partial, then count it in (common.cuh's arrives_last).
    if (nb == 1 || !arrives_last(arrivals + tg, (unsigned)nb)) return;
    // Last block: merge the nb block partials in split order. Volatile loads bypass L1, which is
    // not coherent with the other blocks' writes. Thread i merges element i of a q head, EPT
    // elements a thread; the 32 lanes of a warp share the head (D is a multiple of 32), so lane s
    // loads split s's (max, sum) and the warp's shuffles give the max over the splits, the weights
    // e^(m_s - max) and their l-weighted total. Every element's (max, sum) and first CH splits'
    // accumulators are requested before any is used (one L2 round trip up to CH splits); each
    // element is then summed in split order.
    constexpr int EPT = (G * D + DA_WARPS * 32 - 1) / (DA_WARPS * 32);
    constexpr int CH = EPT >= 8 ? 4 : (EPT >= 4 ? 8 : 16);
    const volatile float* vacc = part_acc;
    const volatile float* vml = part_ml;
    float ms[EPT], ls[EPT], av[EPT][CH];
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
        const int i = threadIdx.x + k * DA_WARPS * 32;
        ms[k] = NEG_INF;
        ls[k] = 0.0f;
        if (i < G * D) {  // uniform over a warp
            const int g = i / D;
            const long long p0 = (row0 + g) * DA_MAX_SPLITS;
            if (lane < nb) {
                ms[k] = vml[(p0 + lane) * 2];
                ls[k] = vml[(p0 + lane) * 2 + 1];
            }
#pragma unroll
            for (int u = 0; u < CH; ++u) av[k][u] = u < nb ? vacc[(p0 + u) * D + (i - g * D)] : 0.0f;
        }
    }
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
        const int i = threadIdx.x + k * DA_WARPS * 32;
        if (i >= G * D) continue;  // uniform over a warp
        const int g = i / D;
        const int e = i - g * D;
        const long long p0 = (row0 + g) * DA_MAX_SPLITS;
        const float mx = warp_max(ms[k]);
        const float f = lane < nb ? expf(ms[k] - mx) : 0.0f;
        const float total = warp_sum(ls[k] * f);
        float a = 0.0f;
        for (int s0 = 0; s0 < nb; s0 += CH) {
            if (s0 > 0) {
#pragma unroll
                for (int u = 0; u < CH; ++u) av[k][u] = s0 + u < nb ? vacc[(p0 + s0 + u) * D + e] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < CH; ++u) {
                const float fu = __shfl_sync(0xffffffffu, f, (s0 + u) & 31);
                if (s0 + u < nb) a = fmaf(av[k][u], fu, a);
            }
        }
        out[(row0 + g) * D + e] = from_f32(a * (1.0f / total));
    }
}

// Two blocks an SM (at most 128 registers a thread) for every group but 8, whose q and
// accumulators alone take 64-128 registers: at batch 1 a 4096-key Llama-3-8B step is 256 blocks,
// one wave on 132 SMs at two blocks each.
#define DA_MIN_BLOCKS(G) ((G) <= 4 ? 2 : 1)

#define DA_INSTANCE(D, G)                                                                       \
    extern "C" __global__ void __launch_bounds__(DA_WARPS * 32, DA_MIN_BLOCKS(G))         \
        decode_attention_d##D##_g##G(                                                           \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, int min_warp_keys) { \
        scaled_decode_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,      \
                                 token_pos, n_q_heads, n_kv_heads, q_stride, block_size, scale, \
                                 out, part_acc, part_ml, arrivals, min_warp_keys);              \
    }

#define DA_HEAD_INSTANCES(D)                                                                    \
    DA_INSTANCE(D, 1)                                                                           \
    DA_INSTANCE(D, 2)                                                                           \
    DA_INSTANCE(D, 4)                                                                           \
    DA_INSTANCE(D, 8)

DA_HEAD_INSTANCES(64)
DA_HEAD_INSTANCES(96)
DA_HEAD_INSTANCES(128)
DA_HEAD_INSTANCES(256)
