// RMSNorm family: plain, fused residual-add + norm, and the gated norm of Gated DeltaNet.
// One block per row; the sum of squares is accumulated in f32. `plus_one` selects the
// (1 + w) weight convention (Qwen3.5/Qwen3-Next) instead of w (Llama, Qwen3).
#include "common.cuh"

__device__ __forceinline__ float norm_weight(const store_t* w, int i, int plus_one) {
    const float wf = to_f32(w[i]);
    return plus_one ? 1.0f + wf : wf;
}

// rmsnorm and add_rmsnorm work in chunks of 8 elements (the arithmetic is common.cuh's): chunk c
// of a row is elements
// [8c, 8c + 8) and thread i takes chunks i, i + blockDim.x, ... The launcher sizes the block
// from `dim` alone (dim/8 threads rounded up to a warp, at most 1024), so one pass usually
// covers the row and its first NORM_CACHE chunks per thread stay in registers between the
// sum of squares and the scaling: the row is read once. A chunk is one 16-byte load when the
// row and the pointers allow it (dim % 8 == 0, 16-byte aligned), else 8 scalar loads with
// zeros past the row end; both give the same values in the same order, so the f32 sum, and so
// the result, depends on `dim` only: never on the alignment, the row count or the other rows.
// The weight's chunks of those first NORM_CACHE passes are loaded before pdl_wait (weights are
// written by no kernel): at batch-1 decode the row's loads and the block sum are short, and a
// weight read after them is a DRAM round trip at the end of every norm.
#define NORM_CACHE 4
#define NORM_MAX_THREADS 1024

__device__ __forceinline__ void store_chunk(store_t* p, int base, int dim, bool vec, uint4 r) {
    if (vec) {
        *reinterpret_cast<uint4*>(p + base) = r;
        return;
    }
    const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (base + 2 * i < dim) p[base + 2 * i] = (store_t)(u[i] & 0xffffu);
        if (base + 2 * i + 1 < dim) p[base + 2 * i + 1] = (store_t)(u[i] >> 16);
    }
}

// out chunk = x chunk * rstd * weight (w or 1 + w): common.cuh's norm_chunk, stored.
__device__ __forceinline__ void scale_chunk(uint4 xr, const store_t* __restrict__ w,
                                            store_t* __restrict__ orow, int base, int dim,
                                            bool vec, float rstd, int plus_one) {
    store_chunk(orow, base, dim, vec, norm_chunk(xr, w, base, dim, vec, rstd, plus_one));
}

// The weight's chunks of a thread's first NORM_CACHE passes (chunk c * step + threadIdx.x).
__device__ __forceinline__ void load_weight_chunks(const store_t* __restrict__ w, int dim, bool vec, int step,
                                                   uint4 (&wc)[NORM_CACHE]) {
    const int n_chunks = (dim + 7) >> 3;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; ++c) {
        const int ch = c * step + threadIdx.x;
        wc[c] = ch < n_chunks ? load_chunk(w, ch * 8, dim, vec) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// residual chunk += x chunk, rounded to storage and written back; returns the rounded sums.
__device__ __forceinline__ uint4 add_chunk(store_t* __restrict__ rrow,
                                           const store_t* __restrict__ xr, int base, int dim,
                                           bool vec) {
    float a[8], b[8];
    unpack_chunk(load_chunk(rrow, base, dim, vec), a);
    unpack_chunk(load_chunk(xr, base, dim, vec), b);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = norm_residual_add(a[e], b[e]);
    const uint4 s = pack_chunk(a);
    store_chunk(rrow, base, dim, vec, s);
    return s;
}

// out[r, :] = x[r, :] * rsqrt(mean(x^2) + eps) * w. Rows are `x_stride` / `out_stride`
// elements apart so that per-head norms can read q/k inside a fused projection. Grid
// dimension y indexes heads: head h of row r starts h * dim elements into the row (in and
// out), so one launch normalises every head of every token (per-head q/k norm).
extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
    rmsnorm(const store_t* __restrict__ x, const store_t* __restrict__ w,
            store_t* __restrict__ out, int dim, long long x_stride, long long out_stride,
            float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long head = (long long)blockIdx.y * dim;
    const store_t* xr = x + blockIdx.x * x_stride + head;
    store_t* orow = out + blockIdx.x * out_stride + head;
    const bool vec = (dim & 7) == 0 && aligned16(xr) && aligned16(orow) && aligned16(w);
    const int n_chunks = (dim + 7) >> 3;
    const int step = blockDim.x;
    uint4 wc[NORM_CACHE];
    load_weight_chunks(w, dim, vec, step, wc);
    pdl_enter();
    uint4 cache[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; ++c) {
        const int ch = c * step + threadIdx.x;
        if (ch < n_chunks) {
            cache[c] = load_chunk(xr, ch * 8, dim, vec);
            ss = chunk_sum_squares(cache[c], ss);
        }
    }
    for (int ch = NORM_CACHE * step + threadIdx.x; ch < n_chunks; ch += step)
        ss = chunk_sum_squares(load_chunk(xr, ch * 8, dim, vec), ss);
    const float rstd = norm_rstd(block_sum(ss, scratch), dim, eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; ++c) {
        const int ch = c * step + threadIdx.x;
        if (ch < n_chunks) store_chunk(orow, ch * 8, dim, vec, norm_chunk_w(cache[c], wc[c], rstd, plus_one));
    }
    for (int ch = NORM_CACHE * step + threadIdx.x; ch < n_chunks; ch += step)
        scale_chunk(load_chunk(xr, ch * 8, dim, vec), w, orow, ch * 8, dim, vec, rstd, plus_one);
}

// residual[r, :] += x[r, :] (rounded to storage, as the model's residual stream is), then
// out[r, :] = rmsnorm(residual[r, :]). Rows are contiguous (`dim` apart). The rounded sums
// stay in registers for the scaling pass (chunks past NORM_CACHE per thread are read back
// from residual, which the same thread wrote).
extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
    add_rmsnorm(store_t* __restrict__ residual, const store_t* __restrict__ x,
                const store_t* __restrict__ w, store_t* __restrict__ out, int dim, float eps,
                int plus_one) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * dim;
    store_t* rrow = residual + base;
    const store_t* xr = x + base;
    store_t* orow = out + base;
    const bool vec = (dim & 7) == 0 && aligned16(rrow) && aligned16(xr) && aligned16(orow) &&
                     aligned16(w);
    const int n_chunks = (dim + 7) >> 3;
    const int step = blockDim.x;
    uint4 wc[NORM_CACHE];
    load_weight_chunks(w, dim, vec, step, wc);
    // The residual row was last written several kernels back, with far more than L2 holds
    // streamed through it since (the GEMVs' weights): its lines are requested into L2 while the
    // kernel before finishes, a line (8 chunks) a thread.
    for (int ch = 8 * threadIdx.x; ch < n_chunks; ch += 8 * step) prefetch_l2(rrow + ch * 8);
    pdl_enter();
    uint4 cache[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; ++c) {
        const int ch = c * step + threadIdx.x;
        if (ch < n_chunks) {
            cache[c] = add_chunk(rrow, xr, ch * 8, dim, vec);
            ss = chunk_sum_squares(cache[c], ss);
        }
    }
    for (int ch = NORM_CACHE * step + threadIdx.x; ch < n_chunks; ch += step)
        ss = chunk_sum_squares(add_chunk(rrow, xr, ch * 8, dim, vec), ss);
    const float rstd = norm_rstd(block_sum(ss, scratch), dim, eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; ++c) {
        const int ch = c * step + threadIdx.x;
        if (ch < n_chunks) store_chunk(orow, ch * 8, dim, vec, norm_chunk_w(cache[c], wc[c], rstd, plus_one));
    }
    for (int ch = NORM_CACHE * step + threadIdx.x; ch < n_chunks; ch += step)
        scale_chunk(load_chunk(rrow, ch * 8, dim, vec), w, orow, ch * 8, dim, vec, rstd, plus_one);
}

// add_rmsnorm with a warp per row, for rows of dim = 256 G (aligned to 16 bytes), a prefill's
// many rows. add_rmsnorm runs such a row as a block of dim / 8 = 32 G threads, a chunk each, so
// its sum of squares is: chunk t's `chunk_sum_squares` from 0, `warp_sum` over each group of 32
// consecutive chunks, `warp_sum` over the G group sums (zero-padded to 32). Here lane l holds
// chunks l + 32 g (g < G) and forms the same sums: the group sum of group g reaches every lane
// (the butterfly gives all lanes the same bits) and lane g keeps it for the last warp_sum, so
// the bits are add_rmsnorm's (GPU test). Why: at 8k rows of 5120 the block per row took 151.5
// us, 1.86x a copy of its bytes (a 640-thread block per row: one load round trip, two block
// barriers and the stores, per block); every chunk load of a row is issued here before the
// first reduction (G a template constant), 2 G 16-byte loads a lane in flight: 91.8 us, 1.13x
// (255 registers at G = 20, no spills).
template <int G>
__device__ __forceinline__ void add_rmsnorm_rows_body(store_t* __restrict__ residual,
                                                      const store_t* __restrict__ x,
                                                      const store_t* __restrict__ w,
                                                      store_t* __restrict__ out, int rows,
                                                      float eps, int plus_one) {
    constexpr int DIM = 256 * G;
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    store_t* rrow = residual + row * DIM;
    const store_t* xr = x + row * DIM;
    store_t* orow = out + row * DIM;
    uint4 cache[G];
#pragma unroll
    for (int g = 0; g < G; ++g) cache[g] = add_chunk(rrow, xr, (32 * g + lane) * 8, DIM, true);
    float mine = 0.0f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float s = warp_sum(chunk_sum_squares(cache[g], 0.0f));
        if (lane == g) mine = s;
    }
    const float rstd = norm_rstd(warp_sum(mine), DIM, eps);
#pragma unroll
    for (int g = 0; g < G; ++g) scale_chunk(cache[g], w, orow, (32 * g + lane) * 8, DIM, true, rstd, plus_one);
}
// Instances: G of the hidden sizes 2048, 3072, 4096 and 5120 (ops/norm.rs add_norm_rows_kernel;
// at 8192, G = 32, ptxas spills).
#define ADD_RMSNORM_ROWS_INSTANCE(G)                                                            \
    extern "C" __global__ void __launch_bounds__(128) add_rmsnorm_rows_g##G(                    \
        store_t* residual, const store_t* x, const store_t* w, store_t* out, int rows,          \
        float eps, int plus_one) {                                                              \
        add_rmsnorm_rows_body<G>(residual, x, w, out, rows, eps, plus_one);                     \
    }
ADD_RMSNORM_ROWS_INSTANCE(8)
ADD_RMSNORM_ROWS_INSTANCE(12)
ADD_RMSNORM_ROWS_INSTANCE(16)
ADD_RMSNORM_ROWS_INSTANCE(20)

// Gated DeltaNet output norm: out = rmsnorm(x) * w * silu(z), rows of `dim` (one head).
// Row r is head r % heads of token r / heads; x and out are contiguous rows, z is read at
// token * z_stride + head * dim (z is a column range of the fused input projection's output).
extern "C" __global__ void rmsnorm_gated(const store_t* __restrict__ x,
                                         const store_t* __restrict__ z, int heads,
                                         long long z_stride,
                                         const store_t* __restrict__ w, store_t* __restrict__ out,
                                         int dim, float eps) {
    __shared__ float scratch[32];
    pdl_enter();
    const long long base = (long long)blockIdx.x * dim;
    const long long zbase = (long long)(blockIdx.x / heads) * z_stride + (long long)(blockIdx.x % heads) * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(x[base + i]);
        ss += v * v;
    }
    const float rstd = gated_norm_rstd(block_sum(ss, scratch), dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[base + i] = gated_norm_out(to_f32(x[base + i]), rstd, to_f32(w[i]), to_f32(z[zbase + i]));
}

// rmsnorm_gated with a warp per row, for dim a multiple of 32 up to 256 (every GDN head size):
// lane l holds elements l + 32 k, and the sum of squares is block_sum's exactly (warp k's
// butterfly over elements 32k..32k+31, then the butterfly over the warp partials, the missing
// ones zero), so the bits are rmsnorm_gated's and the fused decode kernel's. Warps walk the
// rows grid-stride, two rows at a time with every x and z load of both issued before the first
// reduction (the part count is a template constant, so nothing keeps a load behind a shuffle):
// the kernel is bound by how many bytes are in flight. A block per row made a Qwen3.5-27B
// prefill of 8k tokens launch 393k blocks (48 heads a token) and run 643 us a layer, bound by
// block scheduling, where its bytes take ~90 us; a warp per row with the loads of one row
// behind each other's reductions still took 466 us. Rows the 16-byte form below can read (dim
// 32, 64, 128 or 256, aligned) go to it; this one is its fallback and its reference.
template <int PARTS>
__device__ __forceinline__ void gated_rows_body(const store_t* __restrict__ x,
                                                const store_t* __restrict__ z, int heads,
                                                long long z_stride,
                                                const store_t* __restrict__ w,
                                                store_t* __restrict__ out, float eps,
                                                long long rows) {
    constexpr int dim = 32 * PARTS;
    const int lane = threadIdx.x & 31;
    const long long n_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    float wv[PARTS];
#pragma unroll
    for (int k = 0; k < PARTS; ++k) wv[k] = to_f32(w[32 * k + lane]);
    for (long long r0 = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 2; r0 < rows;
         r0 += 2 * n_warps) {
        // The second row of the pair is the first again past the end: its loads stay in
        // bounds and its stores are skipped.
        const bool two = r0 + 1 < rows;
        const long long rr[2] = {r0, two ? r0 + 1 : r0};
        store_t xv[2][PARTS], zv[2][PARTS];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const store_t* xr = x + rr[j] * dim;
            const store_t* zr = z + (rr[j] / heads) * z_stride + (rr[j] % heads) * dim;
#pragma unroll
            for (int k = 0; k < PARTS; ++k) {
                xv[j][k] = xr[32 * k + lane];
                zv[j][k] = zr[32 * k + lane];
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (j == 1 && !two) break;
            float t = 0.0f;
#pragma unroll
            for (int k = 0; k < PARTS; ++k) {
                const float v = to_f32(xv[j][k]);
                const float p = warp_sum(v * v);
                if (lane == k) t = p;
            }
            const float rstd = gated_norm_rstd(warp_sum(t), dim, eps);
#pragma unroll
            for (int k = 0; k < PARTS; ++k)
                out[rr[j] * dim + 32 * k + lane] = gated_norm_out(to_f32(xv[j][k]), rstd, wv[k], to_f32(zv[j][k]));
        }
    }
}

// One entry per part count (rmsnorm_gated_rows_p1 .. _p8), so that each keeps only its own
// registers: one entry for all of them holds the eight-part case's 72 and fits 3 blocks an SM.
// (The 16-byte form below shares the signature: GATED_ROWS_KERNEL(name, body, P).)
#define GATED_ROWS_KERNEL(NAME, BODY, P)                                                        \
    extern "C" __global__ void NAME(                                                            \
        const store_t* __restrict__ x, const store_t* __restrict__ z, int heads,                \
        long long z_stride, const store_t* __restrict__ w, store_t* __restrict__ out, float eps, \
        long long rows) {                                                                       \
        pdl_enter();                                                                            \
        BODY<P>(x, z, heads, z_stride, w, out, eps, rows);                                      \
    }
#define GATED_ROWS_INSTANCE(P) GATED_ROWS_KERNEL(rmsnorm_gated_rows_p##P, gated_rows_body, P)
GATED_ROWS_INSTANCE(1)
GATED_ROWS_INSTANCE(2)
GATED_ROWS_INSTANCE(3)
GATED_ROWS_INSTANCE(4)
GATED_ROWS_INSTANCE(5)
GATED_ROWS_INSTANCE(6)
GATED_ROWS_INSTANCE(7)
GATED_ROWS_INSTANCE(8)

// rmsnorm_gated_rows_p* with 16-byte loads and stores, for PARTS 1, 2, 4 and 8 (dim 32, 64, 128,
// 256): lane l holds the 8 consecutive elements 8 (l % L) .. 8 (l % L) + 7 of a row, L = dim / 8
// lanes a row, so one load instruction of x (or z, or store of out) covers 32 / L rows (two at
// dim 128) where the scalar form's covers 32 elements of one (its loads are 2 bytes a lane: 195.8
// us at the 27B 8k shape, 2.67x a copy of its bytes). The outputs are gated_norm_out per element,
// so only the sum of squares needs care: the scalar form's is a fixed tree over the element
// index n = 32 k + l of sq[n] = x[n]^2. warp_sum(v * v) of part k pairs lanes l and l ^ 16,
// then ^ 8, 4, 2, 1: it combines n's bits 4, 3, 2, 1, 0 in that order (each lane adding its
// partner's value to its own: a + b and b + a are the same bits). warp_sum over the parts (lane
// k holding p_k, the others 0) pairs k with k ^ 16, ^ 8, ^ 4, ^ 2, ^ 1: with k < 8 the first two
// add zeros, and so does every step on a bit above PARTS - 1 (x + 0 is x exactly for the
// non-negative sums here, +0 included), so what it computes is: combine k's bits from the highest
// to bit 0, i.e. n's bits log2(dim) - 1 down to 5. Here n = 8 (l % L) + e (e the element within
// the lane): n's bits 4 and 3 are the lane's bits 1 and 0, n's bits 2, 1, 0 are e's, and n's
// bits 5 and up are the lane's bits 2 and up. So: per element, xor-shuffle 2 then 1 (n bits 4,
// 3); in the lane, e with e + 4, then + 2, then + 1 (bits 2, 1, 0); then xor-shuffle L / 2 down
// to 4 (n bits log2(dim) - 1 .. 5). Every addition of the scalar tree, on the same operands,
// minus the additions of zero: the same bits (rmsnorm_gated_rows_v8_equals_scalar_bit_for_bit).
// The shuffles stay inside a row's L lanes. Each warp takes GATED_V8_LOADS load groups (2 x
// 32 / L rows) at a time, every x and z load of them before the first shuffle; the launcher
// picks this form when x, z, w and out are 16-byte aligned and z_stride is a multiple of 8
// (every row and every lane's chunk then is), and runs it over one resident wave like the scalar
// form.
#define GATED_V8_LOADS 2

template <int PARTS>
__device__ __forceinline__ void gated_rows_v8_body(const store_t* __restrict__ x,
                                                   const store_t* __restrict__ z, int heads,
                                                   long long z_stride,
                                                   const store_t* __restrict__ w,
                                                   store_t* __restrict__ out, float eps,
                                                   long long rows) {
    static_assert(PARTS == 1 || PARTS == 2 || PARTS == 4 || PARTS == 8, "a row is 4, 8, 16 or 32 lanes");
    constexpr int dim = 32 * PARTS;
    constexpr int row_lanes = dim / 8;
    constexpr int rows_per_load = 32 / row_lanes;
    constexpr int rows_per_step = GATED_V8_LOADS * rows_per_load;
    const int lane = threadIdx.x & 31;
    const int col = (lane % row_lanes) * 8;
    const long long n_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    float wv[8];
    unpack_chunk(*reinterpret_cast<const uint4*>(w + col), wv);
    for (long long r0 = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * rows_per_step;
         r0 < rows; r0 += rows_per_step * n_warps) {
        // A lane whose row is past the end loads the last row (in bounds), joins the shuffles of
        // its own row's lanes and stores nothing.
        long long rr[GATED_V8_LOADS];
        uint4 xq[GATED_V8_LOADS], zq[GATED_V8_LOADS];
#pragma unroll
        for (int g = 0; g < GATED_V8_LOADS; ++g) {
            rr[g] = r0 + g * rows_per_load + lane / row_lanes;
            const long long r = rr[g] < rows ? rr[g] : rows - 1;
            xq[g] = *reinterpret_cast<const uint4*>(x + r * dim + col);
            zq[g] = *reinterpret_cast<const uint4*>(z + (r / heads) * z_stride + (r % heads) * dim + col);
        }
#pragma unroll
        for (int g = 0; g < GATED_V8_LOADS; ++g) {
            float xv[8], sq[8];
            unpack_chunk(xq[g], xv);
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[e] = xv[e] * xv[e];
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], 2);
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], 1);
#pragma unroll
            for (int e = 0; e < 4; ++e) sq[e] += sq[e + 4];
#pragma unroll
            for (int e = 0; e < 2; ++e) sq[e] += sq[e + 2];
            float t = sq[0] + sq[1];
#pragma unroll
            for (int o = row_lanes / 2; o >= 4; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
            const float rstd = gated_norm_rstd(t, dim, eps);
            if (rr[g] < rows) {
                float zv[8];
                unpack_chunk(zq[g], zv);
                unsigned u[4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    u[i] = (unsigned)gated_norm_out(xv[2 * i], rstd, wv[2 * i], zv[2 * i]) |
                           ((unsigned)gated_norm_out(xv[2 * i + 1], rstd, wv[2 * i + 1], zv[2 * i + 1]) << 16);
                uint4 o;
                o.x = u[0];
                o.y = u[1];
                o.z = u[2];
                o.w = u[3];
                *reinterpret_cast<uint4*>(out + rr[g] * dim + col) = o;
            }
        }
    }
}

#define GATED_ROWS_V8_INSTANCE(P) GATED_ROWS_KERNEL(rmsnorm_gated_rows_v8_p##P, gated_rows_v8_body, P)
GATED_ROWS_V8_INSTANCE(1)
GATED_ROWS_V8_INSTANCE(2)
GATED_ROWS_V8_INSTANCE(4)
GATED_ROWS_V8_INSTANCE(8)
