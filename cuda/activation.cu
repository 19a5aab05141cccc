// Elementwise activations of the MLP and the attention output gate: f32 math, rounded to
// storage where transformers holds a bf16 tensor (silu(gate), sigmoid(gate)).
//
// Two forms of each: `_v8` for rows whose starts are 16-byte aligned (n and both strides
// multiples of 8, aligned pointers: every real model's shapes), one 16-byte chunk a thread with
// the row from grid y, so no per-element 64-bit division and 16-byte loads; the scalar form for
// the rest (tiny test shapes). The launcher (ops/elementwise.rs) picks; both compute every
// element with the same expression, so they agree bit for bit. In a batched decode profile
// (Llama-3-8B, batch 64) the scalar swiglu took 7.3 us a layer for 5.5 MB.
#include "common.cuh"

// Eight storage elements as a 16-byte chunk (element 0 in the low half of the first word).
__device__ __forceinline__ uint4 pack_store8(const store_t (&v)[8]) {
    uint4 r;
    r.x = (unsigned)v[0] | ((unsigned)v[1] << 16);
    r.y = (unsigned)v[2] | ((unsigned)v[3] << 16);
    r.z = (unsigned)v[4] | ((unsigned)v[5] << 16);
    r.w = (unsigned)v[6] | ((unsigned)v[7] << 16);
    return r;
}

// out[r, i] = silu(gate[r, i]) * up[r, i] (common.cuh swiglu_out); gate and up rows are
// `gate_stride` / `up_stride` apart so that a fused gate_up projection is read in place.
extern "C" __global__ void swiglu(const store_t* __restrict__ gate, const store_t* __restrict__ up,
                                  store_t* __restrict__ out, int rows, int n, long long gate_stride,
                                  long long up_stride) {
    pdl_enter();
    const long long total = (long long)rows * n;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n;
        const int i = (int)(e - r * n);
        out[e] = swiglu_out(to_f32(gate[r * gate_stride + i]), to_f32(up[r * up_stride + i]));
    }
}

// out[r, i] = x[r, i] * sigmoid(gate[r, i]) (Qwen3.5 gated attention output; common.cuh
// gated_out, which decode attention's final write also applies: the decode steps of gated models
// take the gate there and skip this kernel). `out` may be `x`.
extern "C" __global__ void sigmoid_gate_mul(const store_t* x, const store_t* __restrict__ gate,
                                            store_t* out, int rows, int n, long long gate_stride) {
    pdl_enter();
    const long long total = (long long)rows * n;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n;
        const int i = (int)(e - r * n);
        out[e] = gated_out(to_f32(x[e]), to_f32(gate[r * gate_stride + i]));
    }
}

// swiglu over 16-byte chunks: chunk c of row r (grid y strides over rows, grid x over chunks).
extern "C" __global__ void swiglu_v8(const store_t* __restrict__ gate, const store_t* __restrict__ up,
                                     store_t* __restrict__ out, int rows, int n, long long gate_stride,
                                     long long up_stride) {
    pdl_enter();
    const int chunks = n >> 3;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
            float g[8], u[8];
            unpack_chunk(*reinterpret_cast<const uint4*>(gate + r * gate_stride + 8 * c), g);
            unpack_chunk(*reinterpret_cast<const uint4*>(up + r * up_stride + 8 * c), u);
            store_t o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = swiglu_out(g[e], u[e]);
            *reinterpret_cast<uint4*>(out + (long long)r * n + 8 * c) = pack_store8(o);
        }
    }
}

// sigmoid_gate_mul over 16-byte chunks, as swiglu_v8. `out` may be `x` (each thread reads its
// chunk before writing it).
extern "C" __global__ void sigmoid_gate_mul_v8(const store_t* x, const store_t* __restrict__ gate,
                                               store_t* out, int rows, int n, long long gate_stride) {
    pdl_enter();
    const int chunks = n >> 3;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
            const long long e = (long long)r * n + 8 * c;
            float xv[8], g[8];
            unpack_chunk(*reinterpret_cast<const uint4*>(x + e), xv);
            unpack_chunk(*reinterpret_cast<const uint4*>(gate + r * gate_stride + 8 * c), g);
            store_t o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = gated_out(xv[i], g[i]);
            *reinterpret_cast<uint4*>(out + e) = pack_store8(o);
        }
    }
}
