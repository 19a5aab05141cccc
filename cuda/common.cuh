// Shared definitions for every NInfer kernel: the storage type (bf16, or fp16 where the
// architecture has no bf16 arithmetic worth using), conversions to and from f32, 16-byte vector
// access, and warp/block reductions. Kernels store activations and weights in `store_t` and
// accumulate in f32.
#pragma once

// Storage elements are raw 16-bit patterns converted with bit operations or single PTX
// instructions, so the kernels include no CUDA header: NVRTC from a bare wheel (no toolkit
// headers on the machine) compiles them for every architecture from sm_70 on.
typedef unsigned short store_t;

#if defined(NINFER_STORAGE_F16)
__device__ __forceinline__ float to_f32(store_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ store_t from_f32(float f) {
    store_t x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
}
#else
__device__ __forceinline__ float to_f32(store_t x) { return __uint_as_float(((unsigned)x) << 16); }
// Round to nearest even. sm_80+ has the instruction (one F2F where the bit form below is seven
// integer instructions: a third of the instructions of the prefill conv and of the gated norm
// per element); it gives the same bits for every finite and infinite value and the canonical NaN
// for every NaN. Earlier architectures (no bf16 models are served there; CI compiles the kernels
// for them) keep the bit form, NaN kept quiet.
__device__ __forceinline__ store_t from_f32(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    store_t x;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
#else
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (store_t)((u >> 16) | 0x40u);
    return (store_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
#endif

// Shared-memory addresses and cp.async (sm_80+), one definition for every kernel family that
// stages tiles (flash_attention.cu's K/V tiles, gdn_chunked.cu's chunk operands): global memory
// copied into shared memory without passing through registers, many 16-byte loads in flight.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits for this thread's cp.async groups; the memory clobber keeps shared-memory reads after it.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Waits until at most N of this thread's newest cp.async groups are still in flight (the older
// ones have landed); the memory clobber keeps shared-memory reads after it.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Byte offset in a [ROWS][cols] 16-bit tile in the 128-byte swizzle layout of the 16-byte chunk
// c8 of row r: columns in slabs of 64 (128 bytes a row), a slab's rows 128 bytes apart, and
// within each 8-row group (1024 bytes) the chunk index XORed with the row's index in the group.
template <int ROWS>
__device__ __forceinline__ int sw128_offset(int r, int c8) {
    return ((c8 >> 3) * ROWS + r) * 128 + (((c8 & 7) ^ (r & 7)) << 4);
}
// Staging order: chunk i of a tile is chunk i % 8 of its slab in row (i / 8) % ROWS of slab
// i / (8 ROWS), so 8 consecutive chunks fill one 128-byte row (no two share a bank) from 128
// consecutive bytes of global memory.
template <int ROWS>
__device__ __forceinline__ int sw128_chunk_row(int i) { return (i >> 3) % ROWS; }
template <int ROWS>
__device__ __forceinline__ int sw128_chunk_c8(int i) { return (i >> 3) / ROWS * 8 + (i & 7); }

// 16 bytes by cp.async, or 16 zero bytes (nothing read) when !valid.
__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
#endif

// Warpgroup MMA (wgmma, sm_90a code only): operand descriptors of the 128-byte swizzle layout and
// the group fences, for every family with wgmma kernels (flash_attention_sm90.cu's prefill
// attention).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of a K-major operand in the 128-byte swizzle layout at shared address addr (the
// layout: flash_attention_sm90.cu): 8-row groups 1024 bytes apart (the stride byte offset); the leading byte
// offset is unused for this layout (1 by convention); swizzle mode 1 = 128 bytes.
__device__ __forceinline__ unsigned long long wg_desc_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3ffff) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N of this warpgroup's newest wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif

#define NEG_INF __int_as_float(0xff800000)

// Eight storage elements in one 16-byte load or store.
struct __align__(16) vec8 {
    store_t v[8];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `scratch` holds at least 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// An f32 value rounded to the storage type and widened back: what a value held in a bf16 tensor
// between two ops is. The kernels round where transformers (bf16, eager) rounds, not only where
// they store, so that the two implementations differ by summation order alone and not by
// rounding points as well (the table in docs/rounding.md lists every op and its rounding).
__device__ __forceinline__ float round_st(float x) { return to_f32(from_f32(x)); }

// The gated attention output (Qwen3.5's attn_output * torch.sigmoid(gate)): x a storage value
// of the attention output (widened), g the widened gate; sigmoid(g) is rounded to storage before
// the product, as transformers holds it in a bf16 tensor. The one definition of the gate:
// sigmoid_gate_mul (activation.cu, both forms) and decode attention's final write
// (attn_out_store: the gate applied to the value the kernel would store) both compute it here,
// so the fused form keeps the separate kernel's bits.
__device__ __forceinline__ store_t gated_out(float x, float g) {
    return from_f32(x * round_st(sigmoid_f(g)));
}

// An attention output element from its f32 value v: v rounded to storage, or where `gated`,
// that value times the sigmoid of the gate element g (gated_out of round_st(v): exactly the
// stored value, widened, as sigmoid_gate_mul reads it). Decode attention's final writes
// (decode_attention.cu, all forms) go through it; a null gate pointer gives today's bits.
__device__ __forceinline__ store_t attn_out_value(float v, bool gated, store_t g) {
    return gated ? gated_out(round_st(v), to_f32(g)) : from_f32(v);
}
// Element i of `gate`, 0 (unused) where there is no gate; loaded only at or just before the
// final write, so always after the kernel's pdl_wait (the gate is the projection's output).
__device__ __forceinline__ store_t load_gate(const store_t* gate, long long i) {
    return gate ? gate[i] : (store_t)0;
}
// The gate of rows `off` elements past `gate`, null where there is none.
__device__ __forceinline__ const store_t* gate_at(const store_t* gate, long long off) {
    return gate ? gate + off : nullptr;
}
// Element i of an attention output row at `out` (its gate row at `gate`, or null) from v.
__device__ __forceinline__ void attn_out_store(store_t* out, const store_t* gate, int i, float v) {
    out[i] = attn_out_value(v, gate != nullptr, load_gate(gate, i));
}

// One SwiGLU element from the widened gate and up projections: silu(gate) is rounded before
// the product, as transformers' act_fn(gate_proj(x)) * up_proj(x) holds act_fn(...) in a bf16
// tensor. The swiglu kernel (activation.cu) and the gate_up GEMV epilogues (gemv.cu,
// gemv_tc.cu) all compute it here, so the fused forms keep swiglu's bits.
__device__ __forceinline__ store_t swiglu_out(float gate, float up) {
    return from_f32(round_st(silu_f(gate)) * up);
}

// RoPE of one NeoX pair (elements i and i + rotary_dim/2 of a head, widened storage values a
// and b) at position `pos`, in two steps: rope_cos_sin (cos and sin, cast to storage after the
// rope scaling's attn_scale; depends only on the token and the pair, so rope_neox computes it
// once for all of a token's heads) and rope_apply (each product rounded, then their sum).
// These are transformers' (q * cos + rotate_half(q) * sin on bf16 tensors; docs/rounding.md),
// and the one definition of the rotation: rope.cu (rope_neox, rope_kv_write) and the qkv GEMV's
// epilogue that rotates its own sums (gemv.cu gemv_qkv_rope_m1) all use them, so every route
// rounds each element at the same points. rope_rotate is the two steps in a row.
__device__ __forceinline__ void rope_cos_sin(int i, float pos, const float* __restrict__ inv_freq,
                                             float attn_scale, float* c, float* s) {
    sincosf(pos * inv_freq[i], s, c);
    *c = round_st(*c * attn_scale);
    *s = round_st(*s * attn_scale);
}
__device__ __forceinline__ void rope_apply(float a, float b, float c, float s, store_t* lo,
                                           store_t* hi) {
    *lo = from_f32(round_st(a * c) - round_st(b * s));
    *hi = from_f32(round_st(b * c) + round_st(a * s));
}
__device__ __forceinline__ void rope_rotate(float a, float b, int i, float pos,
                                            const float* __restrict__ inv_freq, float attn_scale,
                                            store_t* lo, store_t* hi) {
    float c, s;
    rope_cos_sin(i, pos, inv_freq, attn_scale, &c, &s);
    rope_apply(a, b, c, s, lo, hi);
}

// Gated DeltaNet output norm, out = rmsnorm(x) * w * silu(z), in two steps that rmsnorm_gated
// (norm.cu) and the fused decode kernel gdn_recurrent_gated_dk* (gdn.cu) share, so both round
// the same expressions: the reciprocal RMS from the row's sum of squares, then one element.
__device__ __forceinline__ float gated_norm_rstd(float sum_sq, int dim, float eps) {
    return rsqrtf(sum_sq / (float)dim + eps);
}
// The rounding points are transformers' Qwen3_5RMSNormGated: the normalised value is cast to
// bf16, multiplied by the bf16 weight (a bf16 product, rounded), then by silu(z) computed in f32,
// and rounded once more.
__device__ __forceinline__ store_t gated_norm_out(float x, float rstd, float w, float z) {
    const float n = round_st(w * round_st(x * rstd));
    return from_f32(n * silu_f(z));
}

// Programmatic Dependent Launch (sm_90+). A kernel the host launches with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (`launch_pdl` in ops/mod.rs) may start
// while the kernel before it on the stream is still running: its blocks get scheduled early and
// can do work that depends on no earlier kernel (a GEMV's first weight loads) before
// `pdl_wait()`, which returns once the previous kernel has completed and its writes are
// visible. `pdl_launch_dependents()` lets the next kernel start being scheduled.
//
// SAFETY INVARIANT: a kernel launched with the attribute must execute `pdl_wait()` in every
// block before any early return, before reading anything an earlier kernel wrote and before
// writing anything. Ordering through the chain is transitive only because of that: kernel N
// waits for N-1 to complete, and N-1 completes only after its own wait on N-2 returned. A
// block that exited without waiting would let N complete before N-1, and N+1 would then read
// N-1's outputs unfinished. On older architectures (and on launches without the attribute)
// both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" :::);
}
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_launch_dependents() {}
#endif

// Brings the line holding p into L2, returning nothing: unlike a load it may precede pdl_wait
// for data an earlier kernel still writes, since every write lands in L2 (the device's one
// coherent cache) and the load after the wait reads the writer's value from there.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The common prologue of a kernel launched with PDL that has nothing to do before its inputs
// are ready: wait for the previous kernel, then let the next one be scheduled (after the wait,
// so that at most one kernel's blocks sit waiting for this one).
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// ---------------------------------------------------------------------------------------------
// In-kernel reductions across blocks (decode attention's split merge, device sampling's row
// merge, the GEMV's fused add + norm): each block publishes its partial, then counts itself in;
// the block that arrives last sees every partial and merges them, with no second kernel.
// `arrives_last` is that election for the whole block (every thread must call it):
// atomicInc(counter, blocks - 1) returns the old count and stores 0 when that count is
// blocks - 1, so the electing atomic also resets the counter for the next launch or graph
// replay (no separate reset write that could be missed). The elected block fences again before
// it reads the others' partials (through L2: volatile or ld.global.cg loads, L1 is not coherent).
__device__ __forceinline__ bool arrives_last(unsigned* counter, unsigned blocks) {
    __shared__ int elected;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) elected = atomicInc(counter, blocks - 1) == blocks - 1;
    __syncthreads();
    const bool last = elected;
    if (last) __threadfence();
    return last;
}

// Online-softmax state of G q heads at a lane's EPL elements of each (decode attention, both
// forms): q scaled, accumulators 0, running max -inf and sum 0. `q_lane`: head 0's row at the
// lane's slice; heads are `D` elements apart.
template <int G, int EPL, int D>
__device__ __forceinline__ void softmax_state_init(const store_t* q_lane, float scale, float (&qv)[G][EPL],
                                                   float (&acc)[G][EPL], float (&m)[G], float (&l)[G]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const store_t* qrow = q_lane + (long long)g * D;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qv[g][e] = to_f32(qrow[e]) * scale;
            acc[g][e] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
}

// A decode attention block's merged result at element i (< D) of output row `row` (accumulator
// a, running max mx, sum): the normalised output when the token has one block split (nb == 1),
// gated where `gate_row` (the row's gate, null for none) is given (attn_out_store), else split b's
// partial (accumulators, and max and sum at i == 0) at row * max_splits + b, for the last block
// to arrive to merge. Shared by both CUDA-core forms (merge_warp_partials) and the direct
// tensor-core one (decode_attention.cu fd_merge), whose partials share one layout.
template <int D>
__device__ __forceinline__ void store_block_result(float a, float mx, float sum, int i, long long row,
                                                   int b, int nb, int max_splits, store_t* out,
                                                   const store_t* gate_row, float* part_acc,
                                                   float* part_ml) {
    if (nb == 1) {
        attn_out_store(out + row * D, gate_row, i, a * (1.0f / sum));
    } else {
        const long long p_idx = row * max_splits + b;
        part_acc[p_idx * D + i] = a;
        if (i == 0) {
            part_ml[p_idx * 2] = mx;
            part_ml[p_idx * 2 + 1] = sum;
        }
    }
}

// Element i (< D) of q head g's block result from the WARPS warps' partials in shared memory
// (sm_m / sm_l: each warp's max and sum, sm_acc: its accumulators), merged in warp order: the
// normalised output row `row` when the token has one block split (nb == 1), else split b's
// partial (accumulators, and max and sum at i == 0) at row * max_splits + b. `gate_row`: the
// row's output gate (null for none; store_block_result). Warp 0 of a live block always has keys,
// so the block's max is finite and its sum positive.
template <int WARPS, int G, int D>
__device__ __forceinline__ void merge_warp_partials(int g, int i, const float (&sm_acc)[WARPS][D],
                                                    const float (&sm_m)[WARPS][G],
                                                    const float (&sm_l)[WARPS][G], long long row,
                                                    int b, int nb, int max_splits, store_t* out,
                                                    const store_t* gate_row, float* part_acc,
                                                    float* part_ml) {
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float a = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float lw = sm_l[w][g];
        if (lw != 0.0f) {
            const float f = expf(sm_m[w][g] - mx);
            sum = fmaf(lw, f, sum);
            a = fmaf(sm_acc[w][i], f, a);
        }
    }
    store_block_result<D>(a, mx, sum, i, row, b, nb, max_splits, out, gate_row, part_acc, part_ml);
}

// RMSNorm arithmetic of a row in chunks of 8 storage elements (a uint4), shared by norm.cu's
// rmsnorm / add_rmsnorm kernels and rope.cu's rope_kv_write_normed, which round the same expressions in the same order whatever
// their block shape. The row's f32 sum of squares is defined over `lanes` lanes (the
// block size add_rmsnorm runs with, ops/norm.rs chunked_norm_threads, a multiple of 32 that
// depends on the row length only): lane l sums the chunks l, l + lanes, ... in order with
// `chunk_sum_squares` from 0, each group of 32 lanes is summed by `warp_sum`, and the groups'
// sums (zero-padded to 32) by one more `warp_sum`. Any thread count can reproduce that order.
__device__ __forceinline__ void unpack_chunk(uint4 r, float* f) {
    const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = to_f32((store_t)(u[i] & 0xffffu));
        f[2 * i + 1] = to_f32((store_t)(u[i] >> 16));
    }
}

__device__ __forceinline__ uint4 pack_chunk(const float* f) {
    unsigned u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        u[i] = (unsigned)from_f32(f[2 * i]) | ((unsigned)from_f32(f[2 * i + 1]) << 16);
    uint4 r;
    r.x = u[0];
    r.y = u[1];
    r.z = u[2];
    r.w = u[3];
    return r;
}

// Adds the squares of a chunk's elements to ss, in element order (padding zeros add nothing).
__device__ __forceinline__ float chunk_sum_squares(uint4 r, float ss) {
    float f[8];
    unpack_chunk(r, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
    return ss;
}

// The residual add: the storage sum of a residual element and a sub-block output element.
__device__ __forceinline__ float norm_residual_add(float residual, float x) { return residual + x; }

// The reciprocal RMS of a row of `dim` from its sum of squares.
__device__ __forceinline__ float norm_rstd(float sum_sq, int dim, float eps) {
    return rsqrtf(sum_sq / (float)dim + eps);
}

// One normalised element (the caller rounds it to storage), with transformers' rounding
// points: the (1 + w) convention (Qwen3.5 / Qwen3-Next RMSNorm) computes x * rstd * (1 + w) in
// f32 and casts once; the w convention (Llama / Qwen3 RMSNorm: `weight * x.to(bf16)`) casts
// x * rstd to bf16 before the weight multiply, a bf16 product.
__device__ __forceinline__ float norm_scale(float x, float rstd, float w, int plus_one) {
    return plus_one ? x * rstd * (1.0f + w) : round_st(x * rstd) * w;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Chunk starting at element `base` (< dim) of row p, as 8 raw storage elements in a uint4: one
// 16-byte load when `vec` (dim % 8 == 0 and p 16-byte aligned), else 8 scalar loads with zeros
// past the row end (the same values either way).
__device__ __forceinline__ uint4 load_chunk(const store_t* p, int base, int dim, bool vec) {
    if (vec) return *reinterpret_cast<const uint4*>(p + base);
    unsigned u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = base + 2 * i < dim ? p[base + 2 * i] : 0u;
        const unsigned hi = base + 2 * i + 1 < dim ? p[base + 2 * i + 1] : 0u;
        u[i] = lo | (hi << 16);
    }
    uint4 r;
    r.x = u[0];
    r.y = u[1];
    r.z = u[2];
    r.w = u[3];
    return r;
}

// A normalised chunk of a row (x chunk xr, reciprocal RMS rstd), rounded to
// storage: x * rstd * weight (w or 1 + w, `plus_one`), w's chunk wr loaded as load_chunk loads
// it (the decode kernels load it before their PDL wait). norm.cu's rmsnorm / add_rmsnorm store
// it; rope.cu's rope_kv_write_normed rotates it.
__device__ __forceinline__ uint4 norm_chunk_w(uint4 xr, uint4 wr, float rstd, int plus_one) {
    float f[8], wf[8];
    unpack_chunk(xr, f);
    unpack_chunk(wr, wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = norm_scale(f[e], rstd, wf[e], plus_one);
    return pack_chunk(f);
}
// norm_chunk_w with w's chunk at `base` loaded here.
__device__ __forceinline__ uint4 norm_chunk(uint4 xr, const store_t* __restrict__ w, int base,
                                            int dim, bool vec, float rstd, int plus_one) {
    return norm_chunk_w(xr, load_chunk(w, base, dim, vec), rstd, plus_one);
}
