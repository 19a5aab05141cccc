//! The memory plan: what a model's weights, KV pool, recurrent state, step workspace and
//! reserve take on a device, computed from config.json and the safetensors headers before any
//! weight is read. `ninfer plan` prints it; the engine's startup runs the same plan and refuses
//! a start that cannot fit before loading (`check_startup`), then sizes its caches with the same
//! arithmetic (`cache_spec`, `reserve_bytes`, `EngineConfig::resolve`).

pub mod drafter;
pub mod formats;
pub mod gpu;
pub mod inventory;
pub mod ledger;
pub mod memory;
#[cfg(test)]
mod tests;

pub use formats::QuantFormat;
pub use inventory::{checkpoint_tensors, model_tensors, PlannedTensor, Role, StoredQuant};
pub use ledger::{check_gpu_load, check_startup, plan, Fit, Plan, PlanInput, PoolRule, SpecRows, WeightLine};
pub use memory::{device_memory, host_available_bytes, CudaArch, DeviceMemory};

use crate::config::ModelConfig;
use crate::model::{CacheSpec, KvDtype};
use crate::{NinferError, Result};

/// The kind of backend a plan is for: what it stores weights, KV and state in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The CPU backend: f32 weights, KV and recurrent state.
    Cpu,
    /// The CUDA backend: 16-bit weights and KV (bf16, f16 on sm_70/sm_75), a 16-bit conv state
    /// and an f32 delta-rule state.
    Gpu,
}

impl Target {
    /// Bytes of one value of a dense (unquantized) weight, of the KV cache and of the conv state.
    pub fn dense_bytes(self) -> usize {
        match self {
            Target::Cpu => 4,
            Target::Gpu => 2,
        }
    }

    /// The name of its dense type in the ledger.
    pub fn dense_name(self) -> &'static str {
        match self {
            Target::Cpu => "F32",
            Target::Gpu => "BF16",
        }
    }

    /// Ok when `--kv-dtype` names what this backend keeps (model/kv_dtype.rs); the device
    /// itself checks again at load (bf16 against f16 by architecture).
    pub fn check_kv_dtype(self, kv: KvDtype) -> Result<()> {
        let ok = match self {
            Target::Cpu => matches!(kv, KvDtype::Auto | KvDtype::Float32),
            Target::Gpu => matches!(kv, KvDtype::Auto | KvDtype::Bf16 | KvDtype::F16),
        };
        if ok {
            return Ok(());
        }
        let kept = match self {
            Target::Cpu => "float32 on the CPU",
            Target::Gpu => "bf16 on a GPU (f16 on sm_70/sm_75)",
        };
        Err(NinferError::config("kv_dtype (--kv-dtype)", format!("{} is not supported here: the KV cache is {kept}", kv.name())))
    }
}

/// KV bytes of one token across the attention layers, with the MTP head's one attention layer
/// when it drafts (`--spec mtp`).
pub fn kv_bytes_per_token(cfg: &ModelConfig, target: Target, mtp: bool) -> usize {
    let layers = cfg.num_attention_layers() + usize::from(mtp);
    layers * 2 * cfg.num_kv_heads * cfg.head_dim * target.dense_bytes()
}

/// Recurrent-state bytes of one slot across the Gated DeltaNet layers: the conv state in the
/// dense type, the delta-rule state in f32 (0 for models without such layers).
pub fn state_bytes_per_slot(cfg: &ModelConfig, target: Target) -> usize {
    cfg.linear_attention.map_or(0, |la| (la.conv_floats() * target.dense_bytes() + la.delta_floats() * 4) * cfg.num_linear_layers())
}

/// The cache costs the engine plans with (`ModelRunner::cache_spec` of both backends).
pub fn cache_spec(cfg: &ModelConfig, target: Target, mtp: bool, weight_bytes: usize) -> CacheSpec {
    CacheSpec { kv_bytes_per_token: kv_bytes_per_token(cfg, target, mtp), state_bytes_per_slot: state_bytes_per_slot(cfg, target), weight_bytes }
}

/// The rows of the largest speculative verify step of up to `decode_rows` sequences, each
/// bringing its decode token and up to `max_drafts` drafts within a step of `step_rows`
/// tokens (the scheduler fits drafts into that budget): (the rows a uniform verify step runs,
/// its sequences padded by `pad` as the backend pads them; the rows that want logits, padded
/// or not). Verify chunks of more than MAX_DRAFT_TOKENS + 1 tokens never run as a uniform
/// step. The CUDA runner allocates these at startup and the plan counts them.
pub fn verify_rows(step_rows: usize, decode_rows: usize, max_drafts: usize, pad: impl Fn(usize) -> usize) -> (usize, usize) {
    let longest = (max_drafts + 1).min(crate::spec::MAX_DRAFT_TOKENS + 1).min(step_rows);
    let padded = (2..=longest).map(|r| pad(decode_rows.min(step_rows / r).max(1)) * r).max().unwrap_or(0);
    let logits = (decode_rows * (max_drafts + 1)).min(step_rows).max(padded);
    (padded, logits)
}

/// What a GPU keeps free of a device of `total` bytes for what is allocated after the plan
/// (decode graphs and their scratch, the CUDA context's own growth, other processes' drift):
/// 5% of the device, at least 1 GiB. The host keeps none.
pub fn reserve_bytes(target: Target, total: u64) -> u64 {
    match target {
        Target::Cpu => 0,
        Target::Gpu => (total / 20).max(1 << 30),
    }
}
