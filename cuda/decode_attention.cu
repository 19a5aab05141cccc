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
// Why the layout scales: the fixed form (decode_attention_fixed_* below, 8 block splits
// whatever the context) gives Llama-3-8B at batch 1 only 8 groups x 8 blocks = 64 blocks on 132
// SMs, each warp walking 64 keys one dependent round trip after another at a 4096-key context:
// 32.6 us for 16.8 MB of K/V (~0.5 TB/s on the H200).
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
//
// Every form takes `gate` / `gate_stride` after the scratch: gated attention's output gate (q head
// h of token t, element e at gate[t * gate_stride + h * D + e]; null for none), applied in the
// final write (common.cuh attn_out_value), the bits of sigmoid_gate_mul after the ungated kernel.
#include "common.cuh"
#include "attention_keys.cuh"
#include "attention_mma.cuh"

#define DA_WARPS 8
// Most block splits a token takes; the scratch holds this many partials per (token, q head).
// Must match ops/decode_attention.rs.
#define DA_MAX_SPLITS 32
// Fewest keys a warp walks by default: DA_SHORT_WARP_KEYS for a token of up to DA_SHORT_CONTEXT
// keys (256 keys: 8 block splits), DA_MIN_WARP_KEYS above (1024 keys: 16). Per call on an H200
// (TIMING of cuda_ops decode_attention), batch 1: 4 keys a warp against 8 took 7.22 / 8.13 us
// at 256 keys on Llama-3-8B (6.32 / 7.11 on Qwen3.5-27B) but 9.36 / 8.83 at 1024 (12.80 / 9.07:
// 32 partials to merge). The kernels take the launch's `min_warp_keys`: 0 for this default,
// else that many at every context (the op tests' other layouts, ops/decode_attention.rs).
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
    float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate, long long gate_stride,
    int min_warp_keys) {
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
    // The output gate of the block's heads (head h0's row; null: no gate).
    const store_t* gate0 = gate_at(gate, t * gate_stride + (long long)h0 * D);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane < LPK) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) sm_acc[wi][sl * EPL + e] = acc[g][e];
        }
        __syncthreads();
        if (threadIdx.x < D)
            merge_warp_partials<DA_WARPS, G, D>(g, threadIdx.x, sm_acc, sm_m, sm_l, row0 + g, b, nb,
                                                DA_MAX_SPLITS, out, gate_at(gate0, g * D), part_acc,
                                                part_ml);
        __syncthreads();
    }
    // Publish this block's partial, then count it in (common.cuh's arrives_last).
    if (nb == 1 || !arrives_last(arrivals + tg, (unsigned)nb)) return;
    // Last block: merge the nb block partials in split order. Volatile loads bypass L1, which is
    // not coherent with the other blocks' writes. Thread i merges element i of a q head, EPT
    // elements a thread; the 32 lanes of a warp share the head (D is a multiple of 32), so lane s
    // loads split s's (max, sum) and the warp's shuffles give the max over the splits, the weights
    // e^(m_s - max) and their l-weighted total. Every element's (max, sum) and first CH splits'
    // accumulators (and the output gate's element) are requested before any is used (one L2
    // round trip up to CH splits); each element is then summed in split order.
    constexpr int EPT = (G * D + DA_WARPS * 32 - 1) / (DA_WARPS * 32);
    constexpr int CH = EPT >= 8 ? 4 : (EPT >= 4 ? 8 : 16);
    const volatile float* vacc = part_acc;
    const volatile float* vml = part_ml;
    float ms[EPT], ls[EPT], av[EPT][CH];
    store_t gv[EPT];
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
        const int i = threadIdx.x + k * DA_WARPS * 32;
        ms[k] = NEG_INF;
        ls[k] = 0.0f;
        gv[k] = 0;
        if (i < G * D) {  // uniform over a warp
            const int g = i / D;
            const long long p0 = (row0 + g) * DA_MAX_SPLITS;
            gv[k] = load_gate(gate0, i);  // heads are D apart in the gate row as in the output
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
        out[(row0 + g) * D + e] = attn_out_value(a * (1.0f / total), gate0 != nullptr, gv[k]);
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
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate,  \
        long long gate_stride, int min_warp_keys) {                                             \
        scaled_decode_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,      \
                                 token_pos, n_q_heads, n_kv_heads, q_stride, block_size, scale, \
                                 out, part_acc, part_ml, arrivals, gate, gate_stride,           \
                                 min_warp_keys);                                                \
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


// ---------------------------------------------------------------------------------------------
// Decode attention in one kernel with a fixed DA_SPLITS block splits per (token, group): the
// route of decode launches of 3+ tokens where the direct tensor-core form does not apply (sm_7x,
// head size 96; ops/decode_attention.rs), without attention_combine. A block owns one (token, GQA
// group) and one "block split" of DA_WARPS consecutive warp splits; warp split
// blockIdx.y * DA_WARPS + warp walks decode_partition(limit) keys exactly as attention_body's
// split of that index does, so a token still never needs more than DECODE_SPLITS warp splits,
// i.e. DA_SPLITS blocks, and the grid (tokens x groups, DA_SPLITS) does not depend on the
// contexts (a CUDA graph replays it). The warps of a block merge their partials through
// shared memory in warp order. A token whose keys fit one block split (limit <=
// DA_WARPS * partition: up to 128 keys) is done there: block 0 writes the normalised output.
// Otherwise each live block writes its merged partial (acc, max, sum) to the scratch,
// `__threadfence()`s, and one thread counts the block in with atomicInc on the (token, group)
// arrival counter; the block that arrives last merges the block partials in split order
// 0..nb-1, so the result is the same whichever block is last (deterministic: graph == eager,
// batch == alone, since nb and every split's keys depend on the token's own context only).
// nb, the live block splits, is known on device from the context; idle block splits exit
// without arriving. The election (and the counter's reset for the next layer / step / replay) is
// common.cuh's arrives_last.
#define DA_SPLITS (DECODE_SPLITS / DA_WARPS)
template <int D, int G>
__device__ __forceinline__ void decode_attention_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate, long long gate_stride) {
    constexpr int EPL = D / 32;
    __shared__ float sm_acc[DA_WARPS][D];
    __shared__ float sm_m[DA_WARPS][G], sm_l[DA_WARPS][G];
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int wi = threadIdx.x >> 5;
    const int groups = n_q_heads / G;
    const int tg = blockIdx.x;
    const int t = tg / groups;
    const int h0 = (tg - t * groups) * G;
    const int kvh = h0 / (n_q_heads / n_kv_heads);
    const int limit = token_pos[t] + 1;
    const int part = decode_partition(limit);
    const int block_keys = part * DA_WARPS;
    const int nb = (limit + block_keys - 1) / block_keys;
    const int b = blockIdx.y;
    if (b >= nb) return;  // idle block split (uniform over the block)
    const int start = b * block_keys + wi * part;
    const int end = min(limit, start + part);

    float qv[G][EPL], acc[G][EPL], m[G], l[G];
    softmax_state_init<G, EPL, D>(q + t * q_stride + (long long)h0 * D + lane * EPL, scale, qv, acc, m, l);
    // A warp past the context (start >= limit) keeps m = -inf, l = 0: an empty partial.
    attend_keys<D, G>(k_cache, v_cache, block_tables + (long long)token_seq[t] * max_blocks,
                      n_kv_heads, block_size, (long long)kvh * D + lane * EPL, start, end, qv,
                      acc, m, l);
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[wi][g] = m[g];
            sm_l[wi][g] = l[g];
        }
    }
    // Merge the warps' partials one q head at a time (thread i: element i of the head). Warp 0
    // of a live block always has keys, so the block's max is finite and its sum positive.
    // gate0: the output gate of the block's heads (head h0's row; null: no gate).
    const store_t* gate0 = gate_at(gate, t * gate_stride + (long long)h0 * D);
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) sm_acc[wi][lane * EPL + e] = acc[g][e];
        __syncthreads();
        if (threadIdx.x < D)
            merge_warp_partials<DA_WARPS, G, D>(g, threadIdx.x, sm_acc, sm_m, sm_l,
                                                (long long)t * n_q_heads + h0 + g, b, nb, DA_SPLITS,
                                                out, gate_at(gate0, g * D), part_acc, part_ml);
        __syncthreads();
    }
    // Publish this block's partial, then count it in (common.cuh's arrives_last).
    if (nb == 1 || !arrives_last(arrivals + tg, (unsigned)nb)) return;
    // Last block: merge the nb block partials in split order. Volatile loads bypass L1, which
    // is not coherent with the other blocks' writes; a thread loads all its splits' values
    // before it uses any (one L2 round trip, not one per split).
    const volatile float* vacc = part_acc;
    const volatile float* vml = part_ml;
    for (int i = threadIdx.x; i < G * D; i += DA_WARPS * 32) {
        const int g = i / D;
        const int e = i - g * D;
        const long long row = (long long)t * n_q_heads + h0 + g;
        const long long p0 = row * DA_SPLITS;
        float ms[DA_SPLITS], ls[DA_SPLITS], av[DA_SPLITS];
        const store_t gv = load_gate(gate0, i);  // heads are D apart in the gate row as in the output
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s) {
            if (s < nb) {
                ms[s] = vml[(p0 + s) * 2];
                ls[s] = vml[(p0 + s) * 2 + 1];
                av[s] = vacc[(p0 + s) * D + e];
            }
        }
        float mx = NEG_INF;
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s)
            if (s < nb) mx = fmaxf(mx, ms[s]);
        float a = 0.0f, sum = 0.0f;
#pragma unroll
        for (int s = 0; s < DA_SPLITS; ++s) {
            if (s < nb) {
                const float f = expf(ms[s] - mx);
                sum = fmaf(ls[s], f, sum);
                a = fmaf(av[s], f, a);
            }
        }
        out[row * D + e] = attn_out_value(a * (1.0f / sum), gate0 != nullptr, gv);
    }
}

// The fixed-split form: decode_attention_fixed_d{D}_g{G}, the arguments of the scaled form's
// kernels without the layout argument, DA_WARPS warps a block.
#define DA_FIXED_INSTANCE(D, G)                                                                 \
    extern "C" __global__ void __launch_bounds__(DA_WARPS * 32) decode_attention_fixed_d##D##_g##G(\
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate,  \
        long long gate_stride) {                                                                \
        decode_attention_body<D, G>(q, k_cache, v_cache, block_tables, max_blocks, token_seq,   \
                                    token_pos, n_q_heads, n_kv_heads, q_stride, block_size,     \
                                    scale, out, part_acc, part_ml, arrivals, gate, gate_stride);\
    }

#define DA_FIXED_HEAD_INSTANCES(D)                                                              \
    DA_FIXED_INSTANCE(D, 1)                                                                     \
    DA_FIXED_INSTANCE(D, 2)                                                                     \
    DA_FIXED_INSTANCE(D, 4)                                                                     \
    DA_FIXED_INSTANCE(D, 8)

DA_FIXED_HEAD_INSTANCES(64)
DA_FIXED_HEAD_INSTANCES(96)
DA_FIXED_HEAD_INSTANCES(128)
DA_FIXED_HEAD_INSTANCES(256)

// ---------------------------------------------------------------------------------------------
// The direct tensor-core form (flash_decode_direct_d*, below): the route of sm_80+ decode where
// the head size is 64 / 128 / 256 (ops/decode_attention.rs). The G q heads of a token's group are
// the N columns of m16n8k16 (columns G..7 zero) and 16 keys (for S^T = K Q^T) or 16 head dims
// (for O^T += V^T P^T) its M rows, every K/V byte read once for the whole group; P^T goes from
// the S^T accumulator layout to O^T's B fragments by movmatrix (a register transpose). The warps
// merge through shared memory in warp order; the splits through the scratch partials, merged in
// split order by the last block to arrive (arrives_last), the layout of the scaled form above
// (the same AttnScratch).

// Warps a block of flash_decode_direct_d*.
#define FDD_WARPS 4

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FD_MAX_SPLITS 32  // = ops/decode_attention.rs DECODE_MAX_SPLITS
#define FD_BN 16
// The last block's split merge: output elements a thread sums at once, and splits of each
// whose partials it requests before using any (FD_MERGE_ROWS x FD_MERGE_CHUNK loads in flight).
#define FD_MERGE_ROWS 4
#define FD_MERGE_CHUNK 8

// The 8x8 16-bit matrix held one row pair a lane (lane l: row l/4, columns 2(l%4), +1, the mma
// fragment layout) transposed, in the same layout: what turns the keys-by-heads probabilities
// of S^T into the heads-by-keys B fragment of O^T += V^T P^T without shared memory (sm_75+).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// The end of the tensor-core decode form: the SLOTS partials of a block of WARPS warps (a
// slot is a warp, or a pair of warps that split the head dims; each slot's O^T accumulators
// already in sm_o, [SLOTS][8 heads][D] f32, by head dim) merged in slot order through shared
// memory, the block's partial published, and the last block to arrive merging the splits in
// split order. `m` / `l`: the lane's running max and (warp-reduced) sum of heads 2tq, 2tq + 1,
// written for the slot by the warps with `writes_ml` (one a slot).
template <int D, int SLOTS, int WARPS>
__device__ __forceinline__ void fd_merge(float* sm_o, const float* m, const float* l, int slot, bool writes_ml, int t,
                                         int kvh, int G, int n_q_heads, int b, int nb, store_t* __restrict__ out,
                                         const store_t* gate0, float* part_acc, float* part_ml, unsigned* arrivals) {
    const int lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const int tk = t * (n_q_heads / G) + kvh;
    float* sm_m = sm_o + SLOTS * 8 * D;  // [SLOTS][8]
    float* sm_l = sm_m + SLOTS * 8;
    if (writes_ml && gr == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sm_m[slot * 8 + 2 * tq + h] = m[h];  // -inf (and l 0) for a slot without keys
            sm_l[slot * 8 + 2 * tq + h] = l[h];
        }
    }
    __syncthreads();
    const long long tok_row = (long long)t * n_q_heads + (long long)kvh * G;  // row of head 0
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
        const int g = i / D, d = i - g * D;
        float mb = NEG_INF;
#pragma unroll
        for (int w = 0; w < SLOTS; ++w) mb = fmaxf(mb, sm_m[w * 8 + g]);
        float lb = 0.0f, ob = 0.0f;
#pragma unroll
        for (int w = 0; w < SLOTS; ++w) {
            const float mw = sm_m[w * 8 + g];
            const float f = mw == NEG_INF ? 0.0f : exp2f(mw - mb);
            lb += sm_l[w * 8 + g] * f;
            ob += sm_o[(w * 8 + g) * D + d] * f;
        }
        store_block_result<D>(ob, mb, lb, d, tok_row + g, b, nb, FD_MAX_SPLITS, out, gate_at(gate0, g * D), part_acc,
                              part_ml);
    }
    if (nb == 1 || !arrives_last(arrivals + tk, (unsigned)nb)) return;
    // Last block: the nb split partials in split order, read through L2 (ld.global.cg: L1 is
    // not coherent with the other blocks' writes). Each head's max over the splits, the splits'
    // weights and their total once, in shared memory (free again: every thread is past the
    // warp merge); then each thread sums FD_MERGE_ROWS elements at a time with FD_MERGE_CHUNK
    // splits' loads of each in flight before any is used. Why: the first form re-read the
    // (max, sum) pairs for every element and waited on every load in turn, ~24 elements x nb
    // round trips a thread at d 256, most of the d 256 kernel's ~37 us floor at short contexts.
    float* sm_pm = sm_o;  // [8][FD_MAX_SPLITS] split max, then weight
    float* sm_pl = sm_pm + 8 * FD_MAX_SPLITS;         // [8][FD_MAX_SPLITS] split sum
    float* sm_tot = sm_pl + 8 * FD_MAX_SPLITS;        // [8] weighted total
    for (int i = threadIdx.x; i < G * nb; i += WARPS * 32) {
        const int g = i / nb, sp = i - g * nb;
        const float* ml = part_ml + ((tok_row + g) * FD_MAX_SPLITS + sp) * 2;
        sm_pm[g * FD_MAX_SPLITS + sp] = __ldcg(ml);
        sm_pl[g * FD_MAX_SPLITS + sp] = __ldcg(ml + 1);
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float* pm = sm_pm + threadIdx.x * FD_MAX_SPLITS;
        const float* pl = sm_pl + threadIdx.x * FD_MAX_SPLITS;
        float mx = NEG_INF;
        for (int sp = 0; sp < nb; ++sp) mx = fmaxf(mx, pm[sp]);
        float tot = 0.0f;
        for (int sp = 0; sp < nb; ++sp) {
            const float f = exp2f(pm[sp] - mx);
            pm[sp] = f;
            tot += pl[sp] * f;
        }
        sm_tot[threadIdx.x] = tot;
    }
    __syncthreads();
    for (int i0 = threadIdx.x; i0 < G * D; i0 += FD_MERGE_ROWS * WARPS * 32) {
        float acc[FD_MERGE_ROWS];
        store_t gv[FD_MERGE_ROWS];  // the output gate's elements, requested with the first splits
#pragma unroll
        for (int r = 0; r < FD_MERGE_ROWS; ++r) {
            acc[r] = 0.0f;
            const int i = i0 + r * WARPS * 32;
            gv[r] = i < G * D ? load_gate(gate0, i) : (store_t)0;
        }
        for (int s0 = 0; s0 < nb; s0 += FD_MERGE_CHUNK) {
            float v[FD_MERGE_ROWS][FD_MERGE_CHUNK];
#pragma unroll
            for (int r = 0; r < FD_MERGE_ROWS; ++r) {
                const int i = i0 + r * WARPS * 32;
                const int g = i / D, d = i - g * D;
                const float* pa = part_acc + (tok_row + g) * FD_MAX_SPLITS * D + d;
#pragma unroll
                for (int u = 0; u < FD_MERGE_CHUNK; ++u)
                    v[r][u] = i < G * D && s0 + u < nb ? __ldcg(pa + (long long)(s0 + u) * D) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < FD_MERGE_ROWS; ++r) {
                const int g = (i0 + r * WARPS * 32) / D;
#pragma unroll
                for (int u = 0; u < FD_MERGE_CHUNK; ++u)
                    if (s0 + u < nb) acc[r] += v[r][u] * sm_pm[min(g, 7) * FD_MAX_SPLITS + s0 + u];
            }
        }
#pragma unroll
        for (int r = 0; r < FD_MERGE_ROWS; ++r) {
            const int i = i0 + r * WARPS * 32;
            if (i < G * D) {
                const int g = i / D;
                out[(tok_row + g) * D + (i - g * D)] = attn_out_value(acc[r] / sm_tot[g], gate0 != nullptr, gv[r]);
            }
        }
    }
}

// The online softmax of one 16-key tile of a tensor-core decode form, in place: `sc` the lane's
// S^T accumulators (keys kb + gr and kb + gr + 8, heads 2tq and 2tq + 1) become its
// probabilities (keys at or past `s_end` 0), the running max `m` and sum `l` of the two heads and
// the NT O^T accumulators are rescaled to the new max. ROUND: each probability rounded to the
// storage type before it is summed (the form whose P V runs in the storage type).
template <int NT, bool ROUND>
__device__ __forceinline__ void fd_tile_softmax(float* sc, float* m, float* l, float (*acc)[4], int kb, int gr,
                                                int s_end, float scale_log2) {
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sc[h] = kb + gr < s_end ? sc[h] * scale_log2 : NEG_INF;
        sc[h + 2] = kb + gr + 8 < s_end ? sc[h + 2] * scale_log2 : NEG_INF;
        mx[h] = fmaxf(m[h], fmaxf(sc[h], sc[h + 2]));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
    }
    // Every tile has a key (kb < s_end), so mx is finite from the first tile on.
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        corr[h] = exp2f(m[h] - mx[h]);
        m[h] = mx[h];
        sc[h] = ROUND ? round_st(exp2f(sc[h] - mx[h])) : exp2f(sc[h] - mx[h]);
        sc[h + 2] = ROUND ? round_st(exp2f(sc[h + 2] - mx[h])) : exp2f(sc[h + 2] - mx[h]);
        l[h] = l[h] * corr[h] + sc[h] + sc[h + 2];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] *= corr[0];
        acc[n][1] *= corr[1];
        acc[n][2] *= corr[0];
        acc[n][3] *= corr[1];
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention on tensor cores with K/V loaded straight into mma fragments
// (flash_decode_direct_d*, ops/decode_attention.rs form TensorCoreDirect).
//
// Why: a form that staged its tiles through 68-70 KiB of shared memory a block made the SMs
// take a large shared carveout, and the decode GEMVs around it ran with a small L1 (below 16
// tokens that cost more in the model than the kernel saved). The CUDA-core forms spend ~300 instructions a warp on every 2 KB of K/V (dot
// products, shuffle reductions, an exp per key and head), which bounds batch-1 decode at long
// contexts (~1.9 TB/s at 16k keys on Llama-3-8B). Here every lane loads 16-byte slices of K and
// V rows into registers and they are the fragments: the head dims of S^T = K Q^T are summed in
// an order of our choosing, so a lane's four A-fragment elements of two k-steps are 8
// consecutive dims of one key row (one 16-byte load; Q^T's B fragments are loaded in the same
// order), and for O^T += V^T P^T the head dims (the M rows) are permuted so that a lane's rows
// of every m-tile are 8 consecutive dims of each of its 4 keys (two key rows' halves paired by
// byte permutes), un-permuted when the warp's accumulators go to shared memory. P V runs in the
// storage type (bf16 P, as flash attention's bf16 path; the softmax sums the rounded P). No
// staging: the only shared memory is the warps' merge (16 KiB at d 128).
//
// Layout: a block of FDD_WARPS warps owns (token, kv head, split of fdd_split_keys(limit,
// splits) keys), warp w the 16-key tiles w, w + WARPS, ... of the split; the next tile's rows
// are requested before this one's are used. `splits` (at most FD_MAX_SPLITS) is the launch's:
// the launcher aims at two blocks an SM over the launch's tokens and kv heads
// (ops/decode_attention.rs tc_direct_splits), so a token's layout depends on its context and
// on the launch's token count (as the form does), not on the other tokens' contexts. Before the PDL
// wait a warp requests its first tile (every key but a token's newest was written by earlier
// steps; the step's metadata was uploaded before it) and loads that tile again after the wait
// if it holds the newest key. d 64 and 128 (a tile and the next take 32-64 registers each).
// Keys a split takes for a token seeing `limit` keys: `splits` splits at most, whole blocks'
// worth of tiles (FDD_WARPS x FD_BN keys) each. = ops/decode_attention.rs tc_direct_split_keys.
__device__ __forceinline__ int fdd_split_keys(int limit, int splits) {
    const int unit = FDD_WARPS * FD_BN;
    const int need = (limit + splits - 1) / splits;
    return max(unit, (need + unit - 1) / unit * unit);
}

__device__ __forceinline__ unsigned u4_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// One 16-key tile of a lane: K rows gr and gr + 8 at dims 32p + 8tq .. +7 (k[h][p]); V rows
// 2tq, 2tq + 1, 2tq + 8, 2tq + 9 at dims 64c + 8gr .. +7 (v[i][c]). Keys past `s_end` read the
// split's last key (a valid row; masked out of the softmax).
template <int D>
struct FddTile {
    static constexpr int KC = D / 32, VC = D / 64;
    uint4 k[2][KC];
    uint4 v[4][VC];
    __device__ __forceinline__ void load(const store_t* __restrict__ k_cache, const store_t* __restrict__ v_cache,
                                         const int* __restrict__ table, int kb, int s_end, int block_size,
                                         long long row_elems, long long head_off, int gr, int tq) {
        const int last = s_end - 1 - kb;  // the tile's last live row
        const int kr[2] = {min(gr, last), min(gr + 8, last)};
        const int vr[4] = {min(2 * tq, last), min(2 * tq + 1, last), min(2 * tq + 8, last), min(2 * tq + 9, last)};
        long long ko[2], vo[4];
        if ((block_size & 15) == 0) {  // the tile is inside one cache block (kb is a multiple of 16)
            const long long base = ((long long)table[kb / block_size] * block_size + kb % block_size) * row_elems + head_off;
#pragma unroll
            for (int h = 0; h < 2; ++h) ko[h] = base + kr[h] * row_elems;
#pragma unroll
            for (int i = 0; i < 4; ++i) vo[i] = base + vr[i] * row_elems;
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = kb + kr[h];
                ko[h] = ((long long)table[j / block_size] * block_size + j % block_size) * row_elems + head_off;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = kb + vr[i];
                vo[i] = ((long long)table[j / block_size] * block_size + j % block_size) * row_elems + head_off;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int p = 0; p < KC; ++p)
                k[h][p] = *reinterpret_cast<const uint4*>(k_cache + ko[h] + 32 * p + 8 * tq);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < VC; ++c)
                v[i][c] = *reinterpret_cast<const uint4*>(v_cache + vo[i] + 64 * c + 8 * gr);
    }
    // The rows that are key `newest` (live or clamped to it) take that key's k and v slices
    // from ks / vs (its rotated k and its v from this tile's head dims on, 8 elements a uint4):
    // what the cache holds once the rotating form (FddRope) has written the key's slot.
    __device__ __forceinline__ void patch(int kb, int s_end, int newest, const uint4* ks, const uint4* vs, int gr, int tq) {
        const int last = s_end - 1 - kb, j = newest - kb;
        const int kr[2] = {min(gr, last), min(gr + 8, last)};
        const int vr[4] = {min(2 * tq, last), min(2 * tq + 1, last), min(2 * tq + 8, last), min(2 * tq + 9, last)};
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (kr[h] == j)
#pragma unroll
                for (int p = 0; p < KC; ++p) k[h][p] = ks[4 * p + tq];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (vr[i] == j)
#pragma unroll
                for (int c = 0; c < VC; ++c) v[i][c] = vs[8 * c + gr];
    }
};

// What the rotating direct form (flash_decode_direct_rope_d*) does in place of the step's
// rope_kv_write / rope_kv_write_normed: token t's q heads are read unrotated at
// t * q_stride of q, its k and v heads at t * kv_stride of k_src / v_src (the qkv projection's
// rows); with q_norm (and k_norm) non-null each head is first RMS-normed over its head_dim
// (eps, plus_one); the first rotary_dim elements rotate at position token_pos[t]; the newest
// key's k and v go to the caches at slot_mapping[t] (none where negative).
struct FddRope {
    const store_t* k_src;
    const store_t* v_src;
    long long kv_stride;
    store_t* k_cache;
    store_t* v_cache;
    const long long* slot_mapping;
    const float* inv_freq;
    int rotary_dim;
    float attn_scale;
    const store_t* q_norm;
    const store_t* k_norm;
    float eps;
    int plus_one;
};

// One head of D elements prepared by one warp as rope_kv_write[_normed] leaves it, into `dst`
// (shared, D / 8 chunks): lane l takes chunk l. The norm is rmsnorm_heads' one-warp order
// (chunked_norm_threads is 32 up to D 256: a lane's one chunk, warp_sum, and the second
// warp_sum of block_sum adds zeros), the normed chunk rounded to storage; then each pair
// (i, i + rotary_dim / 2) rotates by rope_apply with rope_cos_sin's values (`cs`: the lane's
// first two pairs, formed before the PDL wait); the tail past rotary_dim stays as it is.
template <int D>
__device__ __forceinline__ void fdd_rope_head(const store_t* x, const store_t* w, uint4 w_chunk, uint4* dst,
                                              const FddRope& r, float pos, const float (&cs)[2][2], int lane) {
    constexpr int NC = D / 8;
    uint4 c = make_uint4(0u, 0u, 0u, 0u);
    if (lane < NC) c = load_chunk(x, lane * 8, D, aligned16(x));
    if (w) {
        const float ss = warp_sum(lane < NC ? chunk_sum_squares(c, 0.0f) : 0.0f);
        if (lane < NC) c = norm_chunk_w(c, w_chunk, norm_rstd(ss, D, r.eps), r.plus_one);
    }
    if (lane < NC) dst[lane] = c;
    __syncwarp();
    store_t* h = reinterpret_cast<store_t*>(dst);
    const int half = r.rotary_dim / 2;
    for (int i = lane, n = 0; i < half; i += 32, ++n) {  // a lane reads and writes its own pairs
        float co, si;
        if (n < 2) {
            co = cs[n][0];
            si = cs[n][1];
        } else {
            rope_cos_sin(i, pos, r.inv_freq, r.attn_scale, &co, &si);
        }
        store_t lo, hi;
        rope_apply(to_f32(h[i]), to_f32(h[i + half]), co, si, &lo, &hi);
        h[i] = lo;
        h[i + half] = hi;
    }
    __syncwarp();
}

template <int D, bool ROPE>
__device__ __forceinline__ void flash_decode_direct_body(
    const store_t* __restrict__ q, const store_t* __restrict__ k_cache,
    const store_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos, int n_q_heads,
    int n_kv_heads, long long q_stride, int block_size, float scale, store_t* __restrict__ out,
    float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate, long long gate_stride, int splits,
    const FddRope& rope) {
    static_assert(D == 64 || D == 128 || D == 256, "a lane's two tiles of K/V must fit its registers");
    // At d 256 a pair of warps shares each tile, one half of the head dims a warp (DH each).
    constexpr int DH = D > 128 ? 128 : D, HALVES = D / DH;
    constexpr int WARPS = FDD_WARPS, SLOTS = WARPS / HALVES;
    extern __shared__ uint4 fa_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gr = lane >> 2, tq = lane & 3;
    const int half = warp % HALVES, slot = warp / HALVES;
    const int tk = blockIdx.x;  // token * n_kv_heads + kv head
    const int t = tk / n_kv_heads;
    const int kvh = tk - t * n_kv_heads;
    const int G = n_q_heads / n_kv_heads;
    const int limit = token_pos[t] + 1;
    const int split = fdd_split_keys(limit, splits);
    const int nb = (limit + split - 1) / split;
    const int b = blockIdx.y;
    if (b >= nb) {  // beyond this token's splits (uniform over the block)
        pdl_enter();
        return;
    }
    const int s0 = b * split;
    const int s_end = min(limit, s0 + split);
    const int* table = block_tables + (long long)token_seq[t] * max_blocks;
    const long long row_elems = (long long)n_kv_heads * D;
    const long long head_off = (long long)kvh * D + half * DH;
    int kb = s0 + slot * FD_BN;
    FddTile<DH> cur;
    if (kb < s_end) cur.load(k_cache, v_cache, table, kb, s_end, block_size, row_elems, head_off, gr, tq);
    // The rotating form: everything of the step's q / k preparation that no earlier kernel of
    // the step writes (the slot, the norm weights' chunks, cos and sin of a lane's first pairs).
    constexpr int NC = D / 8;
    __shared__ uint4 fdd_qs[ROPE ? 8 * NC : 1], fdd_ks[ROPE ? NC : 1], fdd_vs[ROPE ? NC : 1];
    long long cache_slot = -1;
    float cs[2][2] = {{1.0f, 0.0f}, {1.0f, 0.0f}};
    uint4 qw = make_uint4(0u, 0u, 0u, 0u), kw = qw;
    if constexpr (ROPE) {
        cache_slot = rope.slot_mapping[t];
#pragma unroll
        for (int n = 0; n < 2; ++n)
            if (lane + 32 * n < rope.rotary_dim / 2)
                rope_cos_sin(lane + 32 * n, (float)(limit - 1), rope.inv_freq, rope.attn_scale, &cs[n][0], &cs[n][1]);
        if (rope.q_norm && lane < NC) {
            qw = load_chunk(rope.q_norm, lane * 8, D, aligned16(rope.q_norm));
            kw = load_chunk(rope.k_norm, lane * 8, D, aligned16(rope.k_norm));
        }
    }
    pdl_enter();
    // The newest key (position limit - 1): its cache row is written by the kernel just waited
    // for, or in the rotating form by this kernel (the last split's blocks) and taken from
    // shared memory.
    const int newest = (ROPE && cache_slot >= 0 && s_end == limit) ? limit - 1 : -1;
    if constexpr (ROPE) {
        // Tasks of the block's warps in turn: the group's q heads (rotated into fdd_qs), then in
        // the last split the newest key's k head (rotated) and v head, each to shared memory and
        // the cache slot.
        const int tasks = G + (newest >= 0 ? 2 : 0);
        for (int task = warp; task < tasks; task += WARPS) {
            if (task < G) {
                const store_t* x = q + (long long)t * q_stride + (long long)(kvh * G + task) * D;
                fdd_rope_head<D>(x, rope.q_norm, qw, fdd_qs + task * NC, rope, (float)(limit - 1), cs, lane);
            } else {
                const long long row = (long long)t * rope.kv_stride + (long long)kvh * D;
                const long long at = cache_slot * row_elems + (long long)kvh * D;
                if (task == G) {
                    fdd_rope_head<D>(rope.k_src + row, rope.k_norm, kw, fdd_ks, rope, (float)(limit - 1), cs, lane);
                    if (lane < NC) reinterpret_cast<uint4*>(rope.k_cache + at)[lane] = fdd_ks[lane];
                } else if (lane < NC) {
                    const uint4 v = load_chunk(rope.v_src + row, lane * 8, D, aligned16(rope.v_src + row));
                    fdd_vs[lane] = v;
                    reinterpret_cast<uint4*>(rope.v_cache + at)[lane] = v;
                }
            }
        }
        __syncthreads();
        if (kb < s_end && newest >= 0 && kb + FD_BN > newest)
            cur.patch(kb, s_end, newest, fdd_ks + half * DH / 8, fdd_vs + half * DH / 8, gr, tq);
    } else if (kb < s_end && s_end == limit && kb + FD_BN > limit - 1) {
        cur.load(k_cache, v_cache, table, kb, s_end, block_size, row_elems, head_off, gr, tq);
    }

    // Q^T as B fragments in the K tile's dim order: k-step k's rows 2tq, 2tq + 1 (b0) and
    // 2tq + 8, 2tq + 9 (b1) are dims 32(k / 2) + 8tq + 4(k % 2) + 0, 1 and + 2, 3; column gr is
    // head gr, heads past the group zero columns.
    const float scale_log2 = scale * 1.4426950408889634f;
    unsigned qb[DH / 16][2];
    {
        const bool live = gr < G;
        const store_t* qr = ROPE ? reinterpret_cast<const store_t*>(fdd_qs) + (live ? gr : 0) * D + half * DH + 8 * tq
                                 : q + (long long)t * q_stride + (long long)(kvh * G + (live ? gr : 0)) * D + half * DH + 8 * tq;
#pragma unroll
        for (int k = 0; k < DH / 16; ++k) {
            qb[k][0] = live ? ld32(qr + 32 * (k >> 1) + 4 * (k & 1)) : 0u;
            qb[k][1] = live ? ld32(qr + 32 * (k >> 1) + 4 * (k & 1) + 2) : 0u;
        }
    }
    // O^T accumulators: acc[n] rows gr / gr + 8 of m-tile n are dims 64(n / 4) + 8gr + 2(n % 4)
    // + 0 / 1; columns heads 2tq (0, 2) and 2tq + 1 (1, 3).
    float acc[DH / 16][4];
#pragma unroll
    for (int n = 0; n < DH / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int it = 0; kb < s_end; kb += SLOTS * FD_BN, ++it) {
        const int kn = kb + SLOTS * FD_BN;
        FddTile<DH> nxt;
        if (kn < s_end) nxt.load(k_cache, v_cache, table, kn, s_end, block_size, row_elems, head_off, gr, tq);
        if (ROPE && kn < s_end && newest >= 0 && kn + FD_BN > newest)
            nxt.patch(kn, s_end, newest, fdd_ks + half * DH / 8, fdd_vs + half * DH / 8, gr, tq);
        // S^T = K Q^T: rows gr, gr + 8 = keys kb + gr (+8), columns 2tq, 2tq + 1 = heads.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < DH / 16; ++k) {
            const int p = k >> 1, w = 2 * (k & 1);
            const unsigned a[4] = {u4_word(cur.k[0][p], w), u4_word(cur.k[1][p], w), u4_word(cur.k[0][p], w + 1),
                                   u4_word(cur.k[1][p], w + 1)};
            mma16816(sc, a, qb[k][0], qb[k][1]);
        }
        if constexpr (HALVES == 2) {
            // The pair's two halves of each dot product summed (a + b == b + a: both warps hold
            // the same scores and so the same softmax), through a buffer a tile parity so that
            // one barrier a tile orders a write after the partner's read of two tiles before.
            __shared__ float4 fdd_x[2][FDD_WARPS][32];
            fdd_x[it & 1][warp][lane] = make_float4(sc[0], sc[1], sc[2], sc[3]);
            if (slot == 0)  // immediate barrier ids (a register id reserves all 16)
                asm volatile("bar.sync 1, 64;" ::: "memory");
            else
                asm volatile("bar.sync 2, 64;" ::: "memory");
            const float4 o = fdd_x[it & 1][warp ^ 1][lane];
            sc[0] += o.x;
            sc[1] += o.y;
            sc[2] += o.z;
            sc[3] += o.w;
        }
        // The probabilities rounded to the storage type before they are summed into l, so the
        // weights P V multiplies are the ones it is normalised by.
        fd_tile_softmax<DH / 16, true>(sc, m, l, acc, kb, gr, s_end, scale_log2);
        // P^T (keys x heads) in the storage type, transposed into O^T's B fragments.
        const unsigned pb0 = movmatrix_trans(pack2(sc[0], sc[1]));
        const unsigned pb1 = movmatrix_trans(pack2(sc[2], sc[3]));
        // V^T's A fragment of m-tile n: row gr (gr + 8) is the low (high) half of word n % 4 of
        // each key's slice c = n / 4; columns keys 2tq, 2tq + 1 (a0, a1) and 2tq + 8, 2tq + 9.
#pragma unroll
        for (int n = 0; n < DH / 16; ++n) {
            const int c = n >> 2, w = n & 3;
            const unsigned v0 = u4_word(cur.v[0][c], w), v1 = u4_word(cur.v[1][c], w);
            const unsigned v2 = u4_word(cur.v[2][c], w), v3 = u4_word(cur.v[3][c], w);
            const unsigned a[4] = {__byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632),
                                   __byte_perm(v2, v3, 0x5410), __byte_perm(v2, v3, 0x7632)};
            mma16816(acc[n], a, pb0, pb1);
        }
        cur = nxt;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the warp's sums over its keys (rows gr of every lane)
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }
    // The accumulators to shared memory by head dim (the permutation undone), then the merge
    // of the slots (both warps of a pair hold the same max and sum).
    float* ow = reinterpret_cast<float*>(fa_smem) + (slot * 8 + 2 * tq) * D + half * DH + 8 * gr;  // head 2tq
#pragma unroll
    for (int n = 0; n < DH / 16; ++n) {
        float* o = ow + 64 * (n >> 2) + 2 * (n & 3);
        *reinterpret_cast<float2*>(o) = make_float2(acc[n][0], acc[n][2]);
        *reinterpret_cast<float2*>(o + D) = make_float2(acc[n][1], acc[n][3]);
    }
    // The output gate of the group's heads (head kvh * G's row; null: no gate).
    const store_t* gate0 = gate_at(gate, (long long)t * gate_stride + (long long)kvh * G * D);
    fd_merge<D, SLOTS, WARPS>(reinterpret_cast<float*>(fa_smem), m, l, slot, half == 0, t, kvh, G, n_q_heads, b, nb,
                              out, gate0, part_acc, part_ml, arrivals);
}

#define FDD_BODY(D)                                                                             \
    flash_decode_direct_body<D, false>(q, k_cache, v_cache, block_tables, max_blocks, token_seq, \
                                       token_pos, n_q_heads, n_kv_heads, q_stride, block_size,   \
                                       scale, out, part_acc, part_ml, arrivals, gate, gate_stride, \
                                       splits, FddRope{});
#define FDD_ROPE_BODY(D)                                                                        \
    flash_decode_direct_body<D, true>(                                                          \
        q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_pos, n_q_heads,         \
        n_kv_heads, q_stride, block_size, scale, out, part_acc, part_ml, arrivals, gate,        \
        gate_stride, splits,                                                                    \
        FddRope{k_src, v_src, kv_stride, k_cache, v_cache, slot_mapping, inv_freq, rotary_dim,  \
                attn_scale, q_norm, k_norm, eps, plus_one});
#else
#define FDD_BODY(D)
#define FDD_ROPE_BODY(D)
#endif

// The tensor-core decode attention with K/V straight into fragments (flash_decode_direct_body):
// the arguments of the scaled form's kernels, the last the most splits a token takes (theirs: the
// fewest keys a warp); dynamic shared memory ops/decode_attention.rs `tc_direct_smem_bytes` (the
// warps' merge). Two blocks an SM at most 255 registers a thread.
#define FDD_INSTANCE(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(FDD_WARPS * 32, 2) flash_decode_direct_d##D(  \
        const store_t* q, const store_t* k_cache, const store_t* v_cache,                       \
        const int* block_tables, int max_blocks, const int* token_seq, const int* token_pos,    \
        int n_q_heads, int n_kv_heads, long long q_stride, int block_size, float scale,         \
        store_t* out, float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate,  \
        long long gate_stride, int splits) {                                                    \
        FDD_BODY(D)                                                                             \
    }

// The direct form with the step's q / k head norms, RoPE and KV cache write in it (FddRope):
// one kernel where rope_kv_write[_normed] and attention ran at every decode step whose qkv
// projection does not rotate, bit for bit those two kernels. q is the unrotated q part of the
// projection rows (q_stride apart); the caches are written, so they are not const. The arguments
// after `splits` are FddRope's (ops/decode_attention_rope.rs).
#define FDD_ROPE_INSTANCE(D)                                                                    \
    extern "C" __global__ void __launch_bounds__(FDD_WARPS * 32, 2) flash_decode_direct_rope_d##D( \
        const store_t* q, store_t* k_cache, store_t* v_cache, const int* block_tables,          \
        int max_blocks, const int* token_seq, const int* token_pos, int n_q_heads,              \
        int n_kv_heads, long long q_stride, int block_size, float scale, store_t* out,          \
        float* part_acc, float* part_ml, unsigned* arrivals, const store_t* gate,               \
        long long gate_stride, int splits, const store_t* k_src, const store_t* v_src,          \
        long long kv_stride, const long long* slot_mapping, const float* inv_freq,              \
        int rotary_dim, float attn_scale, const store_t* q_norm, const store_t* k_norm,         \
        float eps, int plus_one) {                                                              \
        FDD_ROPE_BODY(D)                                                                        \
    }

FDD_INSTANCE(64)
FDD_INSTANCE(128)
FDD_INSTANCE(256)
FDD_ROPE_INSTANCE(64)
FDD_ROPE_INSTANCE(128)
FDD_ROPE_INSTANCE(256)
