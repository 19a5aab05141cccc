//! The route plan: every kernel route one CUDA device takes for one model, decided once at load
//! from the device's facts (compute capability, SMs, shared memory, NVRTC), the model's shapes,
//! the engine's options and an optional device profile, then read by every launcher. Nothing
//! re-decides a route per step and nothing reads the environment for one: the default table is
//! defaults.rs, a measured device's overrides come from its profile (profile.rs).

mod defaults;
mod profile;
#[cfg(test)]
mod tests;

pub use defaults::{default_cc_ksplit, default_cc_warps, default_plan, CC_KSPLIT_MAX_HIDDEN, CC_PREFETCH_VECTORS, GEMV_TC_RULES, TC_PREFETCH_STEPS};
pub use profile::{DeviceProfile, PlanOverrides, PROFILE_VERSION};

use crate::backend::cuda::ops::{DecodeAttentionRoute, GdnScanForms, GemvForm, GemvTcRule, PrepForm};
use crate::config::CudaOptions;
use crate::Result;

/// What the plan reads of the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    /// The driver's name ("NVIDIA H200"), which a device profile must name.
    pub name: String,
    /// The capability every route sees: the GPU's own, or the emulated one (emulate.rs).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Dynamic shared memory one block may opt into, bytes (0 where the driver does not say).
    pub smem_optin: usize,
    /// Major version of the NVRTC that compiles the kernels (0 where none loads).
    pub nvrtc_major: i32,
}

/// What the plan reads of the model (None for a device opened without one: the op tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelShape {
    pub hidden_size: Option<usize>,
}

/// Every route decision of one device and model, as named fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The device the plan was made for.
    pub facts: DeviceFacts,
    /// The decode GEMV form (ops/gemv_route.rs): per shape from sm_80, one tensor-core instance a
    /// shape under batch invariance, CUDA cores below sm_80.
    pub gemv_form: GemvForm,
    /// The per-shape table of the GEMV forms that consult one (first matching rule wins).
    pub gemv_rules: Vec<GemvTcRule>,
    /// Warps of a CUDA-core GEMV block that split one warp's K (1, 2, 4 or 8; at most `cc_warps`).
    pub cc_ksplit: usize,
    /// Warps a CUDA-core GEMV block (2, 4 or 8).
    pub cc_warps: usize,
    /// Weight vectors per lane the CUDA-core GEMV prefetches before its PDL wait (capped at a row).
    pub cc_prefetch_vectors: u32,
    /// k32 steps per block the tensor-core GEMV prefetches before its PDL wait (0..=512).
    pub tc_prefetch_steps: u32,
    /// Which decode attention form a launch runs (ops/decode_attention.rs).
    pub decode_attention: DecodeAttentionRoute,
    /// Prefill attention may take the warp-specialized wgmma tiling (sm_90a code, NVRTC 13).
    pub prefill_warp_specialized: bool,
    /// The chunked GDN's prep form.
    pub gdn_prep: PrepForm,
    /// The chunked GDN's scan form per key head size.
    pub gdn_scan: GdnScanForms,
    /// The tiled 4-bit GEMVs' form for every model on the device: Some(true) the ring form,
    /// Some(false) the pass form; None (the default) by each model's smallest quantized K
    /// (`quant_tiles::q4t_ring`). A profile may fix it where a device measured otherwise.
    pub q4_ring: Option<bool>,
    /// Batch-1 decode runs the qkv projection with RoPE and the KV cache write in its epilogue
    /// where the layer's layout allows it (`qkv_rope_fits`).
    pub fused_rope: bool,
    /// Kernels that wait on their predecessor are launched with Programmatic Dependent Launch.
    pub pdl: bool,
    /// The preferred shared-memory carveout (percent) of every kernel within the default 48 KiB
    /// of dynamic shared memory, or None for the driver's choice.
    pub smem_carveout: Option<i32>,
    /// Decode steps run as captured CUDA graphs (`CudaOptions::cuda_graphs`).
    pub cuda_graphs: bool,
    /// Steps sample on the device (`CudaOptions::device_sampling`).
    pub device_sampling: bool,
    /// Every route independent of the batch size (`CudaOptions::batch_invariant`).
    pub batch_invariant: bool,
}

impl Plan {
    /// The plan of a device of `facts` for a model of shape `model` under `options`: the
    /// default table, then the overrides of the profile `options.profile` names (an error naming
    /// the file and the field where it does not parse, names another device or asks for a
    /// route the device lacks).
    pub fn build(facts: &DeviceFacts, model: ModelShape, options: &CudaOptions) -> Result<Plan> {
        let mut plan = default_plan(facts, model, options);
        if let Some(path) = &options.profile {
            DeviceProfile::read(path)?.apply(path, &mut plan)?;
        }
        Ok(plan)
    }

    /// Vectors per lane the CUDA-core GEMV prefetches for a weight of `rows` x `k`: the plan's,
    /// at most a whole row (ceil(k / 256)).
    pub fn cc_prefetch_vectors(&self, _rows: usize, k: usize) -> u32 {
        let whole = k.div_ceil(8).div_ceil(32) as u64;
        (self.cc_prefetch_vectors as u64).min(whole) as u32
    }
}
