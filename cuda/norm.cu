// RMSNorm family: plain, fused residual-add + norm, and the gated norm of Gated DeltaNet.
// One block per row; the sum of squares is accumulated in f32. `plus_one` selects the
// (1 + w) weight convention (Qwen3.5/Qwen3-Next) instead of w (Llama, Qwen3).
#include "common.cuh"

__device__ __forceinline__ float norm_weight(const store_t* w, int i, int plus_one) {
    const float wf = to_f32(w[i]);
    return plus_one ? 1.0f + wf : wf;
}

// out[r, :] = x[r, :] * rsqrt(mean(x^2) + eps) * w. Rows are `x_stride` / `out_stride`
// elements apart so that per-head norms can read q/k inside a fused projection. Grid
// dimension y indexes heads: head h of row r starts h * dim elements into the row (in and
// out), so one launch normalises every head of every token (per-head q/k norm).
extern "C" __global__ void rmsnorm(const store_t* __restrict__ x, const store_t* __restrict__ w,
                                   store_t* __restrict__ out, int dim, long long x_stride,
                                   long long out_stride, float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long head = (long long)blockIdx.y * dim;
    const store_t* xr = x + blockIdx.x * x_stride + head;
    store_t* orow = out + blockIdx.x * out_stride + head;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = from_f32(to_f32(xr[i]) * rstd * norm_weight(w, i, plus_one));
}

// residual[r, :] += x[r, :] (rounded to storage, as the model's residual stream is), then
// out[r, :] = rmsnorm(residual[r, :]). Rows are contiguous (`dim` apart).
extern "C" __global__ void add_rmsnorm(store_t* __restrict__ residual,
                                       const store_t* __restrict__ x,
                                       const store_t* __restrict__ w, store_t* __restrict__ out,
                                       int dim, float eps, int plus_one) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const store_t s = from_f32(to_f32(residual[base + i]) + to_f32(x[base + i]));
        residual[base + i] = s;
        const float v = to_f32(s);
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[base + i] = from_f32(to_f32(residual[base + i]) * rstd * norm_weight(w, i, plus_one));
}

// Gated DeltaNet output norm: out = rmsnorm(x) * w * silu(z), rows of `dim` (one head).
extern "C" __global__ void rmsnorm_gated(const store_t* __restrict__ x,
                                         const store_t* __restrict__ z,
                                         const store_t* __restrict__ w, store_t* __restrict__ out,
                                         int dim, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(x[base + i]);
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float n = to_f32(x[base + i]) * rstd * to_f32(w[i]);
        out[base + i] = from_f32(n * silu_f(to_f32(z[base + i])));
    }
}
