//! Model architectures and the engine-facing runner contract.

pub mod runner;

use std::path::Path;

pub use runner::{CacheSpec, Logits, LogitsWanted, ModelRunner, SeqChunk, StepBatch};

use crate::{NinferError, Result};

/// Where to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// "cpu" (more later).
    pub device: String,
    /// Worker threads for the CPU backend (None: all cores).
    pub num_threads: Option<usize>,
}

/// Load a HF model directory onto a backend (placeholder until the model owner lands it).
pub fn load_model(dir: &Path, _opts: &LoadOptions) -> Result<Box<dyn ModelRunner>> {
    Err(NinferError::Unsupported(format!("loading {}", dir.display())))
}
