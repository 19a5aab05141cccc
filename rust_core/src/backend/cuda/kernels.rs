//! The CUDA sources of every kernel family, embedded in the binary.
//!
//! Kernels are compiled from these sources with NVRTC on the machine that runs them, for its
//! exact architecture (see `nvrtc.rs` and docs/kernels.md), so the crate itself never needs a
//! CUDA toolkit to build. Each `.cu` in `cuda/` is one family; the headers (`HEADERS`:
//! `common.cuh`, which they all include, the attention families' `attention_keys.cuh` and
//! `attention_mma.cuh`, the quantized families' `quant.cuh` and `quant_chunk.cuh`, and the
//! low-precision GEMM routes' `narrow_float.cuh`) are handed to NVRTC with each.

/// The header every kernel source includes (`#include "common.cuh"`).
pub const COMMON_HEADER: &str = include_str!("../../../../cuda/common.cuh");

/// Every header a kernel source may include, by the name it includes it as: handed to NVRTC
/// with each program and hashed into the kernel cache's keys.
pub const HEADERS: [(&str, &str); 6] = [
    ("common.cuh", COMMON_HEADER),
    ("attention_keys.cuh", include_str!("../../../../cuda/attention_keys.cuh")),
    ("attention_mma.cuh", include_str!("../../../../cuda/attention_mma.cuh")),
    ("quant.cuh", include_str!("../../../../cuda/quant.cuh")),
    ("quant_chunk.cuh", include_str!("../../../../cuda/quant_chunk.cuh")),
    ("narrow_float.cuh", include_str!("../../../../cuda/narrow_float.cuh")),
];

/// Architectures CI compiles every kernel for (V100 through H100/H200, the B200's sm_100 and the
/// RTX 50 series' sm_120).
pub const CI_ARCHES: [u32; 8] = [70, 75, 80, 86, 89, 90, 100, 120];

/// Whether kernels for compute capability `major.minor` are compiled as sm_90a code (so that
/// its wgmma kernels run there): 9.0 only.
pub fn has_sm90a_code(major: u32, minor: u32) -> bool {
    (major, minor) == (9, 0)
}

/// The NVRTC architecture the kernels are compiled for on a device of compute capability
/// `major.minor`: its own, except that 9.0 (H100 / H200) gets `sm_90a`, whose code runs on 9.0
/// only and adds the Hopper instructions (wgmma) the prefill attention uses there.
pub fn nvrtc_arch(major: u32, minor: u32) -> String {
    if has_sm90a_code(major, minor) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// How activations and weights are stored on the device. Math is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageDType {
    /// bfloat16: the checkpoints' own type; native on sm_80 and newer.
    Bf16,
    /// IEEE half: the fallback for sm_70/sm_75, which have no bf16 arithmetic units.
    F16,
}

impl StorageDType {
    /// The storage type to use on a device of compute capability `major.minor`.
    pub fn for_arch(major: u32, _minor: u32) -> Self {
        if major >= 8 {
            StorageDType::Bf16
        } else {
            StorageDType::F16
        }
    }

    /// The preprocessor defines that select this storage type in `common.cuh`.
    pub fn defines(self) -> &'static [&'static str] {
        match self {
            StorageDType::Bf16 => &[],
            StorageDType::F16 => &["-DNINFER_STORAGE_F16"],
        }
    }

    /// Short name used in cache file names and logs.
    pub fn name(self) -> &'static str {
        match self {
            StorageDType::Bf16 => "bf16",
            StorageDType::F16 => "f16",
        }
    }
}

/// One `.cu` file of `cuda/`: the unit that is compiled and loaded as a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// Token embedding gather.
    Embedding,
    /// RMSNorm, fused residual-add + RMSNorm, gated RMSNorm.
    Norm,
    /// Rotary position embedding (NeoX layout, partial).
    Rope,
    /// SwiGLU and the sigmoid output gate.
    Activation,
    /// Small-M GEMV for decode on CUDA cores (sm_7x).
    Gemv,
    /// Small-M GEMV for decode on tensor cores (sm_80+ only: `min_arch`).
    GemvTc,
    /// Paged attention (decode and prefill), split combine, KV cache write.
    Attention,
    /// Decode attention in one kernel: the direct tensor-core form (sm_80+), the form whose
    /// splits grow with each token's context and the fixed-split form.
    DecodeAttention,
    /// Causal flash attention for prefill on tensor cores with mma.sync (sm_80+).
    FlashAttention,
    /// Causal flash attention for prefill on Hopper's warpgroup tensor cores (sm_90a).
    FlashAttentionSm90,
    /// Gated DeltaNet: causal conv1d, gates, recurrent rule.
    Gdn,
    /// Gated DeltaNet chunked prefill (WY form, 64-token chunks).
    GdnChunked,
    /// Greedy argmax + logsumexp, and the full sampler (penalties, top-k/p, min-p, logprobs).
    Sampling,
    /// Quantized weights of the NInfer formats (W8/Q4/Q5/Q6 groups, FP8 rows, NVFP4): decode
    /// GEMV with fused dequantization, and dequantization into f32 or the storage type.
    QuantNinfer,
    /// The same kernels for the GGUF block formats (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S).
    QuantGguf,
    /// The same kernels for the Hugging Face forms (block FP8, AWQ, GPTQ, pack-quantized).
    QuantHf,
    /// The FP8 prefill route's activation quantization and scaling epilogue around cuBLASLt's
    /// FP8 GEMM (sm_89+; compiled for every arch like the rest).
    Fp8Gemm,
    /// The NVFP4 prefill route's activation quantization and row scaling around cuBLASLt's
    /// block-scaled FP4 GEMM (sm_100+; compiled for every arch like the rest).
    Fp4Gemm,
}

impl KernelFamily {
    /// Every family, in the order CI compiles them.
    pub const ALL: [KernelFamily; 18] = [
        KernelFamily::Embedding,
        KernelFamily::Norm,
        KernelFamily::Rope,
        KernelFamily::Activation,
        KernelFamily::Gemv,
        KernelFamily::GemvTc,
        KernelFamily::Attention,
        KernelFamily::DecodeAttention,
        KernelFamily::FlashAttention,
        KernelFamily::FlashAttentionSm90,
        KernelFamily::Gdn,
        KernelFamily::GdnChunked,
        KernelFamily::Sampling,
        KernelFamily::QuantNinfer,
        KernelFamily::QuantGguf,
        KernelFamily::QuantHf,
        KernelFamily::Fp8Gemm,
        KernelFamily::Fp4Gemm,
    ];

    /// The oldest compute capability (major * 10 + minor) the family is built for: the
    /// tensor-core GEMV's mma.sync m16n8k16 needs sm_80, and sm_7x runs the CUDA-core GEMV, so
    /// it is neither compiled nor loaded there. Every other family serves every arch.
    pub fn min_arch(self) -> u32 {
        match self {
            KernelFamily::GemvTc => 80,
            _ => 70,
        }
    }

    /// Whether the family serves a device of compute capability (major, minor).
    pub fn serves(self, major: u32, minor: u32) -> bool {
        major * 10 + minor >= self.min_arch()
    }

    /// Whether the family holds quantized-weight kernels (loaded only with quantized weights).
    pub fn is_quant(self) -> bool {
        matches!(self, KernelFamily::QuantNinfer | KernelFamily::QuantGguf | KernelFamily::QuantHf | KernelFamily::Fp8Gemm | KernelFamily::Fp4Gemm)
    }

    /// File name under `cuda/` (also the NVRTC program name, so errors point at the file).
    pub fn file_name(self) -> &'static str {
        match self {
            KernelFamily::Embedding => "embedding.cu",
            KernelFamily::Norm => "norm.cu",
            KernelFamily::Rope => "rope.cu",
            KernelFamily::Activation => "activation.cu",
            KernelFamily::Gemv => "gemv.cu",
            KernelFamily::GemvTc => "gemv_tc.cu",
            KernelFamily::Attention => "attention.cu",
            KernelFamily::DecodeAttention => "decode_attention.cu",
            KernelFamily::FlashAttention => "flash_attention.cu",
            KernelFamily::FlashAttentionSm90 => "flash_attention_sm90.cu",
            KernelFamily::Gdn => "gdn.cu",
            KernelFamily::GdnChunked => "gdn_chunked.cu",
            KernelFamily::Sampling => "sampling.cu",
            KernelFamily::QuantNinfer => "quant_ninfer.cu",
            KernelFamily::QuantGguf => "quant_gguf.cu",
            KernelFamily::QuantHf => "quant_hf.cu",
            KernelFamily::Fp8Gemm => "fp8_gemm.cu",
            KernelFamily::Fp4Gemm => "fp4_gemm.cu",
        }
    }

    /// The CUDA C++ source.
    pub fn source(self) -> &'static str {
        match self {
            KernelFamily::Embedding => include_str!("../../../../cuda/embedding.cu"),
            KernelFamily::Norm => include_str!("../../../../cuda/norm.cu"),
            KernelFamily::Rope => include_str!("../../../../cuda/rope.cu"),
            KernelFamily::Activation => include_str!("../../../../cuda/activation.cu"),
            KernelFamily::Gemv => include_str!("../../../../cuda/gemv.cu"),
            KernelFamily::GemvTc => include_str!("../../../../cuda/gemv_tc.cu"),
            KernelFamily::Attention => include_str!("../../../../cuda/attention.cu"),
            KernelFamily::DecodeAttention => include_str!("../../../../cuda/decode_attention.cu"),
            KernelFamily::FlashAttention => include_str!("../../../../cuda/flash_attention.cu"),
            KernelFamily::FlashAttentionSm90 => include_str!("../../../../cuda/flash_attention_sm90.cu"),
            KernelFamily::Gdn => include_str!("../../../../cuda/gdn.cu"),
            KernelFamily::GdnChunked => include_str!("../../../../cuda/gdn_chunked.cu"),
            KernelFamily::Sampling => include_str!("../../../../cuda/sampling.cu"),
            KernelFamily::QuantNinfer => include_str!("../../../../cuda/quant_ninfer.cu"),
            KernelFamily::QuantGguf => include_str!("../../../../cuda/quant_gguf.cu"),
            KernelFamily::QuantHf => include_str!("../../../../cuda/quant_hf.cu"),
            KernelFamily::Fp8Gemm => include_str!("../../../../cuda/fp8_gemm.cu"),
            KernelFamily::Fp4Gemm => include_str!("../../../../cuda/fp4_gemm.cu"),
        }
    }
}
