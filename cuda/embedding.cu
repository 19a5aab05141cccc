// Token embedding gather: out[t, :] = table[ids[t], :]. Ids outside the vocabulary give a zero
// row (the host validates ids; this only keeps a bad id from reading out of bounds).
#include "common.cuh"

extern "C" __global__ void embedding_gather(const store_t* __restrict__ table,
                                            const int* __restrict__ ids,
                                            store_t* __restrict__ out, int hidden, int vocab) {
    const int t = blockIdx.x;
    const int id = ids[t];
    store_t* dst = out + (long long)t * hidden;
    const bool valid = id >= 0 && id < vocab;
    const store_t* src = table + (long long)(valid ? id : 0) * hidden;
    if ((hidden & 7) == 0) {
        const vec8* s = reinterpret_cast<const vec8*>(src);
        vec8* d = reinterpret_cast<vec8*>(dst);
        for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
            vec8 v = s[i];
            if (!valid) {
#pragma unroll
                for (int j = 0; j < 8; ++j) v.v[j] = from_f32(0.0f);
            }
            d[i] = v;
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)
            dst[i] = valid ? src[i] : from_f32(0.0f);
    }
}
