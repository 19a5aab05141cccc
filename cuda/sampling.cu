// Device-side greedy sampling: per row of f32 logits, the index of the largest value (the
// lowest index on ties, as torch.argmax) and log(sum(exp(logits))) so that the chosen token's
// logprob is logits[argmax] - logsumexp without copying the logits to the host.
#include "common.cuh"

extern "C" __global__ void argmax_logsumexp(const float* __restrict__ logits, int vocab,
                                            int* __restrict__ out_ids,
                                            float* __restrict__ out_lse) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    __shared__ float s_sum[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;

    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < n_warps ? s_val[lane] : NEG_INF;
        best_i = lane < n_warps ? s_idx[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) {
                best = ov;
                best_i = oi;
            }
        }
        if (lane == 0) {
            s_val[0] = best;
            s_idx[0] = best_i;
        }
    }
    __syncthreads();
    const float mx = s_val[0];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(row[i] - mx);
    sum = block_sum(sum, s_sum);
    if (threadIdx.x == 0) {
        out_ids[blockIdx.x] = s_idx[0] == 0x7fffffff ? 0 : s_idx[0];
        out_lse[blockIdx.x] = mx + logf(sum);
    }
}

// ---------------------------------------------------------------------------------------------
// Full device sampler: one block of SAMPLE_THREADS threads per row. It implements exactly the
// semantics of the host reference (rust_core/src/sampling/row.rs and sampler.rs):
//   grammar mask -> logit bias -> repetition / presence / frequency penalties (one rounded f32
//   op each, as penalties.rs) -> greedy argmax (lowest id on ties), or temperature + top-k +
//   top-p + min-p over the logits sorted descending (lower id first on ties) and an inverse-CDF
//   draw with the row's uniform u; id order when no filter is set, as the host does.
// Nothing is sorted: every filter keeps a prefix of the sorted order, so each step is a radix
// select over the float keys (4 passes of 8 bits) that finds the element where a count or the
// cumulative probability mass crosses a target, then the tied elements are ranked by id.
// Probability mass is fixed point (w * 2^44 in 64-bit integers, w = exp((l - max) / T) <= 1), so
// every sum is exact and order-independent: the same row and u always give the same token.
// Against the host (f64 weights, sequential sums) only a u within ~1e-6 of a CDF boundary can
// pick the neighbouring token.
// Logprobs are log-softmax of the RAW row: the sampled token's and the top-n (n <= 20) ones.

#define SAMPLE_THREADS 1024
#define SAMPLE_HDR 20
#define SAMPLE_MAX_TOP 20
#define SAMPLE_OUT 42
#define SAMPLE_NONE 0xffffffffu
#define FULL_MASK 0xffffffffu
#define FIX_SCALE 17592186044416.0f

typedef unsigned long long u64;

// Header words of one row in the params buffer (see rust_core/src/backend/cuda/ops/sampling_pack.rs).
enum {
    P_SRC_ROW = 0, P_FLAGS, P_TOP_K, P_N_TOP, P_TEMP, P_TOP_P, P_MIN_P, P_REP, P_PRES, P_FREQ,
    P_U_LO, P_U_HI, P_BIAS_OFF, P_BIAS_N, P_PEN_OFF, P_PEN_N, P_MASK_OFF
};
#define FLAG_GREEDY 1u
#define FLAG_LOGPROBS 2u
// The row's input token of this step (fed[row], the token the step before sampled for it) is an
// output not yet in its penalty pairs (RowSampling::count_input: a step queued ahead).
#define FLAG_COUNT_INPUT 4u

// Radix select modes: stop where the count reaches the target, or the mass reaches / exceeds it.
#define SEL_COUNT_GE 0
#define SEL_MASS_GE 1
#define SEL_MASS_GT 2

struct SampleShared {
    unsigned hc[256];
    u64 hm[256];
    u64 red_m[32];
    float red_f[32];
    int red_i[32];
    unsigned prefix, above_count, tie_count;
    u64 above_mass;
    int res_idx;
    unsigned top_n;
    int top_idx[SAMPLE_MAX_TOP];
};

// Order-preserving key: a larger float has a larger key (-0 below +0, like f32::total_cmp).
__device__ __forceinline__ unsigned f2key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key2f(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Fixed-point probability weight of logit l given the row max m and 1 / temperature.
__device__ __forceinline__ float weight_f(float l, float m, double inv_t) {
    const float x = (float)(((double)l - (double)m) * inv_t);
    return x == x ? expf(x) : 0.0f;
}
__device__ __forceinline__ u64 weight_fixed(float l, float m, double inv_t) {
    return (u64)(weight_f(l, m, inv_t) * FIX_SCALE);
}

__device__ __forceinline__ u64 shfl_xor_u64(u64 v, int o) {
    const unsigned lo = __shfl_xor_sync(FULL_MASK, (unsigned)v, o);
    const unsigned hi = __shfl_xor_sync(FULL_MASK, (unsigned)(v >> 32), o);
    return ((u64)hi << 32) | lo;
}
__device__ __forceinline__ u64 shfl_up_u64(u64 v, int o) {
    const unsigned lo = __shfl_up_sync(FULL_MASK, (unsigned)v, o);
    const unsigned hi = __shfl_up_sync(FULL_MASK, (unsigned)(v >> 32), o);
    return ((u64)hi << 32) | lo;
}
__device__ __forceinline__ u64 shfl_idx_u64(u64 v, int src) {
    const unsigned lo = __shfl_sync(FULL_MASK, (unsigned)v, src);
    const unsigned hi = __shfl_sync(FULL_MASK, (unsigned)(v >> 32), src);
    return ((u64)hi << 32) | lo;
}

// Sum of v over the lanes in `peers` (every lane of the warp calls it).
__device__ __forceinline__ u64 group_sum_u64(u64 v, unsigned peers) {
    if (__all_sync(FULL_MASK, peers == FULL_MASK)) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += shfl_xor_u64(v, o);
        return v;
    }
    u64 s = 0;
#pragma unroll
    for (int src = 0; src < 32; ++src) {
        const u64 t = shfl_idx_u64(v, src);
        if ((peers >> src) & 1u) s += t;
    }
    return s;
}

__device__ u64 block_sum_u64(u64 v, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += shfl_xor_u64(v, o);
    __syncthreads();
    if (lane == 0) sh.red_m[warp] = v;
    __syncthreads();
    u64 t = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += sh.red_m[w];
    return t;
}

// Exclusive prefix sum of v in thread order; every thread also gets the total.
__device__ u64 block_exclusive_scan_u64(u64 v, SampleShared& sh, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = shfl_up_u64(incl, o);
        if (lane >= o) incl += t;
    }
    __syncthreads();
    if (lane == 31) sh.red_m[warp] = incl;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        const u64 s = sh.red_m[w];
        if (w < warp) before += s;
        all += s;
    }
    *total = all;
    return before + incl - v;
}

// Largest value of the row and its lowest index; every thread gets both.
__device__ void block_argmax(const float* row, int vocab, SampleShared& sh, float* out_v, int* out_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, o);
        const int oi = __shfl_xor_sync(FULL_MASK, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sh.red_f[warp] = best;
        sh.red_i[warp] = best_i;
    }
    __syncthreads();
    best = NEG_INF;
    best_i = 0x7fffffff;
    for (int w = 0; w < n_warps; ++w) {
        const float v = sh.red_f[w];
        const int i = sh.red_i[w];
        if (v > best || (v == best && i < best_i)) {
            best = v;
            best_i = i;
        }
    }
    *out_v = best;
    *out_i = best_i == 0x7fffffff ? 0 : best_i;
}

__device__ __forceinline__ bool sel_reached(int mode, unsigned c, u64 m, u64 target) {
    return mode == SEL_COUNT_GE ? c >= target : (mode == SEL_MASS_GE ? m >= target : m > target);
}

// Where a radix select stopped: the element's key, what lies strictly above it in the sorted
// order (count and mass), and which of the `ties` elements with that key (by id) it is.
struct Sel {
    unsigned key;
    unsigned above_count;
    u64 above_mass;
    unsigned ties;
    unsigned rank;
    u64 tie_w;
};

// The first element, in descending order of the row, at which the running count (mode
// SEL_COUNT_GE) or running fixed-point mass (SEL_MASS_GE / SEL_MASS_GT) reaches `target`. The
// caller keeps the target reachable; if it is not, the last element is returned.
__device__ Sel radix_select(const float* row, int vocab, int mode, bool with_mass, u64 target, float m,
                            double inv_t, SampleShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    with_mass = with_mass || mode != SEL_COUNT_GE;
    unsigned prefix = 0, pmask = 0, above_c = 0;
    u64 above_m = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int b = tid; b < 256; b += blockDim.x) {
            sh.hc[b] = 0;
            sh.hm[b] = 0;
        }
        __syncthreads();
        for (int base = 0; base < vocab; base += blockDim.x) {
            const int i = base + tid;
            unsigned digit = 256u;
            u64 w = 0;
            if (i < vocab) {
                const float l = row[i];
                const unsigned k = f2key(l);
                if ((k & pmask) == prefix) {
                    digit = (k >> shift) & 255u;
                    if (with_mass) w = weight_fixed(l, m, inv_t);
                }
            }
            // One atomic per distinct digit of the warp: logits crowd into a few exponents.
            const unsigned peers = __match_any_sync(FULL_MASK, digit);
            if (with_mass) w = group_sum_u64(w, peers);
            if (lane == __ffs(peers) - 1 && digit < 256u) {
                atomicAdd(&sh.hc[digit], (unsigned)__popc(peers));
                if (with_mass) atomicAdd(&sh.hm[digit], w);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l owns digits 255 - 8l down to 248 - 8l (descending order).
            unsigned c = 0;
            u64 ms = 0;
            for (int j = 0; j < 8; ++j) {
                c += sh.hc[255 - 8 * lane - j];
                ms += sh.hm[255 - 8 * lane - j];
            }
            unsigned ci = c;
            u64 mi = ms;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned t = __shfl_up_sync(FULL_MASK, ci, o);
                const u64 tm = shfl_up_u64(mi, o);
                if (lane >= o) {
                    ci += t;
                    mi += tm;
                }
            }
            const unsigned crossed = __ballot_sync(FULL_MASK, sel_reached(mode, above_c + ci, above_m + mi, target));
            const unsigned nonempty = __ballot_sync(FULL_MASK, c > 0);
            const int owner = crossed ? __ffs(crossed) - 1 : 31 - __clz(nonempty);
            if (lane == owner) {
                unsigned cc = above_c + ci - c;
                u64 mm = above_m + mi - ms;
                int pick = -1, last = -1;
                for (int j = 0; j < 8; ++j) {
                    const int d = 255 - 8 * lane - j;
                    const unsigned hc = sh.hc[d];
                    if (hc == 0) continue;
                    if (sel_reached(mode, cc + hc, mm + sh.hm[d], target)) {
                        pick = d;
                        break;
                    }
                    last = d;
                    cc += hc;
                    mm += sh.hm[d];
                }
                if (pick < 0) {
                    pick = last;
                    cc -= sh.hc[last];
                    mm -= sh.hm[last];
                }
                sh.prefix = prefix | ((unsigned)pick << shift);
                sh.above_count = cc;
                sh.above_mass = mm;
                sh.tie_count = sh.hc[pick];
            }
        }
        __syncthreads();
        prefix = sh.prefix;
        above_c = sh.above_count;
        above_m = sh.above_mass;
        pmask |= 255u << shift;
    }
    Sel s;
    s.key = prefix;
    s.above_count = above_c;
    s.above_mass = above_m;
    s.ties = sh.tie_count;
    s.tie_w = with_mass ? weight_fixed(key2f(prefix), m, inv_t) : 0;
    u64 rank = 0;
    if (mode == SEL_COUNT_GE) {
        rank = target > above_c ? target - above_c - 1 : 0;
    } else if (s.tie_w > 0 && target >= above_m) {
        const u64 rem = target - above_m;
        rank = mode == SEL_MASS_GE ? (rem == 0 ? 0 : (rem + s.tie_w - 1) / s.tie_w - 1) : rem / s.tie_w;
    }
    s.rank = (unsigned)(rank < s.ties ? rank : s.ties - 1);
    return s;
}

// Contiguous id range of this thread for passes that need id order.
__device__ __forceinline__ void thread_range(int vocab, int* lo, int* hi) {
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    *lo = min(vocab, (int)threadIdx.x * chunk);
    *hi = min(vocab, *lo + chunk);
}

// The id of the `rank`-th (0-based, by id) element whose key is `key`.
__device__ int nth_with_key(const float* row, int vocab, unsigned key, unsigned rank, SampleShared& sh) {
    int lo, hi;
    thread_range(vocab, &lo, &hi);
    unsigned c = 0;
    for (int i = lo; i < hi; ++i) c += f2key(row[i]) == key;
    __syncthreads();
    if (threadIdx.x == 0) sh.res_idx = 0;
    u64 total;
    const u64 ex = block_exclusive_scan_u64(c, sh, &total);
    if (ex <= rank && rank < ex + c) {
        u64 r = ex;
        for (int i = lo; i < hi; ++i) {
            if (f2key(row[i]) != key) continue;
            if (r == rank) {
                sh.res_idx = i;
                break;
            }
            ++r;
        }
    }
    __syncthreads();
    return sh.res_idx;
}

// The first id whose running fixed-point mass (id order) exceeds `target`.
__device__ int first_id_over(const float* row, int vocab, u64 target, float m, double inv_t, SampleShared& sh) {
    int lo, hi;
    thread_range(vocab, &lo, &hi);
    u64 c = 0;
    for (int i = lo; i < hi; ++i) c += weight_fixed(row[i], m, inv_t);
    __syncthreads();
    if (threadIdx.x == 0) sh.res_idx = vocab - 1;
    u64 total;
    const u64 ex = block_exclusive_scan_u64(c, sh, &total);
    if (ex <= target && target < ex + c) {
        u64 acc = ex;
        for (int i = lo; i < hi; ++i) {
            acc += weight_fixed(row[i], m, inv_t);
            if (acc > target) {
                sh.res_idx = i;
                break;
            }
        }
    }
    __syncthreads();
    return sh.res_idx;
}

// Token of a non-greedy row (processed logits in `row`).
__device__ int sample_processed(const float* row, int vocab, const unsigned* p, SampleShared& sh) {
    float m;
    int am;
    block_argmax(row, vocab, sh, &m, &am);
    const double inv_t = 1.0 / (double)__uint_as_float(p[P_TEMP]);
    const unsigned top_k = p[P_TOP_K];
    const float top_p = __uint_as_float(p[P_TOP_P]);
    const float min_p = __uint_as_float(p[P_MIN_P]);
    const double u = __hiloint2double((int)p[P_U_HI], (int)p[P_U_LO]);
    if (top_k == 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        u64 part = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) part += weight_fixed(row[i], m, inv_t);
        const u64 total = block_sum_u64(part, sh);
        if (total == 0) return am;
        u64 t = (u64)(u * (double)total);
        if (t >= total) t = total - 1;
        return first_id_over(row, vocab, t, m, inv_t, sh);
    }
    unsigned keep;
    u64 mass;
    if (top_k > 0) {
        const Sel s = radix_select(row, vocab, SEL_COUNT_GE, true, top_k, m, inv_t, sh);
        keep = top_k;
        mass = s.above_mass + (u64)(s.rank + 1) * s.tie_w;
    } else {
        u64 part = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) part += weight_fixed(row[i], m, inv_t);
        keep = vocab;
        mass = block_sum_u64(part, sh);
    }
    if (mass == 0) return am;
    if (top_p < 1.0f) {
        double want = ceil((double)top_p * (double)mass);
        u64 t = want < 1.0 ? 1 : (u64)want;
        if (t > mass) t = mass;
        const Sel s = radix_select(row, vocab, SEL_MASS_GE, true, t, m, inv_t, sh);
        const unsigned len = s.above_count + s.rank + 1;
        if (len < keep) {
            keep = len;
            mass = s.above_mass + (u64)(s.rank + 1) * s.tie_w;
        }
    }
    if (min_p > 0.0f) {
        u64 part = 0;
        unsigned cnt = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i];
            if (weight_f(l, m, inv_t) >= min_p) {
                ++cnt;
                part += weight_fixed(l, m, inv_t);
            }
        }
        const u64 mp = block_sum_u64(part, sh);
        const unsigned len = (unsigned)block_sum_u64(cnt, sh);
        if (len > 0 && len < keep) {
            keep = len;
            mass = mp;
        }
    }
    u64 t = (u64)(u * (double)mass);
    if (t >= mass) t = mass - 1;
    const Sel s = radix_select(row, vocab, SEL_MASS_GT, true, t, m, inv_t, sh);
    return nth_with_key(row, vocab, s.key, s.rank, sh);
}

// Raw logprob of `token` and the top-n raw logprobs (value descending, lower id first).
__device__ void raw_logprobs(const float* raw, int vocab, int token, int n, unsigned* out, SampleShared& sh) {
    float mx;
    int am;
    block_argmax(raw, vocab, sh, &mx, &am);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(raw[i] - mx);
    __syncthreads();
    sum = block_sum(sum, sh.red_f);
    const float lse = mx + logf(sum);
    if (threadIdx.x == 0) out[1] = __float_as_uint(raw[token] - lse);
    n = min(min(n, vocab), SAMPLE_MAX_TOP);
    if (n <= 0) return;
    const Sel s = radix_select(raw, vocab, SEL_COUNT_GE, false, (u64)n, 0.0f, 1.0, sh);
    __syncthreads();
    if (threadIdx.x == 0) sh.top_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (f2key(raw[i]) > s.key) sh.top_idx[atomicAdd(&sh.top_n, 1u)] = i;
    }
    const unsigned need = (unsigned)n - s.above_count;
    int lo, hi;
    thread_range(vocab, &lo, &hi);
    unsigned c = 0;
    for (int i = lo; i < hi; ++i) c += f2key(raw[i]) == s.key;
    u64 total;
    const u64 ex = block_exclusive_scan_u64(c, sh, &total);
    if (ex < need) {
        u64 r = ex;
        for (int i = lo; i < hi && r < need; ++i) {
            if (f2key(raw[i]) == s.key) sh.top_idx[s.above_count + r++] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int* t = sh.top_idx;
        for (int a = 1; a < n; ++a) {
            const int x = t[a];
            int b = a - 1;
            while (b >= 0 && (raw[t[b]] < raw[x] || (raw[t[b]] == raw[x] && t[b] > x))) {
                t[b + 1] = t[b];
                --b;
            }
            t[b + 1] = x;
        }
        for (int a = 0; a < n; ++a) {
            out[2 + a] = (unsigned)t[a];
            out[2 + SAMPLE_MAX_TOP + a] = __float_as_uint(raw[t[a]] - lse);
        }
    }
}

// One token's logit under the repetition penalty, then presence / frequency for a token the
// output holds n times (penalties.rs `apply_penalties`: one rounded f32 op each).
__device__ __forceinline__ float penalized_logit(float l, unsigned n, float rep, float pres, float freq) {
    if (rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
    if ((pres != 0.0f || freq != 0.0f) && n > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn((float)n, freq), pres));
    return l;
}

// The penalties of one row over its logits [lo, lo + len), held in chunk[0..len) (chunk[i] is
// id lo + i), as penalties.rs `apply_penalties` (after the bias): for each penalty pair
// (token, output count) in range, the repetition penalty, then presence / frequency when the
// count is > 0, one rounded f32 op each. `input` (SAMPLE_NONE when the row has no
// FLAG_COUNT_INPUT) is one more output occurrence, as `PenaltyHistory::with_pending_output`:
// its pair counts n + 1, or, with no pair, it is penalized as (input, 1) after the pairs (each
// token's penalty is independent of the others, so the order does not matter). Every thread
// of the block calls it; `input_paired` is a shared word; it ends with a barrier.
__device__ void apply_penalty_pairs(float* chunk, int lo, int len, const unsigned* params, const unsigned* p,
                                    unsigned input, unsigned* input_paired) {
    const float rep = __uint_as_float(p[P_REP]);
    const float pres = __uint_as_float(p[P_PRES]);
    const float freq = __uint_as_float(p[P_FREQ]);
    const unsigned* pen = params + p[P_PEN_OFF];
    const unsigned input_at = input - (unsigned)lo;  // wraps past len when outside the chunk
    const bool input_here = input != SAMPLE_NONE && input_at < (unsigned)len;
    if (threadIdx.x == 0) *input_paired = 0;
    __syncthreads();
    for (unsigned e = threadIdx.x; e < p[P_PEN_N]; e += blockDim.x) {
        const unsigned tok = pen[2 * e], at = tok - (unsigned)lo;
        if (at >= (unsigned)len) continue;
        unsigned n = pen[2 * e + 1];
        if (tok == input) {
            ++n;
            *input_paired = 1;
        }
        chunk[at] = penalized_logit(chunk[at], n, rep, pres, freq);
    }
    __syncthreads();
    if (input_here) {  // uniform over the block
        if (threadIdx.x == 0 && !*input_paired) chunk[input_at] = penalized_logit(chunk[input_at], 1, rep, pres, freq);
        __syncthreads();
    }
}

// The token a row counts as one more output (FLAG_COUNT_INPUT), or SAMPLE_NONE.
__device__ __forceinline__ unsigned counted_input(const unsigned* p, const int* fed, int row) {
    return (p[P_FLAGS] & FLAG_COUNT_INPUT) ? (unsigned)fed[row] : SAMPLE_NONE;
}

// The sampler kernels' arguments. params: per row SAMPLE_HDR header words (P_*), then the rows' bias pairs (token, f32 bits),
// penalty pairs (token, output count) and allow-mask words at the offsets the headers give.
// logits: f32 [*, vocab], row p[P_SRC_ROW] is sampled; work: f32 [rows, vocab] scratch for the
// processed logits. fed: i32, fed[r] is row r's input token where its header has
// FLAG_COUNT_INPUT (the ids of a fed decode step, whose row r is sequence r; unread otherwise,
// may be null). out: per row SAMPLE_OUT words: token, raw logprob (f32 bits), top ids[20], top
// logprobs[20].

// ---------------------------------------------------------------------------------------------
// The sampler over many blocks per row: sample_scan (grid: SCAN_SPAN-logit chunks x rows) does
// every pass that streams the row, and sample_pick (one block per row, launched only when some
// row samples) draws the non-greedy tokens from the processed logits sample_scan left in `work`.
//
// A sample_scan block loads its chunk once into registers, applies the row's grammar mask, the
// bias and penalty entries that fall in the chunk (apply_penalty_pairs),
// and reduces the chunk to one partial record: the processed argmax (greedy rows), the raw max
// and sum of exp(raw - max) (logprob rows), and the chunk's top-n raw logits in (value
// descending by total order, id ascending) order. It writes the record, `__threadfence()`s and
// counts itself in with atomicInc on the row's arrival counter; the block that arrives last
// merges the row's records in chunk order, so the result does not depend on which block is last
// (graph == eager). atomicInc(counter, nb - 1) stores 0 when it elects the last block, so every
// counter is 0 again after each launch (the next step / replay starts there).
// Results: the greedy token is the largest value by float compare, lowest id on ties (an
// associative merge); logsumexp = M + log(sum_b s_b exp(m_b - M)); the top ids are the host's
// (total order, lower id first).
#define SCAN_THREADS 256
#define SCAN_PER_THREAD 8
#define SCAN_SPAN (SCAN_THREADS * SCAN_PER_THREAD)
// Partial record of one (row, chunk), in u32 words.
#define SCAN_REC 48
enum { R_BEST = 0, R_BEST_I, R_MAX, R_SUM, R_TOP_I = 4, R_TOP_K = 4 + SAMPLE_MAX_TOP };
// Candidates the merging block stages in shared memory (key + id each, in the chunk buffer):
// 1024, i.e. 20 top logprobs of up to 51 chunks; the rest are read from L2 in each round.
#define SCAN_CAND (SCAN_SPAN / 2)
#define NO_ID 0x7fffffff

// (ka, ia) comes before (kb, ib) in the host's top order: larger key, then lower id.
__device__ __forceinline__ bool key_before(unsigned ka, int ia, unsigned kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}
// Larger value by float compare, lower id on ties (torch.argmax; NaN never wins).
__device__ __forceinline__ bool val_before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// Block-wide best (val_before order) of each thread's (v, i); every thread gets it.
__device__ void scan_best_val(float v, int i, float* red_f, int* red_i, float* out_v, int* out_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (val_before(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        red_f[warp] = v;
        red_i[warp] = i;
    }
    __syncthreads();
    v = NEG_INF;
    i = NO_ID;
    for (int w = 0; w < n_warps; ++w) {
        if (val_before(red_f[w], red_i[w], v, i)) {
            v = red_f[w];
            i = red_i[w];
        }
    }
    *out_v = v;
    *out_i = i;
}

// Block-wide first (key_before order) of each thread's (k, i); i == NO_ID is "none".
__device__ void scan_best_key(unsigned k, int i, unsigned* red_k, int* red_i, unsigned* out_k, int* out_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned ok = __shfl_xor_sync(FULL_MASK, k, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (oi != NO_ID && (i == NO_ID || key_before(ok, oi, k, i))) {
            k = ok;
            i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        red_k[warp] = k;
        red_i[warp] = i;
    }
    __syncthreads();
    k = 0;
    i = NO_ID;
    for (int w = 0; w < n_warps; ++w) {
        if (red_i[w] != NO_ID && (i == NO_ID || key_before(red_k[w], red_i[w], k, i))) {
            k = red_k[w];
            i = red_i[w];
        }
    }
    *out_k = k;
    *out_i = i;
}

// Block-wide max (NaN ignored, as fmaxf); every thread gets it.
__device__ float scan_block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < n_warps ? red[lane] : NEG_INF);
}

// params, logits, work, fed, out: as the sampler kernels' arguments above (work is written for non-greedy rows only;
// for a non-greedy row with logprobs, out[1] holds the row's logsumexp for sample_pick).
// partials: u32 [rows, gridDim.x, SCAN_REC]; arrivals: u32 [rows], zero before the launch and
// zero after it.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
sample_scan(const float* __restrict__ logits, float* __restrict__ work, int vocab,
            const unsigned* __restrict__ params, const int* __restrict__ fed, unsigned* __restrict__ partials,
            unsigned* __restrict__ arrivals, unsigned* __restrict__ out) {
    // The chunk's processed logits; the last block reuses it for the merge candidates.
    __shared__ unsigned s_buf[SCAN_SPAN];
    __shared__ unsigned input_paired;
    __shared__ float red_f[32];
    __shared__ int red_i[32];
    __shared__ unsigned red_k[32];
    float* s_row = reinterpret_cast<float*>(s_buf);
    const int tid = threadIdx.x, nb = gridDim.x, b = blockIdx.x, r = blockIdx.y;
    const unsigned* p = params + (long long)r * SAMPLE_HDR;
    const float* raw = logits + (long long)p[P_SRC_ROW] * vocab;
    const int lo = b * SCAN_SPAN;
    const int len = min(SCAN_SPAN, vocab - lo);
    const unsigned flags = p[P_FLAGS];
    const bool greedy = flags & FLAG_GREEDY;
    const bool lp = flags & FLAG_LOGPROBS;
    const int n_top = lp ? min(min((int)p[P_N_TOP], vocab), SAMPLE_MAX_TOP) : 0;
    const unsigned mask_off = p[P_MASK_OFF];

    float rv[SCAN_PER_THREAD];
#pragma unroll
    for (int k = 0; k < SCAN_PER_THREAD; ++k) {
        const int i = tid + k * SCAN_THREADS;
        rv[k] = i < len ? raw[lo + i] : NEG_INF;
    }
#pragma unroll
    for (int k = 0; k < SCAN_PER_THREAD; ++k) {
        const int i = tid + k * SCAN_THREADS, g = lo + i;
        if (i >= len) continue;
        float v = rv[k];
        if (mask_off != SAMPLE_NONE && !((params[mask_off + (g >> 5)] >> (g & 31)) & 1u)) v = NEG_INF;
        s_row[i] = v;
    }
    __syncthreads();
    const unsigned* bias = params + p[P_BIAS_OFF];
    for (unsigned e = tid; e < p[P_BIAS_N]; e += SCAN_THREADS) {
        const unsigned at = bias[2 * e] - (unsigned)lo;
        if (at < (unsigned)len) s_row[at] = __fadd_rn(s_row[at], __uint_as_float(bias[2 * e + 1]));
    }
    apply_penalty_pairs(s_row, lo, len, params, p, counted_input(p, fed, r), &input_paired);

    unsigned* rec = partials + ((long long)r * nb + b) * SCAN_REC;
    if (greedy) {
        float best = NEG_INF;
        int best_i = NO_ID;
        for (int i = tid; i < len; i += SCAN_THREADS) {
            const float v = s_row[i];
            if (v > best) {
                best = v;
                best_i = lo + i;
            }
        }
        scan_best_val(best, best_i, red_f, red_i, &best, &best_i);
        if (tid == 0) {
            rec[R_BEST] = __float_as_uint(best);
            rec[R_BEST_I] = (unsigned)best_i;
        }
    } else {
        float* row = work + (long long)r * vocab + lo;
        for (int i = tid; i < len; i += SCAN_THREADS) row[i] = s_row[i];
    }
    if (lp) {
        float mx = NEG_INF;
#pragma unroll
        for (int k = 0; k < SCAN_PER_THREAD; ++k) mx = fmaxf(mx, rv[k]);
        mx = scan_block_max(mx, red_f);
        float sum = 0.0f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int k = 0; k < SCAN_PER_THREAD; ++k)
                if (tid + k * SCAN_THREADS < len) sum += expf(rv[k] - mx);
        }
        sum = block_sum(sum, red_f);
        if (tid == 0) {
            rec[R_MAX] = __float_as_uint(mx);
            rec[R_SUM] = __float_as_uint(sum);
        }
        // The chunk's top n_top, one block-wide pick per rank, each after the previous one.
        unsigned pk = 0;
        int pi = NO_ID;
        for (int j = 0; j < n_top; ++j) {
            unsigned bk = 0;
            int bi = NO_ID;
#pragma unroll
            for (int k = 0; k < SCAN_PER_THREAD; ++k) {
                const int i = tid + k * SCAN_THREADS, g = lo + i;
                const unsigned key = f2key(rv[k]);
                if (i < len && (j == 0 || key_before(pk, pi, key, g)) && (bi == NO_ID || key_before(key, g, bk, bi))) {
                    bk = key;
                    bi = g;
                }
            }
            scan_best_key(bk, bi, red_k, red_i, &pk, &pi);
            if (tid == 0) {
                rec[R_TOP_I + j] = (unsigned)pi;
                rec[R_TOP_K + j] = pk;
            }
        }
    }

    // Publish the record, then count the block in (common.cuh's arrives_last).
    if (!arrives_last(arrivals + r, (unsigned)nb)) return;
    // Last block: merge the row's nb records. Volatile loads bypass L1, which is not coherent
    // with the other blocks' writes.
    const volatile unsigned* vp = partials + (long long)r * nb * SCAN_REC;
    unsigned* o = out + (long long)r * SAMPLE_OUT;
    int token = 0;
    if (greedy) {
        float best = NEG_INF;
        int best_i = NO_ID;
        for (int c = tid; c < nb; c += SCAN_THREADS) {
            const float v = __uint_as_float(vp[c * SCAN_REC + R_BEST]);
            const int i = (int)vp[c * SCAN_REC + R_BEST_I];
            if (val_before(v, i, best, best_i)) {
                best = v;
                best_i = i;
            }
        }
        scan_best_val(best, best_i, red_f, red_i, &best, &best_i);
        token = best_i == NO_ID ? 0 : best_i;
    }
    float lse = 0.0f;
    if (lp) {
        float m = NEG_INF;
        for (int c = tid; c < nb; c += SCAN_THREADS) m = fmaxf(m, __uint_as_float(vp[c * SCAN_REC + R_MAX]));
        m = scan_block_max(m, red_f);
        float sum = 0.0f;
        for (int c = tid; c < nb; c += SCAN_THREADS) {
            const float sc = __uint_as_float(vp[c * SCAN_REC + R_SUM]);
            if (sc != 0.0f) sum += sc * expf(__uint_as_float(vp[c * SCAN_REC + R_MAX]) - m);
        }
        sum = block_sum(sum, red_f);
        lse = m + logf(sum);
    }
    if (tid == 0) {
        if (greedy) {
            o[0] = (unsigned)token;
            o[1] = lp ? __float_as_uint(raw[token] - lse) : 0u;
        } else {
            o[1] = lp ? __float_as_uint(lse) : 0u;  // sample_pick subtracts it from the token's logit
        }
    }
    if (n_top == 0) return;
    // Top n_top of the row among the chunks' top lists (nb * n_top candidates), staged in
    // shared memory up to SCAN_CAND of them.
    const int nc = nb * n_top;
    __syncthreads();
    for (int c = tid; c < min(nc, SCAN_CAND); c += SCAN_THREADS) {
        const int cb = c / n_top, j = c - cb * n_top;
        s_buf[2 * c] = vp[cb * SCAN_REC + R_TOP_K + j];
        s_buf[2 * c + 1] = vp[cb * SCAN_REC + R_TOP_I + j];
    }
    __syncthreads();
    unsigned pk = 0;
    int pi = NO_ID;
    for (int j = 0; j < n_top; ++j) {
        unsigned bk = 0;
        int bi = NO_ID;
        for (int c = tid; c < nc; c += SCAN_THREADS) {
            unsigned k;
            int i;
            if (c < SCAN_CAND) {
                k = s_buf[2 * c];
                i = (int)s_buf[2 * c + 1];
            } else {
                const int cb = c / n_top, jj = c - cb * n_top;
                k = vp[cb * SCAN_REC + R_TOP_K + jj];
                i = (int)vp[cb * SCAN_REC + R_TOP_I + jj];
            }
            if (i != NO_ID && (j == 0 || key_before(pk, pi, k, i)) && (bi == NO_ID || key_before(k, i, bk, bi))) {
                bk = k;
                bi = i;
            }
        }
        scan_best_key(bk, bi, red_k, red_i, &pk, &pi);
        if (tid == 0) {
            o[2 + j] = (unsigned)pi;
            o[2 + SAMPLE_MAX_TOP + j] = __float_as_uint(key2f(pk) - lse);
        }
    }
}

// The non-greedy rows after sample_scan: the token drawn from the processed logits in `work`
// (sample_processed), and its raw logprob from the logsumexp that
// sample_scan left in out[1]. Greedy rows are done already and return at once.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_pick(const float* __restrict__ logits, const float* __restrict__ work, int vocab,
            const unsigned* __restrict__ params, unsigned* __restrict__ out) {
    __shared__ SampleShared sh;
    const unsigned* p = params + (long long)blockIdx.x * SAMPLE_HDR;
    if (p[P_FLAGS] & FLAG_GREEDY) return;  // uniform over the block
    const float* raw = logits + (long long)p[P_SRC_ROW] * vocab;
    unsigned* o = out + (long long)blockIdx.x * SAMPLE_OUT;
    const int token = sample_processed(work + (long long)blockIdx.x * vocab, vocab, p, sh);
    if (threadIdx.x == 0) {
        o[0] = (unsigned)token;
        if (p[P_FLAGS] & FLAG_LOGPROBS) o[1] = __float_as_uint(raw[token] - __uint_as_float(o[1]));
    }
}

// Asynchronous scheduling: the token ids of a decode step queued before the step ahead of it
// has returned its samples to the host. ids[i] = the token `sample_rows` wrote for row i (word 0
// of the row's SAMPLE_OUT words), so the next step's embedding reads it on the device.
extern "C" __global__ void feed_sampled_tokens(const unsigned* __restrict__ sampled, int out_words,
                                               int* __restrict__ ids, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ids[i] = (int)sampled[(long long)i * out_words];
}
