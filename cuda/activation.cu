// Elementwise activations of the MLP and the attention output gate: f32 math, rounded to
// storage where transformers holds a bf16 tensor (silu(gate), sigmoid(gate)).
#include "common.cuh"

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

// out[r, i] = x[r, i] * sigmoid(gate[r, i]) (Qwen3.5 gated attention output), sigmoid rounded
// to storage before the product as transformers' attn_output * torch.sigmoid(gate) holds it in
// a bf16 tensor. `out` may be `x`.
extern "C" __global__ void sigmoid_gate_mul(const store_t* x, const store_t* __restrict__ gate,
                                            store_t* out, int rows, int n, long long gate_stride) {
    pdl_enter();
    const long long total = (long long)rows * n;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n;
        const int i = (int)(e - r * n);
        out[e] = from_f32(to_f32(x[e]) * round_st(sigmoid_f(to_f32(gate[r * gate_stride + i]))));
    }
}
