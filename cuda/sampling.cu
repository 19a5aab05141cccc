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
