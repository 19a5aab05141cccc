//! A device profile: routes measured on one device, which override the default table for it.
//! JSON, versioned, naming the device (driver name and compute capability) it was measured on;
//! the calibration work writes it, the plan reads it (`Plan::build`). Every field of `plan` is
//! optional: what the profile leaves out keeps the default.
//!
//! ```json
//! {"version": 1, "device": "NVIDIA H200", "compute_capability": "9.0",
//!  "plan": {"cc_ksplit": 2, "cc_warps": 4, "tc_prefetch_steps": 16, "pdl": true,
//!           "gemv_rules": [{"max_rows": 4096, "min_k": 0, "kernel": "w8u8h", "cuda_cores_at_batch_1": true}]}}
//! ```

use std::path::Path;

use serde::Deserialize;

use super::Plan;
use crate::backend::cuda::ops::{GemvTcConfig, GemvTcRule, GEMV_WARPS};
use crate::{NinferError, Result};

/// The profile format this build reads.
pub const PROFILE_VERSION: u32 = 1;

/// Most k32 steps the tensor-core GEMV may prefetch: 512 cover a whole K of 16384.
const TC_PREFETCH_MAX_STEPS: u32 = 512;

/// A parsed device profile.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// PROFILE_VERSION.
    pub version: u32,
    /// The driver's name of the device it was measured on ("NVIDIA H200").
    pub device: String,
    /// Its compute capability, "MAJOR.MINOR".
    pub compute_capability: String,
    /// The routes it overrides.
    #[serde(default)]
    pub plan: PlanOverrides,
}

/// The plan fields a profile may set (each optional).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanOverrides {
    pub gemv_rules: Option<Vec<ProfileGemvRule>>,
    pub cc_ksplit: Option<usize>,
    pub cc_warps: Option<usize>,
    pub cc_prefetch_vectors: Option<u32>,
    pub tc_prefetch_steps: Option<u32>,
    pub pdl: Option<bool>,
    pub smem_carveout: Option<i32>,
    pub fused_rope: Option<bool>,
    pub q4_ring: Option<bool>,
    pub decode_tensor_cores: Option<bool>,
    pub prefill_warp_specialized: Option<bool>,
}

/// A row of the GEMV table: weights of at most `max_rows` rows (absent: any) and at least
/// `min_k` columns run tensor-core instance `kernel` (`GemvTcConfig::label`, e.g. "w8u4h"), or
/// at batch 1 the CUDA-core kernel where `cuda_cores_at_batch_1`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileGemvRule {
    pub max_rows: Option<usize>,
    #[serde(default)]
    pub min_k: usize,
    pub kernel: String,
    #[serde(default)]
    pub cuda_cores_at_batch_1: bool,
}

/// The error for profile `path`: what is wrong, naming the field.
fn bad(path: &Path, field: &str, why: impl std::fmt::Display) -> NinferError {
    NinferError::config(format!("device profile {}", path.display()), format!("field `{field}`: {why}"))
}

impl DeviceProfile {
    /// Reads and parses the profile at `path` (an error naming the file, and serde's message
    /// naming the field, line and column where it does not parse).
    pub fn read(path: &Path) -> Result<DeviceProfile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| NinferError::config(format!("device profile {}", path.display()), format!("cannot be read: {e}")))?;
        Self::parse(path, &text)
    }

    /// Parses profile text (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<DeviceProfile> {
        let p: DeviceProfile =
            serde_json::from_str(text).map_err(|e| NinferError::config(format!("device profile {}", path.display()), e.to_string()))?;
        if p.version != PROFILE_VERSION {
            return Err(bad(path, "version", format!("this build reads version {PROFILE_VERSION}, the file is version {}", p.version)));
        }
        Ok(p)
    }

    /// Applies the profile to `plan` after checking it was measured on the plan's device and
    /// that every value is one the device runs.
    pub fn apply(&self, path: &Path, plan: &mut Plan) -> Result<()> {
        let (major, minor) = plan.facts.compute_capability;
        let cc = format!("{major}.{minor}");
        if self.compute_capability.trim() != cc {
            return Err(bad(path, "compute_capability", format!("measured on {} ({}), this device is {} ({cc})", self.device, self.compute_capability, plan.facts.name)));
        }
        if self.device.trim() != plan.facts.name {
            return Err(bad(path, "device", format!("measured on {:?}, this device is {:?}", self.device, plan.facts.name)));
        }
        let o = &self.plan;
        if let Some(rules) = &o.gemv_rules {
            if major < 8 {
                return Err(bad(path, "plan.gemv_rules", format!("the tensor-core GEMV needs compute capability 8.0 or newer; this device is {cc}")));
            }
            plan.gemv_rules = rules
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let config = GemvTcConfig::all()
                        .find(|c| c.label().eq_ignore_ascii_case(r.kernel.trim()))
                        .ok_or_else(|| bad(path, &format!("plan.gemv_rules[{i}].kernel"), format!("unknown instance {:?} (one of {})", r.kernel, GemvTcConfig::all().map(GemvTcConfig::label).collect::<Vec<_>>().join(", "))))?;
                    Ok(GemvTcRule { max_rows: r.max_rows.unwrap_or(usize::MAX), min_k: r.min_k, config, cuda_cores: r.cuda_cores_at_batch_1 })
                })
                .collect::<Result<_>>()?;
        }
        if let Some(w) = o.cc_warps {
            if ![2, 4, GEMV_WARPS].contains(&w) {
                return Err(bad(path, "plan.cc_warps", format!("expected 2, 4 or 8, got {w}")));
            }
            plan.cc_warps = w;
        }
        if let Some(s) = o.cc_ksplit {
            plan.cc_ksplit = s;
        }
        if ![1, 2, 4, 8].contains(&plan.cc_ksplit) || plan.cc_ksplit > plan.cc_warps {
            return Err(bad(path, "plan.cc_ksplit", format!("expected 1, 2, 4 or 8 and at most cc_warps ({}), got {}", plan.cc_warps, plan.cc_ksplit)));
        }
        if let Some(v) = o.cc_prefetch_vectors {
            plan.cc_prefetch_vectors = v;
        }
        if let Some(s) = o.tc_prefetch_steps {
            if s > TC_PREFETCH_MAX_STEPS {
                return Err(bad(path, "plan.tc_prefetch_steps", format!("expected 0..={TC_PREFETCH_MAX_STEPS}, got {s}")));
            }
            plan.tc_prefetch_steps = s;
        }
        if let Some(on) = o.pdl {
            if on && major < 9 {
                return Err(bad(path, "plan.pdl", format!("programmatic dependent launch needs compute capability 9.0 or newer; this device is {cc}")));
            }
            plan.pdl = on;
        }
        if let Some(pct) = o.smem_carveout {
            if !(0..=100).contains(&pct) {
                return Err(bad(path, "plan.smem_carveout", format!("expected a percentage of 0..=100, got {pct}")));
            }
            plan.smem_carveout = Some(pct);
        }
        if let Some(on) = o.fused_rope {
            plan.fused_rope = on;
        }
        if let Some(ring) = o.q4_ring {
            if major < 8 {
                return Err(bad(path, "plan.q4_ring", format!("the tiled 4-bit GEMV's forms run mma.sync, compute capability 8.0 or newer; this device is {cc}")));
            }
            plan.q4_ring = Some(ring);
        }
        if let Some(on) = o.decode_tensor_cores {
            if on && major < 8 {
                return Err(bad(path, "plan.decode_tensor_cores", format!("decode attention on tensor cores needs compute capability 8.0 or newer; this device is {cc}")));
            }
            plan.decode_attention.tensor_cores = on;
        }
        if let Some(on) = o.prefill_warp_specialized {
            if on && !(crate::backend::cuda::kernels::has_sm90a_code(major, minor) && plan.facts.nvrtc_major >= 13) {
                return Err(bad(path, "plan.prefill_warp_specialized", format!("the warp-specialized prefill attention is sm_90a code built by NVRTC 13; this device is {cc} with NVRTC {}", plan.facts.nvrtc_major)));
            }
            plan.prefill_warp_specialized = on;
        }
        Ok(())
    }
}
