//! Model architectures and the engine-facing runner contract.
//!
//! `weights` loads a checkpoint into backend layouts, `layers` runs each layer kind over a
//! step, `cpu_model` ties them into a `ModelRunner`.

pub mod cpu_model;
pub mod layers;
pub mod runner;
pub mod weights;

#[cfg(test)]
mod tests;

use std::path::Path;

pub use cpu_model::CpuModel;
pub use runner::{CacheSpec, Logits, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
pub use weights::{ModelWeights, MtpWeights};

use crate::{NinferError, Result};

/// Where to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// "cpu" (more later).
    pub device: String,
    /// Worker threads for the CPU backend (None: all cores).
    pub num_threads: Option<usize>,
}

/// Load a HF model directory onto a backend.
pub fn load_model(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn ModelRunner>> {
    match opts.device.as_str() {
        "" | "cpu" => Ok(Box::new(CpuModel::load(dir, opts)?)),
        other => Err(NinferError::Unsupported(format!("device `{other}` (available: cpu)"))),
    }
}
