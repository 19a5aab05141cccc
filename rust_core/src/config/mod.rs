//! Model config (HF config.json, generation_config.json) and engine config.

pub mod cuda_options;
pub mod generation_config;
pub mod model_config;
pub mod rope;

pub use cuda_options::CudaOptions;
pub use generation_config::GenerationConfig;
pub use model_config::{ArchFamily, LayerType, LinearAttentionConfig, ModelConfig, SUPPORTED_ARCHITECTURES};
pub use rope::{RopeConfig, RopeScaling};
