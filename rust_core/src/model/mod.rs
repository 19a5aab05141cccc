//! Model architectures and the engine-facing runner contract.
//!
//! `cpu` and `cuda` each hold one backend's model: its weights loaded from a checkpoint into the
//! backend's layouts, the step over every layer kind, and the `ModelRunner` that ties them
//! together. What both share lives here: the runner contract (`runner`), the checkpoint's
//! tensor names (`names`), and the KV and logits dtypes a load asks for.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv_dtype;
pub mod logits_dtype;
pub mod names;
pub mod runner;

#[cfg(test)]
pub(crate) mod test_checkpoint;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub use cpu::weights::{ModelWeights, MtpWeights};
pub use cpu::CpuModel;
pub use kv_dtype::{KvDtype, KV_DTYPE_CHOICES, QUANTIZED_KV_DTYPES};
pub use logits_dtype::{LogitsDtype, LogitsRound, LOGITS_DTYPE_CHOICES};
#[cfg(feature = "cuda")]
pub use cuda::CudaModel;
pub use runner::{CacheSpec, DflashDraftSeq, DflashRows, DraftSampling, Logits, LogitsWanted, ModelRunner, MtpDraft, MtpDraftSeq, MtpRows, SeqChunk, StateReplay, StepBatch, VerifyLogits};

use crate::backend::cuda::{resolve_device, DeviceSpec, ResolvedDevice};
use crate::quant::{QuantWeight, QuantizeMode};
use crate::Result;

/// Where to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// "cpu", "cuda", "cuda:N" or "auto" (the GPU when one is present, else the CPU).
    pub device: String,
    /// Worker threads for the CPU backend (None: all cores).
    pub num_threads: Option<usize>,
    /// Logits rounded to the 16-bit dtype the model runs in (Auto, the default) or kept f32.
    pub logits_dtype: LogitsDtype,
    /// The KV cache type asked for: Auto (the default) or the one the backend keeps, checked
    /// by each backend's loader before any weight is read.
    pub kv_dtype: KvDtype,
    /// The CUDA backend's options (graphs, batch invariance, device sampling, device profile):
    /// inputs of the device's route plan.
    pub cuda: crate::config::CudaOptions,
    /// `--quantize`: the format a dense checkpoint's projections are quantized to on load
    /// (`cpu::quant_load`); None keeps them as stored.
    pub quantize: Option<QuantizeMode>,
    /// `--quantize-lm-head`: quantize the logits projection too (needs `quantize`).
    pub quantize_lm_head: bool,
    /// Packed weights handed in by checkpoint tensor name (`model.layers.0.mlp.down_proj.weight`),
    /// used instead of the checkpoint's: GGUF tensors read by the caller.
    pub quant_tensors: Option<Arc<HashMap<String, QuantWeight>>>,
}

/// The device a `device=` string names ("" is the CPU); a string that names none is an
/// `Unsupported` error listing the choices.
pub fn parse_device(device: &str) -> Result<DeviceSpec> {
    if device.trim().is_empty() {
        return Ok(DeviceSpec::Cpu);
    }
    DeviceSpec::parse(device).map_err(|_| crate::NinferError::Unsupported(format!("device `{device}` (available: cpu, cuda, cuda:N, auto)")))
}

/// The concrete device a `device=` string resolves to ("cpu" or "cuda:N"), so that what the
/// engine reports (ledger, info) names the device it runs on, not the "auto" it was asked for.
pub fn resolve_device_name(device: &str) -> Result<String> {
    Ok(match resolve_device(parse_device(device)?)? {
        ResolvedDevice::Cpu => "cpu".to_string(),
        ResolvedDevice::Cuda(ordinal) => format!("cuda:{ordinal}"),
    })
}

/// Load a HF model directory onto a backend.
pub fn load_model(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn ModelRunner>> {
    match resolve_device(parse_device(&opts.device)?)? {
        ResolvedDevice::Cpu => {
            // A device profile holds a GPU's measured routes; on the CPU it would do nothing.
            if let Some(path) = &opts.cuda.profile {
                return Err(crate::NinferError::Device(format!(
                    "cpu: device profile {} (--device-profile-path) holds a GPU's routes; leave it out on the CPU, or choose a cuda device",
                    path.display()
                )));
            }
            Ok(Box::new(CpuModel::load(dir, opts)?))
        }
        ResolvedDevice::Cuda(ordinal) => {
            // The thread count sizes the CPU backend's pool; the CUDA runner has no use for it, and
            // a flag that is accepted must do something.
            if let Some(n) = opts.num_threads {
                return Err(crate::NinferError::Device(format!(
                    "cuda:{ordinal}: num_threads {n} (--num-threads) sets the CPU backend's threads; leave it out on the GPU, or choose device cpu"
                )));
            }
            load_cuda(dir, ordinal, opts)
        }
    }
}

#[cfg(feature = "cuda")]
fn load_cuda(dir: &Path, ordinal: usize, opts: &LoadOptions) -> Result<Box<dyn ModelRunner>> {
    let device = format!("cuda:{ordinal}");
    cpu::quant_load::refuse_unsupported(dir, opts, &device, CudaModel::supports)?;
    let quant = crate::model::cuda::load::QuantLoad::new(dir, opts)?;
    Ok(Box::new(CudaModel::load_with(dir, ordinal, opts.logits_dtype, opts.kv_dtype, &opts.cuda, quant)?))
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(_dir: &Path, ordinal: usize, _opts: &LoadOptions) -> Result<Box<dyn ModelRunner>> {
    Err(crate::NinferError::Device(format!("cuda:{ordinal}: this build of ninfer has no CUDA backend (built without the `cuda` feature)")))
}
