//! The default route table: what the plan decides for each compute capability (sm_70, 75, 80,
//! 86, 89, 90, 100, 120) and model shape when no device profile overrides it. Every number here was
//! measured (the H200 for the tensor-core table and the decode splits); docs/kernels.md keeps
//! what each route computes and why it won.

use super::{DeviceFacts, ModelShape, Plan};
use crate::backend::cuda::ops::{DecodeAttentionRoute, GdnScanForms, GemvForm, GemvTcConfig, GemvTcRule, PrepForm};
use crate::config::CudaOptions;

/// Shorthand for the instance table.
const fn tc(warps: usize, unroll: usize, hold: bool) -> GemvTcConfig {
    GemvTcConfig { warps, unroll, hold }
}

/// The tensor-core GEMV instance per weight shape, first matching row wins, else
/// `GemvTcConfig::DEFAULT` (w8u4). Filled from `report_gemv_tc_sweep` on the H200
/// (cold-L2 weight read rate per instance, rust_core/tests/cuda_ops/gemv_tc.rs): per shape the instance with the least time
/// summed over M = 1, 2, 4, 8, a warps-8 one where it is within 2% (w8 instances give w8u4's
/// bits). Why it depends on the shape: a block per 16 weight rows gives rows / 16 blocks (256
/// for a 4096-row projection against 132 SMs: few warps to keep loads in flight, where holding
/// 8 steps of loads per warp gained 13-14%) while a warp streams K / 32 / warps steps (the
/// 14336-wide down projection: 16 warps a block gained 4%). GB/s at M = 1, chosen / w8u4 /
/// CUDA-core kernel (copy 4248, read + write):
///
/// | model       | weight       | rows x K        | blocks | instance | GB/s at M = 1        |
/// |-------------|--------------|-----------------|--------|----------|----------------------|
/// | Llama-3-8B  | qkv          | 6144 x 4096     | 384    | w8u4h    | 3295 / 2887 / 2999   |
/// | Llama-3-8B  | o            | 4096 x 4096     | 256    | w8u8h    | 3086 / 2732 / 2952   |
/// | Llama-3-8B  | gate_up      | 28672 x 4096    | 1792   | w8u8h    | 3692 / 3610 / 3729   |
/// | Llama-3-8B  | down         | 4096 x 14336    | 256    | cc/w16u4 | 3532 / 3384 / 3663   |
/// | Llama-3-8B  | lm_head f32  | 128256 x 4096   | 8016   | cc/w16u4h| 3960 / 3762 / 4252   |
/// | Qwen3.5-27B | attn qkv+gate| 14336 x 5120    | 896    | cc/w8u8h | 3510 / 3533 / 3798   |
/// | Qwen3.5-27B | attn o       | 5120 x 6144     | 320    | w8u4h    | 3066 / 2786 / 2837   |
/// | Qwen3.5-27B | GDN in_proj  | 16480 x 5120    | 1030   | cc/w8u8h | 3639 / 3596 / 3886   |
/// | Qwen3.5-27B | GDN out      | 5120 x 6144     | 320    | w8u4h    | (as attn o)          |
/// | Qwen3.5-27B | gate_up      | 34816 x 5120    | 2176   | cc/w8u8h | 3784 / 3729 / 3941   |
/// | Qwen3.5-27B | down         | 5120 x 17408    | 320    | cc/w8u4  | 3258 / 3258 / 3569   |
/// | Qwen3.5-27B | lm_head f32  | 248320 x 5120   | 15520  | cc/w8u8h | 4063 / 3933 / 4438   |
///
/// The CUDA-core kernel reads most big matrices faster at M = 1 (4-9% on the 27B's, 4-7% on the
/// 8B's down and lm_head) but not at M >= 2 (1.19 TB/s at M = 8 against 3.8). In the model the
/// isolated figures mislead (neighbours overlap under PDL, L2 is warm): batch-1 decode of both
/// Llama-3-8B and Qwen3.5-27B ran fastest with every shape on CUDA cores (224.7 against at most
/// 221.8 tok/s, 75.2 against 72.1), so `cuda_cores` (the kernel `GemvForm::ByShape` runs at
/// M = 1) is set for every shape measured; from M = 2 on every shape runs its tensor-core
/// instance (`config`).
pub const GEMV_TC_RULES: &[GemvTcRule] = &[
    GemvTcRule { max_rows: 4096, min_k: 8192, config: tc(16, 4, false), cuda_cores: true },
    GemvTcRule { max_rows: 4096, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 5120, min_k: 16384, config: GemvTcConfig::DEFAULT, cuda_cores: true },
    GemvTcRule { max_rows: 6144, min_k: 0, config: tc(8, 4, true), cuda_cores: true },
    GemvTcRule { max_rows: 65536, min_k: 5120, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 65536, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 131072, min_k: 0, config: tc(16, 4, true), cuda_cores: true },
    GemvTcRule { max_rows: usize::MAX, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
];
/// k32 steps per block the tensor-core GEMV prefetches into L2 before its PDL wait: 16 (16 KB,
/// 12.5% of a 4096-wide weight tile). Deeper only slowed decode in the model (128 steps: -14%).
pub const TC_PREFETCH_STEPS: u32 = 16;

/// Weight vectors per lane the CUDA-core GEMV prefetches before its PDL wait: none. Every depth
/// and per-launch budget tried decoded slower (the early lines cost the kernels still running
/// more than they save).
pub const CC_PREFETCH_VECTORS: u32 = 0;

/// Largest hidden size whose CUDA-core GEMVs split K in two. Llama-3-8B (hidden 4096) batch-1
/// decode +5% at a split of 2 (4 and 8 slower); Qwen3.5-27B (hidden 5120) -3%: its GEMVs stream
/// more bytes a launch, so the tail the split shortens is a smaller share of each and the
/// reduction costs more than it saves. One split for all of a model's weights.
pub const CC_KSPLIT_MAX_HIDDEN: usize = 4096;

/// Warps of a CUDA-core GEMV block that share one warp's columns, splitting K between them, for
/// a model of hidden size `hidden` (None: a device opened without a model, the unsplit kernel).
pub fn default_cc_ksplit(hidden: Option<usize>) -> usize {
    match hidden {
        Some(h) if h <= CC_KSPLIT_MAX_HIDDEN => 2,
        _ => 1,
    }
}

/// Warps a CUDA-core GEMV block at K split `ksplit`: 4 (two column groups a block) with a split
/// of 2 (+0.8% against 8 at Llama-3-8B batch-1 decode), else GEMV_WARPS (2 and 4 decode within
/// the spread of 8 unsplit). Never changes a value: a warp's sums do not depend on its block.
pub fn default_cc_warps(ksplit: usize) -> usize {
    if ksplit == 2 {
        4
    } else {
        crate::backend::cuda::ops::GEMV_WARPS
    }
}

/// The plan a device of `facts` runs a model of shape `model` with under `options`, before any
/// device profile.
pub fn default_plan(facts: &DeviceFacts, model: ModelShape, options: &CudaOptions) -> Plan {
    let (major, _) = facts.compute_capability;
    let cc_ksplit = default_cc_ksplit(model.hidden_size);
    // Tensor cores from sm_80 (mma.sync m16n8k16 with bf16 inputs); per shape unless every M of
    // a shape must run one kernel.
    let gemv_form = match (major >= 8, options.batch_invariant) {
        (false, _) => GemvForm::Simt,
        (true, false) => GemvForm::ByShape,
        (true, true) => GemvForm::TensorCores,
    };
    Plan {
        facts: facts.clone(),
        gemv_form,
        gemv_rules: GEMV_TC_RULES.to_vec(),
        cc_ksplit,
        cc_warps: default_cc_warps(cc_ksplit),
        cc_prefetch_vectors: CC_PREFETCH_VECTORS,
        tc_prefetch_steps: TC_PREFETCH_STEPS,
        decode_attention: DecodeAttentionRoute { tensor_cores: major >= 8, batch_invariant: options.batch_invariant },
        // The warp-specialized prefill attention is sm_90a code built by NVRTC 13.
        prefill_warp_specialized: crate::backend::cuda::kernels::has_sm90a_code(facts.compute_capability.0, facts.compute_capability.1)
            && facts.nvrtc_major >= 13,
        gdn_prep: if major >= 8 { PrepForm::TensorCores } else { PrepForm::Simt },
        gdn_scan: GdnScanForms::for_device(major, facts.smem_optin),
        q4_ring: None,
        fused_rope: true,
        // The griddepcontrol instructions are sm_90+ (older devices would ignore the attribute).
        pdl: major >= 9,
        smem_carveout: None,
        cuda_graphs: options.cuda_graphs,
        device_sampling: options.device_sampling,
        batch_invariant: options.batch_invariant,
    }
}
