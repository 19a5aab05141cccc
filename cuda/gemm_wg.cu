// Decode GEMM on Hopper's warpgroup tensor cores (gemm_wg_n{16,32,64}_r{128,256}_s*, sm_90a code
// only): y[M, N] = x[M, K] * W[N, K]^T for the 9-64 rows of a batched decode step, where the step
// is bound by reading W once. Runs only with NINFER_WG_GEMM=1: on the H200 it matches cuBLAS in
// the model but does not beat it (docs/kernels.md "Decode GEMM on warpgroup tensor cores").
//
// Why not cuBLAS there: at 16-64 rows cuBLAS reads the Llama-3-8B qkv / o projections at
// 2.9-3.1 TB/s and the down projection at 3.5 (plus a split-K reduce kernel) against a 4.2 TB/s
// copy (decode_profile_8b_b64_nopdl_c206865.txt), and it cannot start streaming the next
// weight while the kernel before it finishes. Session 32's mma.sync kernel (a warp per 16-row
// tile, x through shared memory a chunk at a time, one chunk of weights in flight a warp) read
// 1.2-3.0 TB/s and lost. Here the weights stream the way the prefill attention streams K/V:
//
// - A block is two warpgroups over a 128- or 256-row weight tile (64 or 128 rows each, in m64
//   wgmma tiles). x is the B operand, its rows the wgmma's N (16, 32 or 64: the launch's M
//   rounded up; rows past M are zero-filled and their outputs never stored; each output element
//   depends only on its own weight row and x row, so padding changes no value).
// - K goes in 64-column stages (one 128-byte row of the swizzle layout): a stage is the tile's
//   16 or 32 KiB of weights plus M x 128 bytes of x, staged by cp.async into a ring of STAGES buffers,
//   STAGES - 1 ahead of the products. The first STAGES - 1 stages of weights are requested
//   before the PDL wait (they depend on no kernel), so the weight stream starts while the
//   kernel before is still finishing.
// - K is split over the blocks of a thread-block cluster (grid.x = the split, at most 8, the
//   portable cluster size), so that a few hundred blocks keep every SM streaming even for the
//   4096-row projections. The partial tiles are summed through distributed shared memory: each
//   block leaves its f32 tile in its own shared memory, and after a cluster barrier each block
//   sums a share of the tile's elements over the cluster's blocks in split order (0, 1, ...),
//   so the result does not depend on which block finishes first, and no partial ever goes to
//   global memory (where cuBLAS's split-K writes and re-reads them, and a reduce kernel runs).
//
// Accumulator layout of a warpgroup's m64nN f32 tile (as in flash_attention.cu): warp w of the
// warpgroup, lane (g, q) = (lane / 4, lane % 4) holds d[j][0..3] = rows 16 w + g (0, 1) and
// 16 w + g + 8 (2, 3) at columns 8 j + 2 q (0, 2) and 8 j + 2 q + 1 (1, 3); rows are weight rows
// (outputs n), columns x rows (m).
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#if defined(NINFER_STORAGE_F16)
#define GW_TYPES "f16.f16"
#else
#define GW_TYPES "bf16.bf16"
#endif

constexpr int GW_THREADS = 256;  // two warpgroups
constexpr int GW_BK = 64;        // k a stage: one 128-byte row of the swizzle layout

// d (64 x N f32) += A B, both from shared memory (K-major, 128-byte swizzle), N = 4 x the
// accumulator array's first extent.
__device__ __forceinline__ void gw_mma(float (&d)[2][4], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." GW_TYPES
        " {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3])
        : "l"(a), "l"(b));
}

__device__ __forceinline__ void gw_mma(float (&d)[4][4], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." GW_TYPES
        " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(a), "l"(b));
}

__device__ __forceinline__ void gw_mma(float (&d)[8][4], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." GW_TYPES
        " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
        "%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
          "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
          "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a), "l"(b));
}

// Keeps the accumulators out of reach of the compiler between the wgmma that writes them and
// the wait after which they are read.
template <int J>
__device__ __forceinline__ void gw_pin(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
        asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// 16 bytes of block `rank`'s shared memory at the address `addr` has in this block.
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}

// MN: x rows of the wgmma (M rounded up to 16 / 32 / 64); WT: 64-row weight tiles a warpgroup
// (the block's weight tile is 128 WT rows: x staged once serves them all, so WT = 2 halves the
// x bytes a weight byte costs); STAGES: the ring. `steps`: 64-column stages a split takes (the
// last split may take fewer; the host makes every split non-empty).
template <int MN, int WT, int STAGES>
__device__ __forceinline__ void gemm_wg_body(const store_t* __restrict__ x, const store_t* __restrict__ w,
                                             store_t* __restrict__ y, int m, int n, int k, int steps) {
    constexpr int J = MN / 8;
    constexpr int ROWS = 128 * WT;
    constexpr int W_BYTES = ROWS * 128;
    constexpr int X_BYTES = MN * 128;
    constexpr int STAGE = W_BYTES + X_BYTES;
    static_assert(X_BYTES % 1024 == 0, "swizzle atoms are 1 KiB aligned");
    extern __shared__ unsigned char gw_smem_raw[];
    // The swizzle pattern repeats every 1024 bytes from a 1024-aligned address.
    const unsigned raw = smem_u32(gw_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* const base_ptr = gw_smem_raw + (base - raw);

    const int tid = threadIdx.x;
    const int wg = tid >> 7;
    const int n0 = blockIdx.y * ROWS;
    const int split = blockIdx.x;
    const int splits = gridDim.x;
    const int total = (k + GW_BK - 1) / GW_BK;
    const int s0 = split * steps;
    const int nsteps = min(total, s0 + steps) - s0;

    // Stage st (local index) into ring buffer b: weights (ROWS x 8 chunks: chunk i is row i / 8,
    // chunk i % 8 of the 128-byte row, so 8 consecutive threads copy 128 consecutive bytes) and
    // x (MN x 8 chunks).
    auto load_w = [&](int st, int b) {
        const int kc = (s0 + st) * GW_BK + (tid & 7) * 8;
        const unsigned dst = base + b * STAGE;
#pragma unroll
        for (int i = 0; i < ROWS * 8 / GW_THREADS; ++i) {
            const int r = (tid >> 3) + i * (GW_THREADS / 8);
            const int row = n0 + r;
            const bool valid = row < n && kc < k;
            const store_t* src = valid ? w + (long long)row * k + kc : w;
            cp_async16_zfill(dst + sw128_offset<ROWS>(r, tid & 7), src, valid);
        }
    };
    auto load_x = [&](int st, int b) {
        const int kc = (s0 + st) * GW_BK + (tid & 7) * 8;
        const unsigned dst = base + b * STAGE + W_BYTES;
#pragma unroll
        for (int i = 0; i < (MN * 8 + GW_THREADS - 1) / GW_THREADS; ++i) {
            const int r = (tid >> 3) + i * (GW_THREADS / 8);
            if (r < MN) {
                const bool valid = r < m && kc < k;
                const store_t* src = valid ? x + (long long)r * k + kc : x;
                cp_async16_zfill(dst + sw128_offset<MN>(r, tid & 7), src, valid);
            }
        }
    };

    // Weights of the first STAGES - 1 stages as one group, before the PDL wait; then x of the
    // same stages, a group each. Iteration s then needs every group up to stage s's x (or, from
    // stage STAGES - 1 on, the group that loop iteration s - STAGES + 1 committed): at most
    // STAGES - 2 newer groups may still be in flight.
    constexpr int AHEAD = STAGES - 1;
#pragma unroll
    for (int st = 0; st < AHEAD; ++st)
        if (st < nsteps) load_w(st, st);
    cp_async_commit();
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int st = 0; st < AHEAD; ++st) {
        if (st < nsteps) load_x(st, st);
        cp_async_commit();
    }

    float d[WT][J][4];
#pragma unroll
    for (int t = 0; t < WT; ++t)
#pragma unroll
        for (int j = 0; j < J; ++j) d[t][j][0] = d[t][j][1] = d[t][j][2] = d[t][j][3] = 0.f;

    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait_group<STAGES - 2>();
        fence_proxy_async_smem();
        // This warpgroup's products of stage s - 1 are done, and after the barrier everyone's:
        // its buffer, (s - 1) % STAGES = (s + AHEAD) % STAGES, may be refilled.
        wg_wait<0>();
#pragma unroll
        for (int t = 0; t < WT; ++t) gw_pin(d[t]);
        __syncthreads();
        const int nx = s + AHEAD;
        if (nx < nsteps) {
            load_w(nx, nx % STAGES);
            load_x(nx, nx % STAGES);
        }
        cp_async_commit();
        const unsigned stage = base + (s % STAGES) * STAGE;
        const unsigned b0 = stage + W_BYTES;
        wg_fence();
#pragma unroll
        for (int t = 0; t < WT; ++t) {
            const unsigned a0 = stage + (wg * WT + t) * 64 * 128;
#pragma unroll
            for (int kk = 0; kk < GW_BK / 16; ++kk)
                gw_mma(d[t], wg_desc_sw128(a0 + kk * 32), wg_desc_sw128(b0 + kk * 32));
        }
        wg_commit();
    }
    wg_wait<0>();
#pragma unroll
    for (int t = 0; t < WT; ++t) gw_pin(d[t]);

    // Slot (t, j, thread) holds that thread's d[t][j]: tile rows (wg WT + t) 64 + 16 warp + g
    // and + 8, x rows 8 j + 2 q and + 1.
    auto store4 = [&](int f, float4 v) {
        const int th = f % GW_THREADS, tj = f / GW_THREADS;
        const int t = tj / J, j = tj % J;
        const int ra = ((th >> 7) * WT + t) * 64 + ((th >> 5) & 3) * 16 + ((th & 31) >> 2);
        const int ca = 8 * j + 2 * (th & 3);
        const int na = n0 + ra, nb = na + 8;
        if (ca < m) {
            if (na < n) y[(long long)ca * n + na] = from_f32(v.x);
            if (nb < n) y[(long long)ca * n + nb] = from_f32(v.z);
        }
        if (ca + 1 < m) {
            if (na < n) y[(long long)(ca + 1) * n + na] = from_f32(v.y);
            if (nb < n) y[(long long)(ca + 1) * n + nb] = from_f32(v.w);
        }
    };
    if (splits == 1) {
#pragma unroll
        for (int t = 0; t < WT; ++t)
#pragma unroll
            for (int j = 0; j < J; ++j)
                store4((t * J + j) * GW_THREADS + tid, make_float4(d[t][j][0], d[t][j][1], d[t][j][2], d[t][j][3]));
        return;
    }

    // Split K: this block's partial tile into its shared memory as 16-byte slots (every stage
    // buffer is free: all products have landed), then each block of the cluster sums its share
    // of the slots over the cluster's blocks in split order.
    __syncthreads();
    float4* red = reinterpret_cast<float4*>(base_ptr);
#pragma unroll
    for (int t = 0; t < WT; ++t)
#pragma unroll
        for (int j = 0; j < J; ++j)
            red[(t * J + j) * GW_THREADS + tid] = make_float4(d[t][j][0], d[t][j][1], d[t][j][2], d[t][j][3]);
    cluster_sync();
    const int slots = WT * J * GW_THREADS;
    const int share = (slots + splits - 1) / splits;
    const int rank = (int)cluster_rank();
    const int end = min(slots, (rank + 1) * share);
    for (int f = rank * share + tid; f < end; f += GW_THREADS) {
        const unsigned addr = base + f * 16;
        float4 acc = ld_cluster_f4(addr, 0);
        for (int r = 1; r < splits; ++r) {
            const float4 p = ld_cluster_f4(addr, (unsigned)r);
            acc.x += p.x;
            acc.y += p.y;
            acc.z += p.z;
            acc.w += p.w;
        }
        store4(f, acc);
    }
    // No block leaves while another may still read its shared memory.
    cluster_sync();
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Every instance: the arguments, 256 threads, dynamic shared memory STAGES x (128 WT x 128 + MN x
// 128 bytes) + 1 KiB of alignment slack; grid (splits, ceil(n / (128 WT))), launched as clusters
// of (splits, 1, 1). Only sm_90a code has a body. Names: gemm_wg_n{MN}_r{128 WT}_s{STAGES}.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GW_BODY(MN, WT, STAGES) gemm_wg_body<MN, WT, STAGES>(x, w, y, m, n, k, steps);
#else
#define GW_BODY(MN, WT, STAGES)
#endif
#define GEMM_WG_INSTANCE(MN, WT, STAGES, ROWS)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gemm_wg_n##MN##_r##ROWS##_s##STAGES(                    \
        const store_t* __restrict__ x, const store_t* __restrict__ w, store_t* __restrict__ y, int m, int n, \
        int k, int steps) {                                                                                  \
        GW_BODY(MN, WT, STAGES)                                                                              \
    }

GEMM_WG_INSTANCE(16, 1, 4, 128)
GEMM_WG_INSTANCE(32, 1, 4, 128)
GEMM_WG_INSTANCE(64, 1, 4, 128)
GEMM_WG_INSTANCE(16, 2, 6, 256)
GEMM_WG_INSTANCE(32, 2, 5, 256)
GEMM_WG_INSTANCE(64, 2, 5, 256)
