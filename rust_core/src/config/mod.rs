//! Model config (HF config.json, generation_config.json) and engine config.

pub mod generation_config;
pub mod model_config;

pub use generation_config::GenerationConfig;
pub use model_config::ModelConfig;
