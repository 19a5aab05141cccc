//! Engine options of the CUDA backend that a user chooses per run (the CLI's and `LLM(...)`'s
//! arguments), as opposed to the routes the device plan decides (backend/cuda/plan).

use std::path::PathBuf;

/// What the CUDA model load is asked for besides the model: each field is an input of the
/// device's route plan. The defaults are the engine's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Decode steps captured once per batch bucket and replayed as CUDA graphs; off runs them
    /// eagerly with the same kernels (the same results, bit for bit).
    pub cuda_graphs: bool,
    /// Every kernel choice independent of the batch size, so that a sequence decoded in a batch
    /// equals it decoded alone bit for bit (at some cost in speed).
    pub batch_invariant: bool,
    /// Steps sample on the device; off samples each step's logits on the host (the reference
    /// the device sampler is tested against).
    pub device_sampling: bool,
    /// A device profile (JSON, plan/profile.rs) whose measured routes override the default
    /// table for this device.
    pub profile: Option<PathBuf>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { cuda_graphs: true, batch_invariant: false, device_sampling: true, profile: None }
    }
}
