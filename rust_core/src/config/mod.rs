//! Model config (HF config.json, generation_config.json) and engine config.

pub mod model_config;

pub use model_config::ModelConfig;
