//! Placeholder: the model owner replaces this with the generation_config.json reader.

/// Defaults from generation_config.json.
#[derive(Clone, Debug, Default)]
pub struct GenerationConfig {
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}
