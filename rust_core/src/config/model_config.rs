//! Placeholder: the model helper replaces this with the full HF config parser.

/// Parsed HF model config.
#[derive(Clone, Debug, Default)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
}
