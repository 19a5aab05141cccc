// The quantized Hugging Face checkpoint forms (rust_core/src/quant/hf.rs defines them): decode
// GEMV and dequantize kernels of block-scaled FP8, AWQ, GPTQ and compressed-tensors
// pack-quantized 4-bit, each reading the checkpoint's own tensors (data, scale, zero, g_idx) as
// stored; each decoder gives values k0 .. k0 + 7 of output row `row` (k0 a multiple of 8)
// exactly as the CPU decoder does.
// A 4-bit weight whose groups are whole runs of 64 values (no act-order g_idx) is repacked at
// upload into quant.cuh's tiled layout with its zeros and runs the tiled kernels
// (quant_gemv_q4_tiles_*); the decoders below serve the rest (groups of 32, act-order), AWQ and
// GPTQ reading K-major words (8 output rows, or 8 inputs of one row, per 32-bit word).
#include "quant.cuh"

// The group of input `col`: g_idx[col] where given, else col / group (0: one group a row).
__device__ __forceinline__ int hf_group(const qweight& w, int col, long long group) {
    if (w.g_idx) return __ldg(w.g_idx + col);
    return group == 0 ? 0 : (int)(col / group);
}

// Block FP8: data E4M3FN [N, K], scale F32 (p2 = 0) or BF16 (p2 = 2) [ceil(N/bn), ceil(K/bk)]
// with bn = p0, bk = p1; w = e4m3(c) * scale.
struct dec_fp8_block {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const long long sk = (w.k + w.p1 - 1) / w.p1;
        const long long srow = (row / w.p0) * sk;
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(w.data + (long long)row * w.k + k0));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float s = q_float_at(w.scale, srow + (k0 + j) / w.p1, w.p2);
            v[j] = __fmul_rn(q_e4m3((j < 4 ? q.x : q.y) >> (8 * (j % 4))), s);
        }
    }
};

// AWQ (GEMM form): qweight I32 [K, N/8], qzeros I32 [G, N/8], scales F16 [G, N], group p0; row
// n is nibble AWQ_NIBBLE[n % 8] (0,4,1,5,2,6,3,7) of word n / 8; w = f32(q - z) * scale.
struct dec_awq {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const int n8 = w.n / 8, wc = row / 8;
        const int ni = ((row % 8) / 2) + ((row % 2) ? 4 : 0);
        const unsigned* qw = reinterpret_cast<const unsigned*>(w.data);
        const unsigned* qz = reinterpret_cast<const unsigned*>(w.zero);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = k0 + j;
            const int q = (int)((__ldg(qw + (long long)col * n8 + wc) >> (4 * ni)) & 15u);
            const int g = hf_group(w, col, w.p0);
            const int z = (int)((__ldg(qz + (long long)g * n8 + wc) >> (4 * ni)) & 15u);
            v[j] = __fmul_rn((float)(q - z), q_float_at(w.scale, (long long)g * w.n + row, 1));
        }
    }
};

// GPTQ: qweight I32 [K/8, N] (input k is nibble k % 8 of row k / 8), qzeros I32 [G, N/8] (row n
// is nibble n % 8), scales F16 [G, N], optional g_idx; group p0, p1 = 1 where the checkpoint
// stores each zero minus one; w = f32(q - zero) * scale[g_idx[k], n].
struct dec_gptq {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const unsigned word = __ldg(reinterpret_cast<const unsigned*>(w.data) + (long long)(k0 / 8) * w.n + row);
        const unsigned* qz = reinterpret_cast<const unsigned*>(w.zero);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = k0 + j;
            const int q = (int)((word >> (4 * j)) & 15u);
            const int g = hf_group(w, col, w.p0);
            const int z = (int)((__ldg(qz + (long long)g * (w.n / 8) + row / 8) >> (4 * (row % 8))) & 15u) + (int)w.p1;
            v[j] = __fmul_rn((float)(q - z), q_float_at(w.scale, (long long)g * w.n + row, 1));
        }
    }
};

// compressed-tensors pack-quantized: weight_packed I32 [N, K/8] (input k is nibble k % 8 of word
// k / 8, the code plus 8), weight_scale [N, G] of dtype p1 (0 F32, 1 F16, 2 BF16), optional
// weight_zero_point I32 [ceil(N/8), G] (row n is nibble n % 8, the zero plus 8), optional g_idx;
// group p0; w = f32(q - z) * scale[n, g].
struct dec_pack4 {
    __device__ __forceinline__ static void decode8(const qweight& w, int row, int k0, float (&v)[8]) {
        const long long gs = w.p0 == 0 ? 1 : (w.k + w.p0 - 1) / w.p0;
        const unsigned word = __ldg(reinterpret_cast<const unsigned*>(w.data) + (long long)row * (w.k / 8) + k0 / 8);
        const unsigned* zp = reinterpret_cast<const unsigned*>(w.zero);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = k0 + j;
            const int q = (int)((word >> (4 * j)) & 15u) - 8;
            const int g = hf_group(w, col, w.p0);
            const int z = zp ? (int)((__ldg(zp + (long long)(row / 8) * gs + g) >> (4 * (row % 8))) & 15u) - 8 : 0;
            v[j] = __fmul_rn((float)(q - z), q_float_at(w.scale, (long long)row * gs + g, w.p1));
        }
    }
};

QUANT_KERNELS(fp8_block, dec_fp8_block)
QUANT_KERNELS(awq4, dec_awq)
QUANT_KERNELS(gptq4, dec_gptq)
QUANT_KERNELS(pack4, dec_pack4)
QUANT_TILED_KERNELS(q4_tiles, dec_q4_tiles)
